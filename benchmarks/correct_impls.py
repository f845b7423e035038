"""Correct attention implementations written the ways users write them, for the random grid of correct
scenarios (benchmarks/correct_grid.py). None of them is the tool's own engine.

NumPy flavour (objects with forward/backward):
  einsum          full softmax with einsum, K/V gradients summed with np.add.at
  flash           FlashAttention-style: online softmax over key blocks of 5, LSE saved, blockwise
                  backward with D = rowsum(dO * O) (float64 accumulation in every dtype)
  float32_inside  computes everything in float32 and casts back (as libraries that upcast to float32
                  do): correct, but only float32-accurate in a float64 scenario
Torch flavour (one callable each, gradients by autograd):
  torch_plain     plain torch ops, autograd backward
  torch_custom    a custom autograd.Function with a hand-written backward
  torch_sdpa      torch.nn.functional.scaled_dot_product_attention with the boolean mask
  torch_softmax32 softmax in float32 and cast back (transformers' eager attention does this)
  torch_jvp_function  examples/torch_jvp.py's autograd.Function with backward and jvp (modes jvp and hvp)
  numpy_jvp       examples/my_attention.py's object, whose ``jvp`` the NumPy flavour's mode jvp checks
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np


def _probabilities(q, k_rep, visible, scale):
    s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k_rep), -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class Einsum:
    @staticmethod
    def forward(q, k, v, visible, scale, kv_map):
        return np.einsum("bhij,bhjd->bhid", _probabilities(q, k[:, kv_map], visible, scale), v[:, kv_map])

    @staticmethod
    def backward(q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _probabilities(q, k_rep, visible, scale)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), dk_rep)
        np.add.at(dv, (slice(None), kv_map), dv_rep)
        return dq, dk, dv



class Flash:
    """Online softmax over key blocks; every accumulation in float64, results cast to the input dtype."""
    block = 5

    def _forward(self, q, k, v, visible, scale, kv_map):
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k[:, kv_map], v[:, kv_map]))
        n_k = k.shape[-2]
        m = np.full(q.shape[:-1] + (1,), -np.inf)
        l = np.zeros_like(m)
        acc = np.zeros(q.shape[:-1] + (v.shape[-1],))
        for j0 in range(0, n_k, self.block):
            cols = slice(j0, j0 + self.block)
            vis = visible[..., cols]
            s = np.where(vis, scale * q64 @ np.swapaxes(k64[..., cols, :], -1, -2), -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            base = np.where(np.isfinite(m_new), m_new, 0.0)
            p = np.exp(s - base)
            rescale = np.exp(m - base)
            l = l * rescale + p.sum(axis=-1, keepdims=True)
            acc = acc * rescale + p @ v64[..., cols, :]
            m = m_new
        o = acc / l
        return o, (m + np.log(l))

    def forward(self, q, k, v, visible, scale, kv_map):
        return self._forward(q, k, v, visible, scale, kv_map)[0].astype(q.dtype)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        o, lse = self._forward(q, k, v, visible, scale, kv_map)
        q64, k64, v64, g64 = (x.astype(np.float64) for x in (q, k[:, kv_map], v[:, kv_map], grad_o))
        d_row = np.sum(g64 * o, axis=-1, keepdims=True)
        dq, dk_rep, dv_rep = np.zeros_like(q64), np.zeros_like(k64), np.zeros_like(v64)
        for j0 in range(0, k.shape[-2], self.block):
            cols = slice(j0, j0 + self.block)
            s = np.where(visible[..., cols], scale * q64 @ np.swapaxes(k64[..., cols, :], -1, -2), -np.inf)
            p = np.exp(s - lse)
            dv_rep[..., cols, :] += np.swapaxes(p, -1, -2) @ g64
            ds = p * (g64 @ np.swapaxes(v64[..., cols, :], -1, -2) - d_row)
            dq += scale * ds @ k64[..., cols, :]
            dk_rep[..., cols, :] += scale * np.swapaxes(ds, -1, -2) @ q64
        dk, dv = np.zeros(k.shape), np.zeros(v.shape)
        np.add.at(dk, (slice(None), kv_map), dk_rep)
        np.add.at(dv, (slice(None), kv_map), dv_rep)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class Float32Inside:
    """Everything in float32, cast back to the caller's dtype."""

    def forward(self, q, k, v, visible, scale, kv_map):
        args = (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
        return Einsum.forward(*args, visible, np.float32(scale), kv_map).astype(q.dtype)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        args = (q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
        out = Einsum.backward(*args, visible, np.float32(scale), kv_map, grad_o.astype(np.float32))
        return tuple(x.astype(q.dtype) for x in out)


einsum, flash, float32_inside = Einsum(), Flash(), Float32Inside()


def torch_plain(q, k, v, visible, scale, kv_map):
    k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
    s = (q @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return s.softmax(dim=-1) @ v_rep


@functools.cache
def _example(file: str, name: str):
    """Attribute ``name`` of examples/``file``, imported once under a name of its own."""
    path = Path(__file__).resolve().parents[1] / "examples" / file
    spec = importlib.util.spec_from_file_location(f"_example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def torch_custom(q, k, v, visible, scale, kv_map):
    globals()["torch_custom"] = _example("torch_attention.py", "attention")
    return torch_custom(q, k, v, visible, scale, kv_map)


def __getattr__(name: str):
    """``numpy_jvp``: examples/my_attention.py's object, imported when first asked for (this module is also copied
    elsewhere without the examples)."""
    if name == "numpy_jvp":
        return _example("my_attention.py", "attention")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def torch_jvp_function(q, k, v, visible, scale, kv_map):
    globals()["torch_jvp_function"] = _example("torch_jvp.py", "attention")
    return torch_jvp_function(q, k, v, visible, scale, kv_map)


def torch_sdpa(q, k, v, visible, scale, kv_map):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k.index_select(1, kv_map), v.index_select(1, kv_map),
                                          attn_mask=visible, scale=scale)


def torch_softmax32(q, k, v, visible, scale, kv_map):
    import torch
    k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
    s = (q @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v_rep


# Soft-capped attention (``softcap:`` scenarios): each takes the cap as the keyword argument softcap, as
# attn-gradcheck passes it.

def numpy_softcap_forward(q, k, v, visible, scale, kv_map, *, softcap):
    s = softcap * np.tanh(scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map]) / softcap)
    s = np.where(visible, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bhjd->bhid", e / e.sum(axis=-1, keepdims=True), v[:, kv_map])


class _NumpySoftcap:
    forward = staticmethod(numpy_softcap_forward)

    @staticmethod
    def backward(q, k, v, visible, scale, kv_map, grad_o, *, softcap):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        t = np.tanh(scale * np.einsum("bhid,bhjd->bhij", q, k_rep) / softcap)
        s = np.where(visible, softcap * t, -np.inf)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / e.sum(axis=-1, keepdims=True)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * (1 - t * t)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p, grad_o))
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv


numpy_softcap = _NumpySoftcap()


def torch_softcap(q, k, v, visible, scale, kv_map, *, softcap):
    import torch
    s = softcap * torch.tanh(scale * (q @ k[:, kv_map].transpose(-1, -2)) / softcap)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v[:, kv_map]


def jax_softcap(q, k, v, visible, scale, kv_map, *, softcap):
    import jax
    import jax.numpy as jnp
    s = softcap * jnp.tanh(scale * (q @ jnp.swapaxes(k[:, kv_map], -1, -2)) / softcap)
    return jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1) @ v[:, kv_map]


