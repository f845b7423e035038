"""Torch attentions in half precision whose errors are a known multiple of the plain computations' (for
tests/test_low_precision_rule.py), and a FlashAttention-style backward that keeps the log-sum-exp in the
input dtype between forward and backward.

times(K): on every element of O, dQ, dK and dV, the float64 reference plus K times the error of the plain way
of computing that tensor that errs most (torch autograd of the plain forward, the closed forms, SDPA, all in
the input dtype: the plain computations the tool measures E_plain on). K = 1 is as accurate as a plain
computation, K = 4 four times less."""
import torch

from gradcheck_cli.ops.attention.torch_engine import formulas


def _ways(q, k, v, visible, scale, kv_map, grad_o):
    """Each plain way's (o, dq, dk, dv) in q's dtype, and the float64 reference's."""
    def autograd(fn, dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            o = fn(*leaves)
            grads = torch.autograd.grad(o, leaves, grad_o.to(dt))
        return (o.detach(), *grads)

    plain = autograd(lambda q_, k_, v_: formulas.forward(q_, k_, v_, visible, scale, kv_map), q.dtype)
    closed = (formulas.forward(q, k, v, visible, scale, kv_map),
              *formulas.backward(q, k, v, visible, scale, kv_map, grad_o))
    sdpa = autograd(lambda q_, k_, v_: formulas.sdpa(q_, k_, v_, visible, scale, kv_map, q.shape[1]), q.dtype)
    ref = autograd(lambda q_, k_, v_: formulas.forward(q_, k_, v_, visible, scale, kv_map), torch.float64)
    return (plain, closed, sdpa), ref


def _times(ways, ref, factor, i):
    worst = max((w[i] for w in ways), key=lambda w: float((w.double() - ref[i]).abs().max()))
    return (ref[i] + factor * (worst.double() - ref[i])).to(worst.dtype)


class _Times(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map, factor):
        ctx.save_for_backward(q, k, v, visible, kv_map)
        ctx.scale, ctx.factor = scale, factor
        ways, ref = _ways(q, k, v, visible, scale, kv_map, torch.zeros_like(q[..., :v.shape[-1]]))
        return _times(ways, ref, factor, 0)

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, visible, kv_map = ctx.saved_tensors
        ways, ref = _ways(q, k, v, visible, ctx.scale, kv_map, grad_o)
        return tuple(_times(ways, ref, ctx.factor, i) for i in (1, 2, 3)) + (None,) * 4


def times(factor: float):
    return lambda q, k, v, visible, scale, kv_map: _Times.apply(q, k, v, visible, scale, kv_map, factor)


as_plain, four_times_plain = times(1.0), times(4.0)


class _LseInDtype(torch.autograd.Function):
    """Forward in float32 from the inputs, the log-sum-exp saved in the input dtype; the backward recomputes
    P = exp(S - LSE) with that rounded LSE (every row's weights off by the same factor)."""
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map).float(), v.index_select(1, kv_map).float()
        s = (q.float() @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        o = (torch.exp(s - lse) @ v_rep).to(q.dtype)
        ctx.save_for_backward(q, k, v, visible, kv_map, lse.to(q.dtype), o)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, visible, kv_map, lse, o = ctx.saved_tensors
        k_rep, v_rep, g = k.index_select(1, kv_map).float(), v.index_select(1, kv_map).float(), grad_o.float()
        s = (q.float() @ k_rep.transpose(-1, -2) * ctx.scale).masked_fill(~visible, float("-inf"))
        p = torch.exp(s - lse.float())
        ds = p * (g @ v_rep.transpose(-1, -2) - (o.float() * g).sum(-1, keepdim=True))
        dk_rep, dv_rep = ds.transpose(-1, -2) @ q.float() * ctx.scale, p.transpose(-1, -2) @ g
        dk = torch.zeros(k.shape, dtype=torch.float32).index_add_(1, kv_map, dk_rep)
        dv = torch.zeros(v.shape, dtype=torch.float32).index_add_(1, kv_map, dv_rep)
        return (ds @ k_rep * ctx.scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def lse_in_dtype(q, k, v, visible, scale, kv_map):
    return _LseInDtype.apply(q, k, v, visible, scale, kv_map)
