"""LayerNorm: y = gamma * (x - mu) / s + beta, with mu = mean(x) and s = sqrt(var(x) + eps) over features.

Shapes (extra leading axes broadcast): x [B, n, d_model], gamma [d_model], beta [d_model], y [B, n, d_model].

Backward, with xhat = (x - mu) / s and g = G_y * gamma:
G_x = (g - mean(g) - xhat * mean(g * xhat)) / s  (the direct term, the centring's feedback, the scale's
feedback); G_gamma = sum over rows of G_y * xhat; G_beta = sum over rows of G_y.

Checks a user's implementation too (``implementation: module:attribute``, an object with
``forward(x, gamma, beta, eps) -> y`` and ``backward(x, gamma, beta, eps, grad_y) -> (dx, dgamma, dbeta)``):
finite differences of its forward against its backward, its results against the float64 reference,
and the invariants below on its gradients.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .. import invariants, numeric
from ..tolerance import INVARIANT_ULPS, machine_epsilon
from . import dense, user_engine
from .registry import SIZE_EDGES, WIDTHS, Axis, Fault, Interface, Op, Param, Structure, named_value, user_code_engines

#: The scale identity (``_invariants``): y(c x) = y(x) up to eps, so <G_x, x> is eps's share alone.
SCALE_IDENTITY = "<G_x, x> = d eps mean(g xhat) / s^2"

FAULTS = {f.name: f for f in (
    Fault("layernorm-mean-term", "G_x drops -mean(g), the feedback of the centring x - mu",
          ("gradient x", "G_x rows sum to 0", SCALE_IDENTITY, "backward agrees with the reference"),
          user=user_engine.ADDED),
    Fault("layernorm-scale-term", "G_x drops -xhat mean(g xhat), the feedback of the scale s",
          ("gradient x", SCALE_IDENTITY, "backward agrees with the reference"),
          user=user_engine.ADDED),
)}


#: Known mistakes of a LayerNorm backward (no CLI switch): candidate causes of a failed gradient check
#: (``fingerprints``), computed by :func:`backward` on request.
MISTAKES = {
    "layernorm-both-feedbacks": "G_x = g / s: drops both feedback terms, -mean(g) and -xhat mean(g xhat)",
    "layernorm-scale-term-sign": "G_x adds xhat mean(g xhat) instead of subtracting it",
    "layernorm-no-gamma": "G_x is written for gamma = 1: G_y in place of g = G_y gamma",
    "layernorm-not-divided-by-s": "G_x is not divided by s (the standard deviation) at the end",
    "layernorm-dgamma-centred-x": "G_gamma sums G_y (x - mu) instead of G_y xhat (not divided by s)",
    "layernorm-dgamma-raw-x": "G_gamma sums G_y x instead of G_y xhat",
    "layernorm-reductions-mean": "G_gamma and G_beta average over the rows instead of summing",
    "layernorm-dbeta-gamma": "G_beta sums G_y gamma instead of G_y",
    "layernorm-dgamma-times-gamma": "G_gamma sums G_y gamma xhat: gamma where G_y alone belongs",
    "layernorm-backward-unbiased-var": "the backward recomputes the variance unbiased (divided by d_model - 1, "
                                       "np.var(ddof=1) or torch.var's default) where the forward's is biased",
    "layernorm-scale-term-centred": "the scale term takes x - mu where xhat belongs: xhat mean(g (x - mu)), or (x - "
                                    "mu) mean(g xhat) (one division by s missing)",
    "layernorm-dbeta-mean": "G_beta averages over the rows instead of summing",
    "layernorm-dgamma-mean": "G_gamma averages over the rows instead of summing",
    **{f"layernorm-backward-eps-{e:g}": f"the backward recomputes s with a hard-coded eps = {e:g}, not the forward's"
       for e in (1e-5, 1e-6)},
    "layernorm-mean-term-no-gamma": "the centring term subtracts mean(G_y) where mean(g), g = G_y gamma, belongs",
    "layernorm-scale-term-mean-g": "the scale term is xhat mean(g) where xhat mean(g xhat) belongs",
    "layernorm-scale-term-no-gamma": "the scale term's mean takes G_y where g = G_y gamma belongs: xhat mean(G_y "
                                     "xhat)",
    "layernorm-scale-term-raw-x": "the scale term's mean takes the raw x where xhat belongs: xhat mean(g x)",
    "layernorm-scale-term-uncentred": "the scale term's mean takes the uncentred x / s where xhat = (x - mu) / s "
                                      "belongs: xhat mean(g x / s)",
    "layernorm-backward-no-eps": "the backward recomputes s = sqrt(var) without the forward's eps",
    "layernorm-scale-term-no-xhat": "the scale term drops its xhat factor: g - mean(g) - mean(g xhat), not g - "
                                    "mean(g) - xhat mean(g xhat)",
    **{f"layernorm-rstd-{p}": f"the statistic 1 / s (rstd) is saved for the backward in {p}"
       for p in numeric.SAVED_PRECISIONS},
}

#: Known mistakes of a LayerNorm forward: (what it gets wrong, y of the forward with it), named when a user's
#: forward fails against the reference and equals one (``UserOp.forward_mistakes``).
FORWARD_MISTAKES = {
    "layernorm-unbiased-var": ("the variance is unbiased (divided by d_model - 1: torch.var's default, "
                               "np.var(ddof=1)) where LayerNorm's is biased",
                               lambda x, gamma, beta, eps: _forward(x, gamma, beta, eps, ddof=1)),
    "layernorm-stats-over-rows": ("the mean and variance are taken over the rows (the sequence axis) where the "
                                  "features' belong", lambda x, gamma, beta, eps: _over_rows(x, gamma, beta, eps)),
    "layernorm-eps-outside-sqrt": ("eps is added outside the square root: (x - mu) / (sqrt(var) + eps)",
                                   lambda x, gamma, beta, eps: _forward(x, gamma, beta, eps, outside=True)),
}


def forward(x, gamma, beta, eps):
    """y [..., d_model]."""
    return _forward(x, gamma, beta, eps)


def _forward(x, gamma, beta, eps, ddof: int = 0, outside: bool = False):
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.sum((x - mu) ** 2, axis=-1, keepdims=True) / (x.shape[-1] - ddof)
    eps = np.asarray(eps, dtype=x.dtype)
    s = np.sqrt(var) + eps if outside else np.sqrt(var + eps)
    return gamma * ((x - mu) / s) + beta


def _over_rows(x, gamma, beta, eps):
    if x.ndim < 2 or x.shape[-2] < 2:
        raise ValueError("one row")
    mu = np.mean(x, axis=-2, keepdims=True)
    return gamma * (x - mu) / np.sqrt(np.mean((x - mu) ** 2, axis=-2, keepdims=True) + eps) + beta


def backward(x, gamma, beta, eps, grad_y, faults: Collection[str] = ()):
    """(G_x, G_gamma, G_beta) for upstream grad_y [..., d_model]; G_gamma and G_beta sum every axis but the last."""
    mu = np.mean(x, axis=-1, keepdims=True)
    var = np.mean((x - mu) ** 2, axis=-1, keepdims=True)
    if "layernorm-backward-unbiased-var" in faults:
        var = var * (x.shape[-1] / max(x.shape[-1] - 1, 1))
    hard_coded = named_value(faults, "layernorm-backward-eps-")
    eps = 0.0 if "layernorm-backward-no-eps" in faults else (eps if hard_coded is None else float(hard_coded))
    s = np.sqrt(var + np.asarray(eps, dtype=x.dtype))
    saved = named_value(faults, "layernorm-rstd-")
    if saved is not None:
        s = 1.0 / numeric.rounded(1.0 / s, saved)
    xhat = (x - mu) / s
    g = grad_y if "layernorm-no-gamma" in faults else grad_y * gamma
    g_x = g
    both = "layernorm-both-feedbacks" in faults
    if "layernorm-mean-term" not in faults and not both:
        g_x = g_x - np.mean(grad_y if "layernorm-mean-term-no-gamma" in faults else g, axis=-1, keepdims=True)
    if "layernorm-scale-term" not in faults and not both:
        inner = {"layernorm-scale-term-centred": x - mu, "layernorm-scale-term-mean-g": 1.0,
                 "layernorm-scale-term-uncentred": x / s, "layernorm-scale-term-raw-x": x}
        fed = grad_y if "layernorm-scale-term-no-gamma" in faults else g
        scale_term = (1.0 if "layernorm-scale-term-no-xhat" in faults else xhat) * np.mean(
            fed * next((inner[f] for f in faults if f in inner), xhat), axis=-1, keepdims=True)
        g_x = g_x + scale_term if "layernorm-scale-term-sign" in faults else g_x - scale_term
    if "layernorm-not-divided-by-s" not in faults:
        g_x = g_x / s
    d = x.shape[-1]
    seen = {"layernorm-dgamma-centred-x": x - mu, "layernorm-dgamma-raw-x": x}
    by = next((seen[f] for f in faults if f in seen), xhat)
    mean = "layernorm-reductions-mean" in faults
    g_beta = grad_y * gamma if "layernorm-dbeta-gamma" in faults else grad_y
    up = grad_y * gamma if "layernorm-dgamma-times-gamma" in faults else grad_y
    g_gamma = (np.mean if mean or "layernorm-dgamma-mean" in faults else np.sum)((up * by).reshape(-1, d), axis=0)
    g_beta = (np.mean if mean or "layernorm-dbeta-mean" in faults else np.sum)(g_beta.reshape(-1, d), axis=0)
    return g_x, g_gamma, g_beta


def _shapes(sc) -> dict:
    d = sc.p("d_model")
    return {"x": (sc.batch, sc.p("n"), d), "gamma": (d,), "beta": (d,)}


def _inputs(sc) -> tuple[dict, np.ndarray]:
    shapes = _shapes(sc)
    data = dense.seeded(sc, {**shapes, "g": shapes["x"]})
    data["gamma"] = (1.0 + 0.5 * data["gamma"]).astype(data["gamma"].dtype)  # away from 0
    return data, data.pop("g")


def _terms(x, gamma, eps, grad_y) -> dict[str, np.ndarray]:
    """The size of the terms each element of y, G_x, G_gamma and G_beta is made of (float64): rounding puts
    about eps x these in each, whatever order an implementation sums in."""
    x, gamma, grad_y = (np.asarray(t, dtype=np.float64) for t in (x, gamma, grad_y))
    mu = np.mean(x, axis=-1, keepdims=True)
    s = np.sqrt(np.mean((x - mu) ** 2, axis=-1, keepdims=True) + eps)
    xhat = np.abs((x - mu) / s)
    spread = (np.abs(x) + np.abs(mu)) / s  # the centred value's own rounding, relative to s
    g = np.abs(grad_y * gamma)
    g_x = (g + np.mean(g, axis=-1, keepdims=True) + xhat * np.mean(g * (xhat + spread), axis=-1, keepdims=True)
           + spread * np.mean(g * xhat, axis=-1, keepdims=True)) / s
    d = x.shape[-1]
    return {"o": np.abs(gamma) * (spread + xhat), "x": g_x,
            "gamma": (np.abs(grad_y) * (spread + xhat)).reshape(-1, d).sum(axis=0),
            "beta": np.abs(grad_y).reshape(-1, d).sum(axis=0)}


def _invariants(g_x, data, g, eps: float, dtype: str, fixed: dict | None = None):
    """Semantic checks of G_x (the one under test, at the scenario's eps, computed in ``dtype``): its rows sum
    to 0 (y does not move when every feature of a row moves alike), and the scale identity: d/dc y(c x) at
    c = 1 gives, per row, <G_x, x> = d eps mean(g xhat) / s^2 (g = G_y gamma, s = sqrt(var + eps), 0 when
    eps = 0). Both hold in the setting the code has: no setting of it is changed. ``fixed``: the user's
    settings fixed inside their module, by name, with why (the identity needs eps: not applicable)."""
    x64, gamma64, g64 = (t.astype(np.float64) for t in (data["x"], data["gamma"], g))
    d = x64.shape[-1]
    terms = _terms(x64, gamma64, eps, g64)["x"]
    ulps = INVARIANT_ULPS * machine_epsilon(dtype) * d
    g_x = np.asarray(g_x, dtype=np.float64)
    checks = [invariants.bounded_each("G_x rows sum to 0", "g_x", g_x.sum(axis=-1), ulps * terms.sum(axis=-1),
                                      "|sum_c G_x[c]| per row, allowed 64 ulps of d_model x the size of its terms "
                                      "(LayerNorm is shift invariant)")]
    if "eps" in (fixed or {}):
        return checks + [invariants.not_applicable(SCALE_IDENTITY, "g_x", fixed["eps"])]
    centred = x64 - np.mean(x64, axis=-1, keepdims=True)
    s2 = np.mean(centred * centred, axis=-1) + eps
    expected = d * eps * np.mean(g64 * gamma64 * centred, axis=-1) / s2 ** 1.5
    return checks + [invariants.bounded_each(
        SCALE_IDENTITY, "g_x", (g_x * x64).sum(axis=-1) - expected, ulps * (terms * np.abs(x64)).sum(axis=-1),
        f"|sum_c G_x[c] x[c] - d eps mean(g xhat) / s^2| per row (g = G_y gamma, s = sqrt(var + eps), xhat = (x - mu) "
        f"/ s; LayerNorm is scale invariant but for eps), at eps = {eps:g}, allowed 64 ulps of d_model x the size of "
        "its terms")]


_STRUCTURE = {"x": Structure(("batch", "row", "feature"), heat=("row", "feature")), "gamma": Structure(("feature",)),
              "beta": Structure(("feature",))}


def _rounding(t):
    return {"x": np.broadcast_to(dense.rss(t, -1)[..., None], t.shape).copy(),   # its row
            "gamma": dense.rss(t.reshape(-1, t.shape[-1]), 0), "beta": dense.rss(t.reshape(-1, t.shape[-1]), 0)}


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """The built-in engine with ``faults`` injected."""
    data, g = _inputs(sc)
    eps = sc.p("eps")
    g_x, g_gamma, g_beta = backward(data["x"], data["gamma"], data["beta"], eps, g, faults)

    analytic = {"x": INVARIANT_ULPS * machine_epsilon(sc.dtype) * _terms(data["x"], data["gamma"], eps, g)["x"]}
    return dense.problem(sc, data, lambda x, gamma, beta: forward(x, gamma, beta, eps),
                         {"x": g_x, "gamma": g_gamma, "beta": g_beta}, g, lift={"gamma": 2, "beta": 2},
                         invariants=lambda: _invariants(g_x, data, g, eps, sc.dtype), analytic_rounding=analytic,
                         rounding=_rounding, structure=_STRUCTURE)


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``)."""
    data, g = _inputs(sc)
    return user_engine.build(sc, user_engine.UserOp(
        inputs=data, args={"eps": sc.p("eps")}, g=g, forward=forward, backward=backward,
        terms=lambda inputs, args, g: _terms(inputs["x"], inputs["gamma"], args["eps"], g),
        invariants=lambda calls, dtype, y: _invariants(calls()["x"], data, g, sc.p("eps"), dtype, calls.fixed),
        batched=("x",), rounding=_rounding, structure=_STRUCTURE, forward_mistakes=FORWARD_MISTAKES,
        mistakes=user_engine.mistakes(FAULTS, MISTAKES)), faults)


#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(x, gamma, beta, eps) -> y and backward(x, gamma, beta, eps, "
    "grad_y) -> (dx, dgamma, dbeta); torch: a callable f(x, gamma, beta, eps) -> y, differentiated by"
    " autograd"), args=("eps",))

