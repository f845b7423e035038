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

#: What a built-in fault does to a user's implementation: the gradient change the bug makes in the
#: float64 reference is added to the implementation's gradients.
_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("softmax-term", "G_S = A * G_A: drops the row-sum subtraction c_i of the softmax backward",
          ("gradient q", "gradient k", "score-gradient rows sum to 0", "backward agrees with the reference"),
          user=_ADDED),
    Fault("mask", "forward and backward ignore the visible set (finite differences agree with it)",
          ("attention is 0 off the visible set", "unseen K/V rows get zero gradient",
           "hidden K/V rows do not change O", "O rows in the range of visible V rows",
           "forward agrees with the reference"), forward=True,
          user="shows the implementation every key as visible, in its forward and its backward"),
    Fault("mask-backward", "only the backward ignores the visible set: it recomputes A without it",
          ("gradient q", "gradient k", "gradient v", "unseen K/V rows get zero gradient",
           "backward agrees with the reference"), user=_ADDED),
    Fault("scale", "G_Q and G_K lose the scale factor (no effect when scale = 1)",
          ("gradient q", "gradient k", "backward agrees with the reference"), user=_ADDED),
    Fault("gqa-sum", "K/V gradients: the last query head of a group overwrites instead of summing "
                     "(no effect without shared KV heads)",
          ("gradient k", "gradient v", "backward agrees with the reference"), user=_ADDED),
    *(Fault(f"scale-d{t}", f"d{t.upper()} x (1 + 10 x the smallest relative error the clean run would have caught in it)",
            (f"gradient {t}", "backward agrees with the reference"), engine=False, sized=True,
            user=f"multiplies the implementation's d{t.upper()} by that factor") for t in "qkv"),
    Fault("swap-dk-dv", "returns dV as dK and dK as dV (applies when d_head = d_value)",
          ("gradient k", "gradient v", "backward agrees with the reference"), engine=False,
          user="swaps the implementation's dK and dV"),
    Fault("leak-hidden-key", "one hidden key (the first in row-major order) is visible, in forward and backward",
          ("forward agrees with the reference",), forward=True, engine=False,
          user="shows the implementation that key as visible, in its forward and its backward"),
)}

#: The faults of the built-in engines (the others act on a user's implementation only).
ENGINE_FAULTS: dict[str, Fault] = {name: f for name, f in FAULTS.items() if f.engine}

#: Built-in faults whose effect on a user's implementation is their change to the reference gradients.
_DIFFERENCE_FAULTS = ("softmax-term", "mask-backward", "scale", "gqa-sum")


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
        g_abs = np.abs(g).astype(np.float64)
        terms = g_abs * output_term_sizes(inputs, a_rows, scale, kv_map, rows)
        # Moving V leaves the logits alone: both evaluations of a V difference round S (and A) the same
        # way, so only the product A V rounds differently (no logit term).
        terms_v = g_abs * output_term_sizes(inputs, a_rows, scale, kv_map, rows, logits=False)
        # The worst case adds every term's bound; independent rounding errors add in quadrature, so a
        # block of many terms (K's: every query of its group) is charged RSS_FACTOR x their root sum of
        # squares when that is less (the worst case would hide real bugs on large float32 heads).
        out = {}
        for name in inputs:
            t = terms_v if name == "v" else terms
            linear = self.sums(name, t)
            # (squares of terms below ~1e-154 underflow: the root sum of squares is at least sum / sqrt(count))
            rss = RSS_FACTOR * np.maximum(np.sqrt(self.sums(name, t * t)), linear / np.sqrt(t.size))
            out[name] = np.minimum(linear, rss)[self.parts[name]]
        return out, float(min(terms.sum(), RSS_FACTOR * np.sqrt(np.sum(terms * terms))))


