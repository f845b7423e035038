"""Recipe: T5's relative position bias (``transformers.models.t5``) checked as the library computes it, its
embedding's weight (the table [buckets, heads]) an input whose gradient is checked end to end.

The tool passes the table as ``relative_attention_bias=`` when a scenario sets ``relative_bias:``; the recipe puts
it in place of the weight of a real ``T5Attention``'s ``relative_attention_bias`` embedding
(``torch.func.functional_call``), lets the library's own ``compute_bias`` bucket the positions, and runs T5's
``eager_attention_forward`` with that position bias and an additive mask built from the tool's visible set, at
T5's own scaling (1: T5 does not scale q k^T, so the scenarios say ``scale: 1.0``). The settings are T5-small's
(32 buckets, max distance 128); an encoder's attention is bidirectional, a decoder's not. The queries are the
last n_q positions of n_k (``past_seen_tokens = n_k - n_q``, as with a cache).

Broken on purpose: ``t5_bias_detached`` (the position bias computed from a detached weight, as code that builds
it once under ``torch.no_grad()`` would: the table gets no gradient) and ``t5_cache_offset_dropped``
(``compute_bias(n_q, n_k)`` without the cache's offset: the queries take positions 0..n_q-1). Tested with
transformers 5.24."""
import functools

import torch
from torch import nn
from transformers import T5Config
from transformers.models.t5.modeling_t5 import T5Attention, eager_attention_forward


class _PositionBias(nn.Module):
    """T5Attention.compute_bias as a module call, so that functional_call can swap the embedding's weight."""

    def __init__(self, attention: T5Attention):
        super().__init__()
        self.attention = attention

    def forward(self, n_q: int, n_k: int, past: int):
        return self.attention.compute_bias(n_q, n_k, past_seen_tokens=past)


@functools.cache
def _t5(heads: int, buckets: int, decoder: bool) -> _PositionBias:
    config = T5Config(d_model=8, d_kv=8, num_heads=heads, relative_attention_num_buckets=buckets,
                      relative_attention_max_distance=128, is_decoder=decoder, dropout_rate=0.0)
    return _PositionBias(T5Attention(config, has_relative_attention_bias=True, layer_idx=0).eval())


def _attention(q, k, v, visible, kv_map, table, decoder: bool, past=None, detach=False):
    n_q, n_k = q.shape[2], k.shape[2]
    module = _t5(q.shape[1], table.shape[0], decoder)
    weight = table.detach() if detach else table
    bias = torch.func.functional_call(module, {"attention.relative_attention_bias.weight": weight},
                                      (n_q, n_k, n_k - n_q if past is None else past))
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module.attention, q, k[:, kv_map], v[:, kv_map], mask,
                                     scaling=module.attention.scaling, position_bias=bias)
    return out.transpose(1, 2)  # the library returns [B, n, H, d]


def t5_encoder_attention(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    return _attention(q, k, v, visible, kv_map, relative_attention_bias, decoder=False)


def t5_decoder_attention(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    return _attention(q, k, v, visible, kv_map, relative_attention_bias, decoder=True)


def t5_bias_detached(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    return _attention(q, k, v, visible, kv_map, relative_attention_bias, decoder=False, detach=True)


def t5_cache_offset_dropped(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    return _attention(q, k, v, visible, kv_map, relative_attention_bias, decoder=True, past=0)
