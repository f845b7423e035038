"""Scaled dot-product attention with visible sets and grouped KV heads: forward, backward, faults.

Shapes (any extra leading axes broadcast, so finite differences can stack perturbed copies):
  q [B, Hq, n_q, d_head]   k [B, Hkv, n_k, d_head]   v [B, Hkv, n_k, d_value]
  visible bool [B, Hq, n_q, n_k]   kv_map int [Hq] (query head r reads KV head kv_map[r])
  o [B, Hq, n_q, d_value]  a [B, Hq, n_q, n_k]

Forward (A.10.1-A.10.3):  S = scale * Q K^T on the visible set, A = softmax with max-subtraction,
O = A V. Backward (A.10.5-A.10.9): G_V = A^T G_O, G_A = G_O V^T, G_S = A * (G_A - rowsum(A * G_A)),
G_Q = scale * G_S K, G_K = scale * G_S^T Q; K and V gradients summed over the query heads that
share a KV head. The n x n softmax Jacobian is never built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import numpy as np

from .. import implementation, invariants
from .dense import RSS_FACTOR
from .registry import Fault, Op, Problem, Structure

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("softmax-term", "G_S = A * G_A: drops the row-sum subtraction c_i of the softmax backward",
          ("gradient q", "gradient k", "score-gradient rows sum to 0")),
    Fault("mask", "forward and backward ignore the visible set (finite differences agree with it)",
          ("attention is 0 off the visible set", "unseen K/V rows get zero gradient",
           "hidden K/V rows do not change O", "O rows in the range of visible V rows"), forward=True),
    Fault("mask-backward", "only the backward ignores the visible set: it recomputes A without it",
          ("gradient q", "gradient k", "gradient v", "unseen K/V rows get zero gradient")),
    Fault("scale", "G_Q and G_K lose the scale factor (no effect when scale = 1)",
          ("gradient q", "gradient k")),
    Fault("gqa-sum", "K/V gradients: the last query head of a group overwrites instead of summing "
                     "(no effect without shared KV heads)",
          ("gradient k", "gradient v")),
)}


def repeat_kv(x: np.ndarray, kv_map: np.ndarray) -> np.ndarray:
    """[..., Hkv, n, d] -> [..., Hq, n, d]: query head r gets KV head kv_map[r]."""
    return np.take(x, kv_map, axis=-3)


def sum_groups(g: np.ndarray, kv_map: np.ndarray, heads_kv: int, *, overwrite: bool = False) -> np.ndarray:
    """The one reduction of :func:`repeat_kv`: [..., Hq, n, d] -> [..., Hkv, n, d], summing the query
    heads that share a KV head. ``overwrite`` is the ``gqa-sum`` fault (the last head wins)."""
    out = np.zeros(g.shape[:-3] + (heads_kv,) + g.shape[-2:], dtype=g.dtype)
    for r, kv in enumerate(kv_map):
        if overwrite:
            out[..., kv, :, :] = g[..., r, :, :]
        else:
            out[..., kv, :, :] += g[..., r, :, :]
    return out


def _exp_scores(q, k, scale, kv_map, visible, hidden=None):
    """exp(S - m) and its row sums l, for S = scale * q k^T with the row max m over the visible set
    subtracted (A.10.2). ``visible`` None means every key is visible; ``hidden`` may pass ~visible
    precomputed (the projection and block ops difference their forwards through this one).

    Hidden entries are overwritten with exactly 0 after the exponential rather than set to -inf
    before it: exp(-inf) takes NumPy's slow scalar path, about 3x the cost of the others. Whatever
    exp gives there (even inf) is discarded.
    """
    # scale k: as cheap as scaling q, and the same rounding whether or not copies are stacked
    k_rep = repeat_kv(k, kv_map) * np.asarray(scale, dtype=q.dtype)
    s = np.matmul(q, np.swapaxes(k_rep, -1, -2))
    if visible is None:
        s -= s.max(axis=-1, keepdims=True)
        e = np.exp(s, out=s)
    else:
        s -= np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
        with np.errstate(over="ignore", under="ignore"):
            e = np.exp(s, out=s)
        np.copyto(e, 0, where=~visible if hidden is None else hidden)
    return e, e.sum(axis=-1, keepdims=True)


def attention_weights(q, k, visible, scale, kv_map, faults: Collection[str] = ()):
    """A [..., B, Hq, n_q, n_k]: softmax of the scores over each row's visible set (A.10.2)."""
    e, l = _exp_scores(q, k, scale, kv_map, None if "mask" in faults else visible)
    e /= l
    return e


