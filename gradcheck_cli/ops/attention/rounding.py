"""The size of the terms attention's outputs and gradients are made of, from which their rounding
comes: the noise floor of finite differences (``Blocks.rounding``) and the allowed disagreement of a
plain implementation with the float64 reference (``term_sizes``). Shapes as in ``formulas``."""
from __future__ import annotations

import numpy as np

from ..dense import RSS_FACTOR
from . import stages as score_stages
from .formulas import raw_scores, repeat_kv, sum_groups

#: Query rows of A taken at a time when the term sizes are formed: each step holds a few arrays of
#: TERM_ROWS x n_k float64 per head, whatever n_q is (memory.py counts TERM_BLOCKS of them).
TERM_ROWS = 256


class Blocks:
    """Independent blocks of the output: a query row (b, r, i) feeds only row i of O[b, r]; K of KV
    head (b, g) feeds only the query heads of group g in batch b; column c of V[b, g] feeds only
    column c of O in those heads (O = A V column by column). A score stage's parameter (``params``: name -> the
    stage owning it; an additive bias, a relative-bias table) has the blocks its stage says
    (``Stage.block_index``, ``Stage.block_sums``)."""

    def __init__(self, sc, kv_map, params: dict | None = None):
        self.group = np.eye(sc.heads_kv)[kv_map]  # [Hq, Hkv] one-hot of g(r)
        b, hq, hkv = sc.batch, sc.heads_q, sc.heads_kv
        self.parts = {
            "q": np.broadcast_to(np.arange(b * hq * sc.n_q).reshape(b, hq, sc.n_q, 1), (b, hq, sc.n_q, sc.d_head)),
            "k": np.broadcast_to(np.arange(b * hkv).reshape(b, hkv, 1, 1), (b, hkv, sc.n_k, sc.d_head)),
            "v": np.broadcast_to(np.arange(b * hkv * sc.d_value).reshape(b, hkv, 1, sc.d_value),
                                 (b, hkv, sc.n_k, sc.d_value)),
        }
        self.params = dict(params or {})
        for name, st in self.params.items():
            self.parts[name] = st.block_index()

    def sums(self, name: str, terms: np.ndarray) -> np.ndarray:
        """Sum terms [..., B, Hq, n_q, d_v] of L by the blocks of input ``name`` -> [..., P], in float64."""
        if name == "q":
            return terms.sum(axis=-1, dtype=np.float64).reshape(terms.shape[:-4] + (-1,))
        if name in self.params:  # by the parameter's own blocks (a bias: summed where it is broadcast)
            return self.params[name].block_sums(terms.sum(axis=-1, dtype=np.float64))
        if name == "k":
            per_group = terms.sum(axis=(-2, -1), dtype=np.float64) @ self.group             # [..., B, Hkv]
        else:
            per_group = np.swapaxes(terms.sum(axis=-2, dtype=np.float64), -1, -2) @ self.group  # [..., B, d_v, Hkv]
            per_group = np.swapaxes(per_group, -1, -2)                                       # [..., B, Hkv, d_v]
        return per_group.reshape(terms.shape[:-4] + (-1,))

    def rounding(self, inputs, g, a, scale, kv_map, rows: int = TERM_ROWS,
                 stages=(), lse=None) -> tuple[dict[str, np.ndarray], float]:
        """Rounding model of one forward, per term of L: a logit carries an error of about
        eps * scale * sum_c |q_ic k_jc|, which the softmax passes on relative to A_ij; O_ic then sums
        A_ij V_jc. So |error of O_ic| <~ eps * sum_j A_ij (1 + scale |q_i|.|k_j|) |V_jc|, times |G_ic|.
        Returns the per-element size of the terms that move with it (by block), and the total.
        ``a`` is A, or a callable giving A's rows for a slice of query rows (``rows`` at a time), so
        the tiled engine never holds all of A. Score ``stages`` change a logit's error as they say
        (``stages.error``)."""
        a_rows = a if callable(a) else (lambda span: a[..., span, :])
        g_abs = np.abs(g).astype(np.float64)
        terms = g_abs * output_term_sizes(inputs, a_rows, scale, kv_map, rows, stages=stages)
        if lse is not None:  # (G_L, LSE): the log-sum-exp output's terms, G_L_i's share in row i's block
            grad_lse, values = lse
            share = np.abs(grad_lse).astype(np.float64) * lse_term_sizes(inputs, a_rows, scale, kv_map, values,
                                                                         rows, stages)
            terms = terms + share[..., None] / terms.shape[-1]
        # Moving V leaves the logits alone: both evaluations of a V difference round S (and A) the same
        # way, so only the product A V rounds differently (no logit term).
        terms_v = g_abs * output_term_sizes(inputs, a_rows, scale, kv_map, rows, logits=False, stages=stages)
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


