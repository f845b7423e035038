"""The tiled (FlashAttention-style) engine for op ``attention`` (``engine: tiled``; A.10.6).

Same function as ``formulas.forward`` in exact arithmetic, evaluated over blocks so that no n_q x n_k
array exists: the forward walks key/value blocks with an online softmax (running row max m and sum l,
rescaling the accumulator when m grows) and saves only O and the per-row log-sum-exp
LSE = m + log(l); the backward recomputes each block's probabilities P = exp(S - LSE) from it and uses
D = rowsum(G_O * O) in place of the softmax's row-sum term (sum_j A_ij G_A_ij = sum_c G_O_ic O_ic).

Shapes as in ``attention`` (extra leading axes broadcast, for perturbed copies). ``visible`` is the
bool array [B, Hq, n_q, n_k] or a callable ``visible(rows, cols)`` returning the block (so a mask need
not be materialised either; ``masks.blockwise``). The named faults are the same bugs as the naive
engine's: ``softmax-term`` (D = 0), ``mask`` (no mask anywhere), ``mask-backward`` (P recomputed
without it), ``scale`` (G_Q, G_K without the scale), ``gqa-sum`` (the last query head of a group wins).

The JVP (forward mode, ``jvp``) walks the same blocks: beside m, l and the accumulator it keeps the running
sums of exp(S - m) dS, exp(S - m) dS V and exp(S - m) dV, and ends with mu = sum exp(S - m) dS / l and
dO = (sum exp(S - m) dS V - mu sum exp(S - m) V + sum exp(S - m) dV) / l; its faults (``jvp-*``) are the
naive engine's too.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from . import stages as score_stages
from .args import Args
from .formulas import DEFAULT_BLOCK, repeat_kv, sum_groups


def _block(visible, rows: slice, cols: slice):
    return visible(rows, cols) if callable(visible) else visible[..., rows, cols]


def _spans(n: int, size: int) -> list[slice]:
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def _online(s, vis, m):
    """One key block of an online softmax: (P, m_new, rescale) for the block's scores ``s`` (``vis``: its
    visible entries, None for all) given the running max ``m``: P = exp(S - m_new) on the visible entries (0
    elsewhere), and rescale = exp(m - m_new), the factor of what was accumulated so far."""
    top = np.max(s, axis=-1, keepdims=True, where=vis, initial=-np.inf) if vis is not None \
        else s.max(axis=-1, keepdims=True)
    m_new = np.maximum(m, top)
    base = np.where(np.isfinite(m_new), m_new, 0.0)  # rows that have seen no key yet
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        p = np.exp(s - base)
    if vis is not None:
        p = np.where(vis, p, 0.0)
    return p, m_new, np.exp(m - base)  # rescale 0 while m is -inf: nothing accumulated yet


def _start(sink, shape, dtype):
    """(m, l) an online softmax starts a block of rows from: -inf and 0, or with sinks m = s_h and l = 1 (the sink
    enters each row once, first; its value row is 0, so the accumulators start at 0 either way)."""
    if sink is None:
        m = np.full(shape, -np.inf, dtype=dtype)
        return m, np.zeros_like(m)
    m = np.broadcast_to(np.asarray(sink).astype(dtype), shape).copy()
    return m, np.ones_like(m)


def _scores(q_blk, k_t_blk, stages, rows, cols):
    """A block's scores: q_blk (k_blk scale)^T through the score stages (with the block's rows and keys)."""
    s = q_blk @ k_t_blk
    return score_stages.apply(stages, s, rows, cols) if stages else s


def forward(q, k, v, visible, scale, kv_map, faults: Collection[str] = (), block_q: int = DEFAULT_BLOCK,
            block_k: int = DEFAULT_BLOCK, with_lse: bool = False, stages=()):
    """O [..., B, Hq, n_q, d_value] (and LSE [..., B, Hq, n_q] with ``with_lse``); the scores through the score
    ``stages`` block by block."""
    masked = "mask" not in faults
    k_rep = repeat_kv(k, kv_map) * np.asarray(scale, dtype=q.dtype)
    v_rep = repeat_kv(v, kv_map)
    lead = np.broadcast_shapes(q.shape[:-2], k_rep.shape[:-2], v_rep.shape[:-2], score_stages.lead(stages))
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = np.empty(lead + (n_q, v.shape[-1]), dtype=np.result_type(q, v))
    lse = np.empty(lead + (n_q,), dtype=out.dtype) if with_lse else None
    sink = score_stages.sink_logits(stages) if stages else None
    drop = score_stages.post(stages) if stages else None
    for rows in _spans(n_q, block_q):
        q_blk = q[..., rows, :]
        m, l = _start(sink, lead + (rows.stop - rows.start, 1), out.dtype)
        acc = np.zeros(lead + (rows.stop - rows.start, v.shape[-1]), dtype=out.dtype)
        for cols in _spans(n_k, block_k):
            vis = _block(visible, rows, cols) if masked else None
            if vis is not None and not vis.any():
                continue  # a block no query sees: skipped, as FlashAttention does
            p, m_new, rescale = _online(_scores(q_blk, np.swapaxes(k_rep[..., cols, :], -1, -2), stages, rows, cols),
                                        vis, m)
            l = l * rescale + p.sum(axis=-1, keepdims=True)
            if drop is not None:  # dropout: the accumulator takes the kept weights, the sum the softmax's
                p = p * drop.weights(rows, cols, p.dtype)
            acc = acc * rescale + p @ v_rep[..., cols, :]
            m = m_new
        out[..., rows, :] = acc / l
        if with_lse:
            lse[..., rows] = (m + np.log(l))[..., 0]
    return (out, lse) if with_lse else out


def jvp(q, k, v, visible, scale, kv_map, dq=None, dk=None, dv=None, faults: Collection[str] = (),
        block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK, stages=()):
    """JVP of :func:`forward` along tangents (dq, dk, dv) (None: zero), [..., B, Hq, n_q, d_value]: the same
    function as ``directional.jvp`` in exact arithmetic, by blocks with an online softmax and no n_q x n_k array.
    Beside the forward's running max m, l = sum_j exp(S_ij - m) and acc_o = sum_j exp(S_ij - m) V_j, each
    query block keeps acc_s = sum_j exp(S_ij - m) dS_ij, acc_sv = sum_j exp(S_ij - m) dS_ij V_j and
    acc_dv = sum_j exp(S_ij - m) dV_j (all rescaled by exp(m_old - m_new) when m grows); at the end
    mu = acc_s / l and dO = (acc_sv - mu acc_o + acc_dv) / l, with dS = scale (dQ K^T + Q dK^T) on the visible
    set (hidden entries contribute nothing). The JVP faults are the naive engine's: ``jvp-centring`` (mu
    dropped), ``jvp-k-path`` (no Q dK^T), ``jvp-scale`` (dS without the scale), ``jvp-mask`` (the tangent's A
    and dS without the visible set; so is ``mask``). Score ``stages``: dS is their derivative times the raw
    scores' tangent."""
    masked = "mask" not in faults and "jvp-mask" not in faults
    k_rep, v_rep = repeat_kv(k, kv_map), repeat_kv(v, kv_map)
    k_scaled = k_rep * np.asarray(scale, dtype=q.dtype)  # S exactly as the forward forms it
    # dS = scale (dQ K^T + Q dK^T), the scale folded into K and Q (unless jvp-scale drops it)
    k_dot_path = k_rep if "jvp-scale" in faults else k_scaled
    q_dot_path = q if "jvp-scale" in faults else q * np.asarray(scale, dtype=q.dtype)
    dk_rep = None if dk is None or "jvp-k-path" in faults else repeat_kv(dk, kv_map)
    dv_rep = None if dv is None else repeat_kv(dv, kv_map)
    present = [x for x in (q, k_rep, v_rep, dq, dk_rep, dv_rep) if x is not None]
    lead = np.broadcast_shapes(*(x.shape[:-2] for x in present))
    dtype = np.result_type(*present)
    n_q, n_k, d_value = q.shape[-2], k.shape[-2], v.shape[-1]
    out = np.empty(lead + (n_q, d_value), dtype=dtype)
    sink = score_stages.sink_logits(stages) if stages else None
    for rows in _spans(n_q, block_q):
        q_blk = q[..., rows, :]
        dq_blk = None if dq is None else dq[..., rows, :]
        m, l = _start(sink, lead + (rows.stop - rows.start, 1), dtype)
        acc_s = np.zeros_like(m)
        acc_o = np.zeros(lead + (rows.stop - rows.start, d_value), dtype=dtype)
        acc_sv, acc_dv = np.zeros_like(acc_o), np.zeros_like(acc_o)
        for cols in _spans(n_k, block_k):
            vis = _block(visible, rows, cols) if masked else None
            if vis is not None and not vis.any():
                continue  # a block no query sees contributes nothing
            scores, slope = q_blk @ np.swapaxes(k_scaled[..., cols, :], -1, -2), None
            if stages:
                scores, slope = score_stages.with_slope(stages, scores, rows, cols)
            p, m_new, rescale = _online(scores, vis, m)
            del scores  # one block fewer held while the tangent's are formed
            s_dot = None
            if dq_blk is not None:
                s_dot = dq_blk @ np.swapaxes(k_dot_path[..., cols, :], -1, -2)
            if dk_rep is not None:
                part = q_dot_path[..., rows, :] @ np.swapaxes(dk_rep[..., cols, :], -1, -2)
                s_dot = part if s_dot is None else np.add(s_dot, part, out=s_dot if s_dot.shape == part.shape
                                                          else None)
            if s_dot is not None and slope is not None:
                s_dot = s_dot * slope
            # P is exactly 0 off the visible set, so P * dS is too: dS needs no mask of its own
            p_dot = np.zeros(p.shape, dtype=dtype) if s_dot is None else p * s_dot
            v_blk = v_rep[..., cols, :]
            l = l * rescale + p.sum(axis=-1, keepdims=True)
            acc_o = acc_o * rescale + p @ v_blk
            acc_s = acc_s * rescale + p_dot.sum(axis=-1, keepdims=True)
            acc_sv = acc_sv * rescale + p_dot @ v_blk
            if dv_rep is not None:
                acc_dv = acc_dv * rescale + p @ dv_rep[..., cols, :]
            m = m_new
        o_dot = acc_sv + acc_dv
        if "jvp-centring" not in faults:
            o_dot -= (acc_s / l) * acc_o
        out[..., rows, :] = o_dot / l
    return out


