"""A torch attention with a hand-written backward (a custom autograd.Function), in the torch interface
attn-gradcheck checks: f(q, k, v, visible, scale, kv_map) -> o, gradients by autograd.

    q [B, Hq, n_q, d_head], k [B, Hkv, n_k, d_head], v [B, Hkv, n_k, d_value]
    visible bool [B, Hq, n_q, n_k] (True = visible), kv_map long [Hq]
"""
import torch


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
        s = (q @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        ctx.save_for_backward(q, k_rep, v_rep, p, kv_map)
        ctx.scale, ctx.heads_kv = scale, k.shape[1]
        return p @ v_rep

    @staticmethod
    def backward(ctx, grad_o):
        q, k_rep, v_rep, p, kv_map = ctx.saved_tensors
        dv_rep = p.transpose(-1, -2) @ grad_o
        dp = grad_o @ v_rep.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        dq = ds @ k_rep * ctx.scale
        dk_rep = ds.transpose(-1, -2) @ q * ctx.scale
        shape = (q.shape[0], ctx.heads_kv) + tuple(k_rep.shape[2:])
        dk = torch.zeros(shape, dtype=q.dtype, device=q.device).index_add_(1, kv_map, dk_rep)
        dv = torch.zeros(shape[:3] + (v_rep.shape[-1],), dtype=q.dtype, device=q.device).index_add_(1, kv_map, dv_rep)
        return dq, dk, dv, None, None, None


def attention(q, k, v, visible, scale, kv_map):
    return _Attention.apply(q, k, v, visible, scale, kv_map)


class _NoSoftmaxTerm(_Attention):
    @staticmethod
    def backward(ctx, grad_o):
        q, k_rep, v_rep, p, kv_map = ctx.saved_tensors
        _, _, dv, *_ = _Attention.backward(ctx, grad_o)
        ds = p * (grad_o @ v_rep.transpose(-1, -2))  # the seed's first exercise: the row-sum term is dropped
        dk = torch.zeros(dv.shape[:3] + (q.shape[-1],), dtype=q.dtype, device=q.device)
        dk.index_add_(1, kv_map, ds.transpose(-1, -2) @ q * ctx.scale)
        return ds @ k_rep * ctx.scale, dk, dv, None, None, None


def broken_attention(q, k, v, visible, scale, kv_map):
    """The same, with the softmax row-sum term dropped from the backward."""
    return _NoSoftmaxTerm.apply(q, k, v, visible, scale, kv_map)
