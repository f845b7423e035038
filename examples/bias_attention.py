"""An additive bias with its gradient (``bias: {shape: [...], grad: true}``): the NumPy interface takes the bias
as the keyword argument ``attn_bias`` ([B|1, H|1, n_q, n_k], FlashAttention's name) and its backward returns
dbias after (dq, dk, dv): the gradient at the softmax's input, summed over the axes the bias is broadcast along.

    numpy_bias                 right
    numpy_bias_not_summed      dbias of a broadcast axis taken from its first element (a real bug class)
    torch_bias                 PyTorch SDPA with a float attn_mask (a learned mask: its gradient by autograd)
    torch_bias_detached        the mask detached before use: its gradient never reaches it
    jax_bias                   jax.nn.dot_product_attention with bias= (its gradient by jax.vjp)
"""
import numpy as np


class NumpyBias:
    sum_broadcast = True

    @staticmethod
    def _p(q, k_rep, visible, scale, attn_bias):
        s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k_rep) + attn_bias, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def forward(self, q, k, v, visible, scale, kv_map, *, attn_bias):
        return np.einsum("bhij,bhjd->bhid", self._p(q, k[:, kv_map], visible, scale, attn_bias), v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, attn_bias):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k_rep, visible, scale, attn_bias)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        if self.sum_broadcast:
            axes = tuple(i for i in (0, 1) if attn_bias.shape[i] == 1 and ds.shape[i] != 1)
            dbias = ds.sum(axis=axes, keepdims=True)
        else:
            dbias = ds[:attn_bias.shape[0], :attn_bias.shape[1]]
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv, dbias


class _NotSummed(NumpyBias):
    sum_broadcast = False


numpy_bias = NumpyBias()
numpy_bias_not_summed = _NotSummed()


def torch_bias(q, k, v, visible, scale, kv_map, *, attn_bias):
    """PyTorch SDPA with a float mask: the bias with the hidden keys at -inf (a learned mask when the scenario checks
    its gradient: autograd reaches attn_bias through SDPA)."""
    import torch.nn.functional as F
    mask = attn_bias.masked_fill(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q, k[:, kv_map], v[:, kv_map], attn_mask=mask, scale=scale)


def jax_bias(q, k, v, visible, scale, kv_map, *, attn_bias):
    """jax.nn.dot_product_attention with bias= and mask= ([B, T, N, H] layout inside)."""
    import jax
    import jax.numpy as jnp
    out = jax.nn.dot_product_attention(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k[:, kv_map], 1, 2),
                                       jnp.swapaxes(v[:, kv_map], 1, 2), bias=attn_bias, mask=visible, scale=scale)
    return jnp.swapaxes(out, 1, 2)


def torch_bias_detached(q, k, v, visible, scale, kv_map, *, attn_bias):
    """Broken: the bias detached before use (a cached mask), so its gradient never reaches it."""
    return torch_bias(q, k, v, visible, scale, kv_map, attn_bias=attn_bias.detach())
