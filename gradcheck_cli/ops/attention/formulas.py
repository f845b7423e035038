"""Scaled dot-product attention with visible sets and grouped KV heads: forward, backward, faults.

Shapes (any extra leading axes broadcast, so finite differences can stack perturbed copies):
  q [B, Hq, n_q, d_head]   k [B, Hkv, n_k, d_head]   v [B, Hkv, n_k, d_value]
  visible bool [B, Hq, n_q, n_k]   kv_map int [Hq] (query head r reads KV head kv_map[r])
  o [B, Hq, n_q, d_value]  a [B, Hq, n_q, n_k]

Forward (A.10.1-A.10.3):  S = scale * Q K^T on the visible set, A = softmax with max-subtraction,
O = A V. Backward (A.10.5-A.10.9): G_V = A^T G_O, G_A = G_O V^T, G_S = A * (G_A - rowsum(A * G_A)),
G_Q = scale * G_S K, G_K = scale * G_S^T Q; K and V gradients summed over the query heads that
share a KV head. The n x n softmax Jacobian is never built.

JVP (forward mode) along tangents (dQ, dK, dV): dS = scale (dQ K^T + Q dK^T) on the visible set,
mu_i = sum_j A_ij dS_ij, dO = (A * (dS - mu)) V + A dV (hidden entries have A = 0 and contribute nothing).

HVP (the Hessian of L = sum(O * G) times a direction (dQ, dK, dV), G fixed): forward mode through the backward.
A_dot = A * (dS - mu), G_A_dot = G dV^T, D = rowsum(A * G_A), D_dot = rowsum(A_dot * G_A + A * G_A_dot) (that is,
rowsum(G * dO)), G_S_dot = A_dot * (G_A - D) + A * (G_A_dot - D_dot); H_Q = scale (G_S_dot K + G_S dK),
H_K = scale (G_S_dot^T Q + G_S^T dQ), H_V = A_dot^T G, with H_K and H_V summed over the query heads of a KV head.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from ..registry import Fault
from . import stages as score_stages

#: What a built-in fault does to a user's implementation: the gradient change the bug makes in the
#: float64 reference is added to the implementation's gradients.
_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"
#: And a JVP fault's: the change it makes to the float64 closed form's output tangent is added to the implementation's.
_JVP_ADDED = "adds to the implementation's JVP the change this bug makes to the float64 closed form's"
#: And an HVP fault's: the change it makes to the float64 closed form's Hessian-vector product.
_HVP_ADDED = "adds to the implementation's HVP the change this bug makes to the float64 closed form's"

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("softmax-term", "G_S = A * G_A: drops the row-sum subtraction c_i of the softmax backward",
          ("gradient q", "gradient k", "score-gradient rows sum to 0", "backward agrees with the reference"),
          user=_ADDED),
    Fault("mask", "forward and backward ignore the visible set (finite differences agree with it)",
          ("attention is 0 off the visible set", "unseen K/V rows get zero gradient",
           "row 0's unseen K/V rows get zero gradient", "hidden K/V rows do not change O",
           "O rows in the range of visible V rows",
           "forward agrees with the reference"), forward=True,
          user="shows the implementation every key as visible, in its forward and its backward"),
    Fault("mask-backward", "only the backward ignores the visible set: it recomputes A without it",
          ("gradient q", "gradient k", "gradient v", "unseen K/V rows get zero gradient",
           "row 0's unseen K/V rows get zero gradient", "backward agrees with the reference"), user=_ADDED),
    Fault("scale", "G_Q and G_K lose the scale factor (no effect when scale = 1)",
          ("gradient q", "gradient k", "backward agrees with the reference"), user=_ADDED),
    Fault("gqa-sum", "K/V gradients: the last query head of a group overwrites instead of summing "
                     "(no effect without shared KV heads)",
          ("gradient k", "gradient v", "backward agrees with the reference"), user=_ADDED),
    *(Fault(f"scale-d{t}", f"d{t.upper()} x (1 + 10 x the smallest relative error the clean run would have "
                           "caught in it)",
            (f"gradient {t}", "backward agrees with the reference"), engine=False, sized=True,
            user=f"multiplies the implementation's d{t.upper()} by that factor") for t in "qkv"),
    Fault("swap-dk-dv", "returns dV as dK and dK as dV (applies when d_head = d_value)",
          ("gradient k", "gradient v", "backward agrees with the reference"), engine=False,
          user="swaps the implementation's dK and dV"),
    Fault("leak-hidden-key", "one hidden key (the first in row-major order) is visible, in forward and backward",
          ("forward agrees with the reference",), forward=True, engine=False,
          user="shows the implementation that key as visible, in its forward and its backward"),
    # Faults of the JVP (forward mode): they apply to scenarios that check it (check: {mode: jvp}) only.
    Fault("jvp-centring", "JVP: dO = (A * dS) V + A dV, the centring term mu_i = sum_j A_ij dS_ij dropped",
          ("jvp (random tangent)", "jvp q", "jvp k", "adjoint identity"), derivative="jvp", user=_JVP_ADDED),
    Fault("jvp-k-path", "JVP: dS = scale dQ K^T, the path of the K tangent (scale Q dK^T) dropped",
          ("jvp (random tangent)", "jvp k", "adjoint identity"), derivative="jvp", user=_JVP_ADDED),
    Fault("jvp-scale", "JVP: dS loses the scale factor (no effect when scale = 1)",
          ("jvp (random tangent)", "jvp q", "jvp k", "adjoint identity"), derivative="jvp", user=_JVP_ADDED),
    Fault("jvp-mask", "JVP: the tangent ignores the visible set (its A and dS are recomputed without it); "
                      "the forward keeps it",
          ("jvp (random tangent)", "jvp q", "jvp k", "jvp v", "adjoint identity"), derivative="jvp", user=_JVP_ADDED),
    # Faults of the HVP (double backward): they apply to scenarios that check it (check: {mode: hvp}) only. "hvp q"
    # is the part H_Q of the Hessian-vector product along a random direction of every input.
    Fault("hvp-d-term", "HVP: G_S_dot = A_dot * (G_A - D) + A * G_A_dot, the tangent of the row sum "
                        "D_dot = rowsum(G * dO) dropped",
          ("hvp q", "hvp k", "Hessian is symmetric"), derivative="hvp", user=_HVP_ADDED),
    Fault("hvp-softmax-tangent", "HVP: G_S_dot = A * (G_A_dot - D_dot), the softmax's tangent term "
                                 "A_dot * (G_A - D) dropped (H_V keeps A_dot)",
          ("hvp q", "hvp k", "Hessian is symmetric"), derivative="hvp", user=_HVP_ADDED),
    Fault("hvp-dk-path", "HVP: H_Q = scale G_S_dot K, the path of the K direction (scale G_S dK) dropped",
          ("hvp q", "Hessian is symmetric"), derivative="hvp", user=_HVP_ADDED),
)}

#: The faults of the built-in engines' forward and VJP (the others act on a user's implementation only, or on
#: the JVP): what the ops composed of attention (projections, block), which have no JVP, borrow.
ENGINE_FAULTS: dict[str, Fault] = {name: f for name, f in FAULTS.items() if f.engine and f.derivative == "vjp"}

#: The faults of the JVP (forward mode), applicable where a scenario checks it.
JVP_FAULTS = tuple(name for name, f in FAULTS.items() if f.derivative == "jvp")

#: The faults of the HVP (the Hessian of L = sum(O * G) times a direction), applicable where a scenario checks it.
HVP_FAULTS = tuple(name for name, f in FAULTS.items() if f.derivative == "hvp")

#: Built-in faults whose effect on a user's implementation is their change to the reference gradients.
DIFFERENCE_FAULTS = ("softmax-term", "mask-backward", "scale", "gqa-sum")


#: Query and key rows per block when a scenario names none (``block_q``, ``block_k``): a common
#: FlashAttention tile; blocks of 64 x 64 scores keep the engine's working set small at any n.
DEFAULT_BLOCK = 64


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


def raw_scores(q, k, scale, kv_map):
    """scale * q k^T, formed as the forward forms it (the input of the score stages)."""
    return np.matmul(q, np.swapaxes(repeat_kv(k, kv_map) * np.asarray(scale, dtype=q.dtype), -1, -2))


def _exp_scores(q, k, scale, kv_map, visible, hidden=None, stages=(), rows=slice(None)):
    """exp(S - m) and its row sums l, for S = scale * q k^T with the row max m over the visible set
    subtracted (A.10.2), S after the score ``stages`` (``stages``; none for plain attention). ``visible`` None
    means every key is visible; ``hidden`` may pass ~visible precomputed (the projection and block ops difference
    their forwards through this one). ``rows``: the query rows' slice of the score grid, for the stages, when q
    holds some rows only.

    Hidden entries are overwritten with exactly 0 after the exponential rather than set to -inf
    before it: exp(-inf) takes NumPy's slow scalar path, about 3x the cost of the others. Whatever
    exp gives there (even inf) is discarded.
    """
    # scale k: as cheap as scaling q, and the same rounding whether or not copies are stacked
    k_rep = repeat_kv(k, kv_map) * np.asarray(scale, dtype=q.dtype)
    s = np.matmul(q, np.swapaxes(k_rep, -1, -2))
    if stages:
        s = score_stages.apply(stages, s, rows)
    if visible is None:
        s -= s.max(axis=-1, keepdims=True)
        e = np.exp(s, out=s)
    else:
        s -= np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
        with np.errstate(over="ignore", under="ignore"):
            e = np.exp(s, out=s)
        np.copyto(e, 0, where=~visible if hidden is None else hidden)
    return e, e.sum(axis=-1, keepdims=True)


def attention_weights(q, k, visible, scale, kv_map, faults: Collection[str] = (), stages=(), rows=slice(None)):
    """A [..., B, Hq, n_q, n_k]: softmax of the scores over each row's visible set (A.10.2)."""
    e, l = _exp_scores(q, k, scale, kv_map, None if "mask" in faults else visible, stages=stages, rows=rows)
    e /= l
    return e


