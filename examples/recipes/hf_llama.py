"""Recipes: Hugging Face transformers' Llama pieces checked as they are.

- Modules with weights (``implementation: {factory, weights, call}`` in hf_llama.yaml): a factory builds the
  library's module from the scenario's sizes; the YAML maps its parameters to the op's tensors, and the tool
  checks their gradients. The decoder layer needs a five-line wrapper that turns the tool's mask and RoPE
  tables into the arguments the library's layer takes.
- Functions (``implementation: "hf_llama:rope"``): an adapter of at most five lines each maps the tool's
  call signature onto the library's.

Tested with transformers 5.24."""
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
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


# -- modules: factories called with the scenario sizes they name ----------------------------------------------

def rmsnorm_module(d_model, eps):
    return LlamaRMSNorm(d_model, eps=eps)


def mlp_module(d_model, d_ff):
    return LlamaMLP(LlamaConfig(hidden_size=d_model, intermediate_size=d_ff, num_attention_heads=1))


def _config(d_model, d_ff, heads_q, heads_kv, d_head, norm_eps=1e-6):
    return LlamaConfig(hidden_size=d_model, intermediate_size=d_ff, num_attention_heads=heads_q,
                       num_key_value_heads=heads_kv, head_dim=d_head, rms_norm_eps=norm_eps,
                       attn_implementation="eager")


class Layer(torch.nn.Module):  # the tool's (x, visible, cos, sin) as the library's mask and position embeddings
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, visible, cos, sin):
        mask = torch.zeros(visible.shape, dtype=x.dtype).masked_fill(~visible, torch.finfo(x.dtype).min)
        embeddings = (torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
        return self.layer(x, attention_mask=mask, position_embeddings=embeddings)


def decoder_layer(d_model, d_ff, heads_q, heads_kv, d_head, norm_eps):
    return Layer(LlamaDecoderLayer(_config(d_model, d_ff, heads_q, heads_kv, d_head, norm_eps), layer_idx=0))


def attention_module(d_model, heads_q, heads_kv, d_head):  # no RoPE: cos = 1, sin = 0 at every position
    class NoRope(Layer):
        def forward(self, x, visible):
            ones = torch.ones(x.shape[1], d_head // 2, dtype=x.dtype)
            return super().forward(x, visible, ones, torch.zeros_like(ones))
    return NoRope(LlamaAttention(_config(d_model, 4 * d_model, heads_q, heads_kv, d_head), layer_idx=0))


class DetachedResidual(Layer):  # broken: the attention residual is detached, as a refactoring slip would
    def forward(self, x, visible, cos, sin):
        mask = torch.zeros(visible.shape, dtype=x.dtype).masked_fill(~visible, torch.finfo(x.dtype).min)
        embeddings = (torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
        layer = self.layer
        h = x.detach() + layer.self_attn(layer.input_layernorm(x), embeddings, mask)[0]
        return h + layer.mlp(layer.post_attention_layernorm(h))


def decoder_layer_detached_residual(d_model, d_ff, heads_q, heads_kv, d_head, norm_eps):
    return DetachedResidual(LlamaDecoderLayer(_config(d_model, d_ff, heads_q, heads_kv, d_head, norm_eps), 0))
