"""Hints for a failed JVP (``check: {mode: jvp}``): the implementation's output tangent is compared, along one
random tangent of q, k and v, with the closed form and with the mistakes a kernel author makes in it (the
centring term dropped or turned around, mu unweighted, a path of dS or the A dV term missing, the scale
missing or doubled, the mask left out of the tangent). A hint names the mistake whose JVP the
implementation's matches: far closer (under a twentieth of the distance) than the correct one."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ....implementation import ImplementationFailure
from ..directional import jvp
from ..formulas import attention_weights, repeat_kv

#: Larger score matrices (B x Hq x n_q x n_k elements) get no JVP hints: the comparison holds them densely.
LARGEST = 2**24

#: Closer to the mistake than to the closed form by at least this factor: the hint fires.
MATCH_FACTOR = 20.0

FIX = "dO = (A * (dS - mu)) V + A dV with dS = scale (dQ K^T + Q dK^T) on the visible set, mu_i = sum_j A_ij dS_ij"


def _variants(q, k, v, args, dq, dk, dv) -> dict[str, np.ndarray]:
    """The correct JVP (key "") and each mistake's, in float64 (``args``: attention's ``Args``, without stages)."""
    visible, scale, kv_map = args.visible, args.scale, np.asarray(args.kv_map)
    kr, vr, dkr, dvr = (repeat_kv(x, kv_map) for x in (k, v, dk, dv))
    a = attention_weights(q, k, **args.kw)
    a_all = attention_weights(q, k, **args.but(visible=np.ones_like(visible)).kw)
    s_q = dq @ np.swapaxes(kr, -1, -2)
    s_k = q @ np.swapaxes(dkr, -1, -2)

    def out(s_dot, mu, weights=a, with_v=True):
        return (weights * (s_dot - mu)) @ vr + (weights @ dvr if with_v else 0.0)

    def mu(weights, s_dot):
        return (weights * s_dot).sum(axis=-1, keepdims=True)

    s_dot = np.where(visible, scale * (s_q + s_k), 0.0)
    count = np.maximum(visible.sum(axis=-1, keepdims=True), 1)
    unmasked = scale * (s_q + s_k)
    found = {}
    heads_q, heads_kv = q.shape[-3], k.shape[-3]
    if heads_q > heads_kv and heads_q % heads_kv == 0:  # GQA: the tangents repeated in the other KV-head layout
        contiguous = np.arange(heads_q) // (heads_q // heads_kv)
        other = np.arange(heads_q) % heads_kv if np.array_equal(kv_map, contiguous) else contiguous
        if not np.array_equal(other, kv_map):
            s_other = np.where(visible, scale * (s_q + q @ np.swapaxes(repeat_kv(dk, other), -1, -2)), 0.0)
            found["the K and V tangents reach the query heads in a different KV-head layout from the forward's K "
                  "and V (contiguous groups vs interleaved)"] = (
                (a * (s_other - mu(a, s_other))) @ vr + a @ repeat_kv(dv, other))
    return found | {
        "": jvp(q, k, v, dq=dq, dk=dk, dv=dv, **args.kw),
        "the centring term is missing: mu_i = sum_j A_ij dS_ij is not subtracted from dS": out(s_dot, 0.0),
        "mu is added instead of subtracted (dS + mu)": out(s_dot, -mu(a, s_dot)),
        "mu is the plain mean of dS over the visible keys, not weighted by A":
            out(s_dot, s_dot.sum(axis=-1, keepdims=True) / count),
        "mu is taken over every key (the softmax and dS without the mask), while the rest of the tangent is masked":
            out(s_dot, mu(a_all, unmasked)),
        "the K tangent's path of dS (scale Q dK^T) is missing":
            out(np.where(visible, scale * s_q, 0.0), mu(a, np.where(visible, scale * s_q, 0.0))),
        "the Q tangent's path of dS (scale dQ K^T) is missing":
            out(np.where(visible, scale * s_k, 0.0), mu(a, np.where(visible, scale * s_k, 0.0))),
        "the V tangent's term A dV is missing": out(s_dot, mu(a, s_dot), with_v=False),
        "dS lacks the scale": out(s_dot / scale, mu(a, s_dot / scale)),
        "dS has the scale twice": out(s_dot * scale, mu(a, s_dot * scale)),
        "the tangent ignores the mask (its A and dS run over every key, while the forward masks)":
            out(unmasked, mu(a_all, unmasked), weights=a_all),
    }


def jvp_hints(jvp: Callable[[dict], np.ndarray], inputs: dict, args, seed) -> Callable[[list], list[str]]:
    """``explain(checks)`` for ``registry.Tangents``: the hint naming the mistake the JVP ``jvp`` (tangents by input
    name, in the inputs' dtype -> dO) matches; failing that, when only some of the per-input directions failed,
    the hint naming those paths. ``args``: attention's ``args.Args`` (the textbook closed forms' mistakes are
    tried, so a scenario with score stages gets the per-path hint only)."""
    def mistake() -> str | None:
        if np.size(args.visible) > LARGEST or args.stages:
            return None
        rng = np.random.default_rng(seed)
        tangent = {n: rng.standard_normal(x.shape).astype(x.dtype) for n, x in inputs.items()}
        try:
            got = np.asarray(jvp(tangent), dtype=np.float64)
        except ImplementationFailure:
            return None
        f64 = {n: x.astype(np.float64) for n, x in {**inputs, **{f"d{n}": t for n, t in tangent.items()}}.items()}
        found = _variants(f64["q"], f64["k"], f64["v"], args, f64["dq"], f64["dk"], f64["dv"])
        right = found.pop("")
        off = float(np.abs(got - right).max(initial=0.0))
        if not np.isfinite(off) or off == 0.0:
            return None
        distance = {name: float(np.abs(got - x).max(initial=0.0)) for name, x in found.items()
                    if np.abs(x - right).max(initial=0.0) > 0}
        best = min(distance, key=distance.get) if distance else None
        if best is None or distance[best] * MATCH_FACTOR > off:
            return None
        return (f"the JVP matches the closed form with this mistake: {best} (off by {distance[best]:.2g} from it, "
                f"{off:.2g} from the correct one); the correct one is {FIX}")

    def explain(checks: list) -> list[str]:
        named = mistake()
        if named:
            return [named]
        paths = [c.name[4:] for c in checks if c.name in ("jvp q", "jvp k", "jvp v") and c.verdict == "fail"]
        if paths and len(paths) < 3:
            return [f"the JVP is wrong along the tangent of {' and '.join(paths)} only: look at that path of the "
                    "forward-mode derivative (e.g. dS = scale (dQ K^T + Q dK^T), mu = sum_j A_ij dS_ij)"]
        return []
    return explain
