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


def infonce(q, p, n, tau):
    # DPR: each query's candidates are every positive of the batch and every hard negative (n [B, k, dim])
    z = q @ jnp.concatenate([p, n.reshape(-1, n.shape[-1])]).T / tau
    return jax.nn.logsumexp(z, axis=-1) - jnp.diagonal(z)
