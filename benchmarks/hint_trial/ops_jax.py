import jax
import jax.numpy as jnp


def R03(x, gamma, eps):
    return gamma * x * jax.lax.rsqrt(jnp.var(x, axis=-1, keepdims=True) + eps)


@jax.custom_vjp
def _rms(x, gamma, eps):
    return gamma * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def _rms_fwd(x, gamma, eps):
    return _rms(x, gamma, eps), (x, gamma, eps)


def _rms_bwd(res, gy):
    x, gamma, eps = res
    rinv = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True))
    g = gy * gamma
    dx = g * rinv - x * jnp.mean(g * x, -1, keepdims=True) * rinv ** 3
    dgamma = jnp.sum((gy * x * rinv).reshape(-1, x.shape[-1]), 0)
    return dx, dgamma, jnp.zeros_like(eps)


_rms.defvjp(_rms_fwd, _rms_bwd)


def R05(x, gamma, eps):
    return _rms(x, gamma, jnp.asarray(eps, x.dtype))


def L03(x, gamma, beta, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    sd = jnp.sqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True))
    return gamma * (x - mu) / (sd + eps) + beta


@jax.custom_vjp
def _ln(x, gamma, beta, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    return gamma * (x - mu) * jax.lax.rsqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True) + eps) + beta


def _ln_fwd(x, gamma, beta, eps):
    mu = jnp.mean(x, -1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True) + eps)
    xhat = (x - mu) * rstd
    return gamma * xhat + beta, (xhat, rstd, gamma, eps)


def _ln_bwd(res, gy):
    xhat, rstd, gamma, eps = res
    dx = rstd * (gy * gamma - jnp.mean(gy, -1, keepdims=True) - xhat * jnp.mean(gy * xhat, -1, keepdims=True))
    d = xhat.shape[-1]
    return dx, jnp.sum((gy * xhat).reshape(-1, d), 0), jnp.sum(gy.reshape(-1, d), 0), jnp.zeros_like(eps)


_ln.defvjp(_ln_fwd, _ln_bwd)


def L05(x, gamma, beta, eps):
    return _ln(x, gamma, beta, jnp.asarray(eps, x.dtype))


def S03(x, w1, w3, w2):
    return (jax.nn.gelu(x @ w1) * (x @ w3)) @ w2


def _make_swiglu(both_paths):
    @jax.custom_vjp
    def f(x, w1, w3, w2):
        return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2

    def fwd(x, w1, w3, w2):
        a, u = x @ w1, x @ w3
        return (jax.nn.silu(a) * u) @ w2, (x, w1, w3, w2, a, u)

    def bwd(res, gy):
        x, w1, w3, w2, a, u = res
        sig = jax.nn.sigmoid(a)
        act = a * sig
        dh = gy @ w2.T
        da = dh * u * sig * (1 + a * (1 - sig))
        du = dh * act
        xf = x.reshape(-1, x.shape[-1])
        dw1 = xf.T @ da.reshape(-1, da.shape[-1])
        dw3 = xf.T @ du.reshape(-1, du.shape[-1])
        dw2 = (act * u).reshape(-1, a.shape[-1]).T @ gy.reshape(-1, gy.shape[-1])
        dx = da @ w1.T + du @ w3.T if both_paths else da @ w1.T
        return dx, dw1, dw3, dw2

    f.defvjp(fwd, bwd)
    return f


S05 = _make_swiglu(False)
C03 = _make_swiglu(True)


def _rotate_half(t):
    h = t.shape[-1] // 2
    return jnp.concatenate([-t[..., h:], t[..., :h]], -1)


def P03(x, cos, sin):
    r = 2 * cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    c, s = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    return jnp.concatenate([xr * c + _rotate_half(xr) * s, rest], -1)


def C06(x, cos, sin):
    r = 2 * cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    c, s = jnp.concatenate([cos, cos], -1), jnp.concatenate([sin, sin], -1)
    return jnp.concatenate([xr * c + _rotate_half(xr) * s, rest], -1)


def _rot(x, cos, sin, sgn):
    h = cos.shape[-1]
    a, b = x[..., :h], x[..., h:2 * h]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos, x[..., 2 * h:]], -1)


@jax.custom_vjp
def P05(x, cos, sin):
    return _rot(x, cos, sin, 1)


def _p05_fwd(x, cos, sin):
    return _rot(x, cos, sin, 1), (cos, sin)


def _p05_bwd(res, gy):
    cos, sin = res
    h = cos.shape[-1]
    ga, gb = gy[..., :h], gy[..., h:2 * h]
    dx = jnp.concatenate([ga * cos + gb * sin, ga * sin + gb * cos, gy[..., 2 * h:]], -1)
    return dx, jnp.zeros_like(cos), jnp.zeros_like(sin)


P05.defvjp(_p05_fwd, _p05_bwd)


def I03(q, p, n, tau):
    c = jnp.concatenate([p, n.reshape(-1, p.shape[-1])])
    z = (q @ c.T) * tau
    return jax.nn.logsumexp(z, -1) - jnp.diagonal(z)


def _split(t, h):
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).transpose(0, 2, 1, 3)


def _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, rot=None, rot_v=False, merge=None):
    hq = visible.shape[1]
    hkv = w_k.shape[1] * hq // w_q.shape[1]
    q, k, v = _split(x @ w_q, hq), _split(x @ w_k, hkv), _split(x @ w_v, hkv)
    if rot is not None:
        q, k = rot(q), rot(k)
        if rot_v:
            v = rot(v)
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, k[:, kv_map]), -jnp.inf)
    o = jnp.einsum("bhij,bhjd->bhid", jax.nn.softmax(s, -1), v[:, kv_map])
    b, h, n, d = o.shape
    merged = o.reshape(b, n, h * d) if merge == "flat" else o.transpose(0, 2, 1, 3).reshape(b, n, h * d)
    return merged @ w_o


def J03(x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
    return _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, merge="flat")


def _rmsn(x, g, eps):
    return g * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def _mlp(x, w1, w3, w2):
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def B02(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps):
    h = x + _attend(_rmsn(x, gamma1, eps), w_q, w_k, w_v, w_o, visible, scale, kv_map,
                    rot=lambda t: _rot(t, cos, sin, 1), rot_v=True)
    return h + _mlp(_rmsn(h, gamma2, eps), w1, w3, w2)


def B04(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps):
    xn = _rmsn(x, gamma1, eps)
    h = xn + _attend(xn, w_q, w_k, w_v, w_o, visible, scale, kv_map, rot=lambda t: _rot(t, cos, sin, 1))
    return h + _mlp(_rmsn(h, gamma2, eps), w1, w3, w2)
