"""Soft-capped attention (Gemma 2's ``attn_logit_softcapping``, FlashAttention's ``softcap``) written three ways,
each taking the cap as the keyword argument ``softcap`` (attn-gradcheck passes it when a scenario sets
``softcap:``): S = c tanh(scale q k^T / c), then the mask, then the softmax.

    numpy_attention   a NumPy object with forward and a hand-written backward
    torch_attention   a torch.autograd.Function with a hand-written backward
    jax_attention     a JAX function (gradients by jax.vjp)
    torch_no_tanh_derivative   the backward drops the tanh' factor: dS_raw = dS (a real bug class)
    torch_capped_after_mask    the cap applied after masking: -inf becomes -c, hidden keys get weight
"""
import numpy as np


class NumpySoftcap:
    @staticmethod
    def _probabilities(q, k_rep, visible, scale, softcap):
        raw = scale * np.einsum("bhid,bhjd->bhij", q, k_rep)
        t = np.tanh(raw / softcap)
        s = np.where(visible, softcap * t, -np.inf)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True), t

    def forward(self, q, k, v, visible, scale, kv_map, *, softcap):
        p, _ = self._probabilities(q, k[:, kv_map], visible, scale, softcap)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, softcap):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, t = self._probabilities(q, k_rep, visible, scale, softcap)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        ds_raw = ds * (1 - t * t)  # d/ds of c tanh(s / c)
        dq = scale * np.einsum("bhij,bhjd->bhid", ds_raw, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds_raw, q)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), dk_rep)
        np.add.at(dv, (slice(None), kv_map), dv_rep)
        return dq, dk, dv


numpy_attention = NumpySoftcap()


def _torch():
    import torch

    class Softcapped(torch.autograd.Function):
        drop_derivative = False

        @staticmethod
        def forward(ctx, q, k, v, visible, scale, kv_map, softcap):
            k_rep, v_rep = k[:, kv_map], v[:, kv_map]
            t = torch.tanh(scale * (q @ k_rep.transpose(-1, -2)) / softcap)
            p = torch.softmax((softcap * t).masked_fill(~visible, float("-inf")), dim=-1)
            ctx.save_for_backward(q, k_rep, v_rep, p, t)
            ctx.scale, ctx.kv_map, ctx.heads_kv = scale, kv_map, k.shape[1]
            return p @ v_rep

        @classmethod
        def backward(cls, ctx, grad_o):
            q, k_rep, v_rep, p, t = ctx.saved_tensors
            dv_rep = p.transpose(-1, -2) @ grad_o
            dp = grad_o @ v_rep.transpose(-1, -2)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))
            if not cls.drop_derivative:
                ds = ds * (1 - t * t)
            dq = ctx.scale * ds @ k_rep
            dk_rep = ctx.scale * ds.transpose(-1, -2) @ q
            shape = (q.shape[0], ctx.heads_kv) + tuple(k_rep.shape[2:])
            dk = torch.zeros(shape, dtype=q.dtype).index_add_(1, ctx.kv_map, dk_rep)
            dv = torch.zeros(shape[:3] + (v_rep.shape[-1],), dtype=q.dtype).index_add_(1, ctx.kv_map, dv_rep)
            return dq, dk, dv, None, None, None, None

    class NoTanhDerivative(Softcapped):
        drop_derivative = True

    return Softcapped, NoTanhDerivative


def torch_attention(q, k, v, visible, scale, kv_map, *, softcap):
    return _torch()[0].apply(q, k, v, visible, scale, kv_map, softcap)


def torch_no_tanh_derivative(q, k, v, visible, scale, kv_map, *, softcap):
    return _torch()[1].apply(q, k, v, visible, scale, kv_map, softcap)


def torch_capped_after_mask(q, k, v, visible, scale, kv_map, *, softcap):
    import torch
    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float("-inf"))
    return torch.softmax(softcap * torch.tanh(s / softcap), dim=-1) @ v[:, kv_map]


def jax_attention(q, k, v, visible, scale, kv_map, *, softcap):
    import jax
    import jax.numpy as jnp
    s = softcap * jnp.tanh(scale * (q @ jnp.swapaxes(k[:, kv_map], -1, -2)) / softcap)
    return jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1) @ v[:, kv_map]
