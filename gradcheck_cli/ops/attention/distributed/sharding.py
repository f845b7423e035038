"""How a sequence of n rows is split over the ranks of a context-parallel group (``distributed.sharding``):

- ``contiguous``: rank r holds rows [r n / ws, (r + 1) n / ws) (``np.array_split``: uneven lengths allowed, the
  first ranks one row longer), as ring attention and Ulysses shard a sequence;
- ``zigzag``: the sequence cut into 2 ws chunks, rank r holding chunks r and 2 ws - 1 - r (load balancing under a
  causal mask: every rank gets an early and a late chunk), lengths uneven when 2 ws does not divide n;
- ``ulysses``: contiguous rows (the all-to-all inside the code moves heads, not rows);
- ``per-document``: a packed batch (``varlen:``) with every document cut into 2 ws chunks, rank r holding chunks r and
  2 ws - 1 - r of each document, in document order (TransformerEngine's THD layout for context parallelism: every
  rank gets an early and a late part of every document).

Everything is index arithmetic on NumPy arrays: :func:`rows` gives each rank's global row indices (its
``q_positions``), :func:`shard` and :func:`gather` move an array along its sequence axis."""
from __future__ import annotations

import numpy as np

SHARDINGS = ("contiguous", "zigzag", "ulysses", "per-document")


def rows(n: int, world_size: int, sharding: str, cu_seqlens=None) -> list[np.ndarray]:
    """The global row indices each rank holds, in the order it holds them (int64); ``cu_seqlens``: the documents'
    offsets, for ``per-document``."""
    every = np.arange(n, dtype=np.int64)
    if sharding == "per-document":
        per_rank = [[] for _ in range(world_size)]
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            chunks = np.array_split(every[int(a):int(b)], 2 * world_size)
            for r in range(world_size):
                per_rank[r] += [chunks[r], chunks[2 * world_size - 1 - r]]
        return [np.concatenate(parts) for parts in per_rank]
    if sharding == "zigzag":
        chunks = np.array_split(every, 2 * world_size)
        return [np.concatenate([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size)]
    return list(np.array_split(every, world_size))


def shard(x: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    """The rows ``index`` of ``x`` along ``axis`` (a fresh, contiguous array)."""
    return np.ascontiguousarray(np.take(x, index, axis=axis))


def gather(parts: list[np.ndarray], indices: list[np.ndarray], axis: int, n: int) -> np.ndarray:
    """The ranks' ``parts`` put back at their global rows along ``axis`` (the inverse of :func:`shard`; the ranks'
    rows are every row once)."""
    first = parts[0]
    shape = list(first.shape)
    shape[axis] = n
    out = np.empty(shape, dtype=first.dtype)
    for part, index in zip(parts, indices):
        sl = [slice(None)] * out.ndim
        sl[axis] = index
        out[tuple(sl)] = part
    return out


def lse_shape(q_shape, axis: int, lse_axis: int) -> list[int]:
    """The LSE's shape beside q of ``q_shape`` (its sequence axis ``axis``: 2 in bhnd, 1 in bnhd): [B, H, n] with
    ``lse_axis`` 2 (lse_layout bhn), [B, n, H] with 1 (bnh)."""
    b, n, h = q_shape[0], q_shape[axis], q_shape[3 - axis]
    return [b, h, n] if lse_axis == 2 else [b, n, h]
