"""``engine: tiled``: the problem of a scenario computed by the tiled engine (``tiled``), with its own check
against the naive engine evaluated by blocks of query rows (``naive_by_rows``)."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ... import invariants, precision
from ...numeric import SeedStream
from ...tolerance import ENGINE_AGREEMENT_ULPS, INVARIANT_ULPS
from ..registry import Problem, Tangents
from . import directional, formulas, varlen
from . import lse as lse_output
from . import stages as score_stages
from .args import Args
from .formulas import DEFAULT_BLOCK
from .hints.tangent import jvp_hints
from .inputs import seeded_inputs
from .invariants import output_invariants
from .reference import diagnosis_fields
from .rounding import TERM_ROWS, Blocks, output_term_sizes, output_terms, term_sizes
from .tiled import _block, _spans, backward, forward, jvp, jvp_terms


def naive_by_rows(q, k, v, visible, scale, kv_map, grad_o, block_q: int = DEFAULT_BLOCK,
                  faults: Collection[str] = (), stages=(), backward_stages=None, params: dict | None = None,
                  grad_lse=None) -> tuple:
    """The naive engine's formulas (full softmax rows, A.10.5-A.10.9) evaluated a block of query rows at
    a time, so the reference for ``tiled agrees with the naive engine`` needs O(block_q x n_k) memory:
    (O, G_Q, G_K, G_V). With ``faults`` it is the naive engine with the same bugs, so the agreement
    check measures the tiling alone and finite differences must catch the faults by themselves. ``params``, when
    given, receives the gradients of the stages' parameters (a bias's), row block by row block."""
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=np.result_type(q, v))
    g_q = np.empty(q.shape, dtype=out.dtype)
    g_k, g_v = np.zeros(k.shape, dtype=out.dtype), np.zeros(v.shape, dtype=out.dtype)
    for rows in _spans(q.shape[-2], block_q):
        vis = _block(visible, rows, slice(None))
        out[..., rows, :] = formulas.forward(q[..., rows, :], k, v, vis, scale, kv_map, faults, stages=stages,
                                             rows=rows)
        grads = formulas.backward(q[..., rows, :], k, v, vis, scale, kv_map, grad_o[..., rows, :], faults,
                                  stages if backward_stages is None else backward_stages, rows,
                                  grad_lse=None if grad_lse is None else grad_lse[..., rows])
        g_q[..., rows, :] = grads.q
        g_k += grads.k
        g_v += grads.v
        if params is not None:
            owners = score_stages.owners(stages if backward_stages is None else backward_stages)
            for name, grad in grads.params.items():
                params.setdefault(name, np.zeros(owners[name].values().shape, dtype=grad.dtype))
                owners[name].param_add(params[name], grad, rows)
    return out, g_q, g_k, g_v


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """The problem of ``engine: tiled``: finite differences, analytic gradients and invariants all
    through the tiled engine, plus its agreement with the naive engine (a check of its own)."""
    qkv, g = seeded_inputs(sc)
    q, k, v = qkv["q"], qkv["k"], qkv["v"]
    dt = np.dtype(sc.dtype)
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible, scale, bq, bk = sc.visible, sc.scale, sc.block_q, sc.block_k
    right = score_stages.from_scenario(sc)  # a stage fault's wrong stage in place, the softmax's visible set
    stages, back, shown = score_stages.inject(right, visible, faults)  # the forward's and the backward's
    shown = varlen.shown(sc, shown, faults)  # a packed batch's fault: the visible set it makes
    extra = score_stages.params(right)  # a stage's parameter whose gradient is checked: an input (a bias)
    inputs = {**qkv, **extra}
    seen, true = Args(shown, scale, kv_map, stages), Args(visible, scale, kv_map, right)
    blocks = Blocks(sc, kv_map, score_stages.owners(right))
    grad_lse = lse_output.upstream(sc) if lse_output.wanted(sc) else None  # the log-sum-exp as an output: G_L

    def fwd(q, k, v):
        return forward(q, k, v, faults=faults, block_q=bq, block_k=bk, **seen.kw)

    def backward_kv(q, k, v, grad_o):
        return backward(q, k, v, grad_o=grad_o, faults=faults, block_q=bq, block_k=bk, **seen.but(stages=back).kw)[1:]

    def copies_forward(name: str, x: np.ndarray, with_lse: bool = False):
        if name in extra:  # a stage's parameter moved: its perturbed copies in the stages
            return forward(q, k, v, faults=faults, block_q=bq, block_k=bk, with_lse=with_lse,
                           **seen.but(stages=score_stages.moved(stages, name, x)).kw)
        at = {**qkv, name: x}
        return forward(at["q"], at["k"], at["v"], faults=faults, block_q=bq, block_k=bk, with_lse=with_lse,
                       **seen.kw)

    def loss_terms(name: str, x: np.ndarray) -> np.ndarray:
        """The terms of L per element of O for perturbed copies (the LSE's share spread over its row's)."""
        if grad_lse is None:
            return copies_forward(name, x) * g
        o_c, values = copies_forward(name, x, with_lse=True)  # in float64: the LSE's terms dwarf O's
        return (o_c.astype(np.float64) * g + (lse_output.returned(values.astype(np.float64), faults)
                                               * grad_lse)[..., None] / o_c.shape[-1])

    o, lse = forward(q, k, v, faults=faults, block_q=bq, block_k=bk, with_lse=True, **seen.kw)
    stats: dict = {}
    param_grads: dict = {}
    g_q, g_k, g_v = backward(q, k, v, grad_o=g, faults=faults, block_q=bq, block_k=bk, saved=(o, lse), stats=stats,
                             params=param_grads, grad_lse=grad_lse, **seen.but(stages=back).kw)
    drop = score_stages.post(right)  # dropout: O = (A * W) V (the term sizes take W from the stages)

    def a_rows(span):
        a = formulas.attention_weights(q[..., span, :], k, faults=faults, rows=span,
                                       **seen.but(visible=shown[..., span, :]).kw)
        return a

    rounding, rounding_total = blocks.rounding(inputs, g, a_rows, scale, kv_map, stages=right,
                                               lse=None if grad_lse is None else (grad_lse, lse))
    rng_inv = np.random.default_rng([sc.seed, SeedStream.INVARIANTS])

    def checks() -> list:
        naive_params: dict = {}
        ref = dict(zip("oqkv", (np.asarray(r, dtype=np.float64) for r in
                                naive_by_rows(q, k, v, shown, scale, kv_map, g, bq, faults, stages, back,
                                              naive_params, grad_lse))))
        ref.update(naive_params)
        # Both engines round: they may differ by ENGINE_AGREEMENT_ULPS x eps x the (worst-case) size of each
        # element's terms, never by a fraction of the result (a saturated row's gradient is zero to rounding).
        sizes = term_sizes(qkv, g, a_rows, scale, kv_map, stages=right, params=True, grad_lse=grad_lse)
        policy = precision.Policy(sc.dtype, 0.0, 0.0, ENGINE_AGREEMENT_ULPS)
        agree = [precision.agreement("tiled agrees with the naive engine", t, mine, ref[t], sizes[t], policy,
                                     what="tiled") for t, mine in (("o", o), ("q", g_q), ("k", g_k), ("v", g_v),
                                                                   *param_grads.items())]
        if sc.mode == "jvp":  # the JVP too, along a random tangent, the naive one by blocks of query rows
            draw = np.random.default_rng([sc.seed, SeedStream.FAST_FORWARD])
            t = {n: draw.standard_normal(x.shape).astype(dt) for n, x in qkv.items()}
            naive = np.empty(o.shape)
            for span in _spans(sc.n_q, TERM_ROWS):
                naive[..., span, :] = directional.jvp(q[..., span, :], k, v, dq=t["q"][..., span, :], dk=t["k"],
                                                      dv=t["v"], faults=faults, rows=span,
                                                      **seen.but(visible=shown[..., span, :]).kw)
            agree.append(precision.agreement("tiled JVP agrees with the naive engine", "o_dot", o_dot(t), naive,
                                             jvp_terms(q, k, v, dq=t["q"], dk=t["k"], dv=t["v"], block_q=bq,
                                                       block_k=bk, **true.kw), policy, what="tiled"))
        eps = float(np.finfo(dt).eps)
        terms = output_terms(qkv, a_rows, scale, kv_map, right)
        # D = rowsum(G_O * O) comes from the forward's O, which carries the rounding of its own terms
        scale_rows = stats["gs_rowscale"] + np.sum(np.abs(g).astype(np.float64) * terms["o"], axis=-1)
        # weights among the dtype's subnormals round absolutely (a multiple of its smallest one per term)
        scale_rows = scale_rows + sc.n_k * float(np.finfo(dt).smallest_subnormal) / eps
        rows = invariants.bounded("score-gradient rows sum to 0", "g_s",
                                  stats["gs_rowsum"] / np.maximum(scale_rows, np.finfo(np.float64).tiny),
                                  INVARIANT_ULPS * eps,
                                  "|sum_j G_S_ij| per row over the size of its terms: sum_j P_ij (|dP_ij| + |D_i|) "
                                  "(1 + |S_ij - LSE_i| + |scale| |q_i|.|k_j|), the rounding P = exp(S - LSE) carries, "
                                  "plus sum_c |G_O_ic| x the terms of O_ic (D is formed from the forward's O); "
                                  "accumulated over the blocks of the tiled backward (softmax is shift invariant)")
        sink = score_stages.sink_logits(stages)
        if sink is not None:  # the sinks' weight per row, from the log-sum-exp of the same forward in float64
            lse64 = forward(*(x.astype(np.float64) for x in (q, k, v)), faults=faults, block_q=bq, block_k=bk,
                            with_lse=True, **seen.kw)[1]
            sink = np.exp(np.asarray(sink, dtype=np.float64)[..., 0] - lse64)
        dropout = None
        if drop is not None:  # the weights after the keep mask, and their row sums (float64, by row blocks)
            w = drop.weights()
            kept = np.concatenate([(formulas.attention_weights(
                q[..., span, :].astype(np.float64), k.astype(np.float64), rows=span,
                **true.but(visible=visible[..., span, :]).kw) * w[..., span, :]).sum(axis=-1)
                for span in _spans(sc.n_q, TERM_ROWS)], axis=-1)
            dropout = (w, kept)
        return agree + [rows] + output_invariants(fwd, backward_kv, qkv, visible, kv_map, o, rng_inv, terms,
                                                  sc.dtype, (g, g_k, g_v), sc.documents, sink, dropout)

    lead = sc.batch * sc.heads_q
    def o_dot(t: dict) -> np.ndarray:
        """The engine's JVP along tangents t (by input name; missing: zero)."""
        return jvp(q, k, v, dq=t.get("q"), dk=t.get("k"), dv=t.get("v"), faults=faults, block_q=bq, block_k=bk,
                   **seen.kw)

    return Problem(
        inputs=inputs,
        loss=lambda name, x: np.sum(loss_terms(name, x), axis=(-4, -3, -2, -1), dtype=np.float64),
        gradients={"q": g_q, "k": g_k, "v": g_v, **param_grads},
        rounding=rounding,
        rounding_total=rounding_total,
        copy_bytes=(4 * lead * bq * bk + 3 * o.size + lead * sc.n_k * (sc.d_head + sc.d_value)) * dt.itemsize,
        invariants=checks,
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g, "scale": np.asarray(scale),
                "kv_map": kv_map, "output": o, "lse": lse, "analytic_q": g_q, "analytic_k": g_k, "analytic_v": g_v,
                **({} if grad_lse is None else {"grad_lse": grad_lse}),
                **extra, **{f"analytic_{t}": x for t, x in param_grads.items()}},
        output=o,
        tangents=Tangents(
            forward=lambda **moved: fwd(**{**qkv, **moved}),
            jvp=o_dot,
            jvp_terms=lambda t: jvp_terms(q, k, v, dq=t.get("q"), dk=t.get("k"), dv=t.get("v"), block_q=bq,
                                          block_k=bk, **true.kw),
            output_terms=output_term_sizes(qkv, a_rows, scale, kv_map, stages=right),
            upstream=g,
            explain=jvp_hints(o_dot, qkv, true, [sc.seed, SeedStream.TANGENT_HINTS])),
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, loss_terms(name, x)),
        **diagnosis_fields(sc),
    )
