"""More realistic buggy torch attention implementations (custom autograd.Function), one bug each, written
by an independent review for tests/test_hints.py.
f(q, k, v, visible, scale, kv_map) -> o; gradients by autograd through the hand-written backward."""
import torch


def _sum_groups(g_rep, kv_map, heads_kv):
    shape = (g_rep.shape[0], heads_kv) + tuple(g_rep.shape[2:])
    return torch.zeros(shape, dtype=g_rep.dtype, device=g_rep.device).index_add_(1, kv_map, g_rep)


def _probs(q, k_rep, visible, scale):
    s = (q @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1)


class _Attention(torch.autograd.Function):
    """Correct reference."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
        p = _probs(q, k_rep, visible, scale)
        ctx.save_for_backward(q, k_rep, v_rep, p, kv_map)
        ctx.scale, ctx.heads_kv = scale, k.shape[1]
        return p @ v_rep

    @staticmethod
    def grads(ctx, grad_o):
        q, k_rep, v_rep, p, kv_map = ctx.saved_tensors
        dv_rep = p.transpose(-1, -2) @ grad_o
        dp = grad_o @ v_rep.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        dq = ds @ k_rep * ctx.scale
        dk_rep = ds.transpose(-1, -2) @ q * ctx.scale
        return dq, _sum_groups(dk_rep, kv_map, ctx.heads_kv), _sum_groups(dv_rep, kv_map, ctx.heads_kv)

    @staticmethod
    def backward(ctx, grad_o):
        return (*_Attention.grads(ctx, grad_o), None, None, None)


# ------------------------------------------------------------------ T1. dropout left on (training=True)
class _DropoutLeftOn(_Attention):
    """attention dropout p=0.1 left on (module in training mode); the mask is drawn anew on every call and
    saved for the backward, so each call's backward is the exact VJP of its own random forward."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
        p = _probs(q, k_rep, visible, scale)
        keep = (torch.rand_like(p) >= 0.1).to(p.dtype) / 0.9  # BUG: dropout in the checked path
        ctx.save_for_backward(q, k_rep, v_rep, p, kv_map, keep)
        ctx.scale, ctx.heads_kv = scale, k.shape[1]
        return (p * keep) @ v_rep

    @staticmethod
    def backward(ctx, grad_o):
        q, k_rep, v_rep, p, kv_map, keep = ctx.saved_tensors
        pd = p * keep
        dv_rep = pd.transpose(-1, -2) @ grad_o
        dpd = grad_o @ v_rep.transpose(-1, -2)
        dp = dpd * keep
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        dq = ds @ k_rep * ctx.scale
        dk_rep = ds.transpose(-1, -2) @ q * ctx.scale
        return (dq, _sum_groups(dk_rep, kv_map, ctx.heads_kv), _sum_groups(dv_rep, kv_map, ctx.heads_kv),
                None, None, None)


# --------------------------------------------------------------- T2. exp without max subtraction
class _NoMaxSubtraction(_Attention):
    """softmax written by hand as exp(s) / sum(exp(s)) with no max subtraction: exact maths, overflows
    to inf (then NaN) once a logit exceeds ~11 in float16 / ~88 in float32."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
        s = (q @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        e = torch.exp(s)  # BUG: no s - rowmax
        p = e / e.sum(dim=-1, keepdim=True)
        ctx.save_for_backward(q, k_rep, v_rep, p, kv_map)
        ctx.scale, ctx.heads_kv = scale, k.shape[1]
        return p @ v_rep


# --------------------------------------------------- T3. log-sum-exp saved before the scale is applied
class _LseBeforeScale(_Attention):
    """FlashAttention-style: forward saves LSE per row, backward recomputes P = exp(scale*QK^T - LSE).
    BUG: the LSE is of the UNscaled logits (logsumexp(QK^T)); forward output itself is right."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
        raw = (q @ k_rep.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
        s = raw * scale
        lse = torch.logsumexp(raw, dim=-1, keepdim=True)  # BUG: should be logsumexp(s)
        o = torch.softmax(s, dim=-1) @ v_rep
        ctx.save_for_backward(q, k_rep, v_rep, lse, kv_map, visible, o)
        ctx.scale, ctx.heads_kv = scale, k.shape[1]
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k_rep, v_rep, lse, kv_map, visible, o = ctx.saved_tensors
        s = (q @ k_rep.transpose(-1, -2) * ctx.scale).masked_fill(~visible, float("-inf"))
        p = torch.exp(s - lse)
        dv_rep = p.transpose(-1, -2) @ grad_o
        dp = grad_o @ v_rep.transpose(-1, -2)
        delta = (grad_o * o).sum(dim=-1, keepdim=True)
        ds = p * (dp - delta)
        dq = ds @ k_rep * ctx.scale
        dk_rep = ds.transpose(-1, -2) @ q * ctx.scale
        return (dq, _sum_groups(dk_rep, kv_map, ctx.heads_kv), _sum_groups(dv_rep, kv_map, ctx.heads_kv),
                None, None, None)


# ---------------------------------------------- T4. delta = rowsum(dO * O) unsqueezed on the wrong axis
class _DeltaNoKeepdim(_Attention):
    """FlashAttention-style backward with delta = rowsum(dO * O) re-expanded on the wrong axis
    (unsqueeze(-2) -> [B, H, 1, n_q] instead of [B, H, n_q, 1]): delta[j] is subtracted in column j.
    Broadcasts silently when n_q == n_k."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k.index_select(1, kv_map), v.index_select(1, kv_map)
        p = _probs(q, k_rep, visible, scale)
        o = p @ v_rep
        ctx.save_for_backward(q, k_rep, v_rep, p, kv_map, o)
        ctx.scale, ctx.heads_kv = scale, k.shape[1]
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k_rep, v_rep, p, kv_map, o = ctx.saved_tensors
        dv_rep = p.transpose(-1, -2) @ grad_o
        dp = grad_o @ v_rep.transpose(-1, -2)
        delta = (grad_o * o).sum(dim=-1).unsqueeze(-2)  # BUG: unsqueeze(-1) intended ([B, H, n_q, 1])
        ds = p * (dp - delta)
        dq = ds @ k_rep * ctx.scale
        dk_rep = ds.transpose(-1, -2) @ q * ctx.scale
        return (dq, _sum_groups(dk_rep, kv_map, ctx.heads_kv), _sum_groups(dv_rep, kv_map, ctx.heads_kv),
                None, None, None)


def _wrap(cls):
    def f(q, k, v, visible, scale, kv_map):
        return cls.apply(q, k, v, visible, scale, kv_map)
    return f


correct = _wrap(_Attention)
dropout_left_on = _wrap(_DropoutLeftOn)
no_max_subtraction = _wrap(_NoMaxSubtraction)
lse_before_scale = _wrap(_LseBeforeScale)
delta_no_keepdim = _wrap(_DeltaNoKeepdim)
