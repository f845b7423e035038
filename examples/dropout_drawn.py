"""Attention dropout whose keep mask the code draws itself (``dropout: {p, drawn_by: code}``): the code is passed
``dropout_p=`` and ``dropout_seed=`` (an int) and returns ``(o, keep_mask)``, keep_mask bool [B, Hq, n_q, n_k]
(True = kept). The tool checks the gradients against the mask the code returned, checks that every call returns
the same mask (finite differences compare separate calls), and that the fraction kept lies within a binomial bound
of 1 - p. torch's and NumPy's global generators are seeded with dropout_seed for each call, so code that draws
from them (``torch.rand_like``) reproduces its mask:

    torch_global       draws from torch's global generator (seeded by the tool), autograd
    torch_generator    draws from its own torch.Generator seeded with dropout_seed
    numpy_drawn        a NumPy object with a hand-written backward, np.random.default_rng(dropout_seed)
    jax_drawn          jax.random.bernoulli(jax.random.key(dropout_seed), 1 - p)
    torch_unseeded     broken: a fresh, unseeded generator on every call (a different mask each call)
    torch_keeps_p      broken: keeps an entry with probability p (rand < p), the returned mask says so
    torch_mask_flipped broken: returns the mask of the dropped entries (~keep) beside the output of the kept
"""
import numpy as np


def _torch(q, k, v, visible, scale, kv_map, keep, p):
    import torch
    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, dim=-1) * keep / (1.0 - p)) @ v[:, kv_map]


def _shape(q, k):
    return q.shape[:-1] + (k.shape[-2],)


def torch_global(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
    import torch
    keep = torch.rand(_shape(q, k), dtype=torch.float64) >= dropout_p
    return _torch(q, k, v, visible, scale, kv_map, keep, dropout_p), keep


def torch_generator(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
    import torch
    gen = torch.Generator().manual_seed(dropout_seed)
    keep = torch.rand(_shape(q, k), generator=gen, dtype=torch.float64) >= dropout_p
    return _torch(q, k, v, visible, scale, kv_map, keep, dropout_p), keep


def torch_unseeded(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
    import torch
    gen = torch.Generator()
    gen.seed()  # a nondeterministic seed: dropout_seed ignored
    keep = torch.rand(_shape(q, k), generator=gen, dtype=torch.float64) >= dropout_p
    return _torch(q, k, v, visible, scale, kv_map, keep, dropout_p), keep


def torch_keeps_p(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
    import torch
    keep = torch.rand(_shape(q, k), dtype=torch.float64) < dropout_p
    return _torch(q, k, v, visible, scale, kv_map, keep, dropout_p), keep


def torch_mask_flipped(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
    import torch
    keep = torch.rand(_shape(q, k), dtype=torch.float64) >= dropout_p
    return _torch(q, k, v, visible, scale, kv_map, keep, dropout_p), ~keep


class NumpyDrawn:
    """Forward and backward each redraw the mask from dropout_seed (as a kernel's saved RNG state does)."""

    def _p(self, q, k, visible, scale, kv_map):
        s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def _keep(self, q, k, p, seed):
        return np.random.default_rng(seed).random(_shape(q, k)) >= p

    def forward(self, q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
        keep = self._keep(q, k, dropout_p, dropout_seed)
        w = (keep / (1.0 - dropout_p)).astype(q.dtype)
        return np.einsum("bhij,bhjd->bhid", self._p(q, k, visible, scale, kv_map) * w, v[:, kv_map]), keep

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, dropout_p, dropout_seed):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k, visible, scale, kv_map)
        w = (self._keep(q, k, dropout_p, dropout_seed) / (1.0 - dropout_p)).astype(q.dtype)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep) * w
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p * w, grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv


numpy_drawn = NumpyDrawn()


def jax_drawn(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed):
    import jax
    import jax.numpy as jnp
    keep = jax.random.bernoulli(jax.random.key(dropout_seed), 1.0 - dropout_p, _shape(q, k))
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -jnp.inf)
    return (jax.nn.softmax(s, axis=-1) * keep / (1.0 - dropout_p)) @ v[:, kv_map], keep
