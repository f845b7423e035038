"""The space ``attn-gradcheck hunt`` searches around an attention scenario (``Op.space``), as data: sizes with the
block edges and primes kernels break at, n_q != n_k, head layouts and GQA ratios, every mask kind, padding,
windows, the softmax scale, float64 and float32, and the values of the variants the scenario uses. Keys whose
values fix the sizes (a mask file, a packed batch, a bias of a given shape) keep those sizes."""
from __future__ import annotations

from ..registry import HEAD_EDGES, SIZE_EDGES, Axis

#: Keys that fix the number of query heads (and so the KV heads and the group); '[]': only a list of values does
#: (a named layout or slope rule does not).
HEADS_FIXED = ("kv_map[]", "sinks.values", "bias.shape", "bias.values", "alibi.slopes[]")
#: Keys that fix the query rows, the keys, or both.
ROWS_FIXED = ("mask.visible", "varlen", "loss_rows", "bias.shape", "bias.values")
KEYS_FIXED = ("mask.visible", "varlen", "bias.shape", "bias.values")

AXES = (
    Axis("dtype", "choice", choices=("float64", "float32")),
    Axis("batch", low=1, high=4, fixed_by=("varlen", "mask.visible", "bias.shape", "bias.values")),
    Axis("heads_kv", low=1, high=4, fixed_by=HEADS_FIXED),
    Axis("group", low=1, high=8, edges=(1, 2, 3, 4, 8), fixed_by=HEADS_FIXED),
    Axis("n_q", low=1, high=300, edges=SIZE_EDGES, fixed_by=ROWS_FIXED),
    Axis("n_k", low=1, high=300, edges=SIZE_EDGES, fixed_by=KEYS_FIXED),
    Axis("d_head", low=1, high=256, edges=HEAD_EDGES),
    Axis("d_value", low=1, high=256, edges=HEAD_EDGES, when_set=True),
    Axis("mask.causal", "choice", choices=(None, "upper-left", "lower-right"), fixed_by=("mask.visible",)),
    Axis("mask.window", "window", of="n_k", fixed_by=("mask.visible",)),
    Axis("mask.key_lengths", "lengths", of="n_k", fixed_by=("mask.visible", "varlen")),
    Axis("scale", "choice", choices=(None, 0.5, 1.0, 4.0, 16.0, 64.0), fixed_by=("convention.scale",)),
    Axis("softcap", "choice", choices=(50.0, 30.0, 5.0, 1.0), when_set=True),
)