def forward(q, k, v, visible, scale, kv_map, faults: Collection[str] = (), hidden=None, stages=(),
            rows=slice(None)):
    """O = A V [..., B, Hq, n_q, d_value] (A.10.3), evaluated as (exp(S - m) V) / l: the same product
    with the normalisation applied to the d_value-wide result instead of the n_k-wide weights.
    ``hidden`` may pass ~visible precomputed (the projection and block ops call this many times; the
    attention op's finite differences evaluate the same function through ``copies.Forward``)."""
    e, l = _exp_scores(q, k, scale, kv_map, None if "mask" in faults else visible, hidden, stages, rows)
    o = np.matmul(e, repeat_kv(v, kv_map))
    o /= l
    return o


@dataclass(frozen=True)
class Gradients:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    s: np.ndarray  # G_S [B, Hq, n_q, n_k], the gradient at the softmax's input (for the row-sum invariant)
    a: np.ndarray  # A and G_A [B, Hq, n_q, n_k], to bound the rounding of G_S's row sums
    ga: np.ndarray


def backward(q, k, v, visible, scale, kv_map, grad_o, faults: Collection[str] = (), stages=(),
             rows=slice(None)) -> Gradients:
    """VJP of :func:`forward` at (q, k, v) for upstream gradient grad_o [B, Hq, n_q, d_value]. With score
    ``stages``, G_S (at the softmax's input) is passed back through their derivative to the raw scores."""
    k_rep, v_rep = repeat_kv(k, kv_map), repeat_kv(v, kv_map)
    a = attention_weights(q, k, visible, scale, kv_map, (*faults, "mask") if "mask-backward" in faults else faults,
                          stages, rows)
    g_v = np.swapaxes(a, -1, -2) @ grad_o
    g_a = grad_o @ np.swapaxes(v_rep, -1, -2)
    if "softmax-term" in faults:
        g_s = a * g_a
    else:
        g_s = a * (g_a - (a * g_a).sum(axis=-1, keepdims=True))
    s = 1.0 if "scale" in faults else scale
    g_raw = g_s
    if stages:
        slope = score_stages.with_slope(stages, raw_scores(q, k, scale, kv_map), rows)[1]
        g_raw = g_s if slope is None else g_s * slope
    g_q = (g_raw @ k_rep) * s
    g_k = (np.swapaxes(g_raw, -1, -2) @ q) * s
    heads_kv, overwrite = k.shape[-3], "gqa-sum" in faults
    return Gradients(q=g_q, k=sum_groups(g_k, kv_map, heads_kv, overwrite=overwrite),
                     v=sum_groups(g_v, kv_map, heads_kv, overwrite=overwrite), s=g_s, a=a, ga=g_a)


