"""Attention as a torch ``autograd.Function`` with a hand-written backward *and* forward-mode derivative
(``jvp``), the way a JVP kernel for consistency-model or MeanFlow training is written, checked with
``check: {mode: jvp}`` (examples/torch_jvp.yaml). ``torch.func.jvp`` needs the function in the
``forward`` / ``setup_context`` style, with ``ctx.save_for_forward`` for what ``jvp`` reads.

    q [B, Hq, n_q, d], k [B, Hkv, n_k, d], v [B, Hkv, n_k, d_value], visible bool [B, Hq, n_q, n_k]
    (True = key visible), kv_map long [Hq]: query head r reads KV head kv_map[r].

JVP: dS = scale (dQ K^T + Q dK^T) on the visible set, mu_i = sum_j A_ij dS_ij,
     dO = (A * (dS - mu)) V + A dV.
``broken_attention`` leaves mu out: the bug the JVP check names (examples/torch_jvp.yaml).

Double backward (``check: {mode: hvp}``, examples/torch_hvp.yaml): autograd differentiates ``backward`` as it is
written. ``attention``'s backward recomputes A from the saved q and k, so its derivative is right;
``saved_weights_attention`` reads the A that ``setup_context`` saved, which autograd never saw being computed: its
gradients and JVP are right, its double backward silently wrong (A counts as a constant there).
"""
import torch


def _weights(q, k_rep, visible, scale):
    s = scale * q @ k_rep.transpose(-1, -2)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)


def _function(centre: bool, recompute: bool = True):
    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(q, k, v, visible, scale, kv_map):
            return _weights(q, k[:, kv_map], visible, scale) @ v[:, kv_map]

        @staticmethod
        def setup_context(ctx, inputs, output):
            q, k, v, visible, scale, kv_map = inputs
            a = _weights(q, k[:, kv_map], visible, scale)
            ctx.save_for_backward(q, k, v, a)
            ctx.save_for_forward(q, k, v, a)
            ctx.visible, ctx.scale, ctx.kv_map = visible, scale, kv_map

        @staticmethod
        def backward(ctx, grad_o):
            q, k, v, a = ctx.saved_tensors
            m, scale = ctx.kv_map, ctx.scale
            if recompute:  # from q and k, in autograd's view: double backward differentiates A too
                a = _weights(q, k[:, m], ctx.visible, scale)
            ga = grad_o @ v[:, m].transpose(-1, -2)
            gs = a * (ga - (a * ga).sum(-1, keepdim=True))
            dq = scale * gs @ k[:, m]
            dk = torch.zeros_like(k).index_add_(1, m, scale * gs.transpose(-1, -2) @ q)  # GQA: heads add up
            dv = torch.zeros_like(v).index_add_(1, m, a.transpose(-1, -2) @ grad_o)
            return dq, dk, dv, None, None, None

        @staticmethod
        def jvp(ctx, dq, dk, dv, *_):
            q, k, v, a = ctx.saved_tensors
            m, scale = ctx.kv_map, ctx.scale
            ds = scale * (dq @ k[:, m].transpose(-1, -2) + q @ dk[:, m].transpose(-1, -2))
            ds = ds.masked_fill(~ctx.visible, 0.0)
            if centre:
                ds = ds - (a * ds).sum(-1, keepdim=True)  # mu_i = sum_j A_ij dS_ij
            return (a * ds) @ v[:, m] + a @ dv[:, m]

    return Attention.apply


attention = _function(centre=True)
broken_attention = _function(centre=False)  # mu dropped: dO = (A * dS) V + A dV
saved_weights_attention = _function(centre=True, recompute=False)  # double backward treats A as a constant
