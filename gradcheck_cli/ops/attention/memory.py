"""Attention's memory estimate (``Op.memory``): what a scenario needs, checked at load time before
anything of size n_q x n_k exists."""
from __future__ import annotations

import numpy as np

from .formulas import DEFAULT_BLOCK
from .rounding import TERM_ROWS

#: Score-sized arrays the naive engine holds at once (A, G_S, ... in the dtype), per score element, and the
#: bytes of the visible set and its complement.
SCORE_ARRAYS, MASK_BYTES = 16, 2
#: Block-sized score arrays the tiled engine holds, and float64 row blocks of term sizes (rounding.TERM_ROWS
#: rows at a time: A's rows, the logits, their product).
BLOCK_ARRAYS, TERM_BLOCKS = 16, 3
#: Copies of each tensor (q, k, v, o and their gradients, analytic and numeric) held in float64.
TENSOR_COPIES = 12


def attention_need(batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, dtype, engine="naive",
                   block_q=DEFAULT_BLOCK, block_k=DEFAULT_BLOCK) -> int:
    """Bytes attention needs before anything of size n_q x n_k is allocated: about ten score-sized
    arrays for the naive engine's forward, backward and invariants plus one (+h, -h) pair of copies
    (see numeric.plan); for the tiled engine only the visible set (bytes) and block-sized scores. The
    tensors (q, k, v, o and their gradients, analytic and numeric) count about a dozen times."""
    itemsize = {"float16": 2, "bfloat16": 2}.get(dtype) or np.dtype(dtype).itemsize
    scores = batch * heads_q * n_q * n_k
    tensors = batch * (heads_q * n_q * (d_head + d_value) + heads_kv * n_k * (d_head + d_value))
    if engine == "tiled":
        return (scores * MASK_BYTES + batch * heads_q * min(block_q, n_q) * min(block_k, n_k) * BLOCK_ARRAYS * itemsize
                + batch * heads_q * TERM_ROWS * n_k * TERM_BLOCKS * 8 + tensors * TENSOR_COPIES * 8)
    return scores * (SCORE_ARRAYS * itemsize + MASK_BYTES) + tensors * TENSOR_COPIES * 8


#: Copies of an additive bias held in float64 (its values, its gradients analytic and numeric, the reference's,
#: the perturbed copies of a block of it).
BIAS_COPIES = 8


def need(sc) -> int:
    """``Op.memory`` of attention: :func:`attention_need` of a scenario (or a probe with its keys), and an additive
    bias's copies (score-sized where it is not broadcast: the tiled engine's O(n) ends there)."""
    base = attention_need(sc.batch, sc.heads_q, sc.heads_kv, sc.n_q, sc.n_k, sc.d_head, sc.d_value, sc.dtype,
                          sc.engine, sc.block_q, sc.block_k)
    try:
        bias = sc.p("bias")
    except KeyError:  # an op composed of attention (projections, block): no variants
        return base
    if bias is None:
        return base
    shape = dict(bias)["shape"] or (1, sc.heads_q, sc.n_q, sc.n_k)
    return base + int(np.prod(shape)) * 8 * BIAS_COPIES
