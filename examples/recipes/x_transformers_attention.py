"""Recipe: x-transformers' Attention and RMSNorm checked as they are, with their weights (x_transformers.yaml).
The Attention module takes the tool's mask as it is (attn_mask: bool [B, H, n_q, n_k], True = attend) and its
bias-free to_q/to_k/to_v/to_out are nn.Linear ([out, in]: the op's weights transposed). With fewer KV heads it
repeats them as 'b kvh n d -> b (r kvh) n d': query head h reads KV head h % Hkv (kv_map: interleaved).
x-transformers' RMSNorm keeps gamma as an offset from 1 (unit_offset) or as a plain scale; it multiplies by
sqrt(d) after F.normalize, so its eps is not the tool's (eps: 0 with a clamp on the norm at 1e-12).

Tested with x-transformers 2.31.10 (torch 2.13.0)."""
from x_transformers.x_transformers import Attention, RMSNorm


def attention(d_model, heads_q, heads_kv, d_head):
    return Attention(d_model, dim_head=d_head, heads=heads_q, kv_heads=heads_kv)


def rmsnorm(d_model):
    return RMSNorm(d_model)


def attention_causal_built_in(d_model, heads_q, heads_kv, d_head):
    # broken: built causal=True (as for a decoder) and also given the mask: it hides the later keys on top of it
    return Attention(d_model, dim_head=d_head, heads=heads_q, kv_heads=heads_kv, causal=True)
