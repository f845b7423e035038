"""Recipes: attention variants of Hugging Face transformers checked as they are.

- Gemma 2's eager attention (``transformers.models.gemma2``): its ``eager_attention_forward`` with its own
  ``softcap`` argument (Gemma 2's ``attn_logit_softcapping``), which the tool passes when a scenario sets
  ``softcap:``; its additive float mask built from the tool's visible set.
- BLOOM's ALiBi (``transformers.models.bloom``): the library's ``build_alibi_tensor`` (its own slopes, from the
  head count, in BLOOM's column form m_h j) added to the scores by ``baddbmm`` as ``BloomAttention.forward`` does
  (the module itself fuses the projections and needs n_q = n_k: its score path is reproduced here line for line).

Both take their softmax in float32 whatever they are given: the scenarios are float32. Broken on purpose:
``gemma2_without_softcap`` (the config's cap lost: ``softcap=None``), ``bloom_distance_bias`` (BLOOM's tensor
where a FlashAttention kernel expects slopes for the distance form: the column form's m_h j used in place of
-m_h |i + n_k - n_q - j| without a causal mask). Tested with transformers 5.24."""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward


def _additive(visible, dtype):
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


def gemma2_attention(q, k, v, visible, scale, kv_map, *, softcap):  # contiguous KV groups
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, head_dim=q.shape[-1])
    out, _ = eager_attention_forward(module, q, k, v, _additive(visible, q.dtype), scaling=scale, softcap=softcap)
    return out.transpose(1, 2)  # the library returns [B, n, H, d]


def gemma2_without_softcap(q, k, v, visible, scale, kv_map, *, softcap):
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, head_dim=q.shape[-1])
    out, _ = eager_attention_forward(module, q, k, v, _additive(visible, q.dtype), scaling=scale, softcap=None)
    return out.transpose(1, 2)


def _bloom_scores(q, k, scale, kv_map, alibi):
    b, h, n_q, d = q.shape
    n_k = k.shape[2]
    scores = alibi.baddbmm(batch1=q.reshape(b * h, n_q, d), batch2=k[:, kv_map].reshape(b * h, n_k, d).transpose(1, 2),
                           beta=1.0, alpha=scale)
    return scores.view(b, h, n_q, n_k)


def bloom_attention(q, k, v, visible, scale, kv_map, *, alibi_slopes, alibi_form="distance"):
    """BloomAttention.forward's score path: the library's alibi (its own slopes) + scale q k^T, the mask added,
    softmax in float32."""
    b, h, _, _ = q.shape
    alibi = build_alibi_tensor(torch.ones(b, k.shape[2], dtype=torch.long), h, q.dtype)  # [B * H, 1, n_k]
    weights = _bloom_scores(q, k, scale, kv_map, alibi) + _additive(visible, q.dtype)
    return F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype) @ v[:, kv_map]


def bloom_distance_bias(q, k, v, visible, scale, kv_map, *, alibi_slopes):
    return bloom_attention(q, k, v, visible, scale, kv_map, alibi_slopes=alibi_slopes)
