"""Recipe: PyTorch's FlexAttention with a soft-capping ``score_mod`` (Gemma 2's) and a document ``mask_mod`` (a
packed batch, FlashAttention's varlen layout), checked as it is.

``torch.nn.attention.flex_attention.flex_attention`` takes the score modification as a function of
``(score, b, h, q_idx, kv_idx)`` and the mask as a ``BlockMask`` made by ``create_block_mask`` from
``mask_mod(b, h, q_idx, kv_idx)``. Here the ``mask_mod`` keeps each query to its own document's keys
(``cu_seqlens``), causal aligned to the lower right of each document, and the ``score_mod`` caps the scores at
``softcap``. GQA: ``enable_gqa=True`` reads contiguous groups of query heads per KV head.

**CUDA only.** In torch 2.13 FlexAttention has no backward on the CPU (``NotImplementedError: FlexAttention does
not support backward on CPU``): its scenarios set ``device: cuda`` and the loader refuses them on a machine
without a GPU (exit 2, naming ``device``); run on a CPU with ``device: cpu`` they fail ``implementation runs`` with
a hint saying so. Its forward runs on the CPU (``tests/test_recipes.py`` compares it with the reference there).

Broken on purpose: ``flex_no_documents`` builds the causal ``mask_mod`` over the packed axis without the document
test (documents see each other), and ``flex_tanh_unscaled`` caps as ``softcap * tanh(score)`` (the division by the
cap dropped)."""
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def _documents(cu_seqlens, n, device):
    """Each packed position's document, and each document's first position and length, as tensors."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.bucketize(torch.arange(n, device=device), bounds[1:], right=True)
    return doc, bounds[:-1], bounds[1:] - bounds[:-1]


def _flex(q, k, v, scale, kv_map, softcap, cu_seqlens_q, cu_seqlens_k, documents=True, divide=True):
    n_q, n_k = q.shape[2], k.shape[2]
    doc_q, q0, lq = _documents(cu_seqlens_q, n_q, q.device)
    doc_k, k0, lk = _documents(cu_seqlens_k, n_k, q.device)

    def mask_mod(b, h, q_idx, kv_idx):
        dq, dk = doc_q[q_idx], doc_k[kv_idx]
        causal = (kv_idx - k0[dk]) <= (q_idx - q0[dq]) + (lk[dq] - lq[dq])  # lower-right within the document
        return (dq == dk) & causal if documents else kv_idx <= q_idx + (n_k - n_q)

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap if divide else score)

    block_mask = create_block_mask(mask_mod, None, None, n_q, n_k, device=q.device)
    groups = q.shape[1] // k.shape[1]
    if (kv_map.cpu() != torch.arange(q.shape[1]) // groups).any():  # flex's GQA reads contiguous groups
        k, v = k[:, kv_map], v[:, kv_map]
    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=k.shape[1] != q.shape[1])


def flex(q, k, v, visible, scale, kv_map, *, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return _flex(q, k, v, scale, kv_map, softcap, cu_seqlens_q, cu_seqlens_k)


def flex_no_documents(q, k, v, visible, scale, kv_map, *, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k):
    return _flex(q, k, v, scale, kv_map, softcap, cu_seqlens_q, cu_seqlens_k, documents=False)


def flex_tanh_unscaled(q, k, v, visible, scale, kv_map, *, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k):
    return _flex(q, k, v, scale, kv_map, softcap, cu_seqlens_q, cu_seqlens_k, divide=False)
