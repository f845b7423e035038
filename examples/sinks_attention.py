"""Attention with learnable sinks written as gpt-oss and a hand-written kernel do, each taking the sink logits as
the keyword argument ``sinks`` (one per query head; attn-gradcheck passes it when a scenario sets ``sinks:``, as
a leaf of autograd / an input whose gradient is checked with ``grad: true``):

    torch_sinks            gpt-oss's eager form: the sink concatenated as an extra score column, softmax, dropped
    numpy_sinks            a NumPy object with a hand-written backward: ds_h = -sum_{b,i} p_i D_i, returned last
    jax_sinks              the same in jax.numpy (jax.vjp differentiates it)
    torch_sink_scaled      broken: the sink multiplied by the softmax scale with the scores
    torch_sink_detached    broken: the sinks detached (their gradient is 0)
    torch_sinks_ignored    broken: takes sinks= and never uses it (a plain softmax)
    numpy_lse_no_sink      broken: the backward recomputes P from a log-sum-exp without the sink (the forward is right)
    numpy_sink_first_batch broken: the sinks' gradient from the first batch element only
    numpy_delta_no_sink    broken: D = rowsum(P~ dP) with P~ normalised without the sink (P itself right)
"""
import numpy as np


def _torch_probs(q, k, visible, scale, kv_map, sinks, sink_scale=1.0):
    import torch
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    s = s.masked_fill(~visible, float("-inf"))
    col = (sinks.to(q.dtype) * sink_scale).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([s, col], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1)[..., :-1]  # the sink's column dropped: it has no value row


def torch_sinks(q, k, v, visible, scale, kv_map, *, sinks):
    return _torch_probs(q, k, visible, scale, kv_map, sinks) @ v[:, kv_map]


def torch_sink_scaled(q, k, v, visible, scale, kv_map, *, sinks):
    return _torch_probs(q, k, visible, scale, kv_map, sinks, sink_scale=scale) @ v[:, kv_map]


def torch_sink_detached(q, k, v, visible, scale, kv_map, *, sinks):
    return _torch_probs(q, k, visible, scale, kv_map, sinks.detach()) @ v[:, kv_map]


def torch_sinks_ignored(q, k, v, visible, scale, kv_map, *, sinks):
    import torch
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v[:, kv_map]


class NumpySinks:
    """Forward saves nothing; the backward recomputes P with the sink in its normaliser."""

    def _p(self, q, k, visible, scale, kv_map, sinks, with_sink=True):
        s = scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map])
        s = np.where(visible, s, -np.inf)
        col = np.broadcast_to(np.asarray(sinks, dtype=s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
        m = np.maximum(s.max(-1, keepdims=True), col) if with_sink else s.max(-1, keepdims=True)
        e = np.exp(s - m)
        total = e.sum(-1, keepdims=True) + (np.exp(col - m) if with_sink else 0.0)
        return e / total

    def forward(self, q, k, v, visible, scale, kv_map, *, sinks):
        return np.einsum("bhij,bhjd->bhid", self._p(q, k, visible, scale, kv_map, sinks), v[:, kv_map])

    def _sink_grad(self, ds):
        return -ds.sum(axis=(0, 2, 3))  # the sink column's dS = -p D completes each row of dS to 0

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, sinks, with_sink=True):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k, visible, scale, kv_map, sinks, with_sink)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv, self._sink_grad(ds)


class NumpyLseNoSink(NumpySinks):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, sinks, with_sink=False):
        return super().backward(q, k, v, visible, scale, kv_map, grad_o, sinks=sinks, with_sink=False)


class NumpySinkFirstBatch(NumpySinks):
    def _sink_grad(self, ds):
        return -ds[:1].sum(axis=(0, 2, 3))


class NumpyDeltaNoSink(NumpySinks):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, sinks):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k, visible, scale, kv_map, sinks)
        p_keys = self._p(q, k, visible, scale, kv_map, sinks, with_sink=False)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p_keys * dp).sum(-1, keepdims=True))  # D from the keys' softmax: the sink left out
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv, self._sink_grad(ds)


numpy_sinks = NumpySinks()
numpy_delta_no_sink = NumpyDeltaNoSink()
numpy_lse_no_sink = NumpyLseNoSink()
numpy_sink_first_batch = NumpySinkFirstBatch()


def jax_sinks(q, k, v, visible, scale, kv_map, *, sinks):
    import jax.numpy as jnp
    s = scale * jnp.einsum("bhid,bhjd->bhij", q, k[:, kv_map])
    s = jnp.where(visible, s, -jnp.inf)
    col = jnp.broadcast_to(jnp.asarray(sinks, dtype=s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
    logits = jnp.concatenate([s, col], axis=-1)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return jnp.einsum("bhij,bhjd->bhid", p[..., :-1], v[:, kv_map])
