"""JAX implementations of the norms, RoPE and the SwiGLU MLP, as users write them: one function each,
differentiated by jax.vjp (the tool compiles forward and VJP once per shape)."""
import jax
import jax.numpy as jnp


def layernorm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return gamma * (x - mu) * jax.lax.rsqrt(var + eps) + beta


def rmsnorm(x, gamma, eps):
    return gamma * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)


def rmsnorm_stop_gradient(x, gamma, eps):
    # bug: a stop_gradient on the normalisation scale, so jax.vjp misses its feedback
    return gamma * x * jax.lax.stop_gradient(jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps))


def rope(x, cos, sin):
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)


def swiglu(x, w1, w3, w2):
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def _heads(t, heads):  # [B, n, H*d] -> [B, H, n, d]
    return jnp.swapaxes(t.reshape(t.shape[:-1] + (heads, -1)), 1, 2)


def _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, rotate=lambda t: t, m=None):
    hq = visible.shape[1]
    hkv = w_k.shape[1] * hq // w_q.shape[1]  # the KV heads have the query heads' width
    s = x if m is None else m
    q, k, v = rotate(_heads(x @ w_q, hq)), rotate(_heads(s @ w_k, hkv)), _heads(s @ w_v, hkv)
    logits = jnp.where(visible, scale * q @ jnp.swapaxes(k[:, kv_map], -1, -2), -jnp.inf)
    o = jax.nn.softmax(logits, axis=-1) @ v[:, kv_map]
    o = jnp.swapaxes(o, 1, 2)
    return o.reshape(o.shape[:2] + (-1,)) @ w_o


def attention_projections(x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
    return _attend(x, w_q, w_k, w_v, w_o, visible, scale, kv_map)


def block(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps):
    h = x + _attend(rmsnorm(x, gamma1, eps), w_q, w_k, w_v, w_o, visible, scale, kv_map,
                    rotate=lambda t: rope(t, cos, sin))
    return h + swiglu(rmsnorm(h, gamma2, eps), w1, w3, w2)


def swiglu_with_params(d_model, d_ff):  # the module form without flax: a function of (params, x) and its params
    params = {"mlp": {"gate": jnp.zeros((d_model, d_ff)), "up": jnp.zeros((d_model, d_ff)),
                      "down": jnp.zeros((d_ff, d_model))}}
    return (lambda p, x: swiglu(x, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"])), params


def rmsnorm_with_params(d_model, eps):  # a factory that takes the scenario's eps; weights: {scale: gamma}
    return (lambda p, x: rmsnorm(x, p["scale"], eps)), {"scale": jnp.ones((d_model,))}


def layernorm_with_params(d_model, eps):  # weights: {scale: gamma, bias: beta}
    return (lambda p, x: layernorm(x, p["scale"], p["bias"], eps)), {"scale": jnp.ones((d_model,)),
                                                                     "bias": jnp.zeros((d_model,))}


def infonce(q, p, n, tau):
    # DPR: each query's candidates are every positive of the batch and every hard negative (n [B, k, dim])
    z = q @ jnp.concatenate([p, n.reshape(-1, n.shape[-1])]).T / tau
    return jax.nn.logsumexp(z, axis=-1) - jnp.diagonal(z)
