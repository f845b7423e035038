"""RMSNorm (chapter 31, section 5): y = gamma * x / r with r = sqrt(mean(x^2) + eps) over features.

Shapes (extra leading axes broadcast): x [B, n, d_model], gamma [d_model], y [B, n, d_model].

Backward, with g = G_y * gamma: G_x = g / r - x * mean(g * x) / r^3 (the direct term minus the
normalisation-scale feedback term); G_gamma = sum over rows of G_y * x / r.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .. import invariants, numeric
from ..tolerance import INVARIANT_ULPS, machine_epsilon
from . import dense, user_engine
from .registry import SIZE_EDGES, WIDTHS, Axis, Fault, Interface, Op, Param, Structure, named_value, user_code_engines

#: The scale identity (``_scale_identity``): y(c x) = y(x) up to eps, so <G_x, x> is eps's share alone.
SCALE_IDENTITY = "<G_x, x> = d eps mean(g xhat) / s^2"

FAULTS = {f.name: f for f in (
    Fault("rmsnorm-feedback", "G_x = G_y * gamma / r: drops the feedback term -x mean(g x) / r^3 of the "
                              "normalisation scale (the forward still looks right)",
          ("gradient x", SCALE_IDENTITY, "backward agrees with the reference"),
          user=user_engine.ADDED),
)}


#: Known mistakes of an RMSNorm backward (no CLI switch): candidate causes of a failed gradient check
#: (``fingerprints``), computed by :func:`backward` on request.
MISTAKES = {
    "rmsnorm-feedback-sign": "G_x adds the feedback term x mean(g x) / r^3 instead of subtracting it",
    "rmsnorm-feedback-sum": "the feedback term sums g x over the features instead of averaging "
                            "(-x sum(g x) / r^3: d_model times too large)",
    "rmsnorm-feedback-no-gamma": "the feedback term uses G_y instead of g = G_y gamma (-x mean(G_y x) / r^3)",
    "rmsnorm-feedback-r2": "the feedback term divides by r^2 instead of r^3",
    "rmsnorm-feedback-xhat-mean-all": "the feedback term xhat mean(g xhat) / r takes its mean over the whole tensor, "
                                      "not per row",
    "rmsnorm-feedback-mean-all": "the feedback term's mean(g x) is taken over the whole tensor, not per row over the "
                                 "features",
    "rmsnorm-feedback-saved-xhat": "the feedback term is written for x but given the saved xhat = x / r: xhat "
                                   "mean(g xhat) / r^3 (divided by r^2 too often)",
    "rmsnorm-no-gamma": "G_x is written for gamma = 1: G_y in place of g = G_y gamma",
    "rmsnorm-dgamma-raw-x": "G_gamma sums G_y x instead of G_y x / r (the normalised x)",
    "rmsnorm-dgamma-mean": "G_gamma averages over the rows instead of summing",
    "rmsnorm-dgamma-times-gamma": "G_gamma sums g x / r with g = G_y gamma: gamma where G_y alone belongs",
    "rmsnorm-backward-no-eps": "the backward recomputes r = sqrt(mean(x^2)) without the forward's eps",
    **{f"rmsnorm-backward-eps-{e:g}": f"the backward recomputes r with a hard-coded eps = {e:g}, not the forward's"
       for e in (1e-5, 1e-6)},
    **{f"rmsnorm-rstd-{p}": f"the statistic 1 / r (rstd) is saved for the backward in {p}"
       for p in numeric.SAVED_PRECISIONS},
}

#: Known mistakes of an RMSNorm forward: (what it gets wrong, y of the forward with it), named when a user's
#: forward fails against the reference and equals one (``UserOp.forward_mistakes``).
FORWARD_MISTAKES = {
    "rmsnorm-eps-outside-sqrt": ("eps is added outside the square root: x / (sqrt(mean(x^2)) + eps)",
                                 lambda x, gamma, eps: gamma * x / (np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
                                                                    + eps)),
    "rmsnorm-no-eps": ("the forward leaves eps out: x / sqrt(mean(x^2))",
                       lambda x, gamma, eps: forward(x, gamma, 0.0)),
    "rmsnorm-centred-variance": ("r is taken from the centred variance (np.var, jnp.var, torch.var) where the mean "
                                 "of squares belongs", lambda x, gamma, eps: gamma * x / np.sqrt(
                                     np.var(x, axis=-1, keepdims=True) + eps)),
    "rmsnorm-gamma-offset": ("the weight is applied as (1 + gamma), Gemma's convention, where the scenario's is gamma",
                             lambda x, gamma, eps: forward(x, 1.0 + gamma, eps)),
}


def forward(x, gamma, eps):
    """y [..., d_model]."""
    r = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.asarray(eps, dtype=x.dtype))
    return gamma * (x / r)


def backward(x, gamma, eps, grad_y, faults: Collection[str] = ()):
    """(G_x, G_gamma) for upstream grad_y [..., d_model]; G_gamma sums every axis but the last."""
    hard_coded = named_value(faults, "rmsnorm-backward-eps-")
    eps = 0.0 if "rmsnorm-backward-no-eps" in faults else (eps if hard_coded is None else float(hard_coded))
    r = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.asarray(eps, dtype=x.dtype))
    saved = named_value(faults, "rmsnorm-rstd-")
    if saved is not None:
        r = 1.0 / numeric.rounded(1.0 / r, saved)
    g = grad_y if "rmsnorm-no-gamma" in faults else grad_y * gamma
    g_x = g / r
    if "rmsnorm-feedback" not in faults:
        fed = grad_y if "rmsnorm-feedback-no-gamma" in faults else g
        reduce = np.sum if "rmsnorm-feedback-sum" in faults else np.mean
        power = {"rmsnorm-feedback-r2": 2, "rmsnorm-feedback-saved-xhat": 5}
        axis = None if "rmsnorm-feedback-mean-all" in faults else -1
        power = next((power[f] for f in faults if f in power), 3)
        feedback = x * reduce(fed * x, axis=axis, keepdims=True) / r ** power
        if "rmsnorm-feedback-xhat-mean-all" in faults:
            feedback = (x / r) * np.mean(fed * x / r) / r
        g_x = g_x + feedback if "rmsnorm-feedback-sign" in faults else g_x - feedback
    up = grad_y * gamma if "rmsnorm-dgamma-times-gamma" in faults else grad_y
    rows = (up * (x if "rmsnorm-dgamma-raw-x" in faults else x / r)).reshape(-1, x.shape[-1])
    g_gamma = rows.mean(axis=0) if "rmsnorm-dgamma-mean" in faults else rows.sum(axis=0)
    return g_x, g_gamma


def _shapes(sc) -> dict:
    return {"x": (sc.batch, sc.p("n"), sc.p("d_model")), "gamma": (sc.p("d_model"),)}


def _inputs(sc) -> tuple[dict, np.ndarray]:
    shapes = _shapes(sc)
    data = dense.seeded(sc, {**shapes, "g": shapes["x"]})
    g = data.pop("g")
    data["gamma"] = (1.0 + 0.5 * data["gamma"]).astype(data["gamma"].dtype)  # away from 0, mixed signs rare
    return data, g


def _scale_identity(g_x, data, g, eps: float, dtype: str) -> list:
    """RMSNorm is scale invariant but for eps: d/dc y(c x) at c = 1 gives, on every row,
    <G_x, x> = d eps mean(g xhat) / s^2 with g = G_y gamma, s = r = sqrt(mean(x^2) + eps), xhat = x / s (0 when
    eps = 0). ``g_x`` is the G_x under test at the scenario's eps, computed in ``dtype``: the identity holds in
    the setting the code has, so no setting of it is changed."""
    x64, gamma64, g64 = (t.astype(np.float64) for t in (data["x"], data["gamma"], g))
    d = x64.shape[-1]
    r = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    gg = g64 * gamma64
    expected = d * eps * np.mean(gg * x64 / r, axis=-1) / r[..., 0] ** 2
    products = (np.asarray(g_x, dtype=np.float64) * x64).sum(axis=-1)
    # the size of the terms, never of the result: G_x[c] = g[c] / r - x[c] mean(g x) / r^3 cancels
    # to nothing when d_model = 1
    terms = np.abs(x64) * (np.abs(gg) / r + np.abs(x64) * np.mean(np.abs(gg * x64), axis=-1, keepdims=True) / r**3)
    bound = INVARIANT_ULPS * machine_epsilon(dtype) * d * terms.sum(axis=-1)
    return [invariants.bounded_each(SCALE_IDENTITY, "g_x", products - expected, bound,
                                    f"|sum_c G_x[c] x[c] - d eps mean(g xhat) / s^2| per row (g = G_y gamma, s = "
                                    f"sqrt(mean(x^2) + eps), xhat = x / s; RMSNorm is scale invariant but for eps), "
                                    f"at eps = {eps:g}, allowed {INVARIANT_ULPS} ulps of d_model x the size of its "
                                    "terms, sum_c |x[c]| (|g[c]| / s + |x[c]| mean|g x| / s^3)")]


def user_scale_identity(calls, data, g, eps: float, dtype: str) -> list:
    """The scale identity on a user's G_x, or not applicable where eps is fixed inside the user's module."""
    if "eps" in calls.fixed:
        return [invariants.not_applicable(SCALE_IDENTITY, "g_x", calls.fixed["eps"])]
    return _scale_identity(calls()["x"], data, g, eps, dtype)


def _terms(x, gamma, eps, grad_y) -> dict[str, np.ndarray]:
    """The size of the terms of y, G_x and G_gamma (float64): G_x = g / r - x mean(g x) / r^3 cancels (to
    exactly 0 when d_model = 1), so its rounding is that of its terms, never of its value."""
    x64, gamma64, g64 = (np.asarray(t, dtype=np.float64) for t in (x, gamma, grad_y))
    r = np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    gg = np.abs(g64 * gamma64)
    d = x64.shape[-1]
    return {"o": 2 * np.abs(gamma64 * x64) / r,
            "x": gg / r + np.abs(x64) * np.mean(gg * np.abs(x64), axis=-1, keepdims=True) / r**3,
            "gamma": 2 * (np.abs(g64 * x64) / r).reshape(-1, d).sum(axis=0)}


_STRUCTURE = {"x": Structure(("batch", "row", "feature"), heat=("row", "feature")), "gamma": Structure(("feature",))}


def _rounding(t):
    return {"x": np.broadcast_to(dense.rss(t, -1)[..., None], t.shape).copy(),   # its row
            "gamma": dense.rss(t.reshape(-1, t.shape[-1]), 0)}                    # its column


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    data, g = _inputs(sc)
    eps = sc.p("eps")
    g_x, g_gamma = backward(data["x"], data["gamma"], eps, g, faults)

    def checks():
        return _scale_identity(g_x, data, g, eps, sc.dtype)

    terms = _terms(data["x"], data["gamma"], eps, g)["x"]
    analytic = {"x": INVARIANT_ULPS * float(np.finfo(np.dtype(sc.dtype)).eps) * terms}
    return dense.problem(
        sc, data, lambda x, gamma: forward(x, gamma, eps), {"x": g_x, "gamma": g_gamma}, g,
        lift={"gamma": 2}, invariants=checks, analytic_rounding=analytic, rounding=_rounding, structure=_STRUCTURE)


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``)."""
    data, g = _inputs(sc)
    return user_engine.build(sc, user_engine.UserOp(
        inputs=data, args={"eps": sc.p("eps")}, g=g, forward=forward, backward=backward,
        terms=lambda inputs, args, g: _terms(inputs["x"], inputs["gamma"], args["eps"], g),
        invariants=lambda calls, dtype, y: user_scale_identity(calls, data, g, sc.p("eps"), dtype),
        batched=("x",), rounding=_rounding, structure=_STRUCTURE, forward_mistakes=FORWARD_MISTAKES,
        mistakes=user_engine.mistakes(FAULTS, MISTAKES)), faults)


