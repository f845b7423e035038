"""Recipe: gpt-oss's attention with learnable sinks, as Hugging Face transformers runs it, checked as it is.

``transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward`` takes the module's ``sinks`` parameter
(one logit per query head), concatenates it to the scaled, masked scores as one more column, subtracts the row
maximum, takes the softmax and drops the sink's column before multiplying by V (its ``repeat_kv`` groups
contiguous query heads). Here the module is a stand-in holding the tool's ``sinks=`` (a leaf of autograd: with
``sinks: {grad: true}`` their gradient is checked) and the mask is the additive float mask transformers builds
(0 where visible, the dtype's minimum where not). gpt-oss alternates sliding-window and full layers: both are
scenarios.

Broken on purpose: ``hf_gpt_oss_scaled_sinks`` concatenates the sink before the softmax scale is applied (a port
that scales the combined logits), so the sink is multiplied by the scale. Tested with transformers 5.24."""
from types import SimpleNamespace

import torch
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward


def _run(q, k, v, visible, scale, kv_map, sinks, groups_from_map=True):
    groups = q.shape[1] // k.shape[1]
    if (kv_map != torch.arange(q.shape[1]) // groups).any():  # transformers groups contiguous query heads
        k, v, groups = k[:, kv_map], v[:, kv_map], 1
    module = SimpleNamespace(sinks=sinks.to(q.dtype), num_key_value_groups=groups, training=False)
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=scale)
    return out.transpose(1, 2)  # the library returns [B, n, H, d]


def hf_gpt_oss(q, k, v, visible, scale, kv_map, *, sinks):
    return _run(q, k, v, visible, scale, kv_map, sinks)


def hf_gpt_oss_scaled_sinks(q, k, v, visible, scale, kv_map, *, sinks):
    # the sink joins the logits before they are scaled: eager_attention_forward with scaling=1 on pre-scaled q
    # would be right; scaling the concatenated logits scales the sink too
    return _run(q, k, v, visible, scale, kv_map, sinks * scale)