def forward(q, k, v, visible, scale, kv_map, faults: Collection[str] = (), hidden=None):
    """O = A V [..., B, Hq, n_q, d_value] (A.10.3), evaluated as (exp(S - m) V) / l: the same product
    with the normalisation applied to the d_value-wide result instead of the n_k-wide weights.
    ``hidden`` may pass ~visible precomputed (the projection and block ops call this many times; the
    attention op's finite differences evaluate the same function through ``copies.Forward``)."""
    e, l = _exp_scores(q, k, scale, kv_map, None if "mask" in faults else visible, hidden)
    o = np.matmul(e, repeat_kv(v, kv_map))
    o /= l
    return o


@dataclass(frozen=True)
class Gradients:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    s: np.ndarray  # G_S [B, Hq, n_q, n_k], the score gradient (for the row-sum invariant)
    a: np.ndarray  # A and G_A [B, Hq, n_q, n_k], to bound the rounding of G_S's row sums
    ga: np.ndarray


def backward(q, k, v, visible, scale, kv_map, grad_o, faults: Collection[str] = ()) -> Gradients:
    """VJP of :func:`forward` at (q, k, v) for upstream gradient grad_o [B, Hq, n_q, d_value]."""
    k_rep, v_rep = repeat_kv(k, kv_map), repeat_kv(v, kv_map)
    a = attention_weights(q, k, visible, scale, kv_map, (*faults, "mask") if "mask-backward" in faults else faults)
    g_v = np.swapaxes(a, -1, -2) @ grad_o
    g_a = grad_o @ np.swapaxes(v_rep, -1, -2)
    if "softmax-term" in faults:
        g_s = a * g_a
    else:
        g_s = a * (g_a - (a * g_a).sum(axis=-1, keepdims=True))
    s = 1.0 if "scale" in faults else scale
    g_q = (g_s @ k_rep) * s
    g_k = (np.swapaxes(g_s, -1, -2) @ q) * s
    heads_kv, overwrite = k.shape[-3], "gqa-sum" in faults
    return Gradients(q=g_q, k=sum_groups(g_k, kv_map, heads_kv, overwrite=overwrite),
                     v=sum_groups(g_v, kv_map, heads_kv, overwrite=overwrite), s=g_s, a=a, ga=g_a)


def seeded_inputs(sc, dtype=None):
    """Seeded q, k, v and upstream gradient g (zero outside ``loss_rows``) in the scenario's dtype
    (or ``dtype``; the draws are the same)."""
    rng = np.random.default_rng(sc.seed)
    dt = np.dtype(dtype or sc.dtype)
    q = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_head)).astype(dt)
    k = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_head)).astype(dt)
    v = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_value)).astype(dt)
    g = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_value)).astype(dt)
    if sc.loss_rows is not None:
        keep = np.zeros(sc.n_q, dtype=bool)
        keep[list(sc.loss_rows)] = True
        g[..., ~keep, :] = 0
    return {"q": q, "k": k, "v": v}, g


