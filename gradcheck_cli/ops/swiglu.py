"""SwiGLU feed-forward (chapter 31, section 5): y = (SiLU(x W_1) * (x W_3)) W_2, row-major weights.

Shapes (extra leading axes broadcast): x [B, n, d_model], W_1, W_3 [d_model, d_ff], W_2 [d_ff, d_model].

Backward, with a = x W_1, b = x W_3, h = SiLU(a) * b and SiLU'(a) = s (1 + a (1 - s)), s = sigmoid(a):
G_h = G_y W_2^T, G_W2 = h^T G_y; each branch gets the other branch's value times the upstream
gradient: G_a = G_h * b * SiLU'(a), G_b = G_h * SiLU(a); G_W1 = x^T G_a, G_W3 = x^T G_b,
G_x = G_a W_1^T + G_b W_3^T.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .. import invariants
from ..tolerance import INVARIANT_ULPS, machine_epsilon
from . import dense, user_engine
from .registry import SIZE_EDGES, WIDTHS, Axis, Fault, Interface, Op, Param, Structure, user_code_engines

FAULTS = {f.name: f for f in (
    Fault("silu-derivative", "G_a = G_h * b: drops SiLU's own derivative SiLU'(x W_1)",
          ("gradient x", "gradient w1", "backward agrees with the reference"), user=user_engine.ADDED),
    Fault("gate-branch", "G_b = G_h: the linear branch does not get the gate branch's value SiLU(x W_1)",
          ("gradient x", "gradient w3", "<G_W3, W_3> = L", "backward agrees with the reference"),
          user=user_engine.ADDED),
)}


#: Known mistakes of a SwiGLU backward (no CLI switch): candidate causes of a failed gradient check
#: (``fingerprints``), computed by :func:`backward` on request.
MISTAKES = {
    "silu-derivative-sigmoid": "SiLU'(a) taken as sigmoid(a): drops the a sigmoid(a) (1 - sigmoid(a)) term",
    "silu-derivative-sigmoid-prime": "SiLU'(a) taken as sigmoid'(a) = sigmoid(a) (1 - sigmoid(a))",
    "silu-derivative-no-product-rule": "SiLU'(a) taken as a sigmoid(a) (1 - sigmoid(a)): drops the sigmoid(a) term",
    "swiglu-branches-swapped": "each branch gets its own value instead of the other's: G_a = G_h SiLU'(a) SiLU(a), "
                               "G_b = G_h b",
    "swiglu-dx-gate-only": "G_x = G_a W_1^T: drops the linear branch's share G_b W_3^T",
    "swiglu-dw2-no-gate": "G_W2 = (x W_3)^T G_y: h taken without the gate SiLU(x W_1)",
    "swiglu-dw1-dw3-swapped": "G_W1 and G_W3 returned in each other's place (the gate and up projections mixed up)",
    "swiglu-dw1-reshaped": "G_W1 = x^T G_a.reshape(d_ff, -1).T: a reshape where G_a's rows [n, d_ff] were meant (rows "
                           "and features scrambled)",
    "swiglu-dw3-reshaped": "G_W3 = x^T G_b.reshape(d_ff, -1).T: a reshape where G_b's rows [n, d_ff] were meant",
    "silu-derivative-of-up": "SiLU'(a) taken at the up branch b = x W_3: sigmoid(b) (1 + a (1 - sigmoid(b))) where "
                             "a = x W_1's belongs",
    "silu-derivative-sign": "SiLU'(a) taken as s (1 + a s): the (1 - s) of sigmoid's derivative written as s",
    "swiglu-up-grad-raw-gate": "G_b = G_h a: the linear branch gets the gate's pre-activation x W_1, not SiLU(x W_1)",
    "swiglu-gate-grad-no-up": "G_a = G_h SiLU'(a): the gate branch does not get the linear branch's value x W_3",
    "swiglu-dw2-no-up": "G_W2 = SiLU(x W_1)^T G_y: h taken without the linear branch x W_3",
    "swiglu-dx-w1-untransposed": "G_x = G_a W_1 + G_b W_3^T: W_1 without its transpose (the shapes agree when "
                                 "d_model = d_ff)",
    "swiglu-dx-w3-untransposed": "G_x = G_a W_1^T + G_b W_3: W_3 without its transpose (the shapes agree when "
                                 "d_model = d_ff)",
}


def _gelu_tanh(a):
    return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a ** 3)))


def _gelu_erf(a):
    from math import erf
    return 0.5 * a * (1.0 + np.vectorize(erf)(a / np.sqrt(2.0)))


#: Known mistakes of a SwiGLU forward: (what it gets wrong, y of the forward with it), named when a user's forward
#: fails against the reference and equals one (``UserOp.forward_mistakes``).
FORWARD_MISTAKES = {
    "swiglu-gate-up-swapped": ("the gate and up projections are swapped: SiLU(x W_3) * (x W_1) (w1 and w3 mixed up "
                               "when loading or in the call)",
                               lambda x, w1, w3, w2: (silu(x @ w3) * (x @ w1)) @ w2),
    "swiglu-gelu-tanh": ("the gate uses GELU (tanh approximation) where SwiGLU's is SiLU (GeGLU written)",
                         lambda x, w1, w3, w2: (_gelu_tanh(x @ w1) * (x @ w3)) @ w2),
    "swiglu-gelu-erf": ("the gate uses GELU (erf) where SwiGLU's is SiLU (GeGLU written)",
                        lambda x, w1, w3, w2: (_gelu_erf(x @ w1) * (x @ w3)) @ w2),
    "swiglu-sigmoid-gate": ("the gate is sigmoid(x W_1), not SiLU(x W_1) = x W_1 sigmoid(x W_1) (GLU written)",
                            lambda x, w1, w3, w2: (_sigmoid(x @ w1) * (x @ w3)) @ w2),
    "swiglu-silu-of-product": ("SiLU is applied to the product (x W_1)(x W_3), not to x W_1 alone",
                               lambda x, w1, w3, w2: silu((x @ w1) * (x @ w3)) @ w2),
    "swiglu-no-up": ("the up branch is missing: SiLU(x W_1) W_2", lambda x, w1, w3, w2: silu(x @ w1) @ w2),
}


def _sigmoid(a):
    return 0.5 * (1.0 + np.tanh(0.5 * a))  # no overflow for large |a|


def silu(a):
    return a * _sigmoid(a)


def forward(x, w1, w3, w2):
    """y [..., n, d_model]."""
    return (silu(x @ w1) * (x @ w3)) @ w2


def _sum_rows(t):
    """[..., n, c] -> [n*..., c] summed: weight gradients add every row of every batch element."""
    return t.reshape(-1, t.shape[-1])


def backward(x, w1, w3, w2, grad_y, faults: Collection[str] = ()):
    """Gradients (x, w1, w3, w2) for upstream grad_y."""
    a, b = x @ w1, x @ w3
    s = _sigmoid(a)
    h = a * s * b
    g_h = grad_y @ w2.T
    h_used = {"swiglu-dw2-no-gate": b, "swiglu-dw2-no-up": a * s}
    g_w2 = _sum_rows(next((h_used[f] for f in faults if f in h_used), h)).T @ _sum_rows(grad_y)
    silu_prime = {"silu-derivative": 1.0, "silu-derivative-sigmoid": s,
                  "silu-derivative-sigmoid-prime": s * (1.0 - s),
                  "silu-derivative-no-product-rule": a * s * (1.0 - s),
                  "silu-derivative-sign": s * (1.0 + a * s),
                  "silu-derivative-of-up": _sigmoid(b) * (1.0 + a * (1.0 - _sigmoid(b)))}
    silu_prime = next((silu_prime[f] for f in faults if f in silu_prime), s * (1.0 + a * (1.0 - s)))
    g_a = g_h * silu_prime if "swiglu-gate-grad-no-up" in faults else g_h * b * silu_prime
    g_b = g_h if "gate-branch" in faults else g_h * (a if "swiglu-up-grad-raw-gate" in faults else a * s)
    if "swiglu-branches-swapped" in faults:
        g_a, g_b = g_h * (a * s) * silu_prime, g_h * b
    xs = _sum_rows(x)
    w1_x = w1 if "swiglu-dx-w1-untransposed" in faults else w1.T
    w3_x = w3 if "swiglu-dx-w3-untransposed" in faults else w3.T
    g_x = g_a @ w1_x if "swiglu-dx-gate-only" in faults else g_a @ w1_x + g_b @ w3_x
    def rows(t, name):  # the known mistake: [n, d_ff] read back through a reshape to [d_ff, n]
        r = _sum_rows(t)
        return r.reshape(r.shape[-1], -1).T if f"swiglu-{name}-reshaped" in faults else r
    g_w1, g_w3 = xs.T @ rows(g_a, "dw1"), xs.T @ rows(g_b, "dw3")
    if "swiglu-dw1-dw3-swapped" in faults:
        g_w1, g_w3 = g_w3, g_w1
    return {"x": g_x, "w1": g_w1, "w3": g_w3, "w2": g_w2}


def _shapes(sc) -> dict:
    d, f = sc.p("d_model"), sc.p("d_ff")
    return {"x": (sc.batch, sc.p("n"), d), "w1": (d, f), "w3": (d, f), "w2": (f, d)}


def euler_checks(inputs, grads, loss_value: float, terms_scale: float, eps: float) -> list:
    """y is linear in W_3 and in W_2, so by Euler's theorem <G_W, W> = L for both."""
    out = []
    for name in ("w3", "w2"):
        value = float(np.sum(grads[name].astype(np.float64) * inputs[name].astype(np.float64)))
        out.append(invariants.bounded(f"<G_{name.upper()}, {name.upper()[0]}_{name[1]}> = L", f"g_{name}",
                                      np.asarray([value - loss_value]), INVARIANT_ULPS * eps * max(terms_scale, 1.0),
                                      f"y is linear in {name.upper()}: sum(G * W) = {value:.9g} against "
                                      f"L = {loss_value:.9g}"))
    return out


