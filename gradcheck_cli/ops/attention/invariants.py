"""Attention's semantic checks, which finite differences cannot make: a forward that ignores the mask
has gradients that agree perfectly with its own finite differences. Exact identities are checked to
``INVARIANT_ULPS`` units of rounding of the values involved; "exactly zero" claims with no slack."""
from __future__ import annotations

import numpy as np

from ... import masks
from ...invariants import bounded, bounded_each
from ...result import Check
from ...tolerance import INVARIANT_ULPS, machine_epsilon
from .varlen import document_invariant

#: The float64 reference's unit roundoff (its own quantities, like a sink's weight, round at that precision).
EPS64 = float(np.finfo(np.float64).eps)


def engine_invariants(fwd, bwd, inputs, visible, kv_map, grads, rng, terms: dict[str, np.ndarray],
                      g: np.ndarray, documents=None, sink=None, dropout=None) -> list[Check]:
    """All attention invariants for the engine. ``fwd(q, k, v) -> (o, a)`` and
    ``bwd(q, k, v, grad_o) -> Gradients`` are the implementation under test; ``grads`` is its backward
    at ``inputs`` and upstream gradient ``g`` (with the A and G_A the backward used, and G_S); ``terms`` as
    for :func:`output_invariants`; ``sink``: the forward's sinks' weight per row (the backward's is ``grads.sink``)."""
    o, a = fwd(inputs["q"], inputs["k"], inputs["v"])

    def backward_kv(q, k, v, grad_o):
        g = bwd(q, k, v, grad_o)
        return g.k, g.v

    return (weight_invariants(a, visible, grads, sink)
            + output_invariants(lambda q, k, v: fwd(q, k, v)[0], backward_kv, inputs, visible, kv_map, o, rng,
                               terms, o.dtype.name, (g, grads.k, grads.v), documents, sink, dropout))


def weight_invariants(a, visible, grads, sink=None) -> list[Check]:
    """Invariants of the attention matrix A (the forward's) and of the score gradient G_S (the backward's). With
    sinks (their weight p per row: ``sink`` the forward's, ``grads.sink`` the backward's) a row of A sums to 1 - p
    and one of G_S to p c_i: the sink's own column, its value row 0, takes the rest of the weight and has
    dS = -p c_i."""
    g_s = grads.s
    eps = float(np.finfo(a.dtype).eps)
    kept, but = (1.0, "") if sink is None else (1.0 - sink, " + p_i (the sink's weight)")
    sink = grads.sink
    checks = [
        bounded("attention is non-negative", "a", np.minimum(a, 0), 0.0, "min over all entries of A must be >= 0"),
        bounded("attention rows sum to 1", "a", a.sum(axis=-1) - kept, INVARIANT_ULPS * eps * a.shape[-1],
               f"|sum_j A_ij{but} - 1| per row"),
        bounded("attention is 0 off the visible set", "a", np.where(visible, 0, a), 0.0,
               "A_ij must be exactly 0 where key j is not visible to query i"),
    ]
    # Rounding of sum_j A_ij (G_A_ij - c_i) is bounded by eps * sum_j A_ij (|G_A_ij| + |c_i|).
    c = (grads.a * grads.ga).sum(axis=-1, keepdims=True)
    row_scale = (grads.a * (np.abs(grads.ga) + np.abs(c))).sum(axis=-1)
    rowsum = g_s.sum(axis=-1)
    if grads.lse is not None:  # the log-sum-exp's gradient adds A G_L: its row sums G_L (1 - p) = G_L sum_j A_ij
        kept_lse = grads.lse if sink is None else grads.lse * grads.a.sum(axis=-1)
        rowsum, row_scale = rowsum - kept_lse, row_scale + np.abs(kept_lse)
    if sink is not None:  # the sink column's dS = -p c_i completes the row
        rowsum, row_scale = rowsum - sink * c[..., 0], row_scale + sink * np.abs(c[..., 0])
    checks.append(bounded("score-gradient rows sum to 0", "g_s",
                         rowsum / np.maximum(row_scale, np.finfo(a.dtype).tiny),
                         INVARIANT_ULPS * eps,
                         "|sum_j G_S_ij" + (" - p_i c_i" if sink is not None else "")
                         + "| / sum_j A_ij (|G_A_ij| + |c_i|) per row (softmax is shift invariant"
                         + ("; the sink's column, dS = -p_i c_i, completes the row)" if sink is not None else ")")))
    return checks


#: The invariants of O allow this many ulps of the size of its terms ("O rows in the range of visible V
#: rows": of sum_j A_ij |V_jc|, the rounding of the weights' normalisation and of the product; a logit's
#: rounding changes the weights but keeps them a convex combination). Half precision accumulates in
#: float32 and rounds once: fewer ulps, or the checks could not see a leak at all.
CONVEX_ULPS = {"float64": 64.0, "float32": 64.0, "float16": 4.0, "bfloat16": 4.0}