class _Blocks:
    """Independent blocks of the output: a query row (b, r, i) feeds only row i of O[b, r]; K of KV
    head (b, g) feeds only the query heads of group g in batch b; column c of V[b, g] feeds only
    column c of O in those heads (O = A V column by column)."""

    def __init__(self, sc, kv_map):
        self.group = np.eye(sc.heads_kv)[kv_map]  # [Hq, Hkv] one-hot of g(r)
        b, hq, hkv = sc.batch, sc.heads_q, sc.heads_kv
        self.parts = {
            "q": np.broadcast_to(np.arange(b * hq * sc.n_q).reshape(b, hq, sc.n_q, 1), (b, hq, sc.n_q, sc.d_head)),
            "k": np.broadcast_to(np.arange(b * hkv).reshape(b, hkv, 1, 1), (b, hkv, sc.n_k, sc.d_head)),
            "v": np.broadcast_to(np.arange(b * hkv * sc.d_value).reshape(b, hkv, 1, sc.d_value),
                                 (b, hkv, sc.n_k, sc.d_value)),
        }

    def sums(self, name: str, terms: np.ndarray) -> np.ndarray:
        """Sum terms [..., B, Hq, n_q, d_v] of L by the blocks of input ``name`` -> [..., P], in float64."""
        if name == "q":
            return terms.sum(axis=-1, dtype=np.float64).reshape(terms.shape[:-4] + (-1,))
        if name == "k":
            per_group = terms.sum(axis=(-2, -1), dtype=np.float64) @ self.group             # [..., B, Hkv]
        else:
            per_group = np.swapaxes(terms.sum(axis=-2, dtype=np.float64), -1, -2) @ self.group  # [..., B, d_v, Hkv]
            per_group = np.swapaxes(per_group, -1, -2)                                       # [..., B, Hkv, d_v]
        return per_group.reshape(terms.shape[:-4] + (-1,))

    def rounding(self, inputs, g, a, scale, kv_map, rows: int = 256) -> tuple[dict[str, np.ndarray], float]:
        """Rounding model of one forward, per term of L: a logit carries an error of about
        eps * scale * sum_c |q_ic k_jc|, which the softmax passes on relative to A_ij; O_ic then sums
        A_ij V_jc. So |error of O_ic| <~ eps * sum_j A_ij (1 + scale |q_i|.|k_j|) |V_jc|, times |G_ic|.
        Returns the per-element size of the terms that move with it (by block), and the total.
        ``a`` is A, or a callable giving A's rows for a slice of query rows (``rows`` at a time), so
        the tiled engine never holds all of A."""
        a_rows = a if callable(a) else (lambda span: a[..., span, :])
        terms = np.abs(g).astype(np.float64) * output_term_sizes(inputs, a_rows, scale, kv_map, rows)
        # The worst case adds every term's bound; independent rounding errors add in quadrature, so a
        # block of many terms (K's: every query of its group) is charged RSS_FACTOR x their root sum of
        # squares when that is less (the worst case would hide real bugs on large float32 heads).
        out = {}
        for name in inputs:
            linear = self.sums(name, terms)
            rss = RSS_FACTOR * np.sqrt(self.sums(name, terms * terms))
            out[name] = np.minimum(linear, rss)[self.parts[name]]
        return out, float(min(terms.sum(), RSS_FACTOR * np.sqrt(np.sum(terms * terms))))


def output_term_sizes(inputs, a_rows, scale, kv_map, rows: int = 256) -> np.ndarray:
    """sum_j A_ij (1 + |scale| sum_c |q_ic k_jc|) |V_jc| for every element of O, in float64: the size of
    the terms each output element is made of, from which its rounding comes (a logit carries an error
    of about eps * |scale| sum_c |q_ic k_jc|, which the softmax passes on relative to A_ij). ``a_rows(span)``
    gives A's rows for a slice of query rows; ``rows`` query rows are taken at a time."""
    qa, ka, va = (np.abs(t).astype(np.float64) for t in
                  (inputs["q"], repeat_kv(inputs["k"], kv_map), repeat_kv(inputs["v"], kv_map)))
    out = np.empty(qa.shape[:-1] + (va.shape[-1],))
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        logit_error = 1.0 + abs(scale) * (qa[..., span, :] @ np.swapaxes(ka, -1, -2))
        out[..., span, :] = (a_rows(span).astype(np.float64) * logit_error) @ va
    return out


#: Invariants that fail when the forward lets hidden keys reach O.
FORWARD_MASK_CHECKS = ("attention is 0 off the visible set", "hidden K/V rows do not change O",
                       "O rows in the range of visible V rows")


