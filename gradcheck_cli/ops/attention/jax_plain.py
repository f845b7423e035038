"""The plain attention in jax.numpy, differentiated by ``jax.vjp``: the peer a user's JAX attention in
float16/bfloat16 is measured against (``precision.judge``'s plain computation, as torch autograd of the
plain forward is for a torch one). Imported only by a JAX scenario in half precision (JAX at the top)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def forward(q, k, v, visible, scale: float, kv_map):
    """O = A V with A the softmax over each row's visible set of scale * q k^T, the row max subtracted
    (``formulas.forward``), every step in the inputs' dtype. Shapes as in ``formulas``."""
    k, v = k[:, kv_map], v[:, kv_map]
    s = (q @ jnp.swapaxes(k, -1, -2)) * scale
    s = jnp.where(visible, s, -jnp.inf)
    e = jnp.exp(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v


def plain(inputs: dict, g, visible, scale: float, kv_map, dtype: str) -> dict:
    """{o, q, k, v}: the plain forward and its ``jax.vjp`` gradients computed in ``dtype`` on ``inputs``
    (rounded to it), as float64 NumPy arrays."""
    dt = jnp.dtype(dtype)  # a NumPy dtype (ml_dtypes' for bfloat16)
    to = lambda a: jnp.asarray(np.asarray(a).astype(dt))  # noqa: E731 (rounded in NumPy: no float64 in JAX)
    rest = (jnp.asarray(visible), float(scale), jnp.asarray(np.asarray(kv_map, dtype=np.int32)))
    o, pull = jax.vjp(lambda q, k, v: forward(q, k, v, *rest), *(to(inputs[t]) for t in "qkv"))
    grads = pull(to(g))
    return {t: np.asarray(x).astype(np.float64) for t, x in zip("oqkv", (o, *grads))}
