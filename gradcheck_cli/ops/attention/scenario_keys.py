"""The keys of the ops with attention's block structure, read by the op itself (``Op.shared_keys``): heads and
their KV map, the sizes, the scale, the masks (``mask_keys``), the rows of the loss and the implementation's
calling convention; their JSON Schema. Each error names the file, line and key (``keys.Fields``)."""
from __future__ import annotations

import math
from pathlib import Path

from ... import masks
from ...keys import Fields, show
from ..convention import (
    KV_LAYOUTS,
    LAYOUTS,
    LSE_LAYOUTS,
    MASK_HEADS,
    MASKS,
    MEANING,
    SCALES,
    Convention,
    default_kv_map,
    interleaved_kv_map,
    shared_mask_problem,
)
from ..registry import KeyGroup
from . import mask_keys, varlen

#: The top-level keys (``mask`` and ``convention`` are mappings of ``NESTED``'s keys).
KEYS = ("heads_q", "heads_kv", "kv_map", "n_q", "n_k", "d_head", "d_value", "scale", "mask", "loss_rows", "varlen")
MASK_KEYS = mask_keys.MASK_KEYS
#: The calling convention of an attention implementation (``ops.convention``), with an implementation only.
CONVENTION_KEYS = ("layout", "mask", "mask_heads", "scale", "lse_layout")
NESTED = {"mask": MASK_KEYS, "convention": CONVENTION_KEYS, "varlen": varlen.NESTED}
#: The keys only op attention takes (a packed batch's documents: its user interface passes cu_seqlens).
ATTENTION_ONLY = ("varlen",)
#: Larger scales only saturate the softmax (and overflow the logits near 1e300).
MAX_SCALE = 1e6


def read(f: Fields, batch: int) -> dict:
    """The keys' values, before anything of their size is allocated: the Scenario fields they give, with
    ``kv_map`` None when it is given by name (``kv_layout``; ``build`` makes it)."""
    heads_q = f.int("heads_q", 1)
    documents = varlen.read(f, batch)  # a packed batch: n_q and n_k are its totals
    n_q = f.int("n_q", None if documents is None else sum(documents.seqlens_q))
    n_k = f.int("n_k", n_q if documents is None else sum(documents.seqlens_k))
    d_head = f.int("d_head")
    d_value = f.int("d_value", d_head)
    heads_kv, kv_map, kv_layout = _heads(f, heads_q)
    scale = f.float("scale", 1.0 / math.sqrt(d_head), positive=False)
    if scale == 0 or abs(scale) > MAX_SCALE:
        raise f.error("scale", f"must be non-zero and within +-{MAX_SCALE:g}, got {scale:g}",
                      hint="omit it for 1/sqrt(d_head)")
    causal, window, key_lengths = mask_keys.read(f, batch, n_k)
    loss_rows = f.int_list("loss_rows", 0, n_q - 1, "a query row", unique=True)
    return {"heads_q": heads_q, "heads_kv": heads_kv, "kv_map": kv_map, "kv_layout": kv_layout, "n_q": n_q,
            "n_k": n_k, "d_head": d_head, "d_value": d_value, "scale": scale, "causal": causal, "window": window,
            "key_lengths": key_lengths, "loss_rows": loss_rows, "documents": documents}


def build(f: Fields, read: dict, batch: int, base_dir: Path, op_spec) -> dict:
    """What the keys describe, once the memory check passed: the KV map by name, the visible set
    [B, Hq, n_q, n_k] (a row that sees no key is an error naming the key to blame) and the convention. The
    Scenario fields, ``read``'s with these."""
    out = {k: v for k, v in read.items() if k != "kv_layout"}
    if out["kv_map"] is None:
        out["kv_map"] = (interleaved_kv_map if read["kv_layout"] == "interleaved" else default_kv_map)(
            read["heads_q"], read["heads_kv"])
    out["kv_map"] = tuple(out["kv_map"])
    out["visible"], out["visible_source"] = mask_keys.visible_set(f, base_dir, batch, read["heads_q"], read["n_q"],
                                                         read["n_k"], read["causal"], read["window"],
                                                         read["key_lengths"], read["documents"])
    out["convention"] = _convention(f, out["visible"], read["scale"], read["d_head"], op_spec)
    return out


