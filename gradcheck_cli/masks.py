"""Visible sets: True at [b, h, i, j] means key j is visible to query i of batch b, query head h.

The visible set of a row is the AND of every constraint given (causal alignment, window, key
padding, an explicit array). Rows whose visible set is empty are not defined (A.10.2) and are
rejected by the scenario loader using :func:`first_empty_row`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CAUSAL = ("none", "upper-left", "lower-right")


def diagonal(n_q: int, n_k: int, causal: str, documents: Documents | None = None) -> np.ndarray:
    """Key index on the diagonal of each query row: i (upper-left) or i + n_k - n_q (otherwise).

    ``none`` uses the lower-right diagonal, as FlashAttention's ``window_size`` does. With ``documents``
    (a packed batch: (query lengths, key lengths) of the documents side by side) each document is aligned on its
    own: query i' of a document whose keys start at k0 has the diagonal k0 + i' (+ its L_k - L_q lower-right).
    """
    i = np.arange(n_q)
    if documents is not None:
        doc, q0, k0, lq, lk = document_layout(n_q, documents)
        local = i - q0[doc] + k0[doc]
        return local if causal == "upper-left" else local + (lk[doc] - lq[doc])
    return i if causal == "upper-left" else i + (n_k - n_q)


#: The documents of a packed batch: (the query lengths, the key lengths), one of each per document.
Documents = tuple[Sequence[int], Sequence[int]]


def document_layout(n: int, documents: Documents, keys: bool = False) -> tuple:
    """(the document of each of the n query rows, or key columns with ``keys``; each document's first query, first
    key, query count and key count)."""
    lq, lk = (np.asarray(x, dtype=np.int64) for x in documents)
    q0, k0 = np.concatenate([[0], np.cumsum(lq)[:-1]]), np.concatenate([[0], np.cumsum(lk)[:-1]])
    lengths = lk if keys else lq
    doc = np.repeat(np.arange(len(lengths)), lengths)[:n]
    return doc, q0, k0, lq, lk


def document_of(n: int, documents: Documents, keys: bool = False) -> np.ndarray:
    """The document each of the n query rows (key columns with ``keys``) belongs to."""
    return document_layout(n, documents, keys)[0]


def build_visible(batch: int, heads_q: int, n_q: int, n_k: int, *, causal: str = "none",
                  window: tuple[int | None, int | None] | None = None,
                  key_lengths: Sequence[int] | None = None,
                  explicit: np.ndarray | None = None, documents: Documents | None = None) -> np.ndarray:
    """The visible set, bool [batch, heads_q, n_q, n_k].

    causal: ``upper-left`` (j <= i), ``lower-right`` (j <= i + n_k - n_q) or ``none``.
    window: (left, right) around the diagonal; None on a side means unbounded.
    key_lengths: per batch element, keys j >= key_lengths[b] are padding.
    explicit: any bool array that broadcasts to [batch, heads_q, n_q, n_k].
    documents: a packed batch's (query lengths, key lengths): no document sees another, and the causal alignment
    and the window hold within each document (FlashAttention's varlen convention).
    """
    structured = blockwise(n_q, n_k, causal=causal, window=window, key_lengths=key_lengths,
                           documents=documents)(slice(None), slice(None))
    visible = np.broadcast_to(structured, (batch, heads_q, n_q, n_k)).copy()
    if explicit is not None:
        visible &= np.broadcast_to(explicit.astype(bool), visible.shape)
    return visible


def first_empty_row(visible: np.ndarray) -> tuple[int, int, int] | None:
    """(batch, head, row) of the first query row with no visible key, or None."""
    empty = ~visible.any(axis=-1)
    if not empty.any():
        return None
    b, h, i = np.argwhere(empty)[0]
    return int(b), int(h), int(i)


def row_constraints(n_q: int, n_k: int, b: int, h: int, i: int, *, causal: str = "none",
                    window: tuple[int | None, int | None] | None = None, key_lengths: Sequence[int] | None = None,
                    explicit: np.ndarray | None = None, documents: Documents | None = None) -> dict[str, np.ndarray]:
    """The keys each constraint given lets query row ``i`` (of batch ``b``, head ``h``) see, on its own: name ->
    bool [n_k] (the row's visible set is their AND). For the empty-row error, to name what hides the row."""
    j = np.arange(n_k)
    diag = int(diagonal(n_q, n_k, causal, documents)[i])
    out = {}
    if documents is not None:
        d = int(document_of(n_q, documents)[i])
        out[f"varlen: document {d}"] = document_of(n_k, documents, keys=True) == d
    if causal != "none":
        out[f"causal: {causal}"] = j <= diag
    if window is not None:
        left, right = window
        out[f"window: [{left}, {right}]"] = (j >= diag - left if left is not None else True) & (
            j <= diag + right if right is not None else True) & np.ones(n_k, dtype=bool)
    if key_lengths is not None:
        out[f"key_lengths[{b}] = {key_lengths[b]}"] = j < key_lengths[b]
    if explicit is not None:
        arr = np.asarray(explicit, dtype=bool)
        arr = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)  # it broadcasts to [batch, heads, n_q, n_k]
        row = arr[tuple(x if arr.shape[a] > 1 else 0 for a, x in enumerate((b, h, i)))]
        out["visible (the explicit array)"] = np.broadcast_to(row, (n_k,)).copy()
    return out


def kv_rows_seen(visible: np.ndarray, kv_map: np.ndarray, heads_kv: int) -> np.ndarray:
    """bool [batch, heads_kv, n_k]: key row j of KV head g is visible to some query of some head r
    with kv_map[r] == g."""
    seen_by_head = visible.any(axis=-2)  # [B, Hq, n_k]
    out = np.zeros(seen_by_head.shape[:1] + (heads_kv,) + seen_by_head.shape[2:], dtype=bool)
    for r, g in enumerate(kv_map):
        out[:, g] |= seen_by_head[:, r]
    return out


def blockwise(n_q: int, n_k: int, *, causal: str = "none", window: tuple[int | None, int | None] | None = None,
              key_lengths: Sequence[int] | None = None, documents: Documents | None = None):
    """The visible set of :func:`build_visible` without an explicit array, as a callable
    ``visible(rows, cols) -> bool [batch or 1, 1, len(rows), len(cols)]`` that builds one block at a
    time: the tiled engine then holds no n_q x n_k array at all (``benchmarks/bench_memory.py``)."""
    diag_all = diagonal(n_q, n_k, causal, documents)
    doc_q = None if documents is None else document_of(n_q, documents)
    doc_k = None if documents is None else document_of(n_k, documents, keys=True)
    lengths = None if key_lengths is None else np.asarray(key_lengths).reshape(-1, 1, 1, 1)

    def visible(rows: slice, cols: slice) -> np.ndarray:
        i = np.arange(n_q)[rows]
        j = np.arange(n_k)[cols][None, :]
        diag = diag_all[i][:, None]
        block = np.ones((len(i), j.shape[1]), dtype=bool)
        if doc_q is not None:
            block &= doc_q[i][:, None] == doc_k[j]
        if causal != "none":
            block &= j <= diag
        if window is not None:
            left, right = window
            if left is not None:
                block &= j >= diag - left
            if right is not None:
                block &= j <= diag + right
        block = block[None, None]
        if lengths is not None:
            block = block & (j[None, None] < lengths)
        return block
    return visible
