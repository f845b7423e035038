import numpy as np


def _reduce(x, kv_map, hkv):
    out = np.zeros(x.shape[:1] + (hkv,) + x.shape[2:], x.dtype)
    np.add.at(out, (slice(None), np.asarray(kv_map)), x)
    return out


def _softmax(s, visible):
    s = np.where(visible, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return e / e.sum(-1, keepdims=True)


class Base:
    def scores(self, q, k, scale, kv_map, **kw):
        return scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map])

    def probs(self, q, k, visible, scale, kv_map, **kw):
        return _softmax(self.scores(q, k, scale, kv_map, **kw), visible)

    def forward(self, q, k, v, visible, scale, kv_map, **kw):
        return np.einsum("bhij,bhjd->bhid", self.probs(q, k, visible, scale, kv_map, **kw), v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
        p = self.probs(q, k, visible, scale, kv_map, **kw)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        return dq, dk, dv


class _A01(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
        p = self.probs(q, k, visible, scale, kv_map)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        return dq, dk, dv


class _A03(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
        full = np.ones_like(visible, dtype=bool)
        p = _softmax(self.scores(q, k, scale, kv_map), full)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        return dq, dk, dv


class _A12(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
        p = self.probs(q, k, visible, scale, kv_map)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        dk[:, kv_map] += scale * np.einsum("bhij,bhid->bhjd", ds, q)
        dv[:, kv_map] += np.einsum("bhij,bhid->bhjd", p, grad_o)
        return dq, dk, dv


class _V02(Base):
    def scores(self, q, k, scale, kv_map, softcap=None, **kw):
        s = scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map])
        return softcap * np.tanh(s / softcap)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, softcap=None, **kw):
        capped = self.scores(q, k, scale, kv_map, softcap=softcap)
        p = _softmax(capped, visible)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        ds = ds * (1.0 - capped ** 2)
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        return dq, dk, dv


def _sum_to(x, shape):
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True)


class _V04(Base):
    def scores(self, q, k, scale, kv_map, attn_bias=None, **kw):
        return scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map]) + attn_bias

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, attn_bias=None, **kw):
        p = self.probs(q, k, visible, scale, kv_map, attn_bias=attn_bias)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        dbias = _sum_to(np.where(visible, dp, 0.0), attn_bias.shape)
        return dq, dk, dv, dbias


def _dist(n_q, n_k, off=True):
    i = np.arange(n_q)[:, None]
    j = np.arange(n_k)[None, :]
    return -np.abs(i + (n_k - n_q if off else 0) - j).astype(np.float64)


class _V07(Base):
    def scores(self, q, k, scale, kv_map, alibi_slopes=None, **kw):
        s = scale * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map])
        return s + np.asarray(alibi_slopes)[None, :, None, None] * _dist(q.shape[2], k.shape[2])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, alibi_slopes=None, **kw):
        p = self.probs(q, k, visible, scale, kv_map, alibi_slopes=alibi_slopes)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        dm = np.einsum("bhij,ij->h", ds, _dist(q.shape[2], k.shape[2], off=False)).astype(q.dtype)
        return dq, dk, dv, dm


class _V11(Base):
    def probs(self, q, k, visible, scale, kv_map, sinks=None, **kw):
        s = np.where(visible, self.scores(q, k, scale, kv_map), -np.inf)
        col = np.asarray(sinks, dtype=s.dtype)[None, :, None, None]
        m = np.maximum(s.max(-1, keepdims=True), col)
        e = np.exp(s - m)
        return e / (e.sum(-1, keepdims=True) + np.exp(col - m))

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, sinks=None, **kw):
        p = self.probs(q, k, visible, scale, kv_map, sinks=sinks)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        delta = (p * dp).sum(-1, keepdims=True)
        ds = p * (dp - delta)
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", p, grad_o), kv_map, v.shape[1])
        dsinks = -delta.sum(axis=(0, 2, 3))
        return dq, dk, dv, dsinks


class _V15(Base):
    def forward(self, q, k, v, visible, scale, kv_map, keep_mask=None, dropout_p=0.0, **kw):
        p = self.probs(q, k, visible, scale, kv_map) * keep_mask / (1.0 - dropout_p)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, keep_mask=None, dropout_p=0.0, **kw):
        p = self.probs(q, k, visible, scale, kv_map)
        pd = p * keep_mask / (1.0 - dropout_p)
        dpd = np.einsum("bhid,bhjd->bhij", grad_o, v[:, kv_map])
        dp = dpd * keep_mask
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k[:, kv_map])
        dk = _reduce(scale * np.einsum("bhij,bhid->bhjd", ds, q), kv_map, k.shape[1])
        dv = _reduce(np.einsum("bhij,bhid->bhjd", pd, grad_o), kv_map, v.shape[1])
        return dq, dk, dv


class _V16(Base):
    def forward(self, q, k, v, visible, scale, kv_map, cu_seqlens_q=None, cu_seqlens_k=None, **kw):
        o = np.zeros(q.shape[:3] + (v.shape[-1],), q.dtype)
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        for d in range(len(cq) - 1):
            a, b, c, e = int(cq[d]), int(cq[d + 1]), int(ck[d]), int(ck[d + 1])
            o[:, :, a:b] = Base.forward(self, q[:, :, a:b], k[:, :, c:e], v[:, :, c:e], visible[:, :, a:b, c:e],
                                        scale, kv_map)
        return o

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, cu_seqlens_q=None, cu_seqlens_k=None, **kw):
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        for d in range(len(cq) - 1):
            a, b, c, e = int(cq[d]), int(cq[d + 1]), int(ck[d]), int(ck[d + 1])
            vis = np.broadcast_to(np.tril(np.ones((b - a, e - c), dtype=bool)), visible[:, :, a:b, c:e].shape)
            g = Base.backward(self, q[:, :, a:b], k[:, :, c:e], v[:, :, c:e], vis, scale, kv_map, grad_o[:, :, a:b])
            dq[:, :, a:b] += g[0]
            dk[:, :, c:e] += g[1]
            dv[:, :, c:e] += g[2]
        return dq, dk, dv


C01 = Base()
A01, A03, A12 = _A01(), _A03(), _A12()
V02, V04, V07, V11, V15, V16 = _V02(), _V04(), _V07(), _V11(), _V15(), _V16()