def _inputs(sc) -> tuple[dict, np.ndarray]:
    shapes = _shapes(sc)
    d, f = sc.p("d_model"), sc.p("d_ff")
    data = dense.seeded(sc, {**shapes, "g": shapes["x"]},
                        scales={"w1": d ** -0.5, "w3": d ** -0.5, "w2": f ** -0.5})
    return data, data.pop("g")


def _terms(x, w1, w3, w2, grad_y) -> dict[str, np.ndarray]:
    """The size of the terms of y and of each gradient (float64): every product and sum taken on absolute
    values, each nonlinearity charged its slope times the size of its argument (|SiLU''| <= 1/2)."""
    x, w1, w3, w2, gy = (np.asarray(t, dtype=np.float64) for t in (x, w1, w3, w2, grad_y))
    a, b = x @ w1, x @ w3
    s = _sigmoid(a)
    slope = np.abs(s * (1.0 + a * (1.0 - s)))
    ax, aw1, aw3, aw2, agy = np.abs(x), np.abs(w1), np.abs(w3), np.abs(w2), np.abs(gy)
    ta, tb = ax @ aw1, ax @ aw3
    t_silu = slope * ta + np.abs(a * s)
    h = np.abs(a * s * b)
    t_h = t_silu * np.abs(b) + np.abs(a * s) * tb + h
    g_h = np.abs(gy @ w2.T)
    t_gh = agy @ aw2.T
    g_a, g_b = g_h * np.abs(b) * slope, g_h * np.abs(a * s)
    t_ga = (t_gh * np.abs(b) + g_h * tb) * slope + 0.5 * g_h * np.abs(b) * ta
    t_gb = t_gh * np.abs(a * s) + g_h * t_silu
    xs = _sum_rows(ax)
    return {"o": (t_h + h) @ aw2, "x": (t_ga + g_a) @ aw1.T + (t_gb + g_b) @ aw3.T,
            "w1": xs.T @ _sum_rows(t_ga + g_a), "w3": xs.T @ _sum_rows(t_gb + g_b),
            "w2": _sum_rows(t_h + h).T @ _sum_rows(agy)}


