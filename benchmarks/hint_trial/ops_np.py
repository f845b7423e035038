import numpy as np

from att_np import Base as _Attn


class _R01:
    def forward(self, x, gamma, eps):
        return gamma * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

    def backward(self, x, gamma, eps, grad_y):
        r = np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
        g = grad_y * gamma
        dx = g / r - x * np.sum(g * x, -1, keepdims=True) / r ** 3
        dgamma = (grad_y * x / r).reshape(-1, x.shape[-1]).sum(0)
        return dx, dgamma


class _LN:
    def forward(self, x, gamma, beta, eps):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return gamma * (x - mu) / np.sqrt(var + eps) + beta

    def backward(self, x, gamma, beta, eps, grad_y):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        rstd = 1.0 / np.sqrt(var + eps)
        xhat = (x - mu) * rstd
        g = grad_y * gamma
        dx = rstd * (g - self._mean_term(g) - xhat * np.mean(g * xhat, -1, keepdims=True))
        flat = x.shape[-1]
        return dx, (grad_y * xhat).reshape(-1, flat).sum(0), grad_y.reshape(-1, flat).sum(0)

    def _mean_term(self, g):
        return np.mean(g, -1, keepdims=True)


class _L01(_LN):
    def _mean_term(self, g):
        return 0.0


def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


class _S01:
    def forward(self, x, w1, w3, w2):
        a, u = x @ w1, x @ w3
        return (a * _sigmoid(a) * u) @ w2

    def backward(self, x, w1, w3, w2, grad_y):
        a, u = x @ w1, x @ w3
        sig = _sigmoid(a)
        h = a * sig * u
        dh = grad_y @ w2.T
        da = dh * u * sig
        du = dh * a * sig
        xf = x.reshape(-1, x.shape[-1])
        dw1 = xf.T @ da.reshape(-1, da.shape[-1])
        dw3 = xf.T @ du.reshape(-1, du.shape[-1])
        dw2 = h.reshape(-1, h.shape[-1]).T @ grad_y.reshape(-1, grad_y.shape[-1])
        return da @ w1.T + du @ w3.T, dw1, dw3, dw2


class _P01:
    def forward(self, x, cos, sin):
        h = cos.shape[-1]
        a, b = x[..., :h], x[..., h:2 * h]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos, x[..., 2 * h:]], -1)

    def backward(self, x, cos, sin, grad_y):
        h = cos.shape[-1]
        ge, go = grad_y[..., 0:2 * h:2], grad_y[..., 1:2 * h:2]
        de, do = ge * cos + go * sin, -ge * sin + go * cos
        out = grad_y.copy()
        out[..., 0:2 * h:2], out[..., 1:2 * h:2] = de, do
        return out


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class _Nce:
    cosine = False

    def _cands(self, p, n):
        return np.concatenate([p, n.reshape(-1, p.shape[-1])])

    def forward(self, q, p, n, tau):
        c = self._cands(p, n)
        qq, cc = (_unit(q), _unit(c)) if self.cosine else (q, c)
        z = qq @ cc.T / tau
        m = z.max(-1, keepdims=True)
        return (m[:, 0] + np.log(np.exp(z - m).sum(-1))) - np.diagonal(z)

    def backward(self, q, p, n, tau, grad_l):
        c = self._cands(p, n)
        qq, cc = (_unit(q), _unit(c)) if self.cosine else (q, c)
        z = qq @ cc.T / tau
        a = np.exp(z - z.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        a[np.arange(len(q)), np.arange(len(q))] -= 1.0
        gz = grad_l[:, None] * a
        gs = gz / tau
        dq, dc = gs @ cc, gs.T @ qq
        if self.cosine:
            dq, dc = self._unit_back(q, dq), self._unit_back(c, dc)
        b = len(q)
        dtau = np.asarray(self._dtau(gz, z, tau), dtype=q.dtype)
        return dq, dc[:b], dc[b:].reshape(n.shape), dtau

    def _dtau(self, gz, z, tau):
        return -np.sum(gz * z) / tau

    def _unit_back(self, x, g):
        u = _unit(x)
        return (g - u * np.sum(u * g, -1, keepdims=True)) / np.linalg.norm(x, axis=-1, keepdims=True)


class _I01(_Nce):
    def _dtau(self, gz, z, tau):
        return np.sum(gz * z) / tau


class _I05(_Nce):
    cosine = True

    def _unit_back(self, x, g):
        return g / np.linalg.norm(x, axis=-1, keepdims=True)


def _split(t, h):
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).transpose(0, 2, 1, 3)


def _merge(t):
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


class _Proj:
    attn = _Attn()

    def _qkv(self, x, w_q, w_k, w_v, visible):
        hq = visible.shape[1]
        hkv = w_k.shape[1] * hq // w_q.shape[1]
        return _split(x @ w_q, hq), _split(x @ w_k, hkv), _split(x @ w_v, hkv)

    def forward(self, x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
        q, k, v = self._qkv(x, w_q, w_k, w_v, visible)
        return _merge(self.attn.forward(q, k, v, visible, scale, kv_map)) @ w_o

    def backward(self, x, w_q, w_k, w_v, w_o, visible, scale, kv_map, grad_y):
        q, k, v = self._qkv(x, w_q, w_k, w_v, visible)
        merged = _merge(self.attn.forward(q, k, v, visible, scale, kv_map))
        dw_o = self._dwo(merged, grad_y)
        do = _split(grad_y @ w_o.T, q.shape[1])
        dq, dk, dv = (_merge(t) for t in self.attn.backward(q, k, v, visible, scale, kv_map, do))
        dw_q = np.einsum("bni,bno->io", x, dq)
        dw_k = np.einsum("bni,bno->io", x, dk)
        dw_v = np.einsum("bni,bno->io", x, dv)
        return self._dx(dq, dk, dv, w_q, w_k, w_v), dw_q, dw_k, dw_v, dw_o

    def _dwo(self, merged, grad_y):
        return np.einsum("bni,bno->io", merged, grad_y)

    def _dx(self, dq, dk, dv, w_q, w_k, w_v):
        return dq @ w_q.T + dk @ w_k.T + dv @ w_v.T


class _J01(_Proj):
    def _dwo(self, merged, grad_y):
        return np.einsum("bno,bni->oi", grad_y, merged)


class _J04(_Proj):
    def _dx(self, dq, dk, dv, w_q, w_k, w_v):
        return dq @ w_q.T


R01 = _R01()
L01, C04 = _L01(), _LN()
S01 = _S01()
P01 = _P01()
I01, I05 = _I01(), _I05()
J01, J04 = _J01(), _J04()
