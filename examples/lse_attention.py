"""Attention that returns its log-sum-exp, as FlashAttention-style kernels do (``softmax_lse``), each called with
``return_lse=True`` when a scenario sets ``outputs: [o, lse]`` and returning ``(o, lse)``, lse [B, Hq, n_q] in
natural log:

    torch_lse             the softmax and torch.logsumexp of the masked scores, autograd through both
    numpy_lse             a NumPy object with a hand-written backward that takes grad_lse: dS = P (dP - D + G_L)
    jax_lse               jax.nn.logsumexp beside the softmax, jax.vjp through both
    numpy_lse_ignored     broken: the backward ignores grad_lse (FlashAttention 2/3's Python interface)
    torch_lse_log2        broken: the LSE in log2 units (exp2-based kernels; pytorch #181645)
    torch_lse_no_max      broken: lse = log(sum exp(S - m)), the row maximum m not added back
    torch_lse_unmasked    broken: the LSE over every key, the mask missing from it (O is right)
"""
import math

import numpy as np


def _torch_scores(q, k, visible, scale, kv_map):
    return (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float("-inf"))


def torch_lse(q, k, v, visible, scale, kv_map, *, return_lse=False):
    import torch
    s = _torch_scores(q, k, visible, scale, kv_map)
    o = torch.softmax(s, dim=-1) @ v[:, kv_map]
    return (o, torch.logsumexp(s, dim=-1)) if return_lse else o


def torch_lse_log2(q, k, v, visible, scale, kv_map, *, return_lse=False):
    import torch
    s = _torch_scores(q, k, visible, scale, kv_map)
    o = torch.softmax(s, dim=-1) @ v[:, kv_map]
    return (o, torch.logsumexp(s, dim=-1) / math.log(2.0)) if return_lse else o


def torch_lse_no_max(q, k, v, visible, scale, kv_map, *, return_lse=False):
    import torch
    s = _torch_scores(q, k, visible, scale, kv_map)
    m = s.max(dim=-1, keepdim=True).values.detach()
    e = torch.exp(s - m)
    o = (e / e.sum(-1, keepdim=True)) @ v[:, kv_map]
    return (o, torch.log(e.sum(-1))) if return_lse else o


def torch_lse_unmasked(q, k, v, visible, scale, kv_map, *, return_lse=False):
    import torch
    s = _torch_scores(q, k, visible, scale, kv_map)
    o = torch.softmax(s, dim=-1) @ v[:, kv_map]
    raw = scale * (q @ k[:, kv_map].transpose(-1, -2))
    return (o, torch.logsumexp(raw, dim=-1)) if return_lse else o


class NumpyLse:
    def _p(self, q, k, visible, scale, kv_map):
        s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -np.inf)
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        total = e.sum(-1, keepdims=True)
        return e / total, (m + np.log(total))[..., 0]

    def forward(self, q, k, v, visible, scale, kv_map, *, return_lse=False):
        p, lse = self._p(q, k, visible, scale, kv_map)
        o = np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])
        return (o, lse) if return_lse else o

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, grad_lse=None):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, _ = self._p(q, k, visible, scale, kv_map)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        shift = (p * dp).sum(-1, keepdims=True)
        if grad_lse is not None and self.takes_lse_gradient:
            shift = shift - grad_lse[..., None]  # dLSE_i/dS_ij = P_ij
        ds = p * (dp - shift)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv

    takes_lse_gradient = True


class NumpyLseIgnored(NumpyLse):
    takes_lse_gradient = False


numpy_lse = NumpyLse()
numpy_lse_ignored = NumpyLseIgnored()


def jax_lse(q, k, v, visible, scale, kv_map, *, return_lse=False):
    import jax
    import jax.numpy as jnp
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -jnp.inf)
    o = jax.nn.softmax(s, axis=-1) @ v[:, kv_map]
    return (o, jax.nn.logsumexp(s, axis=-1)) if return_lse else o
