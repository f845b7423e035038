"""The ``mask.visible`` key: an explicit mask, from a .npy file or an inline nested list."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .. import files
from .fields import _Fields
from .yaml_lines import _show


def _load_visible(f: _Fields, base_dir: Path, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
    raw = f.raw("mask.visible")
    if isinstance(raw, str):
        path = base_dir / raw
        try:
            arr = files.load_npy(path, max_elements=math.prod(shape))
        except files.FileProblem as exc:
            raise f.error("mask.visible", f"{_show(raw)} {exc}",
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
        raise f.error("mask.visible", f"expected a .npy path or a nested list of booleans, got {_show(raw)}")
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