def output_term_sizes(inputs, a_rows, scale, kv_map, rows: int = 256, logits: bool = True) -> np.ndarray:
    """The size of the terms each element of O is made of, from which its rounding comes, in float64:
    sum_j A_ij |V_jc| (the product and the normalisation) plus the logits' share. A logit S_ij carries an
    error of about eps L_ij, L_ij = |scale| sum_c |q_ic k_jc|, which moves O_ic by A_ij (V_jc - O_ic) per
    unit (a shift common to the row cancels); that share is bounded by Cauchy-Schwarz as
    sqrt(sum_j A_ij L_ij^2) sqrt(sum_j A_ij (V_jc - O_ic)^2), so a peaked row, whose O is its top V row,
    is charged nothing for logits it barely weighs. ``a_rows(span)`` gives A's rows for a slice of query
    rows; ``rows`` query rows are taken at a time. ``logits`` False leaves out the logits' share."""
    qa, ka = (np.abs(t).astype(np.float64) for t in (inputs["q"], repeat_kv(inputs["k"], kv_map)))
    v = repeat_kv(inputs["v"], kv_map).astype(np.float64)
    va = np.abs(v)
    out = np.empty(qa.shape[:-1] + (va.shape[-1],))
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        a = a_rows(span).astype(np.float64)
        out[..., span, :] = a @ va
        if logits:
            logit = abs(scale) * (qa[..., span, :] @ np.swapaxes(ka, -1, -2))
            spread = np.sqrt(np.sum(a * logit * logit, axis=-1, keepdims=True))
            o = a @ v
            variance = np.maximum(a @ (v * v) - o * o, 0.0)
            out[..., span, :] += spread * np.sqrt(variance)
    return out


def output_terms(inputs, a, scale, kv_map) -> dict[str, np.ndarray]:
    """The size of the terms of each element of O, for the invariants: ``o`` with the logits' rounding,
    ``o_convex`` without it (sum_j A_ij |V_jc|). ``a``: A, or ``a_rows(span)``."""
    a_rows = a if callable(a) else (lambda span: a[..., span, :])
    return {"o": output_term_sizes(inputs, a_rows, scale, kv_map),
            "o_convex": output_term_sizes(inputs, a_rows, scale, kv_map, logits=False)}


def term_sizes(inputs, g, a_rows, scale, kv_map, rows: int = 256, rss: bool = False) -> dict[str, np.ndarray]:
    """The size of the terms each element of O, G_Q, G_K and G_V is made of (float64, by blocks of
    ``rows`` query rows): rounding in a precision with unit roundoff u puts an error of about
    u x these in each element, whatever order the implementation sums in.

    With L_ij = |scale| sum_c |q_ic k_jc| (a logit's rounding, passed on relative to A_ij) and
    Ã = A (1 + L): O ~ Ã |V|; G_A ~ |G_O| |V|^T; G_S ~ Ã (|G_A| + sum_j A_ij |G_A|_ij);
    G_Q ~ |scale| |G_S| |K|; G_K ~ |scale| |G_S|^T |Q|; G_V ~ Ã^T |G_O| (K/V summed over each group).
    ``rss``: the root sum of squares of those terms instead of their sum (independent rounding errors
    add in quadrature: the statistical size of the error, where the sum is its worst case).
    ``a_rows(span)`` gives A's rows for a slice of query rows."""
    power = 2 if rss else 1
    qa, ka, va = (np.abs(t).astype(np.float64) ** power for t in
                  (inputs["q"], repeat_kv(inputs["k"], kv_map), repeat_kv(inputs["v"], kv_map)))
    q1, k1 = (np.abs(t).astype(np.float64) for t in (inputs["q"], repeat_kv(inputs["k"], kv_map)))
    v1 = np.abs(repeat_kv(inputs["v"], kv_map)).astype(np.float64)
    g1 = np.abs(g).astype(np.float64)
    ga = g1 ** power
    t_o = np.empty(ga.shape)
    t_q = np.empty(qa.shape)
    t_k, t_v = np.zeros(ka.shape), np.zeros(va.shape)
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        a = a_rows(span).astype(np.float64)
        a_err = a * (1.0 + abs(scale) * (q1[..., span, :] @ np.swapaxes(k1, -1, -2)))
        g_a = g1[..., span, :] @ np.swapaxes(v1, -1, -2)
        t_s = a_err * (g_a + np.sum(a * g_a, axis=-1, keepdims=True))
        a_err, t_s = a_err ** power, t_s ** power
        t_o[..., span, :] = a_err @ va
        t_q[..., span, :] = abs(scale) ** power * (t_s @ ka)
        t_k += abs(scale) ** power * (np.swapaxes(t_s, -1, -2) @ qa[..., span, :])
        t_v += np.swapaxes(a_err, -1, -2) @ ga[..., span, :]
    heads_kv = inputs["k"].shape[-3]
    out = {"o": t_o, "q": t_q, "k": sum_groups(t_k, kv_map, heads_kv), "v": sum_groups(t_v, kv_map, heads_kv)}
    if not rss:
        return out
    # Terms below ~1e-154 square to 0 (a key almost no query weighs, at a large scale): the root sum of
    # squares is never below sum / sqrt(number of terms), which does not underflow.
    linear = term_sizes(inputs, g, a_rows, scale, kv_map, rows)
    count = qa.shape[-2] * ka.shape[-2] * max(1, int(np.bincount(np.asarray(kv_map)).max()))
    return {t: np.maximum(np.sqrt(x), linear[t] / np.sqrt(count)) for t, x in out.items()}


