"""attention's directional derivatives in closed form: the JVP (forward mode) and the HVP (the double backward),
with their faults and the size of their terms. Shapes and faults as in ``formulas``.

JVP (forward mode) along tangents (dQ, dK, dV): dS = scale (dQ K^T + Q dK^T) on the visible set,
mu_i = sum_j A_ij dS_ij, dO = (A * (dS - mu)) V + A dV (hidden entries have A = 0 and contribute nothing).

HVP (the Hessian of L = sum(O * G) times a direction (dQ, dK, dV), G fixed): forward mode through the backward.
A_dot = A * (dS - mu), G_A_dot = G dV^T, D = rowsum(A * G_A), D_dot = rowsum(A_dot * G_A + A * G_A_dot) (that is,
rowsum(G * dO)), G_S_dot = A_dot * (G_A - D) + A * (G_A_dot - D_dot); H_Q = scale (G_S_dot K + G_S dK),
H_K = scale (G_S_dot^T Q + G_S^T dQ), H_V = A_dot^T G, with H_K and H_V summed over the query heads of a KV head.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from . import stages as score_stages
from .args import Args
from .formulas import attention_weights, raw_scores, repeat_kv, sum_groups


def _tangent_parts(q, k, args: Args, dq, dk, faults: Collection[str], rows=slice(None)):
    """(A, dS, chain) of the JVP, with the JVP faults applied; dS (the tangent of the softmax's input) is 0 off
    the visible set. ``chain``: None without score stages, else (f', f'', the raw scores' tangent) of the stages
    (f' None for 1, f'' None for 0), dS = f' times that tangent."""
    mask_off = "mask" in faults or "jvp-mask" in faults
    a = attention_weights(q, k, faults=(*faults, "mask") if mask_off else faults, rows=rows, **args.kw)
    kv_map, stages = args.kv_map, args.stages
    s = 1.0 if "jvp-scale" in faults else args.scale
    s_dot = np.zeros(a.shape, dtype=a.dtype)
    if dq is not None:
        s_dot += dq @ np.swapaxes(repeat_kv(k, kv_map), -1, -2)
    if dk is not None and "jvp-k-path" not in faults:
        s_dot += q @ np.swapaxes(repeat_kv(dk, kv_map), -1, -2)
    s_dot *= np.asarray(s, dtype=a.dtype)
    if not mask_off:
        np.copyto(s_dot, 0, where=~args.visible)
    if not stages:
        return a, s_dot, None
    _, d1, d2 = score_stages.jet(stages, raw_scores(q, k, args.scale, kv_map), rows)
    return a, (s_dot if d1 is None else s_dot * d1), (d1, d2, s_dot)


def jvp(q, k, v, visible, scale, kv_map, dq=None, dk=None, dv=None, faults: Collection[str] = (),
        stages=(), rows=slice(None)) -> np.ndarray:
    """JVP of :func:`forward` at (q, k, v) along tangents (dq, dk, dv) (None: zero), [..., B, Hq, n_q, d_value]:
    dO = (A * (dS - mu)) V + A dV with dS = scale (dQ K^T + Q dK^T) on the visible set and
    mu_i = sum_j A_ij dS_ij. GQA: K/V tangents are repeated like K/V. In the inputs' dtype."""
    a, s_dot, _ = _tangent_parts(q, k, Args(visible, scale, kv_map, stages), dq, dk, faults, rows)
    if "jvp-centring" not in faults:
        s_dot -= (a * s_dot).sum(axis=-1, keepdims=True)
    o_dot = (a * s_dot) @ repeat_kv(v, kv_map)
    if dv is not None:
        o_dot += a @ repeat_kv(dv, kv_map)
    return o_dot


def _weights_with_logits(q, k, qa, ka, args: Args) -> tuple[np.ndarray, np.ndarray]:
    """(A, Ã) with Ã = A (1 + L), L_ij = |scale| sum_c |q_ic| |k_jc|: the attention weights, and the same with the
    share of their logits' rounding (a logit S_ij carries an error of about eps L_ij, which A_ij carries relative
    to itself). As in ``rounding.term_sizes``, Ã is the outer factor of each product and the row sums inside take
    A: the factor enters once (first order in eps), not once per use of A."""
    q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
    a = attention_weights(q64, k64, **args.kw)
    logit = abs(args.scale) * (qa @ np.swapaxes(repeat_kv(ka, args.kv_map), -1, -2))
    if args.stages:
        logit = score_stages.error(args.stages, logit, raw_scores(q64, k64, args.scale, args.kv_map))
    return a, a * (1.0 + logit)


def _slope_sizes(q, k, qa, ka, args: Args):
    """(the size of the terms of the stages' f' with its rounding, |f''|) on float64 inputs, or (None, None)."""
    if not args.stages:
        return None, None
    r = raw_scores(np.asarray(q, np.float64), np.asarray(k, np.float64), args.scale, args.kv_map)
    logit = abs(args.scale) * (qa @ np.swapaxes(repeat_kv(ka, args.kv_map), -1, -2))
    d2 = score_stages.jet(args.stages, r)[2]
    return score_stages.slope_size(args.stages, r, logit), None if d2 is None else np.abs(d2)


def _abs64(x):
    return None if x is None else np.abs(np.asarray(x, dtype=np.float64))


def _abs_tangent_scores(qa, ka, args: Args, dqa, dka) -> np.ndarray:
    """|scale| (|dQ| |K|^T + |Q| |dK|^T) on the visible set (0 elsewhere): a bound on |dS|, in float64."""
    out = np.zeros(qa.shape[:-1] + (ka.shape[-2],))
    if dqa is not None:
        out += dqa @ np.swapaxes(repeat_kv(ka, args.kv_map), -1, -2)
    if dka is not None:
        out += qa @ np.swapaxes(repeat_kv(dka, args.kv_map), -1, -2)
    return np.where(args.visible, abs(args.scale) * out, 0.0)


def jvp_terms(q, k, v, visible, scale, kv_map, dq=None, dk=None, dv=None, stages=()) -> np.ndarray:
    """The size of the terms each element of the JVP is made of (its rounding), in float64:
    (Ã * (|dS| + |mu|)) |V| + Ã |dV|, with |dS| bounded by |scale| (|dQ| |K|^T + |Q| |dK|^T), |mu| by
    rowsum(A |dS|), and Ã = A (1 + L) the weights with their logits' rounding (``_weights_with_logits``); score
    stages multiply |dS| by the size of their derivative's terms."""
    qa, ka, va = _abs64(q), _abs64(k), _abs64(v)
    args = Args(visible, scale, kv_map, stages)
    a, a_t = _weights_with_logits(q, k, qa, ka, args)
    s_abs = _abs_tangent_scores(qa, ka, args, _abs64(dq), _abs64(dk))
    slope = _slope_sizes(q, k, qa, ka, args)[0]
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
    a, s_dot, chain = _tangent_parts(q, k, Args(visible, scale, kv_map, stages), dq, dk,
                                     ("mask",) if "mask" in faults else ())
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
    args = Args(visible, scale, kv_map, stages)
    a, a_t = _weights_with_logits(q, k, qa, ka, args)
    r_abs = _abs_tangent_scores(qa, ka, args, dqa, dka)
    slope, bend = _slope_sizes(q, k, qa, ka, args)
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
