"""Hand-written torch and JAX layers with the mistakes their authors make (custom backwards, detached statistics);
see dense_bugs.py. torch: a callable f(inputs..., args...) -> y, differentiated by autograd; JAX: the same on JAX
arrays, differentiated by jax.vjp (custom_vjp where the bug is in a hand-written backward)."""
import torch


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps):
        rms = torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, gamma, rms)
        return gamma * x / rms

    @staticmethod
    def backward(ctx, grad_y):
        x, gamma, rms = ctx.saved_tensors
        dx = grad_y * gamma / rms  # the normaliser taken as a constant
        dgamma = (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)
        return dx, dgamma, None


def rmsnorm_function_no_feedback(x, gamma, eps):
    return _RMSNormFn.apply(x, gamma, eps)


def rmsnorm_detached_rms(x, gamma, eps):
    rms = torch.sqrt((x * x).mean(-1, keepdim=True) + eps).detach()  # "a statistic, no gradient needed"
    return gamma * x / rms


def layernorm_detached_stats(x, gamma, beta, eps):
    mu = x.mean(-1, keepdim=True).detach()
    std = torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps).detach()
    return gamma * (x - mu) / std + beta


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2):
        a, b = x @ w1, x @ w3
        ctx.save_for_backward(x, w1, w3, w2, a, b)
        return (torch.nn.functional.silu(a) * b) @ w2

    @staticmethod
    def backward(ctx, grad_y):
        x, w1, w3, w2, a, b = ctx.saved_tensors
        s = torch.sigmoid(a)
        act = a * s
        dh = grad_y @ w2.T
        da, db = dh * b * s, dh * act  # SiLU'(a) taken as sigmoid(a)
        rows = x.reshape(-1, x.shape[-1])
        return (da @ w1.T + db @ w3.T, rows.T @ da.reshape(-1, da.shape[-1]), rows.T @ db.reshape(-1, db.shape[-1]),
                (act * b).reshape(-1, b.shape[-1]).T @ grad_y.reshape(-1, grad_y.shape[-1]))


def swiglu_function_sigmoid(x, w1, w3, w2):
    return _SwiGLUFn.apply(x, w1, w3, w2)


def rmsnorm(x, gamma, eps):
    """Correct."""
    return gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


RMS = {"op": "rmsnorm", "batch": 2, "n": 5, "d_model": 16, "backend": "torch"}
LN = {"op": "layernorm", "batch": 2, "n": 4, "d_model": 8, "backend": "torch"}
SWIGLU = {"op": "swiglu", "batch": 2, "n": 4, "d_model": 8, "d_ff": 12, "backend": "torch"}

#: (function, the cause the report must name, scenario keys)
BUGS = [
    ("rmsnorm", None, RMS),
    ("rmsnorm_function_no_feedback", "rmsnorm-feedback", RMS),
    ("rmsnorm_detached_rms", "rmsnorm-feedback", RMS),
    ("layernorm_detached_stats", "layernorm-both-feedbacks", LN),
    ("swiglu_function_sigmoid", "silu-derivative-sigmoid", SWIGLU),
]
