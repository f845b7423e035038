"""How a sequence of n rows is split over the ranks of a context-parallel group (``distributed.sharding``):

- ``contiguous``: rank r holds rows [r n / ws, (r + 1) n / ws) (``np.array_split``: uneven lengths allowed, the
  first ranks one row longer), as ring attention and Ulysses shard a sequence;
- ``zigzag``: the sequence cut into 2 ws chunks, rank r holding chunks r and 2 ws - 1 - r (load balancing under a
  causal mask: every rank gets an early and a late chunk), lengths uneven when 2 ws does not divide n;
- ``ulysses``: contiguous rows (the all-to-all inside the code moves heads, not rows).

Everything is index arithmetic on NumPy arrays: :func:`rows` gives each rank's global row indices (its
``q_positions``), :func:`shard` and :func:`gather` move an array along its sequence axis."""
from __future__ import annotations

import numpy as np

SHARDINGS = ("contiguous", "zigzag", "ulysses")


def rows(n: int, world_size: int, sharding: str) -> list[np.ndarray]:
    """The global row indices each rank holds, in the order it holds them (int64)."""
    every = np.arange(n, dtype=np.int64)
    if sharding == "zigzag":
        chunks = np.array_split(every, 2 * world_size)
        return [np.concatenate([chunks[r], chunks[2 * world_size - 1 - r]]) for r in range(world_size)]
    return list(np.array_split(every, world_size))


def shard(x: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    """The rows ``index`` of ``x`` along ``axis`` (a fresh, contiguous array)."""
    return np.ascontiguousarray(np.take(x, index, axis=axis))


def gather(parts: list[np.ndarray], indices: list[np.ndarray], axis: int, n: int) -> np.ndarray:
    """The ranks' ``parts`` put back at their global rows along ``axis`` (the inverse of :func:`shard`)."""
    first = parts[0]
    shape = list(first.shape)
    shape[axis] = n
    out = np.zeros(shape, dtype=first.dtype)
    for part, index in zip(parts, indices):
        sl = [slice(None)] * out.ndim
        sl[axis] = index
        out[tuple(sl)] = part
    return out
