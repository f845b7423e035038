"""The keys of the ops with attention's block structure (heads and their KV map, masks, the implementation's
convention): their checks, each with its file, line and key (``parse`` reads them)."""
from __future__ import annotations

import math

from .. import masks
from ..ops.convention import (
    KV_LAYOUTS,
    LAYOUTS,
    MASK_HEADS,
    MASKS,
    SCALES,
    Convention,
    shared_mask_problem,
)
from .fields import _Fields
from .visible import _load_visible
from .yaml_lines import _Doc, _show


def _heads(f: _Fields, heads_q: int) -> tuple:
    """``heads_kv`` and ``kv_map``: (heads_kv, the explicit map or None, its layout by name or None). A map by
    name is built after the memory check (heads_q may be absurd)."""
    kv_layout = None
    if f.has("kv_map") and not isinstance(f.raw("kv_map"), str):
        kv_map = f.int_list("kv_map", 0, heads_q - 1, "a KV head index (every KV head serves a query head, so "
                                                      "there are at most heads_q of them)")
        if len(kv_map) != heads_q:
            raise f.error("kv_map", f"has {len(kv_map)} entries but heads_q is {heads_q}",
                          hint="give one KV head index per query head")
        heads_kv = f.int("heads_kv", max(kv_map) + 1)
        bad = [g for g in kv_map if g >= heads_kv]
        if bad:
            raise f.error("kv_map", f"KV head {bad[0]} is out of range for heads_kv={heads_kv}",
                          hint=f"use indices 0..{heads_kv - 1} or raise heads_kv")
        if heads_kv > heads_q:  # checked before anything of size heads_kv is built
            raise f.error("heads_kv", f"{heads_kv} KV heads for {heads_q} query heads: some KV head would serve no "
                          "query head", hint="every KV head must serve at least one query head; lower heads_kv")
        unused = sorted(set(range(heads_kv)) - set(kv_map))
        if unused:
            raise f.error("kv_map", f"KV head {unused[0]} of heads_kv={heads_kv} is read by no query head",
                          hint="every KV head must serve at least one query head; lower heads_kv")
    else:
        kv_layout = _kv_layout(f)
        heads_kv = f.int("heads_kv", heads_q)
        if heads_q % heads_kv:
            raise f.error("heads_kv", f"{heads_kv} does not divide heads_q={heads_q}",
                          hint="use a divisor of heads_q, or give an explicit kv_map")
        kv_map = None  # built after the memory check (heads_q may be absurd)

    return heads_kv, kv_map, kv_layout


def _mask_keys(doc: _Doc, f: _Fields, batch: int, n_k: int) -> tuple:
    """``mask.causal``, ``mask.window`` and ``mask.key_lengths``: (causal, window or None, key_lengths or None)."""
    causal = "none" if f.raw("mask.causal") in (None, "none") else f.choice("mask.causal", masks.CAUSAL, "none")
    window = None
    if f.has("mask.window"):
        w = f.raw("mask.window")
        if not isinstance(w, list) or len(w) != 2:
            raise f.error("mask.window", f"expected [left, right], got {_show(w)}",
                          hint="e.g. window: [4, 0]; null or -1 means unbounded on that side")
        sides = []
        for i, x in enumerate(w):
            if x is None or x == -1:
                sides.append(None)
            elif isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise doc.error(f.where("mask.window") + (i,), f"expected an integer >= 0, null or -1, got {_show(x)}")
            else:
                sides.append(x)
        window = (sides[0], sides[1])
    key_lengths = f.int_list("mask.key_lengths", 0, n_k, "a key length")
    if key_lengths is not None and len(key_lengths) != batch:
        raise f.error("mask.key_lengths", f"has {len(key_lengths)} entries but batch is {batch}",
                      hint="give one valid-key count per batch element")
    return causal, window, key_lengths