def sizes(read: dict, batch: int) -> tuple[str, str]:
    """What the memory estimate counts, and the keys that reduce it (the loader's error when it is too much)."""
    return (f"{batch}x{read['heads_q']}x{read['n_q']}x{read['n_k']} score blocks, d_head={read['d_head']}, "
            f"d_value={read['d_value']}", "batch, heads, n_q, n_k or the head dimensions")


def takes(op_spec) -> tuple[str, ...]:
    """The keys that apply to an op: ``KEYS``, and ``convention`` where its implementation takes one
    (``Interface.conventions``: attention's, not the layers')."""
    conventions = op_spec.implementation is not None and bool(op_spec.implementation.conventions)
    keys = KEYS if op_spec.name == "attention" else tuple(k for k in KEYS if k not in ATTENTION_ONLY)
    return keys + (("convention",) if conventions else ())


def _heads(f: Fields, heads_q: int) -> tuple:
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


def _kv_layout(f: Fields) -> str:
    """``kv_map`` given by name: contiguous (the default) or interleaved."""
    if f.has("kv_map") and f.raw("kv_map") not in KV_LAYOUTS:
        raise f.error("kv_map", f"expected a list of KV head indices or one of {', '.join(KV_LAYOUTS)}; got "
                      f"{show(f.raw('kv_map'))}", hint="contiguous: query head r reads KV head r // (heads_q / "
                      "heads_kv) (repeat_kv's); interleaved: r % heads_kv (k.repeat(...)'s)")
    return f.raw("kv_map", KV_LAYOUTS[0])


def _convention(f: Fields, visible, scale: float, d_head: int, op_spec) -> Convention:
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
    values = {"layout": LAYOUTS, "mask": MASKS, "mask_heads": MASK_HEADS, "scale": SCALES, "lse_layout": LSE_LAYOUTS}
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


def schema() -> dict:
    """The keys' JSON Schema (``attn-gradcheck schema`` adds it to the common keys')."""
    pos = {"type": "integer", "minimum": 1}
    ints = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    side = {"oneOf": [{"type": "null"}, {"type": "integer", "minimum": -1}]}
    number = {"oneOf": [{"type": "number"}, {"type": "string"}]}
    mask = {"type": "object", "additionalProperties": False, "properties": {
        "causal": {"enum": list(masks.CAUSAL) + [None],
                   "description": "upper-left: j <= i; lower-right: j <= i + n_k - n_q"},
        "window": {"type": "array", "items": side, "minItems": 2, "maxItems": 2,
                   "description": "(left, right) around the diagonal, as FlashAttention's window_size"},
        "key_lengths": {**ints, "description": "valid keys per batch element"},
        "visible": {"oneOf": [{"type": "string"}, {"type": "array"}],
                    "description": ".npy path (relative to the YAML) or nested list; True = visible"}}}
    described = lambda key, values: {"enum": list(values), "description": "; ".join(  # noqa: E731
        f"{v}: {MEANING[key, v]}" for v in values) + f" (default {values[0]})"}
    convention = {"type": "object", "additionalProperties": False,
                  "description": "how your attention implementation takes its arguments (with implementation)",
                  "properties": {"layout": described("layout", LAYOUTS), "mask": described("mask", MASKS),
                                 "mask_heads": described("mask_heads", MASK_HEADS),
                                 "scale": described("scale", SCALES),
                                 "lse_layout": described("lse_layout", LSE_LAYOUTS)}}
    kv_map = {"oneOf": [ints, {"enum": list(KV_LAYOUTS)}],
              "description": "KV head of each query head, or contiguous (r // (heads_q / heads_kv), the default) "
                             "or interleaved (r % heads_kv)"}
    return {"convention": convention, "heads_q": pos, "heads_kv": pos, "kv_map": kv_map, "n_q": pos, "n_k": pos,
            "d_head": pos, "d_value": pos, "scale": number, "mask": mask, "loss_rows": ints, "varlen": varlen.schema()}


#: The keys the ops with attention's blocks share (attention, its projections, the block).
KEY_GROUP = KeyGroup(name="attention", keys=KEYS + ("convention",), nested=NESTED, read=read, build=build,
                     sizes=sizes, takes=takes, schema=schema, whole=(varlen.KEY,),
                     summary="the attention keys (heads_q, heads_kv, kv_map, n_q, n_k, d_head, d_value, scale, "
                             "mask, loss_rows)")