# ALiBi (``alibi:`` scenarios, and with softcap too): the slopes as the keyword argument alibi_slopes, the form as
# alibi_form when it is not the distance form; softcap when given.

def _alibi_d(n_q, n_k, form):
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    return (-np.abs(i + n_k - n_q - j) if form == "distance" else np.broadcast_to(j, (n_q, n_k))).astype(np.float64)


# T5's relative bias (``relative_bias:``): the table as relative_attention_bias; its settings follow from its bucket
# count, as benchmarks/correct_grid.py draws them: bidirectional for an even count, max_distance 3 x the count.

def _relative(n_q, n_k, table_rows):
    from gradcheck_cli.ops.attention.stages.relative_bias import bucket  # T5's rule (tested against transformers')
    rel = np.arange(n_k)[None, :] - (np.arange(n_q)[:, None] + n_k - n_q)
    return bucket(rel, table_rows, 3 * table_rows, table_rows % 2 == 0)


class _NumpyVariants:
    @staticmethod
    def _p(q, k_rep, visible, scale, softcap, alibi_slopes, alibi_form, attn_bias=None, table=None, sinks=None):
        raw = scale * np.einsum("bhid,bhjd->bhij", q, k_rep)
        t = np.tanh(raw / softcap) if softcap else None
        s = softcap * t if softcap else raw
        if attn_bias is not None:
            s = s + attn_bias
        if table is not None:
            s = s + np.moveaxis(table[_relative(q.shape[2], k_rep.shape[2], table.shape[0])], -1, 0)
        if alibi_slopes is not None:
            s = s + (alibi_slopes[:, None, None] * _alibi_d(q.shape[2], k_rep.shape[2], alibi_form)).astype(s.dtype)
        s = np.where(visible, s, -np.inf)
        if sinks is not None:  # gpt-oss's sinks: one more logit in each row's normaliser, no value row
            col = np.broadcast_to(np.asarray(sinks, dtype=s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
            m = np.maximum(s.max(-1, keepdims=True), col)
            e = np.exp(s - m)
            total = e.sum(-1, keepdims=True) + np.exp(col - m)
            return e / total, t, (m + np.log(total))[..., 0]
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        total = e.sum(-1, keepdims=True)
        return e / total, t, (m + np.log(total))[..., 0]

    def forward(self, q, k, v, visible, scale, kv_map, softcap=None, alibi_slopes=None, alibi_form="distance",
                attn_bias=None, relative_attention_bias=None, sinks=None, return_lse=False, keep_mask=None,
                dropout_p=None, dropout_seed=None, **packed):
        p, _, lse = self._p(q, k[:, kv_map], visible, scale, softcap, alibi_slopes, alibi_form, attn_bias,
                            relative_attention_bias, sinks)
        if dropout_seed is not None:  # dropout: {drawn_by: code}: the mask drawn here, returned last
            keep_mask = np.random.default_rng(dropout_seed).random(p.shape) >= dropout_p
        w = 1.0 if keep_mask is None else (keep_mask / (1.0 - dropout_p)).astype(q.dtype)
        o = np.einsum("bhij,bhjd->bhid", p * w, v[:, kv_map])
        out = (o, lse) if return_lse else (o,)
        out += (keep_mask,) if dropout_seed is not None else ()
        return out if len(out) > 1 else o

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, softcap=None, alibi_slopes=None,
                 alibi_form="distance", attn_bias=None, relative_attention_bias=None, sinks=None, grad_lse=None,
                 keep_mask=None, dropout_p=None, dropout_seed=None, **packed):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        table = relative_attention_bias
        p, t, _ = self._p(q, k_rep, visible, scale, softcap, alibi_slopes, alibi_form, attn_bias, table, sinks)
        if dropout_seed is not None:
            keep_mask = np.random.default_rng(dropout_seed).random(p.shape) >= dropout_p
        w = 1.0 if keep_mask is None else (keep_mask / (1.0 - dropout_p)).astype(q.dtype)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep) * w
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        if grad_lse is not None:  # the LSE an output: dLSE_i / dS_ij = P_ij
            ds = ds + p * grad_lse[..., None]
        dbias = None
        if attn_bias is not None:  # the gradient at the bias (after the cap), summed where it is broadcast
            axes = tuple(i for i in (0, 1) if attn_bias.shape[i] == 1 and ds.shape[i] != 1)
            dbias = ds.sum(axis=axes, keepdims=True) if axes else ds
        dslopes = None
        if alibi_slopes is not None and getattr(self, "learned_slopes", False):
            dslopes = np.einsum("bhij,ij->h", ds, _alibi_d(q.shape[2], k.shape[2], alibi_form)).astype(ds.dtype)
        dsinks = None
        if sinks is not None and getattr(self, "learned_sinks", False):  # the sink column's dS = p (G_L - D) per row
            dsinks = -ds.sum(axis=(0, 2, 3)).astype(ds.dtype)
            if grad_lse is not None:  # the full row (sink included) sums to G_L
                dsinks = dsinks + grad_lse.sum(axis=(0, 2)).astype(ds.dtype)
        dtable = None
        if table is not None:  # the embedding's backward: each pair's gradient added into its bucket
            dtable = np.zeros_like(table)
            np.add.at(dtable, _relative(q.shape[2], k.shape[2], table.shape[0]), np.moveaxis(ds.sum(0), 0, -1))
        if softcap:
            ds = ds * (1 - t * t)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), scale * np.einsum("bhij,bhid->bhjd", ds, q))
        np.add.at(dv, (slice(None), kv_map), np.einsum("bhij,bhid->bhjd", p * w, grad_o))
        out = (scale * np.einsum("bhij,bhjd->bhid", ds, k_rep), dk, dv)
        return out + tuple(x for x in (dbias, dtable, dslopes, dsinks) if x is not None)


