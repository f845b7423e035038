"""The calling convention of a user's attention implementation, and of a layer's mask (projections, block)
(the ``convention:`` scenario keys, docs/your-code.md "Checking your own implementation"): the layout of q, k, v
and o, how the mask is passed, and whether the scale is. The engines for user code (attention's ``user`` and
``torch_engine``, and ``user_engine`` for a layer's mask) keep the tool's layout and visible
set throughout and convert only around each call, so everything after the call (checks, reports)
is in the tool's layout: q [B, Hq, n_q, d], a boolean visible set [B, Hq, n_q, n_k], True = visible.

Works on NumPy arrays (numpy and JAX flavours: the JAX wrapper converts them) and on torch tensors."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

#: The values of each key; the first is the default.
LAYOUTS = ("bhnd", "bnhd")
MASKS = ("keep", "drop", "additive", "additive-min")
MASK_HEADS = ("per-head", "shared")
SCALES = ("passed", "omitted")
#: How a log-sum-exp output is laid out (``outputs: [o, lse]``), whatever the layout of q, k, v and o.
LSE_LAYOUTS = ("bhn", "bnh")
#: The named values of ``kv_map`` (besides a list of KV head indices).
KV_LAYOUTS = ("contiguous", "interleaved")

#: What each value means, for messages and the schema.
MEANING = {
    ("layout", "bhnd"): "q, k, v and o as [B, H, n, d] (SDPA's)",
    ("layout", "bnhd"): "q, k, v and o as [B, n, H, d] (flash-attn's and JAX's (batch, seq, heads, dim))",
    ("mask", "keep"): "a boolean mask, True = key visible (SDPA's boolean attn_mask)",
    ("mask", "drop"): "a boolean mask, True = key hidden (torch.nn.MultiheadAttention's boolean masks)",
    ("mask", "additive"): "a float mask added to the scores: 0 visible, -inf hidden",
    ("mask", "additive-min"): "a float mask added to the scores: 0 visible, finfo(dtype).min hidden "
                              "(HF transformers')",
    ("mask_heads", "per-head"): "the mask as [B, Hq, n_q, n_k]",
    ("mask_heads", "shared"): "one mask for every head, [B, 1, n_q, n_k]",
    ("scale", "passed"): "the scale is passed after the mask",
    ("scale", "omitted"): "no scale argument: the implementation uses 1/sqrt(d_head) itself",
    ("lse_layout", "bhn"): "with outputs: [o, lse], lse as [B, H, n_q] (FlashAttention's softmax_lse, xformers', "
                           "torch's flash kernel's), in either layout",
    ("lse_layout", "bnh"): "with outputs: [o, lse], lse as [B, n_q, H] (jax.nn.dot_product_attention's "
                           "return_residual)",
}


@dataclass(frozen=True)
class Convention:
    """How the implementation is called: forward(q, k, v, mask[, scale], kv_map) in ``layout``."""
    layout: str = LAYOUTS[0]
    mask: str = MASKS[0]
    mask_heads: str = MASK_HEADS[0]
    scale: str = SCALES[0]
    lse_layout: str = LSE_LAYOUTS[0]

    def lse_swapped(self) -> bool:
        """Whether the code's LSE has its head and row axes the other way round from its O's (without d)."""
        return self.layout[1:3] != self.lse_layout[1:3]

    def names(self) -> tuple[str, ...]:
        """The names of the forward's arguments, in order."""
        return ("q", "k", "v", "visible") + (("scale",) if self.scale == "passed" else ()) + ("kv_map",)

    def tensor(self, x):
        """``x`` (q, k, v, o, a gradient) moved between the tool's layout and the implementation's (the
        same swap both ways)."""
        if self.layout == "bhnd":
            return x
        swapped = x.swapaxes(1, 2)
        return np.ascontiguousarray(swapped) if isinstance(swapped, np.ndarray) else swapped.contiguous()

    def shape(self, shape: tuple) -> tuple:
        """A tensor's shape in the implementation's layout."""
        shape = tuple(shape)
        return shape if self.layout == "bhnd" else (shape[0], shape[2], shape[1]) + shape[3:]

    def mask_of(self, visible, dtype, lowest: float | None = None):
        """The tool's visible set (boolean, [B, Hq, n_q, n_k], True = visible) as the implementation takes
        it; a float mask in ``dtype`` (a NumPy dtype for arrays, a torch dtype for tensors, then with
        ``lowest``, its finfo.min)."""
        m = visible[:, :1] if self.mask_heads == "shared" else visible
        if self.mask == "keep":
            return m
        if self.mask == "drop":
            return ~m
        numpy = isinstance(m, np.ndarray)
        if self.mask == "additive":
            fill = -math.inf
        else:
            fill = _lowest(dtype) if lowest is None else lowest
        if numpy:
            return np.where(m, 0.0, fill).astype(dtype)
        return m.new_zeros(tuple(m.shape), dtype=dtype).masked_fill(~m, fill)  # a torch tensor

    def arguments(self, q, k, v, visible, scale, kv_map, dtype, lowest: float | None = None) -> tuple:
        """The forward's arguments, from the tool's (visible: its boolean visible set)."""
        scale_arg = (scale,) if self.scale == "passed" else ()
        return ((self.tensor(q), self.tensor(k), self.tensor(v), self.mask_of(visible, dtype, lowest)) + scale_arg
                + (kv_map,))

    def changes(self) -> dict[str, str]:
        """The keys set to other than their default."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def alternatives(self):
        """(key, value, convention) for every convention that differs from this one in one key."""
        for key, values in (("layout", LAYOUTS), ("mask", MASKS), ("mask_heads", MASK_HEADS), ("scale", SCALES)):
            for value in values:
                if value != getattr(self, key):
                    yield key, value, replace(self, **{key: value})


def _lowest(dtype) -> float:
    """finfo(dtype).min of a NumPy dtype, bfloat16 (ml_dtypes', which np.finfo does not know) included."""
    try:
        return float(np.finfo(dtype).min)
    except ValueError:
        import ml_dtypes
        return float(ml_dtypes.finfo(dtype).min)


def default_kv_map(heads_q: int, heads_kv: int) -> tuple[int, ...]:
    """Contiguous groups: query head r reads KV head r // (heads_q / heads_kv) (``repeat_kv``'s)."""
    group = heads_q // heads_kv
    return tuple(r // group for r in range(heads_q))


def interleaved_kv_map(heads_q: int, heads_kv: int) -> tuple[int, ...]:
    """Query head r reads KV head r % heads_kv (KV heads tiled, ``k.repeat(1, heads_q // heads_kv, 1, 1)``)."""
    return tuple(r % heads_kv for r in range(heads_q))


def shared_mask_problem(visible: np.ndarray) -> tuple[int, int, int] | None:
    """(batch, head, query row) of the first row whose visible set differs from head 0's; None when every
    head sees the same keys (one [B, 1, n_q, n_k] mask can carry it)."""
    differs = (visible != visible[:, :1]).any(axis=-1)
    if not differs.any():
        return None
    return tuple(int(i) for i in np.argwhere(differs)[0])


def applies(convention: Convention, sc) -> bool:
    """Whether ``convention`` can describe scenario ``sc`` (a shared mask needs every head to see the same
    keys; an omitted scale needs the default 1/sqrt(d_head))."""
    if convention.mask_heads == "shared" and shared_mask_problem(sc.visible) is not None:
        return False
    return convention.scale == "passed" or sc.scale == 1.0 / math.sqrt(sc.d_head)


def setting(key: str, value: str) -> str:
    """How a scenario sets ``key`` to ``value``."""
    return f"convention: {{{key}: {value}}}"
