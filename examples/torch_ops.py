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


def _heads(t, heads):  # [B, n, H*d] -> [B, H, n, d]
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, rotate=lambda t: t, m=None):
    hq = visible.shape[1]
    hkv = w_k.shape[1] * hq // w_q.shape[1]  # the KV heads have the query heads' width
    s = x if m is None else m
    q, k, v = rotate(_heads(x @ w_q, hq)), rotate(_heads(s @ w_k, hkv)), _heads(s @ w_v, hkv)
    o = F.scaled_dot_product_attention(q, k[:, kv_map], v[:, kv_map], attn_mask=visible, scale=scale)
    return o.transpose(1, 2).flatten(-2) @ w_o


def attention_projections(x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
    return _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map)


def cross_attention(x, m, w_q, w_k, w_v, w_o, visible, scale, kv_map):
    return _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, m=m)


def block(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps):
    h = x + _attend(rmsnorm(x, gamma1, eps), w_q, w_k, w_v, w_o, visible, scale, kv_map,
                    rotate=lambda t: rope(t, cos, sin))
    return h + swiglu(rmsnorm(h, gamma2, eps), w1, w3, w2)


def block_detached_residual(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map,
                            eps):
    # bug: the attention residual is added detached (x.detach() + ...), so x gets no gradient through it
    h = x.detach() + _attend(rmsnorm(x, gamma1, eps), w_q, w_k, w_v, w_o, visible, scale, kv_map,
                             rotate=lambda t: rope(t, cos, sin))
    return h + swiglu(rmsnorm(h, gamma2, eps), w1, w3, w2)


class SwiGLU(torch.nn.Module):  # a module with weights, as a model would hold them (nn.Linear: [out, in])
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.gate = torch.nn.Linear(d_model, d_ff, bias=False)
        self.up = torch.nn.Linear(d_model, d_ff, bias=False)
        self.down = torch.nn.Linear(d_ff, d_model, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(()))  # not mapped: frozen, listed in the report

    def forward(self, x):
        return self.scale * self.down(F.silu(self.gate(x)) * self.up(x))


class RMSNorm(torch.nn.Module):  # a norm module built with its eps, as models build them (weights: {weight: gamma})
    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(d_model)), eps

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


class LayerNorm(torch.nn.Module):  # weights: {weight: gamma, bias: beta}
    def __init__(self, d_model, eps=1e-5):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.ones(d_model)), torch.nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x):
        return layernorm(x, self.weight, self.bias, self.eps)


def rmsnorm_module(d_model, eps):  # a factory that takes the scenario's eps: the module is built with it
    return RMSNorm(d_model, eps)


def layernorm_module(d_model, eps):
    return LayerNorm(d_model, eps)


def infonce(q, p, n, tau):
    # DPR: each query's candidates are every positive of the batch and every hard negative (n [B, k, dim])
    candidates = torch.cat([p, n.reshape(-1, n.shape[-1])])
    return F.cross_entropy(q @ candidates.T / tau, torch.arange(len(q)), reduction="none")


def infonce_detached_lse(q, p, n, tau):
    # bug: the log-sum-exp is detached (computed "for stability" and left out of the graph), so autograd
    # misses the gradient of the softmax denominator
    z = q @ torch.cat([p, n.reshape(-1, n.shape[-1])]).T / tau
    return torch.logsumexp(z, dim=-1).detach() - z.diagonal()


def attention_projections_interleaved(x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
    # query head h reads KV head h % Hkv (k.repeat(...)), whatever kv_map says: right only with kv_map: interleaved
    hq = visible.shape[1]
    hkv = w_k.shape[1] * hq // w_q.shape[1]
    return _attend(x, w_q, w_k, w_v, w_o, visible, scale, torch.arange(hq) % hkv)
