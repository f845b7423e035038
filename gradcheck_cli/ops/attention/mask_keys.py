"""Attention's mask keys (``mask: {causal, window, key_lengths, visible}``): their values, the visible set they
make, an explicit mask from a .npy file or an inline nested list, and the error for a query row that sees no key
(naming the key to blame)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ... import files, masks
from ...keys import Fields, show

MASK_KEYS = ("causal", "window", "key_lengths", "visible")


def read(f: Fields, batch: int, n_k: int) -> tuple:
    """``mask.causal``, ``mask.window`` and ``mask.key_lengths``: (causal, window or None, key_lengths or None)."""
    causal = "none" if f.raw("mask.causal") in (None, "none") else f.choice("mask.causal", masks.CAUSAL, "none")
    window = None
    if f.has("mask.window"):
        w = f.raw("mask.window")
        if not isinstance(w, list) or len(w) != 2:
            raise f.error("mask.window", f"expected [left, right], got {show(w)}",
                          hint="e.g. window: [4, 0]; null or -1 means unbounded on that side")
        sides = []
        for i, x in enumerate(w):
            if x is None or x == -1:
                sides.append(None)
            elif isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise f.doc.error(f.where("mask.window") + (i,), f"expected an integer >= 0, null or -1, got {show(x)}")
            else:
                sides.append(x)
        window = (sides[0], sides[1])
    key_lengths = f.int_list("mask.key_lengths", 0, n_k, "a key length")
    if key_lengths is not None and len(key_lengths) != batch:
        raise f.error("mask.key_lengths", f"has {len(key_lengths)} entries but batch is {batch}",
                      hint="give one valid-key count per batch element")
    return causal, window, key_lengths


def visible_set(f: Fields, base_dir, batch: int, heads_q: int, n_q: int, n_k: int, causal, window,
                key_lengths, documents=None) -> tuple:
    """The visible set [B, Hq, n_q, n_k] the mask keys (and ``mask.visible``) make, within each document of a
    packed batch (``documents``: ``varlen.Documents``), and the explicit array's source; a query row that sees no
    key is an error naming the key (and the document) to blame."""
    explicit, source = None, None
    if f.has("mask.visible"):
        explicit, source = _load_visible(f, base_dir, (batch, heads_q, n_q, n_k))
    pair = None if documents is None else documents.pair
    visible = masks.build_visible(batch, heads_q, n_q, n_k, causal=causal, window=window,
                                  key_lengths=key_lengths, explicit=explicit, documents=pair)
    empty = masks.first_empty_row(visible)
    if empty is not None:
        b, h, i = empty
        given = [k for k in ("mask.visible", "mask.key_lengths", "mask.window", "mask.causal") if f.has(k)]
        swept = [k for k in given if "sweep" in f.where(k)]
        message, hint, culprit = _empty_row(masks.row_constraints(n_q, n_k, b, h, i, causal=causal, window=window,
                                                                  key_lengths=key_lengths, explicit=explicit,
                                                                  documents=pair), b, h, i, n_q, n_k)
        if documents is not None:
            message, hint = _in_document(documents, i, causal, message, hint)
        blamed = culprit if culprit in given else (swept or given or [None])[0]
        raise f.doc.error(f.where(blamed) if blamed else f.path, message, hint=hint)

    return visible, source


def _in_document(documents, i: int, causal: str, message: str, hint: str) -> tuple[str, str]:
    """The empty-row error of a packed batch, naming the document (its queries outnumbering its keys under
    lower-right causal masking is the usual cause)."""
    d, local = documents.query(i)
    lq, lk = documents.seqlens_q[d], documents.seqlens_k[d]
    if causal == "lower-right" and lq > lk:
        return (f"{documents.describe(d)}: its query {local} (packed row {i}) sees no key: with more queries than "
                f"keys, causal: lower-right aligns the document's last query with its last key, so its first "
                + (f"{lq - lk} queries come" if lq - lk > 1 else "query comes") + " before every key",
                "give the document at least as many keys as queries (FlashAttention's varlen convention rejects "
                "nothing but leaves such rows undefined), or use causal: upper-left")
    return f"{documents.describe(d)}: its query {local}: " + message, hint


def _empty_row(allowed: dict, b: int, h: int, i: int, n_q: int, n_k: int) -> tuple[str, str, str | None]:
    """(message, hint, the mask key to blame or None) of the error for query row ``i`` seeing no key: the
    constraint that hides every key on its own, or the keys each allows when only their combination leaves none,
    with the remedy that fits."""
    alone = [name for name, keys in allowed.items() if not keys.any()]

    def keys(mask) -> str:
        idx = [int(j) for j, on in enumerate(mask) if on]
        if len(idx) == 1:
            return f"key {idx[0]}"
        return f"keys {idx[0]}-{idx[-1]}" if idx[-1] - idx[0] + 1 == len(idx) else f"keys {', '.join(map(str, idx))}"

    where = f"query row {i} of batch {b}, head {h} sees no key"
    if alone:
        name = alone[0]
        if name.startswith("causal"):
            why = (f"{name} alone hides every key of it: with n_q = {n_q} > n_k = {n_k} the lower-right diagonal "
                   f"of row {i} is key {i + n_k - n_q}" if "lower-right" in name else f"{name} alone hides every key")
            hint = ("with n_q > n_k, lower-right rows before the first key see nothing: use causal: upper-left, or "
                    "n_k >= n_q") if "lower-right" in name else "check the causal alignment"
        elif name.startswith("window"):
            why, hint = f"{name} alone hides every key of it", "widen the window"
        elif name.startswith("key_lengths"):
            why, hint = f"{name} alone hides every key", "every batch element needs a key: raise it to 1 or more"
        else:
            why, hint = (f"{name} has no True in this row", "give the explicit visible array at least one True in "
                         "every query row (True = key visible)")
        key = "mask." + next(k for k in ("causal", "window", "key_lengths", "visible") if name.startswith(k))
        return f"{where}: {why}", hint, key
    parts = "; ".join(f"{name} allows {keys(mask)}" for name, mask in allowed.items())
    return (f"{where}: each constraint leaves it some key, but not the same one ({parts})",
            "the row's visible set is the AND of the constraints: make them overlap (widen the window, raise "
            "key_lengths, or change the causal alignment)", None)


def _load_visible(f: Fields, base_dir: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    raw = f.raw("mask.visible")
    if isinstance(raw, str):
        path = base_dir / raw
        try:
            arr = files.load_npy(path, max_elements=math.prod(shape))
        except files.FileProblem as exc:
            raise f.error("mask.visible", f"{show(raw)} {exc}",
                          hint="give a .npy file of booleans, relative to the YAML file, written with "
                               "numpy.save(path, mask.astype(bool))") from None
        source = raw
    elif isinstance(raw, list):
        depth, inner = 0, raw
        while isinstance(inner, list) and depth <= 4:
            depth, inner = depth + 1, inner[0] if inner else None
        if depth > 4:
            raise f.error("mask.visible", "an inline mask is nested more than 4 lists deep; a mask has at most 4 "
                                          "dimensions ([batch, heads_q, n_q, n_k])")
        try:
            arr = np.array(raw)
        except ValueError:
            raise f.error("mask.visible", "inline mask rows must all have the same length") from None
        source = "inline"
    else:
        raise f.error("mask.visible", f"expected a .npy path or a nested list of booleans, got {show(raw)}")
    if arr.ndim > 4:
        raise f.error("mask.visible", f"has {arr.ndim} dimensions; a mask has at most 4 ([batch, heads_q, n_q, n_k])")
    if arr.dtype != bool:
        if arr.dtype.kind in "iu" and arr.size and np.isin(arr, (0, 1)).all():
            arr = arr.astype(bool)
        else:
            raise f.error("mask.visible", f"expected booleans (True = visible) or the integers 0 and 1, got dtype "
                                          f"{arr.dtype}" + (" with other values" if arr.dtype.kind in "iu" else ""))
    try:
        np.broadcast_shapes(arr.shape, shape)
        if np.broadcast_shapes(arr.shape, shape) != shape:
            raise ValueError
    except ValueError:
        raise f.error("mask.visible", f"shape {list(arr.shape)} does not broadcast to "
                      f"[batch, heads_q, n_q, n_k] = {list(shape)}",
                      hint="use [n_q, n_k] or a shape broadcastable to [batch, heads_q, n_q, n_k]") from None
    return arr, source
