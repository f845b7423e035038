"""ALiBi attention written as BLOOM and FlashAttention do, each taking the slopes as the keyword argument
``alibi_slopes`` (attn-gradcheck passes it, one slope per query head, when a scenario sets ``alibi:``):

    torch_alibi        FlashAttention's distance form: S + (-m |i + n_k - n_q - j|), autograd
    torch_bloom        BLOOM's column form m * j, with its own slopes from the head count (build_alibi_tensor)
    numpy_alibi        a NumPy object with forward and a hand-written backward (ALiBi changes no derivative)
    jax_alibi          jax.nn.dot_product_attention with the bias (its softmax is float32: checked in float32)
    torch_no_offset    the distance without the lower-right offset: wrong when n_q != n_k
    torch_pow2_slopes  BLOOM's form with the powers-of-two slope formula for every head count: wrong for 6 heads
"""
import math

import numpy as np


def _distance(n_q, n_k, offset=True):
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    return -np.abs(i + (n_k - n_q if offset else 0) - j).astype(np.float64)


def torch_alibi(q, k, v, visible, scale, kv_map, *, alibi_slopes):
    import torch
    d = torch.as_tensor(_distance(q.shape[2], k.shape[2]), dtype=q.dtype)
    s = scale * (q @ k[:, kv_map].transpose(-1, -2)) + alibi_slopes.to(q.dtype)[:, None, None] * d
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v[:, kv_map]


def torch_no_offset(q, k, v, visible, scale, kv_map, *, alibi_slopes):
    import torch
    d = torch.as_tensor(_distance(q.shape[2], k.shape[2], offset=False), dtype=q.dtype)
    s = scale * (q @ k[:, kv_map].transpose(-1, -2)) + alibi_slopes.to(q.dtype)[:, None, None] * d
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v[:, kv_map]


def _bloom_slopes(heads, pow2_only=False):
    """transformers' BLOOM build_alibi_tensor slopes (and the bug of taking the power-of-two rule everywhere)."""
    closest = heads if pow2_only else 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** i for i in range(1, 1 + 2 * (heads - closest), 2)]
    return slopes


def _bloom(q, k, v, visible, scale, kv_map, pow2_only):
    import torch
    m = torch.tensor(_bloom_slopes(q.shape[1], pow2_only), dtype=q.dtype)
    s = scale * (q @ k[:, kv_map].transpose(-1, -2)) + m[:, None, None] * torch.arange(k.shape[2], dtype=q.dtype)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v[:, kv_map]


def torch_bloom(q, k, v, visible, scale, kv_map, *, alibi_slopes, alibi_form="distance"):
    return _bloom(q, k, v, visible, scale, kv_map, pow2_only=False)


def torch_pow2_slopes(q, k, v, visible, scale, kv_map, *, alibi_slopes, alibi_form="distance"):
    return _bloom(q, k, v, visible, scale, kv_map, pow2_only=True)


class NumpyAlibi:
    @staticmethod
    def _p(q, k_rep, visible, scale, slopes):
        s = scale * np.einsum("bhid,bhjd->bhij", q, k_rep) + slopes[:, None, None] * _distance(q.shape[2],
                                                                                                k_rep.shape[2])
        s = np.where(visible, s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def forward(self, q, k, v, visible, scale, kv_map, *, alibi_slopes):
        return np.einsum("bhij,bhjd->bhid", self._p(q, k[:, kv_map], visible, scale, alibi_slopes), v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, alibi_slopes):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k_rep, visible, scale, alibi_slopes)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))  # the bias is additive: dS passes through unchanged
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv


numpy_alibi = NumpyAlibi()


def jax_alibi(q, k, v, visible, scale, kv_map, *, alibi_slopes):
    import jax
    import jax.numpy as jnp
    bias = jnp.asarray(alibi_slopes)[:, None, None] * jnp.asarray(_distance(q.shape[2], k.shape[2]))
    # jax.nn.dot_product_attention takes [B, T, N, H]
    out = jax.nn.dot_product_attention(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k[:, kv_map], 1, 2),
                                       jnp.swapaxes(v[:, kv_map], 1, 2), bias=bias[None].astype(q.dtype),
                                       mask=visible, scale=scale)
    return jnp.swapaxes(out, 1, 2)