def jvp_terms(q, k, v, visible, scale, kv_map, dq=None, dk=None, dv=None, block_q: int = DEFAULT_BLOCK,
              block_k: int = DEFAULT_BLOCK, stages=()) -> np.ndarray:
    """``directional.jvp_terms`` (the size of the terms of each element of the JVP, in float64) by the JVP's blocks,
    with an online softmax and no n_q x n_k array (blocks no query sees skipped): with P = exp(S - m),
    P~ = P (1 + L) (L = |scale| |q| |k|^T, the logits' rounding) and |dS| = |scale| (|dQ| |K|^T + |Q| |dK|^T) on the
    visible set, it keeps sum P~ |dS| |V|, sum P~ |V|, sum P |dS| and sum P~ |dV| beside l = sum P (all rescaled
    when m grows): (A~ (|dS| + rowsum(A |dS|))) |V| + A~ |dV| is their combination, the row sum A |dS| being
    common to a row's terms. Score ``stages``: L is the error of the staged scores and |dS| is multiplied by the
    size of their derivative's terms."""
    f64 = [None if x is None else np.asarray(x, dtype=np.float64) for x in (q, k, v, dq, dk, dv)]
    q, k, v, dq, dk, dv = f64
    k_rep = repeat_kv(k, kv_map)
    k_scaled = k_rep * scale
    qa, ka, va = np.abs(q) * abs(scale), np.abs(k_rep), np.abs(repeat_kv(v, kv_map))
    dqa = None if dq is None else np.abs(dq) * abs(scale)
    dka = None if dk is None else np.abs(repeat_kv(dk, kv_map))
    dva = None if dv is None else np.abs(repeat_kv(dv, kv_map))
    present = [x for x in (q, k_rep, dq, dka, dva) if x is not None]
    lead = np.broadcast_shapes(*(x.shape[:-2] for x in present))
    n_q, n_k, d_value = q.shape[-2], k.shape[-2], v.shape[-1]
    out = np.empty(lead + (n_q, d_value))
    sink = score_stages.sink_logits(stages) if stages else None
    for rows in _spans(n_q, block_q):
        m, l = _start(sink, lead + (rows.stop - rows.start, 1), np.float64)
        row_s = np.zeros_like(m)
        acc_sv = np.zeros(lead + (rows.stop - rows.start, d_value))
        acc_v, acc_dv = np.zeros_like(acc_sv), np.zeros_like(acc_sv)
        for cols in _spans(n_k, block_k):
            vis = _block(visible, rows, cols)
            if not vis.any():
                continue
            raw = q[..., rows, :] @ np.swapaxes(k_scaled[..., cols, :], -1, -2)
            p, m_new, rescale = _online(score_stages.apply(stages, raw, rows, cols) if stages else raw, vis, m)
            logit = qa[..., rows, :] @ np.swapaxes(ka[..., cols, :], -1, -2)
            if stages:
                slope = score_stages.slope_size(stages, raw, logit, rows, cols)
                logit = score_stages.error(stages, logit, raw, rows, cols)
            del raw
            p_t = p * (1.0 + logit)
            del logit
            s_abs = np.zeros(p.shape)
            if dqa is not None:
                s_abs += dqa[..., rows, :] @ np.swapaxes(ka[..., cols, :], -1, -2)
            if dka is not None:
                s_abs += qa[..., rows, :] @ np.swapaxes(dka[..., cols, :], -1, -2)
            if stages and slope is not None:
                s_abs = s_abs * slope
            v_blk = va[..., cols, :]
            l = l * rescale + p.sum(axis=-1, keepdims=True)
            row_s = row_s * rescale + (p * s_abs).sum(axis=-1, keepdims=True)  # P is 0 off the visible set
            acc_sv = acc_sv * rescale + (p_t * s_abs) @ v_blk
            acc_v = acc_v * rescale + p_t @ v_blk
            if dva is not None:
                acc_dv = acc_dv * rescale + p_t @ dva[..., cols, :]
            m = m_new
        with np.errstate(invalid="ignore", divide="ignore"):
            out[..., rows, :] = np.where(l > 0, (acc_sv + (row_s / l) * acc_v + acc_dv) / l, 0.0)
    return out


