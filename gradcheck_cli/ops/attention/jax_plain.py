"""The plain attention in jax.numpy, differentiated by ``jax.vjp``: the peer a user's JAX attention in
float16/bfloat16 is measured against (``precision.judge``'s plain computation, as torch autograd of the
plain forward is for a torch one). Imported only by a JAX scenario in half precision (JAX at the top)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import stages as score_stages


def _sink_column(s, stages):
    """The masked scores ``s`` with the sinks' logits as one more column (gpt-oss's way, the column dropped after
    the softmax), in the scores' dtype; None without sinks."""
    sink = score_stages.sink_logits(stages) if stages else None
    if sink is None:
        return None
    col = jnp.broadcast_to(jnp.asarray(sink, dtype=s.dtype)[..., 0], s.shape[:-1])[..., None]
    return jnp.concatenate([s, col], axis=-1)


def _softmax(s, stages):
    """The softmax of the masked scores ``s`` over each row, with the sinks' logits in its normaliser."""
    full = _sink_column(s, stages)
    if full is None:
        e = jnp.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    e = jnp.exp(full - full.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True))[..., :-1]


def forward(q, k, v, visible, scale: float, kv_map, stages=()):
    """O = A V with A the softmax over each row's visible set of scale * q k^T (through the score ``stages``), the
    row max subtracted (``formulas.forward``), every step in the inputs' dtype. Shapes as in ``formulas``."""
    k, v = k[:, kv_map], v[:, kv_map]
    s = (q @ jnp.swapaxes(k, -1, -2)) * scale
    if stages:
        s = score_stages.apply(stages, s, xp=jnp)
    return _softmax(jnp.where(visible, s, -jnp.inf), stages) @ v


def forward_softmax(q, k, v, visible, scale: float, kv_map, stages=()):
    """The same through ``jax.nn.softmax`` (JAX's own, with its own backward): the library way a JAX attention is
    most often written, whose half-precision rounding differs from the explicit exponentials'."""
    k, v = k[:, kv_map], v[:, kv_map]
    s = (q @ jnp.swapaxes(k, -1, -2)) * scale
    if stages:
        s = score_stages.apply(stages, s, xp=jnp)
    s = jnp.where(visible, s, -jnp.inf)
    full = _sink_column(s, stages)
    if full is not None:  # the sink as one more column of jax.nn.softmax, dropped after
        return jax.nn.softmax(full, axis=-1)[..., :-1] @ v
    return jax.nn.softmax(s, axis=-1) @ v


def backward(q, k, v, visible, scale: float, kv_map, grad_o, stages=()):
    """(G_Q, G_K, G_V): the closed forms (``formulas.backward``), every step in the inputs' dtype, K/V
    gradients summed over the query heads of each KV head; G_S back through the score ``stages``' derivative."""
    k_rep, v_rep = k[:, kv_map], v[:, kv_map]
    raw = (q @ jnp.swapaxes(k_rep, -1, -2)) * scale
    staged, slope = score_stages.with_slope(stages, raw, xp=jnp) if stages else (raw, None)
    a = _softmax(jnp.where(visible, staged, -jnp.inf), stages)
    g_a = grad_o @ jnp.swapaxes(v_rep, -1, -2)
    g_s = a * (g_a - (a * g_a).sum(axis=-1, keepdims=True))
    if slope is not None:
        g_s = g_s * slope
    g_k_rep, g_v_rep = (jnp.swapaxes(g_s, -1, -2) @ q) * scale, jnp.swapaxes(a, -1, -2) @ grad_o
    groups = jax.nn.one_hot(kv_map, k.shape[1], dtype=q.dtype)  # [Hq, Hkv]: each query head's KV head
    return ((g_s @ k_rep) * scale, jnp.einsum("bhnd,hg->bgnd", g_k_rep, groups),
            jnp.einsum("bhnd,hg->bgnd", g_v_rep, groups))


#: Compiled with every operation's result rounded to the dtype, as JAX computes it one operation at a time
#: (XLA may otherwise keep float32 between fused operations): the numbers of ``jax.vjp`` of ``forward``
#: called eagerly (to the bit on most CPUs; with the same error against float64 on one with native float16,
#: whose compiled float16 products round differently by a few ulps), from one compiled program instead of one
#: per operation (seconds of compiling); without LLVM's optimisations, which take most of the compile time of a
#: program this small and change no number.
ROUNDED = {"xla_allow_excess_precision": False, "xla_backend_optimization_level": 0}


def _ways(scale: float, stages=()):
    def run(q, k, v, g, visible, kv_map):
        kw = {"visible": visible, "scale": scale, "kv_map": kv_map, "stages": stages}  # Args.kw, traced
        o, pull = jax.vjp(lambda q, k, v: forward(q, k, v, **kw), q, k, v)
        o_sm, pull_sm = jax.vjp(lambda q, k, v: forward_softmax(q, k, v, **kw), q, k, v)
        return (o, *pull(g), *backward(q, k, v, grad_o=g, **kw), o_sm, *pull_sm(g))
    return run


def _plain_ways(scale: float, stages=()):
    return jax.jit(_ways(scale, stages))


#: The compiled program of each (scale, argument shapes and dtypes), for the life of the process.
_COMPILED: dict[tuple, object] = {}


def plain(inputs: dict, g, args, dtype: str) -> list[dict]:
    """Three plain computations in ``dtype`` on ``inputs`` (rounded to it) under attention's ``args``
    (``args.Args``: visible set, scale, kv_map, stages), each {o, q, k, v} as float64 NumPy
    arrays: the plain forward with its ``jax.vjp`` gradients, the closed forms, and the forward through
    ``jax.nn.softmax`` with its ``jax.vjp`` gradients (so that no one plain way is lucky: as the torch engine
    takes autograd, the closed forms and SDPA); with score stages, a fourth: the first run op by op (eagerly)."""
    dt = jnp.dtype(dtype)  # a NumPy dtype (ml_dtypes' for bfloat16)
    to = lambda a: jnp.asarray(np.asarray(a).astype(dt))  # noqa: E731 (rounded in NumPy: no float64 in JAX)
    scale, stages = float(args.scale), args.stages
    arrays = (*(to(inputs[t]) for t in "qkv"), to(g), jnp.asarray(args.visible),
              jnp.asarray(np.asarray(args.kv_map, dtype=np.int32)))
    key = (scale, score_stages.keys(stages)) + tuple((a.shape, str(a.dtype)) for a in arrays)
    if key not in _COMPILED:
        _COMPILED[key] = _plain_ways(scale, stages).lower(*arrays).compile(compiler_options=ROUNDED)
    o, *grads = (np.asarray(x).astype(np.float64) for x in _COMPILED[key](*arrays))
    ways = [dict(zip("oqkv", (o, *grads[:3]))), dict(zip("oqkv", (o, *grads[3:6]))), dict(zip("oqkv", grads[6:]))]
    if stages:  # a stage's elementwise functions (softcap's tanh) round otherwise op by op than in one program, even
        # without excess precision (a float16 case: 3x the compiled ways' dK error): the plain forward run eagerly too
        # (each operation is a program of its own: none is worth keeping in the persistent compilation cache, whose
        # writes, each scanning the folder, would cost more than the run and crowd out the programs worth keeping)
        kept = jax.config.jax_persistent_cache_min_compile_time_secs
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
        try:
            eager = [np.asarray(x).astype(np.float64) for x in _ways(scale, stages)(*arrays)[:4]]
        finally:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", kept)
        ways.append(dict(zip("oqkv", eager)))
    return ways