def _tangent_parts(q, k, visible, scale, kv_map, dq, dk, faults: Collection[str], stages=(), rows=slice(None)):
    """(A, dS, chain) of the JVP, with the JVP faults applied; dS (the tangent of the softmax's input) is 0 off
    the visible set. ``chain``: None without score stages, else (f', f'', the raw scores' tangent) of the stages
    (f' None for 1, f'' None for 0), dS = f' times that tangent."""
    mask_off = "mask" in faults or "jvp-mask" in faults
    a = attention_weights(q, k, visible, scale, kv_map, (*faults, "mask") if mask_off else faults, stages, rows)
    s = 1.0 if "jvp-scale" in faults else scale
    s_dot = np.zeros(a.shape, dtype=a.dtype)
    if dq is not None:
        s_dot += dq @ np.swapaxes(repeat_kv(k, kv_map), -1, -2)
    if dk is not None and "jvp-k-path" not in faults:
        s_dot += q @ np.swapaxes(repeat_kv(dk, kv_map), -1, -2)
    s_dot *= np.asarray(s, dtype=a.dtype)
    if not mask_off:
        np.copyto(s_dot, 0, where=~visible)
    if not stages:
        return a, s_dot, None
    _, d1, d2 = score_stages.jet(stages, raw_scores(q, k, scale, kv_map), rows)
    return a, (s_dot if d1 is None else s_dot * d1), (d1, d2, s_dot)


