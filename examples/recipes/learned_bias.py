"""Recipes: a learned additive bias, its gradient checked, in the libraries' own attention functions.

- PyTorch SDPA (``torch.nn.functional.scaled_dot_product_attention``) with a learned float ``attn_mask``: the
  bias with the hidden keys at -inf, KV heads shared by ``enable_gqa=True``; autograd takes the mask's gradient
  through SDPA (the scenario's ``bias: {grad: true}``, passed as ``attn_bias=``).
- ``jax.nn.dot_product_attention`` with ``bias=`` and ``mask=`` (its [B, T, N, H] layout inside), differentiated
  by ``jax.vjp`` along the bias too.

Broken on purpose, the way they are written in real code: ``sdpa_bias_scaled`` (the bias folded in before the
scale, ``(Q K^T + B) * scale``: the forward disagrees), ``sdpa_mask_under_no_grad`` (the float mask built under
``torch.no_grad()``, as a cached mask is: its gradient never reaches the bias) and ``jax_bias_stop_gradient``
(the bias wrapped in ``jax.lax.stop_gradient``, as a fixed positional bias is: likewise). Each function imports
its library inside, so that each scenario needs only its own."""


def sdpa_learned_mask(q, k, v, visible, scale, kv_map, *, attn_bias):  # contiguous KV groups
    import torch
    import torch.nn.functional as F
    mask = torch.where(visible, attn_bias, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sdpa_bias_scaled(q, k, v, visible, scale, kv_map, *, attn_bias):
    import torch
    import torch.nn.functional as F
    mask = torch.where(visible, attn_bias * scale, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sdpa_mask_under_no_grad(q, k, v, visible, scale, kv_map, *, attn_bias):
    import torch
    import torch.nn.functional as F
    with torch.no_grad():
        mask = torch.where(visible, attn_bias, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _jax_attention(q, k, v, visible, scale, kv_map, bias):
    import jax
    import jax.numpy as jnp
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 -- [B, H, n, d] -> [B, n, H, d]
    out = jax.nn.dot_product_attention(t(q), t(k[:, kv_map]), t(v[:, kv_map]), bias=bias, mask=visible, scale=scale)
    return t(out)


def jax_learned_bias(q, k, v, visible, scale, kv_map, *, attn_bias):
    return _jax_attention(q, k, v, visible, scale, kv_map, attn_bias)


def jax_bias_stop_gradient(q, k, v, visible, scale, kv_map, *, attn_bias):
    import jax
    return _jax_attention(q, k, v, visible, scale, kv_map, jax.lax.stop_gradient(attn_bias))


