"""What travels to the ranks: the finite differences' perturbed copies of an input, compactly. A call's array
``x`` [C * B, ...] holds C copies of a [B, ...] input that differ from each other in a few entries (the perturbed
ones); :func:`pack` sends the first copy and the entries where the others differ from it (:class:`Packed`), and the
rank rebuilds the very same array before the code sees it (:func:`unpack`). An array whose copies differ in many
entries travels as it is. Sent as is, the copies were most of a check's time: 8.7 GB pickled through the pipes for
one world-size-4 check at n = 256 (python benchmarks/bench_distributed.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Above this share of differing entries, an array travels as it is.
DENSE = 1 / 8


@dataclass(frozen=True)
class Packed:
    """C copies of ``first`` [B, ...] along axis 0, with ``values`` at the flat positions ``at`` of the whole."""
    first: np.ndarray
    copies: int
    at: np.ndarray
    values: np.ndarray

    @property
    def shape(self) -> tuple:
        return (self.copies * self.first.shape[0],) + self.first.shape[1:]

    def unpack(self) -> np.ndarray:
        x = np.empty((self.copies * self.first.shape[0],) + self.first.shape[1:], dtype=self.first.dtype)
        x.reshape((self.copies,) + self.first.shape)[...] = self.first
        x.reshape(-1)[self.at] = self.values
        return x


def differing(x: np.ndarray, batch: int) -> tuple | None:
    """(the positions of ``x`` [C * B, ...] where its copies differ from the first, as index arrays per axis, and the
    values there), found once per call for every rank's :func:`pack`; None when the copies are not worth packing (one
    copy, or many differences)."""
    c = x.shape[0] // batch if batch else 0
    if c < 2 or x.shape[0] != c * batch:
        return None
    copies = x.reshape((c, batch) + x.shape[1:])
    # != is True for NaN against NaN: such an entry travels as a value, and comes back as the same NaN
    at = np.flatnonzero(copies[1:] != copies[:1]) + x[:batch].size
    if at.size > DENSE * x.size:
        return None
    where = np.unravel_index(at, x.shape)
    return where, x[where]


def pack(x: np.ndarray, batch: int, moved: tuple | None, rows: np.ndarray, axis: int):
    """Rows ``rows`` along ``axis`` of ``x`` [C * B, ...] (a rank's shard), packed when ``moved`` (:func:`differing`)
    says so; a fresh contiguous array otherwise."""
    if moved is None:
        return np.ascontiguousarray(np.take(x, rows, axis=axis))
    where, values = moved
    local = np.full(x.shape[axis], -1, dtype=np.int64)  # global row -> its place on this rank
    local[rows] = np.arange(rows.size)
    mine = local[where[axis]] >= 0
    place = [w[mine] for w in where]
    place[axis] = local[place[axis]]
    shape = list(x.shape)
    shape[axis] = rows.size
    first = np.ascontiguousarray(np.take(x[:batch], rows, axis=axis))
    return Packed(first, x.shape[0] // batch, np.ravel_multi_index(tuple(place), shape), values[mine])


def unpack(message):
    """A call with its packed arrays (top level, and in its ``kwargs``) rebuilt."""
    if not isinstance(message, dict):
        return message
    out = {k: v.unpack() if isinstance(v, Packed) else v for k, v in message.items()}
    if isinstance(out.get("kwargs"), dict):
        out["kwargs"] = unpack(out["kwargs"])
    return out