def jvp(q, k, v, visible, scale, kv_map, dq=None, dk=None, dv=None, faults: Collection[str] = (),
        stages=(), rows=slice(None)) -> np.ndarray:
    """JVP of :func:`forward` at (q, k, v) along tangents (dq, dk, dv) (None: zero), [..., B, Hq, n_q, d_value]:
    dO = (A * (dS - mu)) V + A dV with dS = scale (dQ K^T + Q dK^T) on the visible set and
    mu_i = sum_j A_ij dS_ij. GQA: K/V tangents are repeated like K/V. In the inputs' dtype."""
    a, s_dot, _ = _tangent_parts(q, k, visible, scale, kv_map, dq, dk, faults, stages, rows)
    if "jvp-centring" not in faults:
        s_dot -= (a * s_dot).sum(axis=-1, keepdims=True)
    o_dot = (a * s_dot) @ repeat_kv(v, kv_map)
    if dv is not None:
        o_dot += a @ repeat_kv(dv, kv_map)
    return o_dot


def _weights_with_logits(q, k, qa, ka, visible, scale, kv_map, stages=()) -> tuple[np.ndarray, np.ndarray]:
    """(A, Ã) with Ã = A (1 + L), L_ij = |scale| sum_c |q_ic| |k_jc|: the attention weights, and the same with the
    share of their logits' rounding (a logit S_ij carries an error of about eps L_ij, which A_ij carries relative
    to itself). As in ``rounding.term_sizes``, Ã is the outer factor of each product and the row sums inside take
    A: the factor enters once (first order in eps), not once per use of A."""
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    a = attention_weights(q64, k64, visible, scale, kv_map, stages=stages)
    logit = abs(scale) * (qa @ np.swapaxes(repeat_kv(ka, kv_map), -1, -2))
    if stages:
        logit = score_stages.error(stages, logit, raw_scores(q64, k64, scale, kv_map))
    return a, a * (1.0 + logit)


def _slope_sizes(q, k, qa, ka, scale, kv_map, stages):
    """(the size of the terms of the stages' f' with its rounding, |f''|) on float64 inputs, or (None, None)."""
    if not stages:
        return None, None
    r = raw_scores(np.asarray(q, np.float64), np.asarray(k, np.float64), scale, kv_map)
    logit = abs(scale) * (qa @ np.swapaxes(repeat_kv(ka, kv_map), -1, -2))
    d2 = score_stages.jet(stages, r)[2]
    return score_stages.slope_size(stages, r, logit), None if d2 is None else np.abs(d2)