def diagnosis_fields(sc, context=None) -> dict:
    """The structure and hints of the diagnosis (``attention_hints``); ``context`` for an implementation."""
    from .attention_hints import diagnosis
    structure, hints = diagnosis(sc, context)
    return {"structure": structure, "hints": hints}


def hint_context(inputs: dict, g, visible, scale, kv_map, results: dict, reference_results: dict, impl_forward=None):
    """What the hints may consult about an implementation (``attention_hints.Context``)."""
    from .attention_hints import Context
    x = {t: val.astype(np.float64) for t, val in inputs.items()}

    def reference_output(visible=visible, kv_map=kv_map):
        return forward(x["q"], x["k"], x["v"], visible, scale, np.asarray(kv_map, dtype=np.intp))

    return Context(output=np.asarray(results["o"], dtype=np.float64), reference=reference_output,
                   reference_gradients={t: reference_results[t] for t in "qkv"},
                   gradients={t: np.asarray(results[t], dtype=np.float64) for t in "qkv"}, forward=impl_forward,
                   inputs=inputs, g=np.asarray(g, dtype=np.float64))


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """Inputs for scenario ``sc``, the loss L = sum(O * G), analytic gradients and invariants: of the
    built-in engine with ``faults`` injected, or of the user's implementation when the scenario names one
    (with the faults' ``user`` variants; ``sizes`` sets the sized ones)."""
    if sc.backend == "torch":
        from ..backends import torch_backend  # torch is imported only when a scenario asks for it
        return torch_backend.build(sc, faults, sizes)
    if sc.implementation is not None:
        return _build_user(sc, faults, sizes)
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
        + invariants.attention(fwd, bwd, inputs, visible, kv_map, grads, rng_inv,
                               output_terms(inputs, a, scale, kv_map)),
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": grads.q, "analytic_k": grads.k, "analytic_v": grads.v},
        output=o,
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, copies_forward(name, x) * g),
        **diagnosis_fields(sc),
    )


class Interface:
    """The interface-level faults for a user's implementation (``Fault.user``): what it is shown
    (``visible``) and what its gradients become (``gradients``). No fault: both unchanged."""

    def __init__(self, faults: Collection[str], sizes: dict[str, float] | None, visible, scale, kv_map):
        self.faults, self.sizes, self.scale, self.kv_map = tuple(faults), dict(sizes or {}), scale, kv_map
        self.true_visible = visible
        self.visible = visible
        if "mask" in self.faults:
            self.visible = np.ones_like(visible)
        if "leak-hidden-key" in self.faults:
            hidden = np.argwhere(~visible)
            if len(hidden):
                self.visible = visible.copy()
                self.visible[tuple(hidden[0])] = True
        self.added = tuple(f for f in self.faults if f in _DIFFERENCE_FAULTS)

    def gradients(self, q, k, v, grad_o, dq, dk, dv):
        out = {"q": dq, "k": dk, "v": dv}
        if self.added:
            args = [x.astype(np.float64) for x in (q, k, v, grad_o)]
            right = backward(*args[:3], self.true_visible, self.scale, self.kv_map, args[3])
            wrong = backward(*args[:3], self.true_visible, self.scale, self.kv_map, args[3], self.added)
            for t in out:
                out[t] = (out[t].astype(np.float64) + getattr(wrong, t) - getattr(right, t)).astype(out[t].dtype)
        for t in out:
            if f"scale-d{t}" in self.faults:
                out[t] = (out[t] * (1.0 + self.sizes.get(f"scale-d{t}", 0.0))).astype(out[t].dtype)
        if "swap-dk-dv" in self.faults and out["k"].shape == out["v"].shape:
            out["k"], out["v"] = out["v"], out["k"]
        return out["q"], out["k"], out["v"]