def backward(q, k, v, visible, scale, kv_map, grad_o, faults: Collection[str] = (), block_q: int = DEFAULT_BLOCK,
             block_k: int = DEFAULT_BLOCK, saved: tuple | None = None, stats: dict | None = None, stages=(),
             params: dict | None = None, grad_lse=None):
    """(G_Q, G_K, G_V) by blocks, recomputing P from the saved LSE (``saved`` = (O, LSE), else the
    forward is run to get them). No leading copy axes here. ``stats``, when given, receives the row
    sums of G_S and the sizes of their terms (``gs_rowsum``, ``gs_rowscale``: sum_j P_ij (|dP_ij| + |D_i|)
    times P's relative rounding 1 + |S_ij - LSE_i| + |scale| |q_i|.|k_j|), for the invariant that they
    vanish.

    ``mask-backward`` recomputes A without the mask as the naive engine's fault does: P from the
    log-sum-exp of an unmasked forward, and D from its output. Score ``stages``: each block's G_S goes back to
    the raw scores times their derivative (the row sums are G_S's, at the softmax's input); ``params``, when
    given, receives the gradients of the stages' parameters (an additive bias's), accumulated block by block."""
    args = Args(visible, scale, kv_map, stages)
    tiles = {"block_q": block_q, "block_k": block_k, "with_lse": True}
    o, lse = saved if saved is not None else forward(q, k, v, faults=faults, **tiles, **args.kw)
    masked = "mask" not in faults and "mask-backward" not in faults
    if "mask-backward" in faults and "mask" not in faults:
        o, lse = forward(q, k, v, faults=(*faults, "mask"), **tiles, **args.kw)
    d_row = np.zeros(o.shape[:-1]) if "softmax-term" in faults else np.sum(grad_o * o, axis=-1)
    if grad_lse is not None and "lse-grad-ignored" not in faults:  # dS = P (dP - D + G_L): D shifted by -G_L
        d_row = d_row - grad_lse
    k_rep, v_rep = repeat_kv(k, kv_map), repeat_kv(v, kv_map)
    k_scaled = k_rep * np.asarray(scale, dtype=q.dtype)  # S exactly as the forward formed it
    s_grad = 1.0 if "scale" in faults else scale
    g_q = np.zeros(q.shape, dtype=o.dtype)
    g_k = np.zeros(k_rep.shape, dtype=o.dtype)
    g_v = np.zeros(v_rep.shape, dtype=o.dtype)
    rowsum, rowscale = np.zeros(o.shape[:-1]), np.zeros(o.shape[:-1])
    sink = score_stages.sink_logits(stages) if stages else None
    drop = score_stages.post(stages) if stages else None
    lse_grad = grad_lse is not None and "lse-grad-ignored" not in faults
    if lse_grad:  # a row of dS sums to G_L (1 - p) + D p, D here shifted by -G_L: its sum is -d_row + G_L - ...
        rowsum -= grad_lse
        rowscale += np.abs(grad_lse)
    if sink is not None:  # the sink's column has dS = p (G_L - D) = -p d_row: the other columns sum to that negated
        with np.errstate(over="ignore", under="ignore"):
            p_sink = np.exp(np.asarray(sink)[..., 0] - lse)
        rowsum -= d_row * p_sink
        rowscale += np.abs(d_row) * p_sink
    n_q, n_k = q.shape[-2], k.shape[-2]
    owners = {st.param: st for st in stages if st.param is not None}
    totals = {name: np.zeros(st.values().shape, dtype=o.dtype) for name, st in owners.items()}
    for cols in _spans(n_k, block_k):
        k_blk, v_blk = k_rep[..., cols, :], v_rep[..., cols, :]
        for rows in _spans(n_q, block_q):
            vis = _block(visible, rows, cols) if masked else None
            if vis is not None and not vis.any():
                continue
            raw = q[..., rows, :] @ np.swapaxes(k_scaled[..., cols, :], -1, -2)
            s = score_stages.apply(stages, raw, rows, cols) if stages else raw
            with np.errstate(over="ignore", under="ignore"):
                p = np.exp(s - lse[..., rows, None])
            if vis is not None:
                p = np.where(vis, p, 0.0)
            g_o = grad_o[..., rows, :]
            p_s = p
            if drop is None:
                g_v[..., cols, :] += np.swapaxes(p, -1, -2) @ g_o
                g_p = g_o @ np.swapaxes(v_blk, -1, -2)
            else:  # dropout: dV = (P * W)^T dO, dP = (dO V^T) * W
                w_v = drop.backward_weights(rows, cols)
                w_v = None if w_v is None else w_v.astype(p.dtype, copy=False)
                g_v[..., cols, :] += np.swapaxes(p if w_v is None else p * w_v, -1, -2) @ g_o
                g_p = (g_o @ np.swapaxes(v_blk, -1, -2)) * drop.weights(rows, cols, p.dtype)
                w_s = drop.score_weights(rows, cols)
                p_s = p if w_s is None else p * w_s.astype(p.dtype, copy=False)
            g_s = p_s * (g_p - d_row[..., rows, None])
            if stats is not None:  # P = exp(S - LSE) carries eps (1 + |S - LSE| + S's own rounding) relative
                rowsum[..., rows] += g_s.sum(axis=-1)
                logit = abs(scale) * (np.abs(q[..., rows, :]) @ np.swapaxes(np.abs(k_blk), -1, -2))
                if stages:
                    logit = score_stages.error(stages, logit, raw, rows, cols)
                with np.errstate(invalid="ignore"):
                    spread = np.where(p > 0, np.abs(s - lse[..., rows, None]), 0.0)
                rowscale[..., rows] += (p * (np.abs(g_p) + np.abs(d_row[..., rows, None]))
                                        * (1.0 + spread + logit)).sum(axis=-1)
            if stages:  # back through the stages to the raw scores, the parameters' block gradients on the way
                g_s, blocks = score_stages.pull_back(stages, raw, g_s, rows, cols)
                for name, grad in blocks.items():
                    owners[name].param_add(totals[name], grad, rows, cols)
            g_q[..., rows, :] += (g_s @ k_blk) * s_grad
            g_k[..., cols, :] += (np.swapaxes(g_s, -1, -2) @ q[..., rows, :]) * s_grad
    if stats is not None:
        stats.update(gs_rowsum=rowsum, gs_rowscale=rowscale)
    if params is not None:
        if sink is not None and lse_grad:
            totals = score_stages.lse_terms(stages, totals, grad_lse, p_sink)
        params.update(totals)
    heads_kv, overwrite = k.shape[-3], "gqa-sum" in faults
    return (g_q, sum_groups(g_k, kv_map, heads_kv, overwrite=overwrite),
            sum_groups(g_v, kv_map, heads_kv, overwrite=overwrite))