def _abs64(x):
    return None if x is None else np.abs(np.asarray(x, dtype=np.float64))


def _abs_tangent_scores(qa, ka, visible, scale, kv_map, dqa, dka) -> np.ndarray:
    """|scale| (|dQ| |K|^T + |Q| |dK|^T) on the visible set (0 elsewhere): a bound on |dS|, in float64."""
    out = np.zeros(qa.shape[:-1] + (ka.shape[-2],))
    if dqa is not None:
        out += dqa @ np.swapaxes(repeat_kv(ka, kv_map), -1, -2)
    if dka is not None:
        out += qa @ np.swapaxes(repeat_kv(dka, kv_map), -1, -2)
    return np.where(visible, abs(scale) * out, 0.0)


def jvp_terms(q, k, v, visible, scale, kv_map, dq=None, dk=None, dv=None, stages=()) -> np.ndarray:
    """The size of the terms each element of the JVP is made of (its rounding), in float64:
    (Ã * (|dS| + |mu|)) |V| + Ã |dV|, with |dS| bounded by |scale| (|dQ| |K|^T + |Q| |dK|^T), |mu| by
    rowsum(A |dS|), and Ã = A (1 + L) the weights with their logits' rounding (``_weights_with_logits``); score
    stages multiply |dS| by the size of their derivative's terms."""
    qa, ka, va = _abs64(q), _abs64(k), _abs64(v)
    a, a_t = _weights_with_logits(q, k, qa, ka, visible, scale, kv_map, stages)
    s_abs = _abs_tangent_scores(qa, ka, visible, scale, kv_map, _abs64(dq), _abs64(dk))
    slope = _slope_sizes(q, k, qa, ka, scale, kv_map, stages)[0]
    if slope is not None:
        s_abs = s_abs * slope
    s_abs = s_abs + (a * s_abs).sum(axis=-1, keepdims=True)
    out = (a_t * s_abs) @ repeat_kv(va, kv_map)
    if dv is not None:
        out += a_t @ repeat_kv(_abs64(dv), kv_map)
    return out