#: Names of the reference checks of each result.
REFERENCE_CHECKS = {"o": "forward agrees with the reference", "q": "backward agrees with the reference",
                    "k": "backward agrees with the reference", "v": "backward agrees with the reference"}


def reference(inputs: dict, g: np.ndarray, visible, scale, kv_map) -> tuple[dict, dict, np.ndarray]:
    """The float64 reference on the given inputs: ({o, q, k, v}, term sizes (root sum of squares) of
    each, A)."""
    x = {t: val.astype(np.float64) for t, val in inputs.items()}
    g64 = np.asarray(g, dtype=np.float64)
    o = forward(x["q"], x["k"], x["v"], visible, scale, kv_map)
    grads = backward(x["q"], x["k"], x["v"], visible, scale, kv_map, g64)
    terms = term_sizes(x, g64, lambda span: grads.a[..., span, :], scale, kv_map, rss=True)
    return {"o": o, "q": grads.q, "k": grads.k, "v": grads.v}, terms, grads.a


def plain(inputs: dict, g: np.ndarray, visible, scale, kv_map, dtype: str) -> dict:
    """The built-in engine computed in ``dtype`` (float64 or float32) on the inputs: a plain
    implementation's rounding, for the agreement rule."""
    x = {t: val.astype(dtype) for t, val in inputs.items()}
    o = forward(x["q"], x["k"], x["v"], visible, scale, kv_map)
    grads = backward(x["q"], x["k"], x["v"], visible, scale, kv_map, np.asarray(g).astype(dtype))
    return {"o": o, "q": grads.q, "k": grads.k, "v": grads.v}


def _varies(first: np.ndarray, second: np.ndarray, tolerance: float) -> bool:
    """Two calls on the same inputs differ by more than ``tolerance`` x the largest value."""
    gap = float(np.abs(np.asarray(first, dtype=np.float64) - second).max(initial=0.0))
    return gap > tolerance * float(np.abs(first).max(initial=0.0))