def output_term_sizes(inputs, a_rows, scale, kv_map, rows: int = TERM_ROWS, logits: bool = True,
                      stages=()) -> np.ndarray:
    """The size of the terms each element of O is made of, from which its rounding comes, in float64:
    sum_j A_ij |V_jc| (the product and the normalisation) plus the logits' share. A logit S_ij carries an
    error of about eps L_ij, L_ij = |scale| sum_c |q_ic k_jc|, which moves O_ic by A_ij (V_jc - O_ic) per
    unit (a shift common to the row cancels); that share is bounded by Cauchy-Schwarz as
    sqrt(sum_j A_ij L_ij^2) sqrt(sum_j A_ij (V_jc - O_ic)^2), so a peaked row, whose O is its top V row,
    is charged nothing for logits it barely weighs. ``a_rows(span)`` gives A's rows for a slice of query
    rows; ``rows`` query rows are taken at a time. ``logits`` False leaves out the logits' share. Score
    ``stages``: L_ij is the error of the scores after them (``_logit_error``)."""
    qa, ka = (np.abs(t).astype(np.float64) for t in (inputs["q"], repeat_kv(inputs["k"], kv_map)))
    v = repeat_kv(inputs["v"], kv_map).astype(np.float64)
    va = np.abs(v)
    out = np.empty(qa.shape[:-1] + (va.shape[-1],))
    drop = score_stages.post(stages) if stages else None
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        a = a_rows(span).astype(np.float64)
        if drop is not None:  # dropout: O's weights are A W
            a = a * drop.weights(span)
        out[..., span, :] = a @ va
        if logits:
            logit = _logit_error(inputs, qa, ka, scale, kv_map, span, stages)
            spread = np.sqrt(np.sum(a * logit * logit, axis=-1, keepdims=True))
            o = a @ v
            variance = np.maximum(a @ (v * v) - o * o, 0.0)
            out[..., span, :] += spread * np.sqrt(variance)
    return out


def _logit_error(inputs, qa, ka, scale, kv_map, span, stages=(), with_slope: bool = False):
    """L_ij = |scale| sum_c |q_ic| |k_jc| for the query rows ``span`` (qa, ka: |q| and |repeat_kv(k)| in float64),
    the size of a raw score's rounding; after score ``stages``, the error they pass on and add. ``with_slope``:
    (that, the size of the terms of the stages' derivative or None), the raw scores formed once for both."""
    logit = abs(scale) * (qa[..., span, :] @ np.swapaxes(ka, -1, -2))
    if not stages:
        return (logit, None) if with_slope else logit
    r = raw_scores(np.asarray(inputs["q"][..., span, :], np.float64), np.asarray(inputs["k"], np.float64), scale,
                   kv_map)
    error = score_stages.error(stages, logit, r, span)
    return (error, score_stages.slope_size(stages, r, logit, span)) if with_slope else error


