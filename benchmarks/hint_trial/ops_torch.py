import torch
import torch.nn.functional as F


def R02(x, gamma, eps):
    return gamma * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)


class _Rms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps, exact):
        rinv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, gamma, rinv)
        ctx.exact = exact
        return gamma * x * rinv

    @staticmethod
    def backward(ctx, gy):
        x, gamma, rinv = ctx.saved_tensors
        g = gy * gamma
        dx = g * rinv - x * (g * x).mean(-1, keepdim=True) * rinv ** 3
        xn = x * rinv if ctx.exact else x
        dgamma = (gy * xn).reshape(-1, x.shape[-1]).sum(0)
        return dx, dgamma, None, None


def R04(x, gamma, eps):
    return _Rms.apply(x, gamma, eps, False)


def C02(x, gamma, eps):
    return _Rms.apply(x, gamma, eps, True)


def L02(x, gamma, beta, eps):
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True)
    return gamma * (x - mu) / torch.sqrt(var + eps) + beta


class _Ln(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, beta, eps):
        mu = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, gamma, mu, rstd)
        return gamma * (x - mu) * rstd + beta

    @staticmethod
    def backward(ctx, gy):
        x, gamma, mu, rstd = ctx.saved_tensors
        xhat = (x - mu) * rstd
        g = gy * gamma
        dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        d = x.shape[-1]
        dgamma = (gy * (x - mu)).reshape(-1, d).sum(0)
        dbeta = gy.reshape(-1, d).sum(0)
        return dx, dgamma, dbeta, None


def L04(x, gamma, beta, eps):
    return _Ln.apply(x, gamma, beta, eps)


def S02(x, w1, w3, w2):
    return (F.silu(x @ w3) * (x @ w1)) @ w2


class _Swi(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2):
        a, u = x @ w1, x @ w3
        ctx.save_for_backward(x, w1, w3, w2, a, u)
        return (F.silu(a) * u) @ w2

    @staticmethod
    def backward(ctx, gy):
        x, w1, w3, w2, a, u = ctx.saved_tensors
        sig = torch.sigmoid(a)
        act = a * sig
        dh = gy @ w2.T
        da = dh * u * (sig * (1 + a * (1 - sig)))
        du = dh * act
        xf = x.reshape(-1, x.shape[-1])
        dw1 = xf.T @ da.reshape(-1, da.shape[-1])
        dw3 = xf.T @ du.reshape(-1, du.shape[-1])
        dw2 = act.reshape(-1, act.shape[-1]).T @ gy.reshape(-1, gy.shape[-1])
        return da @ w1.T + du @ w3.T, dw1, dw3, dw2


def S04(x, w1, w3, w2):
    return _Swi.apply(x, w1, w3, w2)


def _rotate_half(t):
    t1, t2 = t.chunk(2, dim=-1)
    return torch.cat([t2, -t1], dim=-1)


def P02(x, cos, sin):
    r = 2 * cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return torch.cat([xr * c + _rotate_half(xr) * s, rest], -1)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        h = cos.shape[-1]
        ctx.save_for_backward(cos, sin)
        a, b = x[..., :h], x[..., h:2 * h]
        return torch.cat([a * cos - b * sin, a * sin + b * cos, x[..., 2 * h:]], -1)

    @staticmethod
    def backward(ctx, gy):
        cos, sin = ctx.saved_tensors
        h = cos.shape[-1]
        ga, gb = gy[..., :h], gy[..., h:2 * h]
        dx = torch.zeros_like(gy)
        dx[..., :h] = ga * cos + gb * sin
        dx[..., h:2 * h] = -ga * sin + gb * cos
        return dx, None, None


def P04(x, cos, sin):
    return _Rope.apply(x, cos, sin)


def I02(q, p, n, tau):
    z = q @ p.T / tau
    return F.cross_entropy(z, torch.arange(len(q)), reduction="none")


class _Nce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, p, tau):
        z = q @ p.T / tau
        ctx.save_for_backward(q, p, z)
        ctx.tau = tau
        return torch.logsumexp(z, -1) - z.diagonal()

    @staticmethod
    def backward(ctx, gl):
        q, p, z = ctx.saved_tensors
        a = torch.softmax(z, -1) - torch.eye(len(q), dtype=z.dtype)
        gs = gl[:, None] * a / ctx.tau
        return gs @ p, gs @ q, None


def I04(q, p, n, tau):
    return _Nce.apply(q, p, tau)


def _heads(t, h):
    return t.unflatten(-1, (h, -1)).transpose(1, 2)


def _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, rot=None, split=_heads):
    hq = visible.shape[1]
    hkv = w_k.shape[1] * hq // w_q.shape[1]
    q, k, v = split(x @ w_q, hq), split(x @ w_k, hkv), split(x @ w_v, hkv)
    if rot is not None:
        q, k = rot(q), rot(k)
    s = (scale * q @ k[:, kv_map].transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    o = torch.softmax(s, -1) @ v[:, kv_map]
    return o.transpose(1, 2).flatten(-2) @ w_o


def J02(x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
    def split(t, h):
        b, n, _ = t.shape
        return t.reshape(b, h, n, -1)
    return _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, split=split)


def _rms(x, g, eps):
    return g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(t, cos, sin):
    h = cos.shape[-1]
    a, b = t[..., :h], t[..., h:2 * h]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, t[..., 2 * h:]], -1)


def _mlp(x, w1, w3, w2):
    return (F.silu(x @ w1) * (x @ w3)) @ w2


def B01(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps):
    h = x + _attend(_rms(x, gamma1, eps), w_q, w_k, w_v, w_o, visible, scale, kv_map, rot=lambda t: _rope(t, cos, sin))
    return x + _mlp(_rms(h, gamma2, eps), w1, w3, w2)


def B03(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps):
    h = x + _attend(_rms(x, gamma1, eps), w_q, w_k, w_v, w_o, visible, scale, kv_map, rot=lambda t: _rope(t, cos, sin))
    return h + _mlp(_rms(h, gamma1, eps), w1, w3, w2)