class _LearnedSlopes(_NumpyVariants):
    learned_slopes = True  # alibi: {grad: true}: the backward returns the slopes' gradient last


class _LearnedSinks(_NumpyVariants):
    learned_sinks = True  # sinks: {grad: true}: the backward returns the sinks' gradient last


class _LearnedSlopesSinks(_LearnedSlopes):
    learned_sinks = True


numpy_variants = _NumpyVariants()
numpy_variants_learned_slopes = _LearnedSlopes()
numpy_variants_learned_sinks = _LearnedSinks()
numpy_variants_learned_slopes_sinks = _LearnedSlopesSinks()


def torch_variants(q, k, v, visible, scale, kv_map, softcap=None, alibi_slopes=None, alibi_form="distance",
                   attn_bias=None, relative_attention_bias=None, sinks=None, return_lse=False, keep_mask=None,
                   dropout_p=None, dropout_seed=None, **packed):
    import torch
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if attn_bias is not None:
        s = s + attn_bias
    if relative_attention_bias is not None:
        t = relative_attention_bias
        idx = torch.as_tensor(_relative(q.shape[2], k.shape[2], t.shape[0]), device=t.device)
        s = s + t[idx].permute(2, 0, 1).to(s.dtype)
    if alibi_slopes is not None:
        d = torch.as_tensor(_alibi_d(q.shape[2], k.shape[2], alibi_form), dtype=q.dtype, device=q.device)
        s = s + alibi_slopes.to(q.dtype)[:, None, None] * d
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # gpt-oss's eager form: the sink a column of the softmax, then dropped
        col = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, col], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    if dropout_seed is not None:  # dropout: {drawn_by: code}: from torch's global generator (the tool seeds it)
        keep_mask = torch.rand(p.shape, dtype=torch.float64, device=p.device) >= dropout_p
    if keep_mask is not None:
        p = p * keep_mask / (1.0 - dropout_p)
    o = p @ v[:, kv_map]
    out = (o, torch.logsumexp(s, dim=-1)) if return_lse else (o,)
    out += (keep_mask,) if dropout_seed is not None else ()
    return out if len(out) > 1 else o