def diagnosis(sc) -> tuple[dict[str, Structure], object]:
    """(structure, hints) for the diagnosis of failed checks (README "Diagnosis"): what the axes of
    q, k, v mean, which rows the mask touches, and the rules that name a likely cause."""
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible = sc.visible
    sees_all = visible.all(axis=-1)                                        # [B, Hq, n_q]
    group = np.eye(sc.heads_kv, dtype=np.int64)[kv_map]                     # [Hq, Hkv]
    seen = np.einsum("bhij,hg->bgj", visible.astype(np.int64), group)        # [B, Hkv, n_k]
    every = seen == (sc.n_q * group.sum(axis=0))[None, :, None]
    kv_classes = {"key rows every query sees": every, "key rows hidden from some queries": ~every & (seen > 0),
                  "key rows no query sees": seen == 0}
    n_k = visible.shape[-1]
    first = np.where(visible.any(axis=-1), visible.argmax(axis=-1), 0)
    last = np.where(visible.any(axis=-1), n_k - 1 - visible[..., ::-1].argmax(axis=-1), n_k - 1)
    q_classes = {"query rows that see every key": sees_all, "query rows with hidden keys": ~sees_all,
                 "query rows cut on the left (window edge)": first > 0,
                 "query rows cut on the right (causal diagonal, padding)": last < n_k - 1}
    if sc.heads_kv < sc.heads_q:
        for g in range(sc.heads_kv):
            heads = kv_map == g
            q_classes[f"query heads of KV head {g} ({', '.join(map(str, np.flatnonzero(heads)))})"] = \
                np.broadcast_to(heads[None, :, None], sees_all.shape)
    structure = {
        "q": Structure(("batch", "query head", "query row", "feature"), q_classes, ("query head", "query row")),
        "k": Structure(("batch", "KV head", "key row", "feature"), kv_classes, ("KV head", "key row")),
        "v": Structure(("batch", "KV head", "key row", "feature"), kv_classes, ("KV head", "key row")),
    }
    shared = group.sum(axis=0) > 1                                           # [Hkv]

    def hints(evidence: dict, checks: list) -> list[str]:
        failed = {c.tensor for c in checks if c.kind == "gradient" and c.verdict == "fail"}
        broken = {c.name for c in checks if c.kind == "invariant" and not c.passed}
        out = []
        forward_mask = [name for name in FORWARD_MASK_CHECKS if name in broken]
        if forward_mask:
            out.append("the forward lets hidden keys reach O (" + "; ".join(forward_mask) + ")"
                       + ("" if failed else ", while finite differences agree with the backward")
                       + ": apply the visible set in the forward (hidden keys get weight exactly 0)")
        elif _mask_backward(evidence, failed, broken, sees_all, kv_classes["key rows no query sees"]):
            out.append("the errors sit only where the mask matters (query rows with hidden keys, or gradient "
                       "flowing into keys no query sees) while rows that see every key are right: the backward "
                       "ignores or misapplies the visible set (e.g. recomputes A without it)")
        shift = _shift_violation(evidence, failed, broken, sc.tolerance)
        if shift:
            out.append(shift)
        ratio = _common_factor(evidence, failed, sc.tolerance)
        if ratio is not None:
            why = ""
            if abs(ratio * sc.scale - 1) < 1e-2:
                why = f"; it is 1/scale ({1 / sc.scale:.4g}): the backward drops the scale"
            elif abs(ratio / sc.scale - 1) < 1e-2:
                why = f"; it is the scale ({sc.scale:.4g}): the backward applies it twice"
            out.append(f"G_Q and G_K are both {ratio:.4g} x their finite differences while G_V is right: the scale "
                       f"factor in the backward (G_Q = scale * G_S K, G_K = scale * G_S^T Q){why}")
        heads = _bad_kv_heads(evidence, failed)
        if heads is not None and heads.any() and shared[heads].all():
            bad = [int(h) for h in np.flatnonzero(heads)]
            sizes = sorted({int(group.sum(axis=0)[h]) for h in bad})
            out.append(f"errors only in K/V gradients of KV heads shared by several query heads (KV head "
                       f"{', '.join(map(str, bad))}; {'/'.join(map(str, sizes))} query heads each)"
                       + ("; unshared KV heads are right" if (~shared).any() else "")
                       + ", and G_Q is right: the GQA reduction must sum the gradients of every query head "
                         "in a group (sum_groups)")
        return out

    return structure, hints


def diagnosis_fields(sc) -> dict:
    structure, hints = diagnosis(sc)
    return {"structure": structure, "hints": hints}


def _mask_backward(evidence, failed, broken, sees_all, nobody) -> bool:
    """Gradient errors confined to where masking matters, or the unseen-rows invariant failing."""
    if "unseen K/V rows get zero gradient" in broken:
        return True
    for name in ("k", "v"):
        ev = evidence.get(name)
        if ev is not None and name in failed and (ev.bad & nobody[..., None]).any():
            return True
    ev = evidence.get("q")
    if ev is None or "q" not in failed:
        return False
    full_rows = sees_all[..., None] & ev.checked
    return bool(full_rows.any() and not (ev.bad & full_rows).any() and ev.bad.any())