def lse_term_sizes(inputs, a_rows, scale, kv_map, lse, rows: int = TERM_ROWS, stages=()) -> np.ndarray:
    """The size of the terms of each LSE_i [B, Hq, n_q] (float64): |LSE_i| (its maximum and logarithm) plus
    sum_j A_ij (1 + L_ij), the logits' rounding passed on through the weights."""
    qa, ka = (np.abs(t).astype(np.float64) for t in (inputs["q"], repeat_kv(inputs["k"], kv_map)))
    out = np.abs(np.asarray(lse, dtype=np.float64)) + 1.0
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        a = a_rows(span).astype(np.float64)
        out[..., span] += (a * np.broadcast_to(_logit_error(inputs, qa, ka, scale, kv_map, span, stages),
                                               a.shape)).sum(axis=-1)
    return out


def output_terms(inputs, a, scale, kv_map, stages=()) -> dict[str, np.ndarray]:
    """The size of the terms of each element of O, for the invariants: ``o`` with the logits' rounding,
    ``o_convex`` without it (sum_j A_ij |V_jc|). ``a``: A, or ``a_rows(span)``."""
    a_rows = a if callable(a) else (lambda span: a[..., span, :])
    terms = {"o": output_term_sizes(inputs, a_rows, scale, kv_map, stages=stages),
             "o_convex": output_term_sizes(inputs, a_rows, scale, kv_map, logits=False, stages=stages)}
    sink = score_stages.sink_logits(stages) if stages else None
    if sink is not None or (stages and score_stages.post(stages) is not None):
        # the keys' share of a row (against the sink's, or after the keep mask) carries their logits' rounding
        terms["weights"], terms["sink_reference"] = _weight_terms(
            inputs, a_rows, scale, kv_map, stages, 0.0 if sink is None else np.abs(np.asarray(sink))[..., 0])
    return terms


