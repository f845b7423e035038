"""Recipes: Hugging Face transformers' Llama pieces checked as they are, each behind an adapter of at most
five lines that maps the tool's call signature onto the library's (weights passed in with
torch.func.functional_call, so their gradients are checked). Tested with transformers 5.24."""
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
    eager_attention_forward,
)


def rmsnorm(x, gamma, eps):
    norm = LlamaRMSNorm(x.shape[-1], eps=eps).to(x.dtype)
    return torch.func.functional_call(norm, {"weight": gamma}, (x,))


def rope(x, cos, sin):  # Llama pairs feature k with k + d/2 and takes cos/sin over the whole head
    x_embed, _ = apply_rotary_pos_emb(x, x, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    return x_embed


def mlp(x, w1, w3, w2):  # nn.Linear keeps [out, in]: the tool's [in, out] weights are transposed
    config = LlamaConfig(hidden_size=x.shape[-1], intermediate_size=w1.shape[-1], num_attention_heads=1)
    weights = {"gate_proj.weight": w1.T, "up_proj.weight": w3.T, "down_proj.weight": w2.T}
    return torch.func.functional_call(LlamaMLP(config).to(x.dtype), weights, (x,))


def eager_attention(q, k, v, visible, scale, kv_map):  # contiguous KV groups, additive float mask
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=scale)
    return out.transpose(1, 2)  # the library returns [B, n, H, d]


def sdpa_attention(q, k, v, visible, scale, kv_map):  # the library's SDPA path: a boolean mask (True = keep)
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, is_causal=False)
    out, _ = sdpa_attention_forward(module, q, k, v, visible, scaling=scale, is_causal=False)
    return out.transpose(1, 2)


def rope_interleaved_tables(x, cos, sin):  # broken: cos/sin repeated per pair (GPT-J's tables) for Llama's layout
    x_embed, _ = apply_rotary_pos_emb(x, x, cos.repeat_interleave(2, -1)[None], sin.repeat_interleave(2, -1)[None])
    return x_embed
