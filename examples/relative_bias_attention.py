"""T5's relative position bias in your code (``relative_bias: {buckets, max_distance, bidirectional}``): the table
W [buckets, Hq] (the weight of T5's ``relative_attention_bias`` embedding) comes as the keyword argument
``relative_attention_bias``; the code buckets the relative positions itself (T5's rule, the settings of its
config: here 8 buckets, max distance 16, bidirectional, as examples/relative_bias.yaml says), the queries aligned
with the last keys. A NumPy backward returns dW after (dq, dk, dv): dS summed into each (i, j)'s bucket.

    numpy_relative                 right (np.add.at: repeated buckets accumulate)
    numpy_relative_fancy_index     dW[bucket] += dS: NumPy's buffered fancy indexing keeps one pair per bucket
    torch_relative                 the table gathered by torch indexing, autograd for its gradient
    jax_relative                   likewise in JAX (jax.vjp)
"""
import math

import numpy as np

BUCKETS, MAX_DISTANCE = 8, 16


def buckets_of(n_q, n_k, buckets=BUCKETS, max_distance=MAX_DISTANCE):
    """T5's _relative_position_bucket (bidirectional) of j - (i + n_k - n_q), [n_q, n_k]."""
    rel = np.arange(n_k)[None, :] - (np.arange(n_q)[:, None] + n_k - n_q)
    half = buckets // 2
    out = (rel > 0) * half
    rel = np.abs(rel)
    exact = half // 2
    large = exact + (np.log(np.maximum(rel, 1) / exact) / math.log(max_distance / exact) * (half - exact)).astype(int)
    return out + np.where(rel < exact, rel, np.minimum(large, half - 1))


class NumpyRelative:
    accumulate = True

    @staticmethod
    def _p(q, k_rep, visible, scale, table):
        bias = np.moveaxis(table[buckets_of(q.shape[2], k_rep.shape[2])], -1, 0)  # [H, n_q, n_k]
        s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k_rep) + bias, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def forward(self, q, k, v, visible, scale, kv_map, *, relative_attention_bias):
        p = self._p(q, k[:, kv_map], visible, scale, relative_attention_bias)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, relative_attention_bias):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k_rep, visible, scale, relative_attention_bias)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        idx = buckets_of(q.shape[2], k.shape[2])
        dtable = np.zeros_like(relative_attention_bias)
        per_head = np.moveaxis(ds.sum(0), 0, -1)  # [n_q, n_k, H]
        if self.accumulate:
            np.add.at(dtable, idx, per_head)
        else:
            dtable[idx] += per_head  # the bug: a bucket met twice is written once
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv, dtable


class _FancyIndex(NumpyRelative):
    accumulate = False


numpy_relative = NumpyRelative()
numpy_relative_fancy_index = _FancyIndex()


def torch_relative(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    import torch
    idx = torch.as_tensor(buckets_of(q.shape[2], k.shape[2]))
    bias = relative_attention_bias[idx].permute(2, 0, 1)  # [H, n_q, n_k]
    s = (scale * q @ k[:, kv_map].transpose(-1, -2) + bias).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v[:, kv_map]


def jax_relative(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    import jax
    import jax.numpy as jnp
    bias = jnp.moveaxis(relative_attention_bias[buckets_of(q.shape[2], k.shape[2])], -1, 0)
    s = jnp.where(visible, scale * q @ jnp.swapaxes(k[:, kv_map], -1, -2) + bias, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v[:, kv_map]
