import math

import torch


def _sdpa(q, k, v, visible, scale, kv_map, extra=None):
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    if extra is not None:
        s = extra(s)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v[:, kv_map]


def A04(q, k, v, visible, scale, kv_map):
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    s = s * visible
    return torch.softmax(s, dim=-1) @ v[:, kv_map]


class _GqaAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        kr, vr = k[:, kv_map], v[:, kv_map]
        s = (scale * (q @ kr.transpose(-1, -2))).masked_fill(~visible, float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = p @ vr
        ctx.save_for_backward(q, kr, vr, p, o)
        ctx.scale, ctx.hkv = scale, k.shape[1]
        return o

    @staticmethod
    def backward(ctx, go):
        q, kr, vr, p, o = ctx.saved_tensors
        dp = go @ vr.transpose(-1, -2)
        delta = (go * o).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = ctx.scale * ds @ kr
        dkr = ctx.scale * ds.transpose(-1, -2) @ q
        dvr = p.transpose(-1, -2) @ go
        b, hq, n, d = dkr.shape
        g = hq // ctx.hkv
        dk = dkr.reshape(b, g, ctx.hkv, n, d).sum(1)
        dv = dvr.reshape(b, g, ctx.hkv, n, dvr.shape[-1]).sum(1)
        return dq, dk, dv, None, None, None


def A05(q, k, v, visible, scale, kv_map):
    return _GqaAttn.apply(q, k, v, visible, scale, torch.as_tensor(kv_map))


def A08(q, k, v, visible, scale, kv_map):
    n_q, n_k = q.shape[2], k.shape[2]
    causal = torch.tril(torch.ones(n_q, n_k, dtype=torch.bool))
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    s = s.masked_fill(~causal, float("-inf"))
    return torch.softmax(s, dim=-1) @ v[:, kv_map]


def V01(q, k, v, visible, scale, kv_map, *, softcap):
    return _sdpa(q, k, v, visible, scale, kv_map, lambda s: softcap * torch.tanh(s))


def V05(q, k, v, visible, scale, kv_map, *, attn_bias):
    s = scale * (q @ k[:, kv_map].transpose(-1, -2) + attn_bias)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v[:, kv_map]


def _t5_bucket(rel, num_buckets=8, max_distance=16):
    num_buckets //= 2
    ret = (rel > 0).long() * num_buckets
    n = rel.abs()
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return ret + torch.where(is_small, n, large)


def V08(q, k, v, visible, scale, kv_map, *, relative_attention_bias):
    n_q, n_k = q.shape[2], k.shape[2]
    ctx_pos = torch.arange(n_q)[:, None] + (n_k - n_q)
    mem_pos = torch.arange(n_k)[None, :]
    buckets = _t5_bucket(ctx_pos - mem_pos)
    bias = relative_attention_bias[buckets].permute(2, 0, 1)[None]
    return _sdpa(q, k, v, visible, scale, kv_map, lambda s: s + bias)


def _sink_probs(q, k, visible, scale, kv_map, sinks, shifted):
    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - m)
    sk = sinks.to(q.dtype).reshape(1, -1, 1, 1)
    tail = torch.exp(sk - m) if shifted else torch.exp(sk)
    return e / (e.sum(-1, keepdim=True) + tail)


def V10(q, k, v, visible, scale, kv_map, *, sinks):
    return _sink_probs(q, k, visible, scale, kv_map, sinks, False) @ v[:, kv_map]


def C05(q, k, v, visible, scale, kv_map, *, sinks):
    return _sink_probs(q, k, visible, scale, kv_map, sinks, True) @ v[:, kv_map]


class _LseAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, visible, scale, kv_map):
        kr, vr = k[:, kv_map], v[:, kv_map]
        s = (scale * (q @ kr.transpose(-1, -2))).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None])
        o = p @ vr
        ctx.save_for_backward(q, k, v, p, o, kv_map)
        ctx.scale = scale
        return o, lse

    @staticmethod
    def backward(ctx, go, glse):
        q, k, v, p, o, kv_map = ctx.saved_tensors
        kr, vr = k[:, kv_map], v[:, kv_map]
        dp = go @ vr.transpose(-1, -2)
        delta = (go * o).sum(-1, keepdim=True)
        if glse is None:
            glse = torch.zeros_like(delta[..., 0])
        ds = p * (dp - delta - glse[..., None])
        dq = ctx.scale * ds @ kr
        dkr = ctx.scale * ds.transpose(-1, -2) @ q
        dvr = p.transpose(-1, -2) @ go
        dk = torch.zeros_like(k).index_add_(1, kv_map, dkr)
        dv = torch.zeros_like(v).index_add_(1, kv_map, dvr)
        return dq, dk, dv, None, None, None


def V13(q, k, v, visible, scale, kv_map, *, return_lse=False):
    o, lse = _LseAttn.apply(q, k, v, visible, scale, torch.as_tensor(kv_map))
    return (o, lse) if return_lse else o
