"""Scaled dot-product attention with visible sets and grouped KV heads: forward, backward, faults.

Shapes (any extra leading axes broadcast, so finite differences can stack perturbed copies):
  q [B, Hq, n_q, d_head]   k [B, Hkv, n_k, d_head]   v [B, Hkv, n_k, d_value]
  visible bool [B, Hq, n_q, n_k]   kv_map int [Hq] (query head r reads KV head kv_map[r])
  o [B, Hq, n_q, d_value]  a [B, Hq, n_q, n_k]

Forward (A.10.1-A.10.3):  S = scale * Q K^T on the visible set, A = softmax with max-subtraction,
O = A V. Backward (A.10.5-A.10.9): G_V = A^T G_O, G_A = G_O V^T, G_S = A * (G_A - rowsum(A * G_A)),
G_Q = scale * G_S K, G_K = scale * G_S^T Q; K and V gradients summed over the query heads that
share a KV head. The n x n softmax Jacobian is never built.
The JVP and the HVP are in ``directional``.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from ... import numeric
from ..registry import Fault, named_value
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
          ("gradient q", "gradient k", "score-gradient rows sum to 0", "backward agrees with the reference",
           "gradient bias", "gradient relative_bias", "gradient alibi_slopes", "gradient sinks"),
          user=_ADDED),  # from dS: wrong too
    Fault("mask", "forward and backward ignore the visible set (finite differences agree with it)",
          ("attention is 0 off the visible set", "unseen K/V rows get zero gradient",
           "row 0's unseen K/V rows get zero gradient", "hidden K/V rows do not change O",
           "O rows in the range of visible V rows", "documents do not see each other",
           "forward agrees with the reference", "lse agrees with the reference",
           "shifting every V row shifts O by as much",
           "backward agrees with the reference"), forward=True,
          user="shows the implementation every key as visible, in its forward and its backward"),
    Fault("mask-backward", "only the backward ignores the visible set: it recomputes A without it",
          ("gradient q", "gradient k", "gradient v", "unseen K/V rows get zero gradient",
           "row 0's unseen K/V rows get zero gradient", "backward agrees with the reference", "gradient bias",
           "gradient relative_bias", "gradient alibi_slopes", "gradient sinks"),
          user=_ADDED),
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
          ("forward agrees with the reference", "lse agrees with the reference", "backward agrees with the reference",
           "row 0's unseen K/V rows get zero gradient"), forward=True, engine=False,
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
    sink = None
    if stages:
        s = score_stages.apply(stages, s, rows)
        sink = score_stages.sink_logits(stages)
    if visible is None:
        top = s.max(axis=-1, keepdims=True)
    else:
        top = np.max(s, axis=-1, keepdims=True, where=visible, initial=-np.inf)
    if sink is not None:  # the sinks' logits join the normaliser (and its max)
        sink = np.asarray(sink).astype(s.dtype, copy=False)
        top = np.maximum(top, sink)
    if np.broadcast_shapes(s.shape, top.shape) == s.shape:
        s -= top
    else:  # perturbed copies of the sinks: more copies than the scores have
        s = s - top
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp(s, out=s)
    if visible is not None:
        np.copyto(e, 0, where=~visible if hidden is None else hidden)
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l += np.exp(sink - top)
    return e, l


def log_sum_exp(q, k, visible, scale, kv_map, faults: Collection[str] = (), stages=(), rows=slice(None)):
    """LSE [..., B, Hq, n_q]: log of each row's softmax normaliser over its visible keys (and the sinks' exp(s_h)),
    natural log (``lse-log2`` returns it in log2 units)."""
    s = score_stages.apply(stages, raw_scores(q, k, scale, kv_map), rows) if stages else raw_scores(q, k, scale,
                                                                                                     kv_map)
    shown = True if visible is None or "mask" in faults else visible
    top = np.max(s, axis=-1, keepdims=True, where=shown, initial=-np.inf)
    sink = score_stages.sink_logits(stages) if stages else None
    if sink is not None:
        top = np.maximum(top, np.asarray(sink).astype(s.dtype, copy=False))
    with np.errstate(over="ignore", under="ignore"):
        total = np.sum(np.exp(s - top), axis=-1, keepdims=True, where=shown)
        if sink is not None:
            total = total + np.exp(sink - top)
    lse = (top + np.log(total))[..., 0]
    return lse / np.log(2.0) if "lse-log2" in faults else lse


def sink_weight(q, k, visible, scale, kv_map, stages=(), rows=slice(None)):
    """The weight a sink takes in each row, p_i = exp(s_h - L_i) [..., B, Hq, n_q] (sum_j A_ij = 1 - p_i); None
    without sinks."""
    sink = score_stages.sink_logits(stages) if stages else None
    if sink is None:
        return None
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(np.asarray(sink)[..., 0] - log_sum_exp(q, k, visible, scale, kv_map, stages=stages, rows=rows))


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
    drop = score_stages.post(stages) if stages else None
    if drop is not None:  # dropout: the weights after the softmax times M / (1 - p)
        e = e * drop.weights(rows, dtype=e.dtype)
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
    params: dict = field(default_factory=dict)  # the score stages' parameters' gradients (an additive bias's)
    sink: np.ndarray | None = None  # the sinks' weight per row, p [B, Hq, n_q] (rows of A sum to 1 - p); None: none
    lse: np.ndarray | None = None  # the log-sum-exp's upstream gradient G_L the backward took, or None


def backward(q, k, v, visible, scale, kv_map, grad_o, faults: Collection[str] = (), stages=(),
             rows=slice(None), grad_lse=None) -> Gradients:
    """VJP of :func:`forward` at (q, k, v) for upstream gradient grad_o [B, Hq, n_q, d_value] (and ``grad_lse``
    [B, Hq, n_q], the log-sum-exp's, when it is an output: G_S gains A G_L). With score ``stages``, G_S (at the
    softmax's input) is passed back through their derivative to the raw scores."""
    k_rep, v_rep = repeat_kv(k, kv_map), repeat_kv(v, kv_map)
    # known mistakes (hints.known): the backward recomputes A at another scale (unscaled, or scaled twice)
    a_scale = {"backward-softmax-unscaled": 1.0, "backward-softmax-scaled-twice": scale * scale}
    a_scale = next((a_scale[f] for f in faults if f in a_scale), scale)
    a = attention_weights(q, k, visible, a_scale, kv_map, (*faults, "mask") if "mask-backward" in faults else faults,
                          stages, rows)
    saved = named_value(faults, "lse-saved-")
    a_row = a  # the weights of the row term D_i = rowsum(A G_A) = rowsum(G_O O), a kernel's from O
    if saved is not None:  # a known mistake (hints.known): A rebuilt from a wrong saved LSE (a lower precision,
        # the row max left out) or over every key (the mask not applied again)
        saved, d_from_a = saved.removesuffix("-rowsum-of-p"), saved.endswith("-rowsum-of-p")
        lse = log_sum_exp(q, k, visible, scale, kv_map, stages=stages, rows=rows)
        raw = raw_scores(q[..., rows, :], k, scale, kv_map)
        s_all = score_stages.apply(stages, raw, rows) if stages else raw
        if saved == "unmasked":
            a = np.exp(s_all - lse[..., None])
        elif saved == "row-max":  # the row max saved where the LSE belongs: A = exp(S - m), unnormalised
            top = np.max(s_all, axis=-1, initial=-np.inf, where=np.broadcast_to(visible, s_all.shape)[..., rows, :]
                         if visible is not None else True)
            a = a * np.exp(lse - top)[..., None]
        elif saved == "without-max":
            top = np.max(s_all, axis=-1, initial=-np.inf, where=np.broadcast_to(visible, s_all.shape)[..., rows, :]
                         if visible is not None else True)
            a = a * np.exp(top)[..., None]
        else:
            a = a * np.exp(lse - numeric.rounded(lse, saved))[..., None]
        a_row = a if d_from_a else a_row
    drop = score_stages.post(stages) if stages else None
    if drop is None:
        g_v = np.swapaxes(a, -1, -2) @ grad_o
        g_a = grad_o @ np.swapaxes(v_rep, -1, -2)
        a_s = a
    else:  # dropout: O = (A * W) V, so dV = (A * W)^T dO and dA = (dO V^T) * W
        w_v = drop.backward_weights(rows)
        w_v = None if w_v is None else w_v.astype(a.dtype, copy=False)
        g_v = np.swapaxes(a if w_v is None else a * w_v, -1, -2) @ grad_o
        g_a = grad_o @ np.swapaxes(v_rep, -1, -2)
        g_a_row = g_a = g_a * drop.weights(rows, dtype=a.dtype)
        if "dropout-dp-unmasked" in faults or "dropout-dp-unmasked-d-right" in faults:  # known mistakes: the
            g_a = grad_o @ np.swapaxes(v_rep, -1, -2)  # keep mask forgotten on dP (and on D, or D from dO O)
            g_a_row = g_a_row if "dropout-dp-unmasked-d-right" in faults else g_a
        w_s = drop.score_weights(rows)
        a_s = a if w_s is None else a * w_s.astype(a.dtype, copy=False)
    if drop is None:
        g_a_row = g_a
    if "softmax-term" in faults:
        g_s = a_s * g_a
    else:
        g_s = a_s * (g_a - (a_row * g_a_row).sum(axis=-1, keepdims=True))
    if grad_lse is not None and "lse-grad-ignored" not in faults:  # dLSE_i / dS_ij = A_ij
        # known mistakes (hints.known): G_L added without A, to the visible scores or to every one
        weight = {"lse-grad-no-weights": a > 0, "lse-grad-no-weights-all": 1.0}
        g_s = g_s + next((weight[f] for f in faults if f in weight), a) * np.asarray(grad_lse)[..., None]
    s = 1.0 if "scale" in faults else scale
    g_raw, params = g_s, {}
    if stages:
        g_raw, params = score_stages.pull_back(stages, raw_scores(q, k, scale, kv_map), g_s, rows)
    g_q = (g_raw @ k_rep) * s
    g_k = (np.swapaxes(g_raw, -1, -2) @ q) * s
    heads_kv, overwrite = k.shape[-3], "gqa-sum" in faults
    sink = sink_weight(q, k, None if "mask" in faults or "mask-backward" in faults else visible, scale, kv_map,
                       stages, rows) if stages else None
    if sink is not None and grad_lse is not None and "lse-grad-ignored" not in faults:
        params = score_stages.lse_terms(stages, params, grad_lse, sink)
    return Gradients(q=g_q, k=sum_groups(g_k, kv_map, heads_kv, overwrite=overwrite),
                     v=sum_groups(g_v, kv_map, heads_kv, overwrite=overwrite), s=g_s, a=a, ga=g_a, params=params,
                     sink=sink, lse=None if grad_lse is None or "lse-grad-ignored" in faults else np.asarray(grad_lse))