def _weight_terms(inputs, a_rows, scale, kv_map, stages, sink, rows: int = TERM_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """With sinks, per row [B, Hq, n_q]: (the size of the rounding of the keys' total weight 1 - p_i in the
    computation, sum_j A_ij (1 + L_ij + |s_h|), L the logits' rounding and |s_h| the sink logit's (an online softmax
    rescales both by the running maximum: the weight moves between the keys and the sink, where without a sink it
    only moves among the keys and the total stays 1), and the size of the rounding of the reference's
    p_i = exp(s_h - LSE_i) itself, p_i (1 + |s_h| + max_j L_ij + log(1 + n_k)), which 1 - p_i keeps in full when
    the sink takes nearly all the weight (float64: the reference's precision)."""
    qa, ka = (np.abs(t).astype(np.float64) for t in (inputs["q"], repeat_kv(inputs["k"], kv_map)))
    mine, ref = np.empty(qa.shape[:-1]), np.empty(qa.shape[:-1])
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        a = a_rows(span).astype(np.float64)
        logit = np.broadcast_to(_logit_error(inputs, qa, ka, scale, kv_map, span, stages), a.shape)
        p = np.clip(1.0 - a.sum(axis=-1), 0.0, 1.0)  # the sink's weight
        drop = score_stages.post(stages) if stages else None
        if drop is not None:  # the weights after the keep mask
            a = a * drop.weights(span)
        kept = a.sum(axis=-1)
        mine[..., span] = (a * (1.0 + logit)).sum(axis=-1) + kept * sink
        ref[..., span] = p * (1.0 + sink + np.max(logit, axis=-1, initial=0.0) + np.log1p(a.shape[-1]))
    return mine, ref


def term_sizes(inputs, g, a_rows, scale, kv_map, rows: int = TERM_ROWS, rss: bool = False,
               stages=(), params: bool = False, grad_lse=None) -> dict[str, np.ndarray]:
    """The size of the terms each element of O, G_Q, G_K and G_V is made of (float64, by blocks of
    ``rows`` query rows): rounding in a precision with unit roundoff u puts an error of about
    u x these in each element, whatever order the implementation sums in.

    With L_ij = |scale| sum_c |q_ic k_jc| (a logit's rounding, passed on relative to A_ij) and
    Ã = A (1 + L): O ~ Ã |V|; G_A ~ |G_O| |V|^T; G_S ~ Ã (|G_A| + sum_j A_ij |G_A|_ij);
    G_Q ~ |scale| |G_S| |K|; G_K ~ |scale| |G_S|^T |Q|; G_V ~ Ã^T |G_O| (K/V summed over each group).
    ``rss``: the root sum of squares of those terms instead of their sum (independent rounding errors
    add in quadrature: the statistical size of the error, where the sum is its worst case).
    ``a_rows(span)`` gives A's rows for a slice of query rows. Score ``stages``: L is the error of the scores
    after them, and G_S goes back to the raw scores times the size of their derivative's terms; ``params``
    (True) adds those of the stages' checked parameters: G_S's terms gathered as each stage gathers its
    parameter's gradient (``Stage.param_terms``: a bias's summed over its broadcast axes)."""
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
    owners = score_stages.owners(stages) if params else {}
    t_p = {name: np.zeros(st.values().shape) for name, st in owners.items()}
    drop = score_stages.post(stages) if stages else None
    for start in range(0, qa.shape[-2], rows):
        span = slice(start, min(start + rows, qa.shape[-2]))
        a = a_rows(span).astype(np.float64)
        error, slope = _logit_error(inputs, q1, k1, scale, kv_map, span, stages, with_slope=True)
        a_err = a * (1.0 + error)
        g_a = g1[..., span, :] @ np.swapaxes(v1, -1, -2)
        if drop is not None:  # dropout: dA = (dO V^T) W; O's and dV's weights are A W
            w = drop.weights(span)
            g_a = g_a * w
        t_s = a_err * (g_a + np.sum(a * g_a, axis=-1, keepdims=True))
        if grad_lse is not None:  # the log-sum-exp's upstream gradient: G_S gains A G_L
            t_s = t_s + a_err * np.abs(np.asarray(grad_lse, dtype=np.float64)[..., span, None])
        for name, total in t_p.items():  # the gradient at the softmax's input, gathered as the stage does
            owners[name].param_add(total, owners[name].param_terms(t_s ** power, span, power=power), span)
        if slope is not None:
            t_s = t_s * slope
        if drop is not None:
            a_err = a_err * w
        a_err, t_s = a_err ** power, t_s ** power
        t_o[..., span, :] = a_err @ va
        t_q[..., span, :] = abs(scale) ** power * (t_s @ ka)
        t_k += abs(scale) ** power * (np.swapaxes(t_s, -1, -2) @ qa[..., span, :])
        t_v += np.swapaxes(a_err, -1, -2) @ ga[..., span, :]
    if grad_lse is not None:  # a sink's gradient gains sum_i G_L_i, beside -sum dS, where the LSE is an output
        for name, st in owners.items():
            if st.normaliser:
                t_p[name] = t_p[name] + st.lse_grad(np.abs(np.asarray(grad_lse, dtype=np.float64)) ** power, 0.0)
    heads_kv = inputs["k"].shape[-3]
    out = {"o": t_o, "q": t_q, "k": sum_groups(t_k, kv_map, heads_kv), "v": sum_groups(t_v, kv_map, heads_kv), **t_p}
    if not rss:
        return out
    # Terms below ~1e-154 square to 0 (a key almost no query weighs, at a large scale): the root sum of
    # squares is never below sum / sqrt(number of terms), which does not underflow.
    linear = term_sizes(inputs, g, a_rows, scale, kv_map, rows, stages=stages, params=params, grad_lse=grad_lse)
    count = qa.shape[-2] * ka.shape[-2] * max(1, int(np.bincount(np.asarray(kv_map)).max()))
    return {t: np.maximum(np.sqrt(x), linear[t] / np.sqrt(count)) for t, x in out.items()}
