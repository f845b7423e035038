"""Attention over a packed variable-length batch (FlashAttention's varlen), written the ways people write it.
attn-gradcheck passes cu_seqlens_q=, cu_seqlens_k= (int32 offsets, documents + 1), max_seqlen_q= and max_seqlen_k=
when a scenario sets ``varlen:``; q is [B, Hq, total_q, d] (B = 1, or the perturbed copies stacked along it), every
batch element the same packed layout.

    numpy_attention   a NumPy object: a loop over the documents, each its own softmax under its block of visible,
                      with a hand-written backward
    torch_attention   plain torch, FlashAttention's varlen convention written out: per document, causal aligned
                      bottom-right on its own keys (it reads cu_seqlens, not visible), autograd for the backward
    jax_attention     a JAX function on the packed visible set (it ignores cu_seqlens)
    torch_packed_causal      broken: one causal mask over the packed axis (documents see the ones before them)
    torch_top_left           broken: each document's causal mask aligned top-left (torch.tril without the offset)
    torch_single_query_path  broken: a document of one query takes a "decode" path that reads every key up to its
                             document's end, across document boundaries (flash-attention #1537's kind)
    torch_alibi_attention    with ALiBi (alibi_slopes=), each document's own positions, as FlashAttention's varlen
    torch_alibi_packed_positions  broken: ALiBi's distances taken on the packed axis, not within the document
"""
import numpy as np


def _documents(cu_q, cu_k):
    return [(int(cu_q[d]), int(cu_q[d + 1]), int(cu_k[d]), int(cu_k[d + 1])) for d in range(len(cu_q) - 1)]


class NumpyVarlen:
    def forward(self, q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        o = np.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        for q0, q1, k0, k1 in _documents(cu_seqlens_q, cu_seqlens_k):
            if q1 > q0:
                p = self._probabilities(q[:, :, q0:q1], k[:, kv_map, k0:k1], visible[:, :, q0:q1, k0:k1], scale)
                o[:, :, q0:q1] = p @ v[:, kv_map, k0:k1]
        return o

    @staticmethod
    def _probabilities(q, k, visible, scale):
        s = np.where(visible, scale * (q @ np.swapaxes(k, -1, -2)), -np.inf)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k):
        dq, dk_rep = np.zeros_like(q), np.zeros(q.shape[:2] + k.shape[2:], dtype=q.dtype)
        dv_rep = np.zeros(q.shape[:2] + v.shape[2:], dtype=q.dtype)
        for q0, q1, k0, k1 in _documents(cu_seqlens_q, cu_seqlens_k):
            if q1 == q0:
                continue
            k_d, v_d, g = k[:, kv_map, k0:k1], v[:, kv_map, k0:k1], grad_o[:, :, q0:q1]
            p = self._probabilities(q[:, :, q0:q1], k_d, visible[:, :, q0:q1, k0:k1], scale)
            dv_rep[:, :, k0:k1] = np.swapaxes(p, -1, -2) @ g
            dp = g @ np.swapaxes(v_d, -1, -2)
            ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
            dq[:, :, q0:q1] = scale * ds @ k_d
            dk_rep[:, :, k0:k1] = scale * np.swapaxes(ds, -1, -2) @ q[:, :, q0:q1]
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), dk_rep)
        np.add.at(dv, (slice(None), kv_map), dv_rep)
        return dq, dk, dv


numpy_attention = NumpyVarlen()


def _torch_varlen(q, k, v, scale, kv_map, cu_q, cu_k, align="bottom-right", single_query_path=False,
                  alibi_slopes=None, packed_positions=False):
    """Per document: S = scale q k^T (+ ALiBi's -m_h |i' + L_k - L_q - j'| on the document's own positions),
    causal (bottom-right on the document's own keys, or top-left), softmax, P V."""
    import torch
    out = []
    for q0, q1, k0, k1 in _documents(cu_q.tolist(), cu_k.tolist()):
        if q1 == q0:
            continue
        if single_query_path and q1 - q0 == 1:
            k0 = 0  # the bug: the one-query path reads every key before its document's end
        qd, kd, vd = q[:, :, q0:q1], k[:, kv_map, k0:k1], v[:, kv_map, k0:k1]
        lq, lk = q1 - q0, k1 - k0
        offset = (lk - lq) if align == "bottom-right" else 0
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(offset)
        s = scale * (qd @ kd.transpose(-1, -2))
        if alibi_slopes is not None:  # FlashAttention's varlen ALiBi: each document's own positions
            i = torch.arange(lq, device=q.device)[:, None] + lk - lq + (q0 - k0 if packed_positions else 0)
            j = torch.arange(lk, device=q.device)[None, :]
            s = s - alibi_slopes.to(s.dtype)[:, None, None] * (i - j).abs().to(s.dtype)
        s = s.masked_fill(~causal, float("-inf"))
        out.append(torch.softmax(s, dim=-1) @ vd)
    return torch.cat(out, dim=2)


def torch_attention(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return _torch_varlen(q, k, v, scale, kv_map, cu_seqlens_q, cu_seqlens_k)


def torch_alibi_attention(q, k, v, visible, scale, kv_map, *, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                          max_seqlen_q, max_seqlen_k):
    return _torch_varlen(q, k, v, scale, kv_map, cu_seqlens_q, cu_seqlens_k, alibi_slopes=alibi_slopes)


def torch_alibi_packed_positions(q, k, v, visible, scale, kv_map, *, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k):
    return _torch_varlen(q, k, v, scale, kv_map, cu_seqlens_q, cu_seqlens_k, alibi_slopes=alibi_slopes,
                         packed_positions=True)


def torch_top_left(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return _torch_varlen(q, k, v, scale, kv_map, cu_seqlens_q, cu_seqlens_k, align="top-left")


def torch_single_query_path(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k):
    return _torch_varlen(q, k, v, scale, kv_map, cu_seqlens_q, cu_seqlens_k, single_query_path=True)


def torch_packed_causal(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    import torch
    zero = cu_seqlens_q[:1]  # the documents' boundaries dropped: one document of every query and key
    return _torch_varlen(q, k, v, scale, kv_map, torch.cat([zero, cu_seqlens_q[-1:]]),
                         torch.cat([zero, cu_seqlens_k[-1:]]))


def jax_attention(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    import jax
    import jax.numpy as jnp
    s = scale * (q @ jnp.swapaxes(k[:, kv_map], -1, -2))
    return jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1) @ v[:, kv_map]
