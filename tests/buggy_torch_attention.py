"""BUGGY torch attention implementations (torch flavour), one bug each, for the tests of the verdict
(tests/test_hints.py).
callable f(q, k, v, visible, scale, kv_map) -> o, built on a custom torch.autograd.Function whose
backward is hand-written. ``CATALOG = {name: (callable, cause_tag, description)}``.

    q [B, Hq, n_q, d_head], k [B, Hkv, n_k, d_head], v [B, Hkv, n_k, d_value]
    visible bool [B, Hq, n_q, n_k] (True = visible), kv_map long [Hq]

Every bug starts from ``_Attention`` (correct; the maths of examples/torch_attention.py) and changes one thing.
"""
import torch


def _probs(q, k_rep, visible, scale):
    s = (q @ k_rep.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1)


def _sum_groups(g_rep, kv_map, heads_kv):
    shape = (g_rep.shape[0], heads_kv) + tuple(g_rep.shape[2:])
    return torch.zeros(shape, dtype=g_rep.dtype, device=g_rep.device).index_add_(1, kv_map, g_rep)


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
    def grads(ctx, grad_o, row_sum=True):
        q, k_rep, v_rep, p, kv_map = ctx.saved_tensors
        dv_rep = p.transpose(-1, -2) @ grad_o
        dp = grad_o @ v_rep.transpose(-1, -2)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True)) if row_sum else p * dp
        dq = ds @ k_rep * ctx.scale
        dk_rep = ds.transpose(-1, -2) @ q * ctx.scale
        return dq, _sum_groups(dk_rep, kv_map, ctx.heads_kv), _sum_groups(dv_rep, kv_map, ctx.heads_kv)

    @staticmethod
    def backward(ctx, grad_o):
        dq, dk, dv = _Attention.grads(ctx, grad_o)
        return dq, dk, dv, None, None, None


class _DkTimes1001(_Attention):
    @staticmethod
    def backward(ctx, grad_o):
        dq, dk, dv = _Attention.grads(ctx, grad_o)
        return dq, dk * 1.001, dv, None, None, None


class _SoftmaxRowsum(_Attention):
    @staticmethod
    def backward(ctx, grad_o):
        dq, dk, dv = _Attention.grads(ctx, grad_o, row_sum=False)
        return dq, dk, dv, None, None, None


class _InplaceGradO(_Attention):
    @staticmethod
    def backward(ctx, grad_o):
        grad_o.mul_(0.35)  # BUG: mutates autograd's (the caller's) upstream gradient, and uses it
        dq, dk, dv = _Attention.grads(ctx, grad_o)
        return dq, dk, dv, None, None, None


class _Nondeterministic(_Attention):
    @staticmethod
    def backward(ctx, grad_o):
        dq, dk, dv = _Attention.grads(ctx, grad_o)
        dk = dk + torch.randn_like(dk) * (1e-9 * dk.abs().max())
        return dq, dk, dv, None, None, None


class _Float32Internal(_Attention):
    """NOT a bug: float32 inside, input dtype outside."""

    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        ctx.dtype = q.dtype
        return _Attention.forward(ctx, q.float(), k.float(), v.float(), visible, scale, kv_map).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_o):
        dq, dk, dv = _Attention.grads(ctx, grad_o.float())
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None, None


class _MaskIgnored(_Attention):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        return _Attention.forward(ctx, q, k, v, torch.ones_like(visible), scale, kv_map)


class _InplaceInput(_Attention):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        o = _Attention.forward(ctx, q.clone(), k, v, visible, scale, kv_map)
        q.mul_(1.0 + 1e-3)  # BUG: side effect on the caller's q (output computed from the original)
        return o


def _wrap(fn_cls, doc):
    def f(q, k, v, visible, scale, kv_map):
        return fn_cls.apply(q, k, v, visible, scale, kv_map)
    f.__doc__ = doc
    return f


correct = _wrap(_Attention, "Correct reference (custom autograd.Function, hand-written backward).")
dk_times_1001 = _wrap(_DkTimes1001, "dk multiplied by 1.001.")
softmax_rowsum = _wrap(_SoftmaxRowsum, "Backward drops the softmax row-sum term: dS = P * dP.")
inplace_grad_o = _wrap(_InplaceGradO, "Backward does grad_o.mul_(0.35), then computes gradients from it.")
nondeterministic_backward = _wrap(_Nondeterministic, "dk + torch.randn noise of 1e-9 x max|dk| on each call.")
float32_internal_correct = _wrap(_Float32Internal, "NOT a bug: float32 inside, cast back to the input dtype.")
mask_ignored = _wrap(_MaskIgnored, "Forward (hence the saved P and the backward) ignores `visible`.")
inplace_input = _wrap(_InplaceInput, "Forward does q.mul_(1.001) after computing o (side effect only).")

CATALOG = {
    "correct": (correct, "none", "the correct reference"),
    "dk-times-1.001": (dk_times_1001, "constant-factor-k", "dk multiplied by 1.001"),
    "softmax-rowsum": (softmax_rowsum, "softmax-rowsum", "backward drops the row-sum term: dS = P * dP"),
    "inplace-grad-o": (inplace_grad_o, "mutation", "backward does grad_o.mul_(0.35) and uses it"),
    "nondeterministic-backward": (nondeterministic_backward, "nondeterminism", "dk + 1e-9 x max|dk| noise per call"),
    "float32-internal-correct": (float32_internal_correct, "precision", "NOT a bug: float32 internally"),
    "mask-ignored": (mask_ignored, "forward-mask-leak", "forward and backward ignore `visible`"),
    "inplace-input": (inplace_input, "mutation", "forward does q.mul_(1.001) after computing o"),
}