#: The invariants of the K/V gradients: every query row's loss, and query row 0's alone.
UNSEEN, UNSEEN_BY_ROW_0 = "unseen K/V rows get zero gradient", "row 0's unseen K/V rows get zero gradient"


def output_invariants(forward, backward_kv, inputs, visible, kv_map, o, rng, terms: dict[str, np.ndarray],
                      precision: str, checked, documents=None, sink=None, dropout=None) -> list[Check]:
    """Invariants that need only the output and the K/V gradients, so they apply to any
    implementation: ``forward(q, k, v) -> o``, ``backward_kv(q, k, v, grad_o) -> (g_k, g_v)``, and
    ``checked`` = (g, g_k, g_v), the scenario's upstream gradient and the K/V gradients under test at it.
    ``terms``: the size of the terms of each element of O, ``o`` (with the logits' rounding) and
    ``o_convex`` (sum_j A_ij |V_jc|), in float64; ``precision``: the dtype the computation rounds in; ``documents``:
    a packed batch's (``varlen.Documents``), whose independence is checked too; ``sink``: the sinks' weight per row
    [B, Hq, n_q] (the reference's, float64) or None: O rows then lie in the range of the visible V rows and 0 (the
    sink's value row), and shifting V moves O by (1 - p_i) c; ``dropout``: (W, kept) of a keep mask, W [B, Hq, n_q, n_k]
    the weights after the softmax and kept [B, Hq, n_q] = sum_j A_ij W_ij (the reference's): O rows then lie in the
    range of W_ij V_j over the visible keys, and shifting V moves O by kept_i c."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    eps = machine_epsilon(precision)
    heads_kv = k.shape[-3]
    checks = []
    hidden = ~masks.kv_rows_seen(visible, kv_map, heads_kv)  # [B, Hkv, n_k]: rows no query sees
    n_hidden = int(hidden.sum())

    # Under the scenario's loss (its upstream gradient: on every query row unless loss_rows says otherwise),
    # K/V rows that no query row carrying upstream gradient sees, in any query head sharing them (padding
    # keys, keys past every window), must get exactly zero gradient.
    g, grads_kv = checked[0], checked[1:]
    loaded = np.any(np.asarray(g) != 0, axis=-1)  # [B, Hq, n_q]: the query rows the loss is on
    unloaded = ~masks.kv_rows_seen(visible & loaded[..., None], kv_map, heads_kv)
    rows = "every query row" if loaded.all() else f"{int(loaded.sum())} of {loaded.size} query rows"
    for name, grad in zip("kv", grads_kv):
        checks.append(bounded(UNSEEN, name, np.where(unloaded[..., None], np.asarray(grad), 0), 0.0,
                             f"loss on {rows} (the scenario's upstream gradient); {int(unloaded.sum())} (batch, kv "
                             "head, key) rows none of them sees must get exactly zero gradient"))

    # The seed's causal test, for any mask: upstream gradient only on query row 0; K/V rows that no
    # query head sharing them sees from row 0 must get exactly zero gradient (under a causal mask every key
    # is seen by some row, so only a loss on one row sees the future keys leak into it).
    first = np.zeros_like(o)
    first[..., 0, :] = np.random.default_rng(rng.integers(2**32)).standard_normal(first[..., 0, :].shape)
    first_k, first_v = backward_kv(q, k, v, first)
    unseen = ~masks.kv_rows_seen(visible[..., :1, :], kv_map, heads_kv)  # [B, Hkv, n_k]
    n_unseen = int(unseen.sum())
    for name, grad in (("k", first_k), ("v", first_v)):
        checks.append(bounded(UNSEEN_BY_ROW_0, name, np.where(unseen[..., None], grad, 0), 0.0,
                             f"loss on query row 0 only; {n_unseen} (batch, kv head, key) rows it cannot see "
                             "must get exactly zero gradient"))

    # Replacing K/V rows that no query sees must not change O (beyond the rounding of O's own terms).
    k2 = np.where(hidden[..., None], rng.standard_normal(k.shape).astype(k.dtype) * 10, k)
    v2 = np.where(hidden[..., None], rng.standard_normal(v.shape).astype(v.dtype) * 10, v)
    o2 = forward(q, k2, v2)
    ulps = CONVEX_ULPS.get(precision, INVARIANT_ULPS)
    checks.append(bounded_each("hidden K/V rows do not change O", "o", np.asarray(o2, dtype=np.float64) - o,
                               ulps * eps * terms["o_convex"],
                               (f"{n_hidden} (batch, kv head, key) rows visible to no query replaced by random values"
                                if n_hidden else "every key row is visible to some query: nothing to replace")
                               + f"; allowed {ulps:g} ulps of {precision} of sum_j A_ij |V_jc| (the visible keys' "
                               "logits do not move)",
                               guarded=float(np.abs(o).max(initial=0.0)) if n_hidden else None))

    # The weights of each row sum to 1: adding the same vector to every V row adds it to every O row.
    shift = np.random.default_rng(rng.integers(2**32)).standard_normal(v.shape[:-2] + (1, v.shape[-1]))
    shift = (shift * max(float(np.abs(v).max(initial=0.0)), 1.0)).astype(v.dtype)
    o3 = np.asarray(forward(q, k, v + shift), dtype=np.float64)
    moved = np.take(shift.astype(np.float64), kv_map, axis=-3)  # [B, Hq, 1, d_v]: each query head's KV head
    if dropout is not None:  # the weights after the keep mask sum to kept_i
        moved = moved * np.asarray(dropout[1], dtype=np.float64)[..., None]
    elif sink is not None:  # the sink keeps its weight on its value row, 0
        moved = moved * (1.0 - np.asarray(sink, dtype=np.float64))[..., None]
    allowed = ulps * eps * (terms["o_convex"] + 2 * np.abs(moved))
    if (sink is not None or dropout is not None) and "weights" in terms:  # the keys' total weight rounds with them
        c = np.abs(np.take(shift.astype(np.float64), kv_map, axis=-3))
        tiny = float(np.finfo(precision).tiny) if precision in ("float16", "float32", "float64") else 2.0 ** -126
        allowed = allowed + (ulps * eps * terms["weights"][..., None]
                             + INVARIANT_ULPS * EPS64 * terms["sink_reference"][..., None]
                             + ulps * tiny * v.shape[-2]) * c  # weights below the normal range round absolutely
    checks.append(bounded_each("shifting every V row shifts O by as much", "o", o3 - o - moved,
                               allowed,
                               "O(V + c) - O(V) - c per element, c one random vector per (batch, KV head) "
                               "added to every V "
                               + ("row, times sum_j A_ij W_ij (dropout's weights of the row)" if dropout is not None
                                  else "row, times 1 - p_i (the sinks' weight): the attention weights and the sink's "
                                  "sum to 1" if sink is not None else "row: the attention weights of each row sum to 1")
                               + f"; allowed {ulps:g} ulps of {precision} of sum_j A_ij |V_jc| + 2 |c|"
                               + (" + |c| sum_j A_ij (1 + L_ij + |s_h|) (the keys' weight against the sink's, L_ij "
                                  "their logits' rounding), the float64 reference's rounding of p_i, and n_k x the "
                                  "dtype's smallest normal (weights that small round absolutely)"
                                  if sink is not None else ""),
                               # with sinks in half precision the logits' rounding moves weight between the keys
                               # and the sink by up to a few % of c: the check still sees a sink left out or
                               # misapplied (its violation ~ p c), but has no power to claim beyond; the reference
                               # agreement carries it there
                               guarded=None if (sink is not None or dropout is not None)
                               and precision in ("float16", "bfloat16")
                               else float(np.abs(moved).max(initial=0.0))))

    # Each O row is a convex combination of its visible V rows (and of 0, the sink's value row, with sinks).
    checks.append(bounded_each("O rows in the range of visible V rows", "o",
                               _outside_visible_range(o, v, visible, kv_map, zero=sink is not None,
                                                      weights=None if dropout is None else dropout[0]),
                               ulps * eps * terms["o_convex"],
                               "distance of O_i outside [min, max] of the V rows visible to query i"
                               + (" and 0 (the sink's value row)" if sink is not None else "") + ", per column; "
                               f"allowed {ulps:g} ulps of {precision} of sum_j A_ij |V_jc|",
                               guarded=float(np.abs(o).max(initial=0.0))))
    if documents is not None:
        checks.append(document_invariant(forward, inputs, documents, np.asarray(o, dtype=np.float64),
                                         np.random.default_rng(rng.integers(2**32)), terms["o_convex"], precision,
                                         ulps))
    return checks


def _outside_visible_range(o, v, visible, kv_map, block_elements: int = 1 << 22, zero: bool = False,
                           weights=None) -> np.ndarray:
    """Per element of o [B, Hq, n_q, d_v]: how far it lies outside [min, max] over the V rows
    visible to its query row (and 0 with ``zero``: a sink's value row). Evaluated in blocks of query rows to bound
    memory."""
    out = np.zeros(o.shape, dtype=np.float64)
    n_q, n_k, d_v = o.shape[-2], v.shape[-2], v.shape[-1]
    rows = max(1, block_elements // max(1, n_k * d_v))
    for b in range(o.shape[0]):
        for r, kv in enumerate(kv_map):
            vals = v[b, kv][None, :, :]                       # [1, n_k, d_v]
            for i0 in range(0, n_q, rows):
                vis = visible[b, r, i0:i0 + rows, :, None]    # [rows, n_k, 1]
                row_vals = vals if weights is None else weights[b, r, i0:i0 + rows, :, None] * vals  # W_ij V_j
                lo = np.where(vis, row_vals, np.inf).min(axis=1)
                hi = np.where(vis, row_vals, -np.inf).max(axis=1)
                if zero:
                    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
                oi = o[b, r, i0:i0 + rows]
                out[b, r, i0:i0 + rows] = np.maximum(lo - oi, 0) + np.maximum(oi - hi, 0)
    return out