_STRUCTURE = {"x": Structure(("batch", "row", "feature"), heat=("row", "feature")),
              "w1": Structure(("d_model", "d_ff")),
              "w3": Structure(("d_model", "d_ff")), "w2": Structure(("d_ff", "d_model"))}


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    data, g = _inputs(sc)
    d, f = sc.p("d_model"), sc.p("d_ff")
    grads = backward(**data, grad_y=g, faults=faults)
    x, w1, w3, w2 = (data[t] for t in ("x", "w1", "w3", "w2"))
    a, b = x @ w1, x @ w3
    h = silu(a) * b
    y = h @ w2
    ax = np.abs(x).astype(np.float64)
    magnitude = ((ax @ np.abs(w1)) * np.abs(b) + np.abs(silu(a)) * (ax @ np.abs(w3)) + np.abs(h)) @ np.abs(w2)
    loss_value = float(np.sum(y.astype(np.float64) * g))
    scale = float(np.sum(np.abs(g) * magnitude))
    eps = float(np.finfo(np.dtype(sc.dtype)).eps)
    return dense.problem(
        sc, data, forward, grads, g, lift={"w1": 1, "w3": 1, "w2": 1}, magnitude=magnitude,
        invariants=lambda: euler_checks(data, grads, loss_value, scale, eps),
        work_factor=4.0 * f / d + 2, structure=_STRUCTURE)


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``): its weight gradients are
    checked like its input's."""
    data, g = _inputs(sc)
    order = ("x", "w1", "w3", "w2")

    def backward_tuple(x, w1, w3, w2, grad_y, faults=()):
        grads = backward(x, w1, w3, w2, grad_y, faults)
        return tuple(grads[t] for t in order)

    def checks(gradients, dtype, y):
        scale = float(np.sum(np.abs(g) * _terms(*data.values(), g)["o"]))
        return euler_checks(data, gradients(), float(np.sum(y.astype(np.float64) * g)), scale, machine_epsilon(dtype))

    return user_engine.build(sc, user_engine.UserOp(
        inputs={t: data[t] for t in order}, args={}, g=g, forward=forward, backward=backward_tuple,
        terms=lambda inputs, args, g: _terms(*inputs.values(), g), invariants=checks, batched=("x",),
        structure=_STRUCTURE, forward_mistakes=FORWARD_MISTAKES, mistakes=user_engine.mistakes(FAULTS, MISTAKES)),
        faults)


