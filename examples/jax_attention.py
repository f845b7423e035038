"""Attention written in JAX, as a user would: visible sets (True = key visible), grouped KV heads by kv_map.
One function; the tool differentiates it with jax.vjp."""
import jax
import jax.numpy as jnp


def attention(q, k, v, visible, scale, kv_map):
    k, v = k[:, kv_map], v[:, kv_map]                  # [B, Hkv, n_k, d] -> [B, Hq, n_k, d]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = jnp.where(visible, s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def attention_additive_mask(q, k, v, visible, scale, kv_map):
    # bug: the mask added as a finite -10 to the scores (instead of -inf), so hidden keys keep some weight
    k, v = k[:, kv_map], v[:, kv_map]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale + jnp.where(visible, 0.0, -10.0)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


@jax.custom_vjp
def _softmax_without_row_sum(s):
    return jax.nn.softmax(s, axis=-1)


def _softmax_fwd(s):
    a = jax.nn.softmax(s, axis=-1)
    return a, a


def _softmax_bwd(a, g):
    return (a * g,)  # bug: dS = A * (dA - rowsum(A * dA)) with the row-sum term dropped


_softmax_without_row_sum.defvjp(_softmax_fwd, _softmax_bwd)


def attention_softmax_term_dropped(q, k, v, visible, scale, kv_map):
    # bug: a hand-written softmax VJP without its row-sum term: O is right, dQ and dK are wrong
    k, v = k[:, kv_map], v[:, kv_map]
    s = jnp.where(visible, jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", _softmax_without_row_sum(s), v)