def _shift_violation(evidence, failed, broken, tolerance) -> str | None:
    """Softmax is shift invariant: moving every key by the same vector moves each score row by a
    constant, so the K gradients of a (batch, KV head) sum to zero over the keys."""
    ev = evidence.get("k")
    message = ("softmax is shift invariant, so the row-sum term of its backward is missing or wrong: "
               "G_S = A * (G_A - rowsum(A * G_A))")
    if "score-gradient rows sum to 0" in broken:
        return "G_S rows do not sum to 0: " + message
    if ev is None or not ({"q", "k"} & failed) or not ev.checked.all():
        return None
    total_a = float(np.abs(ev.analytic.sum(axis=-2)).max(initial=0.0))
    total_n = float(np.abs(ev.numeric.sum(axis=-2)).max(initial=0.0))
    size = float(np.abs(ev.analytic).max(initial=0.0))
    if total_a > 10 * tolerance * size and total_a > 10 * total_n:
        return (f"the analytic G_K does not sum to 0 over the keys (worst {total_a:.3g}; the finite differences "
                f"sum to {total_n:.1g}): " + message)
    return None


def _common_factor(evidence, failed, tolerance) -> float | None:
    """The factor c when analytic = c x numeric for both q and k (and v is right), else None."""
    if not {"q", "k"} <= failed or "v" in failed or "q" not in evidence or "k" not in evidence:
        return None
    factors = []
    for name in ("q", "k"):
        ev = evidence[name]
        a, n = ev.analytic[ev.checked], ev.numeric[ev.checked]
        nn = float(n @ n)
        if not np.isfinite(nn) or nn == 0:
            return None
        c = float(a @ n) / nn
        if float(np.abs(a - c * n).max()) > (10 * tolerance + 1e-3) * float(np.abs(a).max()):
            return None
        factors.append(c)
    c_q, c_k = factors
    if abs(c_q - c_k) > 1e-2 * abs(c_q) or abs(c_q - 1) < 1e-2:
        return None
    return (c_q + c_k) / 2


def _bad_kv_heads(evidence, failed) -> np.ndarray | None:
    """bool [Hkv]: KV heads with an out-of-tolerance K or V element, when G_Q is right; else None."""
    if "q" in failed or not {"k", "v"} & failed:
        return None
    heads = None
    for name in ("k", "v"):
        ev = evidence.get(name)
        if ev is not None:
            bad = ev.bad.any(axis=(0, 2, 3))
            heads = bad if heads is None else heads | bad
    return heads


def build(sc, faults: Collection[str] = ()) -> Problem:
    """Inputs for scenario ``sc``, the loss L = sum(O * G), analytic gradients and invariants: of the
    built-in engine with ``faults`` injected, or of the user's implementation when the scenario names one."""
    if sc.backend == "torch":
        from ..backends import torch_backend  # torch is imported only when a scenario asks for it
        return torch_backend.build(sc, faults)
    if sc.implementation is not None:
        return _build_user(sc)
    if sc.engine == "tiled":
        from . import tiled
        return tiled.build(sc, faults)
    from . import copies
    inputs, g = seeded_inputs(sc)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    dt = np.dtype(sc.dtype)
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible, scale = sc.visible, sc.scale
    blocks = _Blocks(sc, kv_map)

    def fwd(q, k, v):
        return (forward(q, k, v, visible, scale, kv_map, faults),
                attention_weights(q, k, visible, scale, kv_map, faults))

    def bwd(q, k, v, grad_o):
        return backward(q, k, v, visible, scale, kv_map, grad_o, faults)

    def reference(q, k, v):
        return forward(q, k, v, visible, scale, kv_map, faults)

    # Finite differences evaluate the same forward by blocks of query rows (ops/copies.py), checked
    # against the reference in every run.
    fast = copies.Forward(None if "mask" in faults else visible, scale, kv_map, sc.n_q, sc.n_k)

    def copies_forward(name: str, x: np.ndarray) -> np.ndarray:
        return fast(**{**inputs, name: x})

    o, a = fwd(q, k, v)
    grads = bwd(q, k, v, g)
    rounding, rounding_total = blocks.rounding(inputs, g, a, scale, kv_map)
    rng_inv = np.random.default_rng([sc.seed, 1])
    return Problem(
        inputs=inputs,
        loss=lambda name, x: np.sum(copies_forward(name, x) * g, axis=(-4, -3, -2, -1), dtype=np.float64),
        gradients={"q": grads.q, "k": grads.k, "v": grads.v},
        rounding=rounding,
        rounding_total=rounding_total,
        copy_bytes=3 * a.size * dt.itemsize + o.size * dt.itemsize,
        invariants=lambda: [copies.agreement(fast, reference, inputs, visible, scale, kv_map, faults,
                                             np.random.default_rng([sc.seed, 4]))]
        + invariants.attention(fwd, bwd, inputs, visible, kv_map, grads, rng_inv),
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": grads.q, "analytic_k": grads.k, "analytic_v": grads.v},
        output=o,
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, copies_forward(name, x) * g),
        **diagnosis_fields(sc),
    )