def jax_variants(q, k, v, visible, scale, kv_map, softcap=None, alibi_slopes=None, alibi_form="distance",
                 attn_bias=None, relative_attention_bias=None, sinks=None, return_lse=False, keep_mask=None,
                 dropout_p=None, dropout_seed=None, **packed):
    import jax
    import jax.numpy as jnp
    s = scale * (q @ jnp.swapaxes(k[:, kv_map], -1, -2))
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if attn_bias is not None:
        s = s + attn_bias
    if relative_attention_bias is not None:
        t = relative_attention_bias
        s = s + jnp.moveaxis(t[_relative(q.shape[2], k.shape[2], t.shape[0])], -1, 0).astype(s.dtype)
    if alibi_slopes is not None:
        bias = jnp.asarray(alibi_slopes)[:, None, None] * _alibi_d(q.shape[2], k.shape[2], alibi_form)
        s = s + bias.astype(s.dtype)
    s = jnp.where(visible, s, -jnp.inf)
    if sinks is not None:
        col = jnp.broadcast_to(jnp.asarray(sinks, dtype=s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
        s = jnp.concatenate([s, col], axis=-1)
        p = jax.nn.softmax(s, axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    if dropout_seed is not None:
        keep_mask = jax.random.bernoulli(jax.random.key(dropout_seed), 1.0 - dropout_p, p.shape)
    if keep_mask is not None:
        p = p * keep_mask / (1.0 - dropout_p)
    o = p @ v[:, kv_map]
    out = (o, jax.nn.logsumexp(s, axis=-1)) if return_lse else (o,)
    out += (keep_mask,) if dropout_seed is not None else ()
    return out if len(out) > 1 else o


# A packed batch (``varlen:``) written as FlashAttention's varlen users write it: a loop over the documents of
# cu_seqlens, each its own attention under its block of the visible set (NumPy with a hand-written backward; torch
# by autograd). The variant implementations above read the packed visible set instead and ignore cu_seqlens.

def _documents(cu_q, cu_k):
    return [(int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])) for d in range(len(cu_q) - 1)]


class _NumpyVarlen:
    def forward(self, q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, **lengths):
        o = np.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        for q0, q1, k0, k1 in _documents(cu_seqlens_q, cu_seqlens_k):
            if q1 > q0:
                sub = (q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], visible[:, :, q0:q1, k0:k1], scale, kv_map)
                o[:, :, q0:q1] = einsum.forward(*sub)
        return o

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, cu_seqlens_q, cu_seqlens_k, **lengths):
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        for q0, q1, k0, k1 in _documents(cu_seqlens_q, cu_seqlens_k):
            if q1 > q0:
                sub = (q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], visible[:, :, q0:q1, k0:k1], scale, kv_map)
                a, b, c = einsum.backward(*sub, grad_o[:, :, q0:q1])
                dq[:, :, q0:q1], dk[:, :, k0:k1], dv[:, :, k0:k1] = a, b, c
        return dq, dk, dv


