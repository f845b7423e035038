"""Hand-written JAX layers (jax.custom_vjp) with the mistakes their authors make; see torch_bugs.py."""
import jax
import jax.numpy as jnp


@jax.custom_vjp
def _rms(x, gamma, eps):
    return gamma * x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps)


def _rms_fwd(x, gamma, eps):
    return _rms(x, gamma, eps), (x, gamma, eps)


def _rms_bwd(saved, grad_y):
    x, gamma, eps = saved
    r = jnp.sqrt((x * x).mean(-1, keepdims=True) + eps)
    g = grad_y * gamma
    dx = g / r - x * (g * x).mean(-1, keepdims=True) / r ** 3
    dgamma = (grad_y * x / r).reshape(-1, x.shape[-1]).mean(0)  # averaged over tokens
    return dx, dgamma, jnp.zeros_like(eps)


_rms.defvjp(_rms_fwd, _rms_bwd)


def rmsnorm_dgamma_mean(x, gamma, eps):
    return _rms(x, gamma, eps)


@jax.custom_vjp
def _rope(x, cos, sin):
    h = cos.shape[-1]
    a, b = x[..., :h], x[..., h:2 * h]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos, x[..., 2 * h:]], axis=-1)


def _rope_fwd(x, cos, sin):
    return _rope(x, cos, sin), (cos, sin)


def _rope_bwd(saved, g):
    cos, sin = saved
    h = cos.shape[-1]
    a, b = g[..., :h], g[..., h:2 * h]
    # the forward's rotation again: the transpose (-angle) forgotten
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos, g[..., 2 * h:]], axis=-1), None, None


_rope.defvjp(_rope_fwd, _rope_bwd)


def rope_same_rotation(x, cos, sin):
    return _rope(x, cos, sin)


BUGS = [
    ("rmsnorm_dgamma_mean", "rmsnorm-dgamma-mean", {"op": "rmsnorm", "batch": 2, "n": 5, "d_model": 16,
                                                    "backend": "jax"}),
    ("rope_same_rotation", "rope-transpose", {"op": "rope", "batch": 2, "heads": 2, "n": 6, "d_head": 8,
                                              "backend": "jax"}),
]
