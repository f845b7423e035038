import jax
import jax.numpy as jnp


def _attn(q, k, v, visible, scale, kv_map, extra=None):
    kr, vr = k[:, kv_map], v[:, kv_map]
    s = scale * jnp.einsum("bhid,bhjd->bhij", q, kr)
    if extra is not None:
        s = extra(s)
    s = jnp.where(visible, s, -jnp.inf)
    return jnp.einsum("bhij,bhjd->bhid", jax.nn.softmax(s, axis=-1), vr)


def A06(q, k, v, visible, scale, kv_map):
    return _attn(q, k, v, visible, q.shape[-1] ** -0.5, kv_map)


@jax.custom_vjp
def _core(q, k, v, visible, scale):
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, k), -jnp.inf)
    return jnp.einsum("bhij,bhjd->bhid", jax.nn.softmax(s, axis=-1), v)


def _core_fwd(q, k, v, visible, scale):
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, k), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhij,bhjd->bhid", p, v), (q, k, v, p, scale, visible)


def _core_bwd(res, g):
    q, k, v, p, scale, visible = res
    dv = jnp.einsum("bhij,bhjd->bhid", p, g)
    dp = jnp.einsum("bhid,bhjd->bhij", g, v)
    ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))
    dq = scale * jnp.einsum("bhij,bhjd->bhid", ds, k)
    dk = scale * jnp.einsum("bhij,bhid->bhjd", ds, q)
    return dq, dk, dv, None, None


_core.defvjp(_core_fwd, _core_bwd)


def A07(q, k, v, visible, scale, kv_map):
    return _core(q, k[:, kv_map], v[:, kv_map], visible, scale)


def A11(q, k, v, visible, scale, kv_map):
    g = q.shape[1] // k.shape[1]
    kr, vr = jnp.tile(k, (1, g, 1, 1)), jnp.tile(v, (1, g, 1, 1))
    s = jnp.where(visible, scale * jnp.einsum("bhid,bhjd->bhij", q, kr), -jnp.inf)
    return jnp.einsum("bhij,bhjd->bhid", jax.nn.softmax(s, axis=-1), vr)


def V06(q, k, v, visible, scale, kv_map, *, alibi_slopes):
    n_q, n_k = q.shape[2], k.shape[2]
    rel = (jnp.arange(n_k)[None, :] - jnp.arange(n_q)[:, None]).astype(q.dtype)
    bias = jnp.asarray(alibi_slopes, q.dtype)[:, None, None] * rel
    return _attn(q, k, v, visible, scale, kv_map, lambda s: s + bias)


def V12(q, k, v, visible, scale, kv_map, *, return_lse=False):
    raw = jnp.einsum("bhid,bhjd->bhij", q, k[:, kv_map])
    o = _attn(q, k, v, visible, scale, kv_map)
    lse = jax.nn.logsumexp(jnp.where(visible, raw, -jnp.inf), axis=-1)
    return (o, lse) if return_lse else o


def V14(q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):
    return _attn(q, k, v, visible, scale, kv_map, lambda s: s * keep_mask / (1.0 - dropout_p))


def V17(q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    n_q, n_k = q.shape[2], k.shape[2]
    cq, ck = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)
    seg_q = jnp.searchsorted(cq, jnp.arange(n_q), side="right") - 1
    seg_k = jnp.searchsorted(ck, jnp.arange(n_k), side="right") - 1
    same = (seg_q[:, None] == seg_k[None, :])[None, None]
    kr, vr = k[:, kv_map], v[:, kv_map]
    s = jnp.where(same, scale * jnp.einsum("bhid,bhjd->bhij", q, kr), -jnp.inf)
    return jnp.einsum("bhij,bhjd->bhid", jax.nn.softmax(s, axis=-1), vr)
