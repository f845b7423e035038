"""Attention dropout as training code writes it, with the keep mask attn-gradcheck draws and passes
(``keep_mask=`` bool [B, Hq, n_q, n_k], True = kept, and ``dropout_p=``) when a scenario sets ``dropout: {p}``:
the weights after the softmax are multiplied by keep_mask / (1 - p), so the function is fixed and its gradients
well defined:

    torch_dropout          the softmax, times keep_mask / (1 - p), autograd
    numpy_dropout          a NumPy object with a hand-written backward: dV = (P W)^T dO, dP = (dO V^T) W,
                           dS = P (dP - rowsum(P dP))
    jax_dropout            the same in jax.numpy
    torch_dropout_scale_p  broken: kept weights scaled by p instead of 1 / (1 - p)
    numpy_dv_unmasked      broken: dV = P^T dO, the mask missing from dV
    numpy_ds_dropped       broken: dS built from the dropped weights P W instead of P
"""
import numpy as np


def _torch(q, k, v, visible, scale, kv_map, keep_mask, factor):
    import torch
    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, dim=-1) * keep_mask * factor) @ v[:, kv_map]


def torch_dropout(q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):
    return _torch(q, k, v, visible, scale, kv_map, keep_mask, 1.0 / (1.0 - dropout_p))


def torch_dropout_scale_p(q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):
    return _torch(q, k, v, visible, scale, kv_map, keep_mask, dropout_p)


class NumpyDropout:
    def _p(self, q, k, visible, scale, kv_map):
        s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def forward(self, q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):
        w = keep_mask / (1.0 - dropout_p)
        return np.einsum("bhij,bhjd->bhid", self._p(q, k, visible, scale, kv_map) * w, v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, keep_mask, dropout_p):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k, visible, scale, kv_map)
        w = keep_mask / (1.0 - dropout_p)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep) * w
        ds = self._ds(p, w, dp)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", self._dv_weights(p, w), grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv

    def _ds(self, p, w, dp):
        return p * (dp - (p * dp).sum(-1, keepdims=True))

    def _dv_weights(self, p, w):
        return p * w


class NumpyDvUnmasked(NumpyDropout):
    def _dv_weights(self, p, w):
        return p


class NumpyDsDropped(NumpyDropout):
    def _ds(self, p, w, dp):
        return p * w * (dp - (p * dp).sum(-1, keepdims=True))


numpy_dropout = NumpyDropout()
numpy_dv_unmasked = NumpyDvUnmasked()
numpy_ds_dropped = NumpyDsDropped()


def jax_dropout(q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):
    import jax
    import jax.numpy as jnp
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -jnp.inf)
    return (jax.nn.softmax(s, axis=-1) * keep_mask / (1.0 - dropout_p)) @ v[:, kv_map]