#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(x, gamma, eps) -> y and backward(x, gamma, eps, grad_y) -> (dx, "
    "dgamma); torch: a callable f(x, gamma, eps) -> y, differentiated by autograd; jax: the same "
    "function on JAX arrays, differentiated by jax.vjp"), args=("eps",))

#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 2, "n": 5, "d_model": 16}

#: The space ``attn-gradcheck hunt`` searches: rows, width (each side of the powers of 2) and dtype; eps is the code's.
SPACE = (Axis("dtype", "choice", choices=("float64", "float32")), Axis("batch", low=1, high=4),
         Axis("n", low=1, high=300, edges=SIZE_EDGES), Axis("d_model", low=1, high=1024, edges=WIDTHS))

OP = Op(name="rmsnorm", summary="RMSNorm y = gamma * x / sqrt(mean(x^2) + eps): gradients of x and gamma",
        tensors=("x", "gamma"), faults=FAULTS,
        **user_code_engines("gradcheck_cli.ops.rmsnorm"),
        backends=("numpy", "torch", "jax"),
        implementation=INTERFACE,
        keys={"n": Param("int", 4, "rows per batch element"),
              "d_model": Param("int", help="features per row, e.g. 'd_model: 16'"),
              "eps": Param("float", 1e-6, "added to mean(x^2); 0 allowed", minimum=0.0)},
        shapes=_shapes,
        describe=lambda sc: f"B={sc.batch} n={sc.p('n')} d_model={sc.p('d_model')} eps={sc.p('eps'):g} "
                            f"{sc.dtype} {sc.mode}",
        example=EXAMPLE, space=SPACE)