def _visible_set(doc: _Doc, f: _Fields, base_dir, batch: int, heads_q: int, n_q: int, n_k: int, causal, window,
                 key_lengths) -> tuple:
    """The visible set [B, Hq, n_q, n_k] the mask keys (and ``mask.visible``) make, and the explicit array's
    source; a query row that sees no key is an error naming the key to blame."""
    explicit, source = None, None
    if f.has("mask.visible"):
        explicit, source = _load_visible(f, base_dir, (batch, heads_q, n_q, n_k))
    visible = masks.build_visible(batch, heads_q, n_q, n_k, causal=causal, window=window,
                                  key_lengths=key_lengths, explicit=explicit)
    empty = masks.first_empty_row(visible)
    if empty is not None:
        b, h, i = empty
        given = [k for k in ("mask.visible", "mask.key_lengths", "mask.window", "mask.causal") if f.has(k)]
        swept = [k for k in given if "sweep" in f.where(k)]
        message, hint, culprit = _empty_row(masks.row_constraints(n_q, n_k, b, h, i, causal=causal, window=window,
                                                                  key_lengths=key_lengths, explicit=explicit), b, h,
                                            i, n_q, n_k)
        blamed = culprit if culprit in given else (swept or given or [None])[0]
        raise doc.error(f.where(blamed) if blamed else f.path, message, hint=hint)

    return visible, source


def _conventions(op_spec) -> bool:
    """Whether ``convention:`` applies to an op (``Interface.conventions``: attention's implementations, and
    the mask keys for the layers')."""
    return op_spec.implementation is not None and bool(op_spec.implementation.conventions)


def _kv_layout(f: _Fields) -> str:
    """``kv_map`` given by name: contiguous (the default) or interleaved."""
    if f.has("kv_map") and f.raw("kv_map") not in KV_LAYOUTS:
        raise f.error("kv_map", f"expected a list of KV head indices or one of {', '.join(KV_LAYOUTS)}; got "
                      f"{_show(f.raw('kv_map'))}", hint="contiguous: query head r reads KV head r // (heads_q / "
                      "heads_kv) (repeat_kv's); interleaved: r % heads_kv (k.repeat(...)'s)")
    return f.raw("kv_map", KV_LAYOUTS[0])


def _convention(f: _Fields, visible, scale: float, d_head: int, op_spec) -> Convention:
    """The ``convention`` keys: how an implementation takes its arguments (``ops.convention``); an
    op takes those its interface names (``Interface.conventions``)."""
    given = [key for key in f.values if key.startswith("convention.") and f.has(key)]
    if not given:
        return Convention()
    takes = op_spec.implementation.conventions if op_spec.implementation else ()
    for key in given:
        if key.split(".", 1)[1] not in takes:
            raise f.error(key, f"does not apply to op {op_spec.name}: its implementation takes "
                          + (f"convention: {{{', '.join(takes)}}} only" if takes else "no convention keys"),
                          hint="the layout and the scale are attention's: a layer gets x and its weights")
    if not f.has("implementation"):
        for key in given:
            if f.where(key)[0] != "defaults":
                raise f.error(key, "applies to a scenario with an implementation: it says how your code takes its "
                              "arguments", hint="remove it, or add 'implementation: module:attribute'")
        return Convention()
    values = {"layout": LAYOUTS, "mask": MASKS, "mask_heads": MASK_HEADS, "scale": SCALES}
    convention = Convention(**{key: f.choice(f"convention.{key}", choices, choices[0])
                               for key, choices in values.items()})
    if convention.mask_heads == "shared":
        row = shared_mask_problem(visible)
        if row is not None:
            b, h, i = row
            raise f.error("convention.mask_heads", f"shared passes one mask [B, 1, n_q, n_k] for every head, but the "
                          f"visible set differs between heads (batch {b}, head {h}, query row {i} sees other keys "
                          "than head 0)", hint="use mask_heads: per-head, or a mask the same for every head")
    if convention.scale == "omitted" and f.has("scale") and scale != 1.0 / math.sqrt(d_head):
        raise f.error("convention.scale", f"omitted means the implementation uses 1/sqrt(d_head) = "
                      f"{1 / math.sqrt(d_head):.6g} itself, but the scenario's scale is {scale:g}",
                      hint="remove scale, or use convention: {scale: passed}")
    return convention


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