def _build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """The same problem for the user's implementation (README "Checking your own implementation"):
    its forward and backward are called through ``implementation.call`` (fresh copies in, copies out;
    misbehaviour is a failed check), perturbed copies are stacked along the batch axis, and the built-in
    engine in float64 is the reference its output and gradients must agree with (``precision``)."""
    from .. import precision
    impl = sc.implementation_object
    inputs, g = seeded_inputs(sc)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    dt = np.dtype(sc.dtype)
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible, scale, batch = sc.visible, sc.scale, sc.batch
    blocks = _Blocks(sc, kv_map)
    interface = Interface(faults, sizes, visible, scale, kv_map)
    names = ("q", "k", "v", "visible", "scale", "kv_map", "grad_o")

    def user_forward(q, k, v, visible):
        shape = (q.shape[0], sc.heads_q, sc.n_q, sc.d_value)
        return implementation.call(impl.forward, "forward", (q, k, v, visible, scale, kv_map), {"o": (shape, dt)},
                                   names)["o"]

    def user_backward(q, k, v, grad_o):
        out = implementation.call(impl.backward, "backward", (q, k, v, interface.visible, scale, kv_map, grad_o),
                                  {"dq": (q.shape, dt), "dk": (k.shape, dt), "dv": (v.shape, dt)}, names)
        return interface.gradients(q, k, v, grad_o, out["dq"], out["dk"], out["dv"])

    def copies_forward(name: str, x: np.ndarray) -> np.ndarray:
        """x [C, B, ...]: C perturbed copies of input ``name``, stacked along the batch axis."""
        c = x.shape[0]
        args = {t: (x if t == name else np.broadcast_to(val, (c,) + val.shape)).reshape((c * batch,) + val.shape[1:])
                for t, val in inputs.items()}
        vis = np.broadcast_to(interface.visible, (c,) + visible.shape).reshape((c * batch,) + visible.shape[1:])
        try:
            return user_forward(args["q"], args["k"], args["v"], vis).reshape((c,) + g.shape)
        except implementation.ImplementationFailure as exc:
            raise implementation.in_copies(exc, batch, name) from None

    o = user_forward(q, k, v, interface.visible)
    dq, dk, dv = user_backward(q, k, v, g)
    again = {"o": user_forward(q, k, v, interface.visible), **dict(zip("qkv", user_backward(q, k, v, g)))}
    results = {"o": o, "q": dq, "k": dk, "v": dv}
    deterministic = implementation.determinism("forward and backward", results, again, sc.nondet_tol)
    ref, terms, a64 = reference(inputs, g, visible, scale, kv_map)
    agree, computes_in = precision.judge(results, ref, terms, sc.dtype,
                                         lambda p: plain(inputs, g, visible, scale, kv_map, p), REFERENCE_CHECKS,
                                         sc.factor, sc.slack)
    rounding, rounding_total = blocks.rounding(inputs, g, a64, scale, kv_map)
    rule = precision.Policy.for_dtype(computes_in)
    rng_inv = np.random.default_rng([sc.seed, 1])

    def checks() -> list:
        try:
            return [deterministic] + agree + invariants.attention_outputs(
                lambda q, k, v: user_forward(q, k, v, interface.visible),
                lambda q, k, v, go: user_backward(q, k, v, go)[1:],
                inputs, visible, kv_map, o, rng_inv, output_terms(inputs, a64, scale, kv_map), computes_in)
        except implementation.ImplementationFailure as exc:
            return [deterministic] + agree + [implementation.failure_check("invariants", exc)]

    copy_bytes = 3 * a64.size * dt.itemsize + o.size * dt.itemsize + (k.size + v.size + q.size) * dt.itemsize
    return Problem(
        inputs=inputs,
        loss=lambda name, x: np.sum(copies_forward(name, x) * g, axis=(-4, -3, -2, -1), dtype=np.float64),
        gradients={"q": dq, "k": dk, "v": dv},
        rounding=rounding,
        rounding_total=rounding_total,
        copy_bytes=copy_bytes + visible.size,
        invariants=checks,
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": dq, "analytic_k": dk, "analytic_v": dv, "reference_output": ref["o"]},
        output=o,
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, copies_forward(name, x) * g),
        compute_dtype=None if computes_in == sc.dtype else computes_in,
        analytic_rounding={t: rule.ulps * rule.eps * terms[t] for t in "qkv"},
        nondeterministic=_varies(o, again["o"], sc.nondet_tol),
        **diagnosis_fields(sc, hint_context(inputs, g, visible, scale, kv_map, results, ref, user_forward)),
    )


def shapes(sc) -> dict:
    return {"q": (sc.batch, sc.heads_q, sc.n_q, sc.d_head), "k": (sc.batch, sc.heads_kv, sc.n_k, sc.d_head),
            "v": (sc.batch, sc.heads_kv, sc.n_k, sc.d_value)}


def why_not(sc, fault: str) -> str | None:
    """Why a fault cannot apply to a scenario, where its structure says so."""
    if fault == "swap-dk-dv" and sc.d_head != sc.d_value:
        return f"dK and dV differ in shape (d_head {sc.d_head}, d_value {sc.d_value}): they cannot be swapped"
    if fault in ("mask", "mask-backward", "leak-hidden-key") and sc.visible.all():
        return "every key is visible to every query: there is no mask to ignore"
    if fault == "gqa-sum" and sc.heads_kv == sc.heads_q:
        return "no KV head is shared by several query heads"
    if fault == "scale" and sc.scale == 1.0:
        return "scale is 1: dropping it changes nothing"
    return None


OP = Op(name="attention", summary="scaled dot-product attention (A.10): gradients of q, k, v",
        tensors=("q", "k", "v"), faults=FAULTS, build=build, attention_keys=True, shapes=shapes, why_not=why_not)
