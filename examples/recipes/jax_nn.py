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



def _block(q, k, v, mask, scale, kv_map):
    """One block of keys: (o, lse) in [B, n, H, d] / [B, n, H], the LSE -inf on a row the block hides."""
    k, v = k[:, :, kv_map], v[:, :, kv_map]
    s = jnp.where(mask.transpose(0, 2, 1, 3), scale * jnp.einsum("bihd,bjhd->bihj", q, k), -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return jnp.einsum("bihj,bjhd->bihd", p, v), lse


def blockwise_attention_lse(q, k, v, mask, scale, kv_map, *, return_lse=False):
    """Attention over two blocks of keys merged by their log-sum-exp, as ring and blockwise attention merge partial
    results (q, k, v, o [B, n, H, d]; lse [B, n, H]): lse = logaddexp(lse_1, lse_2), o = sum_b exp(lse_b - lse) o_b.
    Written plainly in jax.numpy; its gradients are jax.vjp's through the merge."""
    half = k.shape[1] // 2
    parts = [_block(q, k[:, cut], v[:, cut], mask[..., cut], scale, kv_map)
             for cut in (slice(0, half), slice(half, None))]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    o = sum(jnp.exp(part_lse - lse)[..., None] * part_o for part_o, part_lse in parts)
    return (o, lse) if return_lse else o


def dot_product_attention_lse(q, k, v, mask, scale, kv_map, *, return_lse=False):
    """jax.nn.dot_product_attention's own log-sum-exp (``return_residual=True``, [B, n_q, H]): JAX returns it under
    ``lax.stop_gradient`` (a residual for a backward, not an output), so a loss that trains through it gets no
    gradient from it. The scenario that uses it as an output fails, and the hint says the backward ignores the
    LSE's upstream gradient."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, return_residual=return_lse)


def blockwise_attention_lse_log2(q, k, v, mask, scale, kv_map, *, return_lse=False):
    """Broken: the merged log-sum-exp handed on in log2 units (a kernel's exp2 trick leaking out, pytorch #181645)."""
    o, lse = blockwise_attention_lse(q, k, v, mask, scale, kv_map, return_lse=True)
    return (o, lse / jnp.log(2.0)) if return_lse else o
