"""torch implementations of the norms, RoPE and the SwiGLU MLP, as users write them: one callable each,
differentiated by autograd (the tool computes every gradient with torch.autograd.grad)."""
import torch
import torch.nn.functional as F


def layernorm(x, gamma, beta, eps):
    return F.layer_norm(x, x.shape[-1:], gamma, beta, eps)


def rmsnorm(x, gamma, eps):
    return gamma * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rmsnorm_detached(x, gamma, eps):
    # bug: the normalisation scale is detached (a "stop-gradient" left in), so autograd misses its feedback
    return gamma * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps).detach()


def rope(x, cos, sin):
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], dim=-1)


def swiglu(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def infonce(q, p, n, tau):
    # DPR: each query's candidates are every positive of the batch and every hard negative (n [B, k, dim])
    candidates = torch.cat([p, n.reshape(-1, n.shape[-1])])
    return F.cross_entropy(q @ candidates.T / tau, torch.arange(len(q)), reduction="none")


def infonce_detached_lse(q, p, n, tau):
    # bug: the log-sum-exp is detached (computed "for stability" and left out of the graph), so autograd
    # misses the gradient of the softmax denominator
    z = q @ torch.cat([p, n.reshape(-1, n.shape[-1])]).T / tau
    return torch.logsumexp(z, dim=-1).detach() - z.diagonal()
