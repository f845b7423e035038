"""Recipe: a packed batch as Hugging Face transformers builds it for SDPA, checked as it is.

transformers packs sequences without padding by restarting ``position_ids`` at 0 for each one (its data
collators' ``return_position_ids`` / ``DataCollatorWithFlattening``); ``masking_utils.find_packed_sequence_indices``
finds the sequences from the restarts, ``packed_sequence_mask_function`` and ``causal_mask_function`` (ANDed by
``and_masks``) make the block-causal mask, ``sdpa_mask`` materialises it, and
``integrations.sdpa_attention.sdpa_attention_forward`` runs the attention (with its own GQA handling). Here the
position ids are made from the tool's ``cu_seqlens_q`` as a collator makes them; each document is its own
self-attention (seqlens_q = seqlens_k, causal).

Broken on purpose: ``hf_packed_arange_positions`` numbers the positions 0..total-1 over the packed batch (no
restart: transformers #39814's kind of misaligned position ids), so transformers sees one sequence and every
document sees the ones before it. Tested with transformers 5.24."""
from types import SimpleNamespace

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    sdpa_mask,
)


def _restarting_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, total]: 0, 1, ... within each document, as a packing collator writes position_ids."""
    bounds = cu_seqlens.tolist()
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])[None]


def _attention(q, k, v, scale, kv_map, position_ids):
    packed = find_packed_sequence_indices(position_ids)  # None: one sequence
    mask_function = causal_mask_function if packed is None else and_masks(
        causal_mask_function, packed_sequence_mask_function(packed))
    n = q.shape[2]
    mask = sdpa_mask(batch_size=1, q_length=n, kv_length=n, mask_function=mask_function,
                     allow_is_causal_skip=False, device=q.device)  # bool [1, 1, n, n], True = attend
    groups = q.shape[1] // k.shape[1]
    if (kv_map != torch.arange(q.shape[1]) // groups).any():  # transformers' repeat_kv groups contiguous heads
        k, v, groups = k[:, kv_map], v[:, kv_map], 1
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    out, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scale)
    return out.transpose(1, 2)  # the library returns [B, n, H, d]


def hf_packed(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return _attention(q, k, v, scale, kv_map, _restarting_positions(cu_seqlens_q))


def hf_packed_arange_positions(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k):
    return _attention(q, k, v, scale, kv_map, torch.arange(q.shape[2])[None])
