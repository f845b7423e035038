"""Recipe: jax.nn.dot_product_attention (what flax's attention calls), checked as it is behind a four-line
adapter: it takes [B, n, H, d] and a boolean mask (True = attend), and maps KV heads to query heads in
contiguous groups itself."""
import jax


def dot_product_attention(q, k, v, visible, scale, kv_map):
    to_bnhd = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.nn.dot_product_attention(to_bnhd(q), to_bnhd(k), to_bnhd(v), mask=visible, scale=scale)
    return to_bnhd(out)


def dot_product_attention_bnhd(q, k, v, mask, scale, kv_map):
    """The same with no layout adapter: the scenario says ``convention: {layout: bnhd}`` (jax_nn.yaml), so the
    tool passes [B, n, H, d] and takes o back in it; this only names the keyword arguments."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