def _validate(params: dict, extra: dict) -> list:
    """One feature and no eps: var(x) = 0, so y divides zero by zero on every row."""
    if params.get("d_model") == 1 and params.get("eps") == 0:
        return [("eps", "with d_model 1 the variance of every row is 0, so eps 0 divides zero by zero (y is NaN)",
                 "give eps > 0, or d_model >= 2")]
    return []


#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 2, "n": 4, "d_model": 8, "eps": 0.0}

#: The space ``attn-gradcheck hunt`` searches: rows, width (each side of the powers of 2) and dtype; eps is the code's.
SPACE = (Axis("dtype", "choice", choices=("float64", "float32")), Axis("batch", low=1, high=4),
         Axis("n", low=1, high=300, edges=SIZE_EDGES), Axis("d_model", low=1, high=1024, edges=WIDTHS))

OP = Op(name="layernorm", summary="LayerNorm y = gamma * (x - mean) / sqrt(var + eps) + beta: gradients of x, "
                                  "gamma and beta; checks your implementation too",
        tensors=("x", "gamma", "beta"), faults=FAULTS,
        **user_code_engines("gradcheck_cli.ops.layernorm"),
        keys={"n": Param("int", 4, "rows per batch element"),
              "d_model": Param("int", help="features per row, e.g. 'd_model: 16'"),
              "eps": Param("float", 1e-5, "added to var(x); 0 allowed", minimum=0.0)},
        shapes=_shapes, validate=_validate,
        describe=lambda sc: f"B={sc.batch} n={sc.p('n')} d_model={sc.p('d_model')} eps={sc.p('eps'):g} "
                            f"{sc.dtype} {sc.mode}",
        backends=("numpy", "torch", "jax"),
        implementation=INTERFACE,
        example=EXAMPLE, space=SPACE)