#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(x, w1, w3, w2) -> y and backward(x, w1, w3, w2, grad_y) -> (dx, "
    "dw1, dw3, dw2); torch: a callable f(x, w1, w3, w2) -> y, differentiated by autograd; jax: the "
    "same function on JAX arrays, differentiated by jax.vjp; weights [in, out]"), args=())

#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 2, "n": 4, "d_model": 8, "d_ff": 12}

#: The space ``attn-gradcheck hunt`` searches: rows, the model and hidden widths, and dtype.
SPACE = (Axis("dtype", "choice", choices=("float64", "float32")), Axis("batch", low=1, high=4),
         Axis("n", low=1, high=300, edges=SIZE_EDGES), Axis("d_model", low=1, high=1024, edges=WIDTHS),
         Axis("d_ff", low=1, high=1024, edges=WIDTHS))

OP = Op(name="swiglu", summary="SwiGLU (SiLU(x W1) * x W3) W2: gradients of x, W1, W2, W3",
        tensors=("x", "w1", "w3", "w2"), faults=FAULTS,
        **user_code_engines("gradcheck_cli.ops.swiglu"),
        backends=("numpy", "torch", "jax"),
        implementation=INTERFACE,
        keys={"n": Param("int", 4, "rows per batch element"),
              "d_model": Param("int", help="features per row, e.g. 'd_model: 8'"),
              "d_ff": Param("int", help="hidden width, e.g. 'd_ff: 16'")},
        shapes=_shapes,
        describe=lambda sc: f"B={sc.batch} n={sc.p('n')} d_model={sc.p('d_model')} d_ff={sc.p('d_ff')} "
                            f"{sc.dtype} {sc.mode}",
        example=EXAMPLE, space=SPACE)
