"""User code for benchmarks/gpu_check.py: PyTorch's SDPA kernels behind the tool's torch interface
(``f(q, k, v, visible, scale, kv_map) -> o``), each kernel forced with ``torch.nn.attention.sdpa_kernel``, and a
broken one that must fail.

- ``flash``: FlashAttention's kernel; it takes no mask, so the scenario's mask must be the causal one it draws
  (``is_causal=True``, n_q = n_k: the lower-right and upper-left diagonals agree).
- ``efficient``: the memory-efficient kernel, with the mask as an additive float bias.
- ``math``: the reference kernel, with the boolean mask.
- ``broken_unscaled``: the math kernel with the scale applied twice (a factor on dQ and dK the checks must catch).

On a machine without CUDA (``GPU_CHECK_DRY=1``, the dry run) the flash and memory-efficient kernels fall back to
the math kernel where the CPU build has not got them, so the script's every step still runs.
"""
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DRY = os.environ.get("GPU_CHECK_DRY") == "1"


def _kernels(backend):
    return [backend, SDPBackend.MATH] if DRY else [backend]


def _heads(k, v, kv_map):
    return k.index_select(1, kv_map), v.index_select(1, kv_map)


def flash(q, k, v, visible, scale, kv_map):
    k, v = _heads(k, v, kv_map)
    with sdpa_kernel(_kernels(SDPBackend.FLASH_ATTENTION)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def efficient(q, k, v, visible, scale, kv_map):
    k, v = _heads(k, v, kv_map)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    with sdpa_kernel(_kernels(SDPBackend.EFFICIENT_ATTENTION)):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def math(q, k, v, visible, scale, kv_map):
    k, v = _heads(k, v, kv_map)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)


def broken_unscaled(q, k, v, visible, scale, kv_map):
    k, v = _heads(k, v, kv_map)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q * scale, k, v, attn_mask=visible, scale=scale)