def _build_user(sc) -> Problem:
    """The same problem for the user's implementation (README "Checking your own implementation"):
    its forward and backward are called through ``implementation.call`` (so misbehaviour is a failed
    check), perturbed copies are stacked along the batch axis, and the built-in engine in float64 is
    the reference its output and gradients must agree with."""
    impl = sc.implementation_object
    inputs, g = seeded_inputs(sc)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    dt = np.dtype(sc.dtype)
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible, scale, batch = sc.visible, sc.scale, sc.batch
    blocks = _Blocks(sc, kv_map)

    def user_forward(q, k, v, visible):
        shape = (q.shape[0], sc.heads_q, sc.n_q, sc.d_value)
        return implementation.call(impl.forward, "forward", (q, k, v, visible, scale, kv_map), {"o": (shape, dt)})["o"]

    def user_backward(q, k, v, grad_o):
        out = implementation.call(impl.backward, "backward", (q, k, v, visible, scale, kv_map, grad_o),
                                  {"dq": (q.shape, dt), "dk": (k.shape, dt), "dv": (v.shape, dt)})
        return out["dq"], out["dk"], out["dv"]

    def copies_forward(name: str, x: np.ndarray) -> np.ndarray:
        """x [C, B, ...]: C perturbed copies of input ``name``, stacked along the batch axis."""
        c = x.shape[0]
        args = {t: (x if t == name else np.broadcast_to(val, (c,) + val.shape)).reshape((c * batch,) + val.shape[1:])
                for t, val in inputs.items()}
        vis = np.broadcast_to(visible, (c,) + visible.shape).reshape((c * batch,) + visible.shape[1:])
        try:
            return user_forward(args["q"], args["k"], args["v"], vis).reshape((c,) + g.shape)
        except implementation.ImplementationFailure as exc:
            raise implementation.in_copies(exc, batch, name) from None

    o = user_forward(q, k, v, visible)
    dq, dk, dv = user_backward(q, k, v, g)
    ref_inputs = {t: val.astype(np.float64) for t, val in inputs.items()}
    ref_o = forward(**ref_inputs, visible=visible, scale=scale, kv_map=kv_map)
    ref = backward(**ref_inputs, visible=visible, scale=scale, kv_map=kv_map, grad_o=g.astype(np.float64))
    rounding, rounding_total = blocks.rounding(inputs, g, ref.a, scale, kv_map)
    rng_inv = np.random.default_rng([sc.seed, 1])

    def checks() -> list:
        agree = [invariants.agreement("forward agrees with the reference", "o", o, ref_o, sc.tolerance)]
        agree += [invariants.agreement("backward agrees with the reference", t, mine, theirs, sc.tolerance)
                  for t, mine, theirs in (("q", dq, ref.q), ("k", dk, ref.k), ("v", dv, ref.v))]
        try:
            return agree + invariants.attention_outputs(
                lambda q, k, v: user_forward(q, k, v, visible), lambda q, k, v, go: user_backward(q, k, v, go)[1:],
                inputs, visible, kv_map, o, rng_inv)
        except implementation.ImplementationFailure as exc:
            return agree + [implementation.failure_check("invariants", exc)]

    tiled = (k.size + v.size + q.size) * dt.itemsize + visible.size
    return Problem(
        inputs=inputs,
        loss=lambda name, x: np.sum(copies_forward(name, x) * g, axis=(-4, -3, -2, -1), dtype=np.float64),
        gradients={"q": dq, "k": dk, "v": dv},
        rounding=rounding,
        rounding_total=rounding_total,
        copy_bytes=3 * ref.a.size * dt.itemsize + o.size * dt.itemsize + tiled,
        invariants=checks,
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": dq, "analytic_k": dk, "analytic_v": dv, "reference_output": ref_o},
        output=o,
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, copies_forward(name, x) * g),
        **diagnosis_fields(sc),
    )


def shapes(sc) -> dict:
    return {"q": (sc.batch, sc.heads_q, sc.n_q, sc.d_head), "k": (sc.batch, sc.heads_kv, sc.n_k, sc.d_head),
            "v": (sc.batch, sc.heads_kv, sc.n_k, sc.d_value)}


OP = Op(name="attention", summary="scaled dot-product attention (A.10): gradients of q, k, v",
        tensors=("q", "k", "v"), faults=FAULTS, build=build, attention_keys=True, shapes=shapes)
