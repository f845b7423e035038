"""Recipes for JAX and flax, checked as they are:

- jax.nn.dot_product_attention (what flax's attention calls) and flax.linen.dot_product_attention behind
  adapters of at most four lines: they take [B, n, H, d] and a boolean mask (True = attend);
- flax's multi-head attention modules with their weights (``implementation: {factory, weights, call}`` in
  jax_nn.yaml): linen's MultiHeadDotProductAttention (a factory returns the module and its variables) and
  nnx's MultiHeadAttention (GQA); their DenseGeneral kernels [d_model, heads, d_head] take the op's
  [d_model, heads * d_head] weights reshaped."""
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


def dot_product_attention(q, k, v, visible, scale, kv_map):
    to_bnhd = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.nn.dot_product_attention(to_bnhd(q), to_bnhd(k), to_bnhd(v), mask=visible, scale=scale)
    return to_bnhd(out)


def flax_dot_product_attention(q, k, v, visible, scale, kv_map):  # no GQA, and the scale is 1/sqrt(d) always
    to_bnhd = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731
    return to_bnhd(nn.dot_product_attention(to_bnhd(q), to_bnhd(k), to_bnhd(v), mask=visible))


def linen_attention(d_model, heads_q, d_head, batch, n_q, dtype):
    module = nn.MultiHeadDotProductAttention(num_heads=heads_q, qkv_features=heads_q * d_head, out_features=d_model,
                                             use_bias=False, param_dtype=jnp.dtype(dtype))
    return module, module.init(jax.random.key(0), jnp.zeros((batch, n_q, d_model), dtype))


def nnx_attention(d_model, heads_q, heads_kv, d_head, dtype):
    return nnx.MultiHeadAttention(num_heads=heads_q, num_kv_heads=heads_kv, in_features=d_model,
                                  qkv_features=heads_q * d_head, out_features=d_model, use_bias=False, decode=False,
                                  param_dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))


def dot_product_attention_bnhd(q, k, v, mask, scale, kv_map):
    """The same with no layout adapter: the scenario says ``convention: {layout: bnhd}`` (jax_nn.yaml), so the
    tool passes [B, n, H, d] and takes o back in it; this only names the keyword arguments."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