numpy_varlen = _NumpyVarlen()


def torch_varlen(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, **lengths):
    import torch
    out = []
    for q0, q1, k0, k1 in _documents(cu_seqlens_q.tolist(), cu_seqlens_k.tolist()):
        if q1 > q0:
            s = scale * (q[:, :, q0:q1] @ k[:, kv_map, k0:k1].transpose(-1, -2))
            p = torch.softmax(s.masked_fill(~visible[:, :, q0:q1, k0:k1], float("-inf")), dim=-1)
            out.append(p @ v[:, kv_map, k0:k1])
    return torch.cat(out, dim=2)


# Context-parallel attention per rank (``distributed:``), as users write it: examples/context_parallel.py's
# all-gather attention (K and V in one all_gather, padded for uneven shards, its gradient made contiguous for
# torch.distributed.nn.functional's gloo backward, the mask from global positions).

def cp_allgather(*args, **kw):
    return _example("context_parallel.py", "allgather_attention")(*args, **kw)


def cp_jax_ring(*args, **kw):
    """JAX per-shard code under shard_map: a ppermute ring differentiated by JAX."""
    return _example("context_parallel_jax.py", "ring_attention")(*args, **kw)


def cp_jax_ring_vjp(*args, **kw):
    """The same ring with a hand-written two-ring backward (jax.custom_vjp)."""
    return _example("context_parallel_jax.py", "ring_attention_vjp")(*args, **kw)


def cp_jax_allgather(*args, **kw):
    """lax.all_gather of K/V (takes sinks=)."""
    return _example("context_parallel_jax.py", "allgather_attention")(*args, **kw)


def cp_jax_ulysses(*args, **kw):
    """lax.all_to_all to head-sharded and back."""
    return _example("context_parallel_jax.py", "ulysses_attention")(*args, **kw)