def hvp(q, k, v, visible, scale, kv_map, grad_o, dq=None, dk=None, dv=None,
        faults: Collection[str] = (), stages=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The derivative of :func:`backward`'s (G_Q, G_K, G_V) along the direction (dq, dk, dv) (None: zero) with
    grad_o fixed: the Hessian of L = sum(O * grad_o) times the direction, (H_Q, H_K, H_V) shaped like (q, k, v).
    Forward mode through the backward (module docstring); GQA: K/V and their directions are repeated like K/V,
    and H_K, H_V summed over the query heads of a KV head. In the inputs' dtype. ``faults``: the HVP faults, and
    ``mask`` (the visible set ignored throughout, as in the forward). Score ``stages``: G_S and its tangent go
    back to the raw scores as G_R = f' G_S, G_R_dot = f' G_S_dot + f'' R_dot G_S (R_dot the raw scores' tangent)."""
    a, s_dot, chain = _tangent_parts(q, k, visible, scale, kv_map, dq, dk, ("mask",) if "mask" in faults else (),
                                     stages)
    dtype, heads_kv = a.dtype, k.shape[-3]
    sc = np.asarray(scale, dtype=dtype)
    g = np.asarray(grad_o, dtype=dtype)
    k_rep, v_rep = repeat_kv(k, kv_map), repeat_kv(v, kv_map)
    a_dot = a * (s_dot - (a * s_dot).sum(axis=-1, keepdims=True))
    g_a = g @ np.swapaxes(v_rep, -1, -2)
    centred = g_a - (a * g_a).sum(axis=-1, keepdims=True)  # G_A - D
    g_s = a * centred
    d_dot = (a_dot * g_a).sum(axis=-1, keepdims=True)
    g_a_dot = None
    if dv is not None:
        g_a_dot = g @ np.swapaxes(repeat_kv(dv, kv_map), -1, -2)
        d_dot += (a * g_a_dot).sum(axis=-1, keepdims=True)
    if "hvp-d-term" in faults:
        d_dot = np.zeros_like(d_dot)
    g_s_dot = a * (-d_dot if g_a_dot is None else g_a_dot - d_dot)  # A * (G_A_dot - D_dot)
    if "hvp-softmax-tangent" not in faults:
        g_s_dot += a_dot * centred
    if chain is not None:  # back through the score stages to the raw scores
        d1, d2, r_dot = chain
        bent = None if d2 is None else d2 * r_dot * g_s
        if d1 is not None:
            g_s, g_s_dot = g_s * d1, g_s_dot * d1
        if bent is not None:
            g_s_dot = g_s_dot + bent
    h_q = g_s_dot @ k_rep
    if dk is not None and "hvp-dk-path" not in faults:
        h_q += g_s @ repeat_kv(dk, kv_map)
    h_q *= sc
    h_k = np.swapaxes(g_s_dot, -1, -2) @ q
    if dq is not None:
        h_k += np.swapaxes(g_s, -1, -2) @ dq
    h_k *= sc
    h_v = np.swapaxes(a_dot, -1, -2) @ g
    return h_q, sum_groups(h_k, kv_map, heads_kv), sum_groups(h_v, kv_map, heads_kv)


def hvp_terms(q, k, v, visible, scale, kv_map, grad_o, dq=None, dk=None,
              dv=None, stages=()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The size of the terms each element of :func:`hvp`'s (H_Q, H_K, H_V) is made of (its rounding), in float64:
    its formulas with absolute values and every subtraction an addition (|A_dot| <= A * (|dS| + rowsum(A |dS|)),
    |G_A| <= |G| |V|^T, ...), the outer A of each product taken with its logits' rounding (Ã,
    ``_weights_with_logits``). A bound on |hvp| elementwise."""
    qa, ka, va, g = _abs64(q), _abs64(k), _abs64(v), _abs64(grad_o)
    dqa, dka, dva = _abs64(dq), _abs64(dk), _abs64(dv)
    heads_kv, sc = k.shape[-3], abs(scale)
    a, a_t = _weights_with_logits(q, k, qa, ka, visible, scale, kv_map, stages)
    r_abs = _abs_tangent_scores(qa, ka, visible, scale, kv_map, dqa, dka)
    slope, bend = _slope_sizes(q, k, qa, ka, scale, kv_map, stages)
    s_abs = r_abs if slope is None else r_abs * slope
    s_abs = s_abs + (a * s_abs).sum(axis=-1, keepdims=True)
    a_dot, a_dot_t = a * s_abs, a_t * s_abs
    g_a = g @ np.swapaxes(repeat_kv(va, kv_map), -1, -2)
    centred = g_a + (a * g_a).sum(axis=-1, keepdims=True)
    g_s = a_t * centred
    inner = (a_dot * g_a).sum(axis=-1, keepdims=True)  # |D_dot|, then |G_A_dot| + |D_dot|
    if dva is not None:
        g_a_dot = g @ np.swapaxes(repeat_kv(dva, kv_map), -1, -2)
        inner = inner + (a * g_a_dot).sum(axis=-1, keepdims=True) + g_a_dot
    g_s_dot = a_dot_t * centred + a_t * inner
    if slope is not None:  # back through the score stages: |f'| (with its rounding) and |f''| |R_dot| |G_S|
        g_s_dot = g_s_dot * slope + (0.0 if bend is None else bend * r_abs * g_s)
        g_s = g_s * slope
    h_q = g_s_dot @ repeat_kv(ka, kv_map)
    if dka is not None:
        h_q += g_s @ repeat_kv(dka, kv_map)
    h_k = np.swapaxes(g_s_dot, -1, -2) @ qa
    if dqa is not None:
        h_k += np.swapaxes(g_s, -1, -2) @ dqa
    h_v = np.swapaxes(a_dot_t, -1, -2) @ g
    return h_q * sc, sum_groups(h_k * sc, kv_map, heads_kv), sum_groups(h_v, kv_map, heads_kv)
