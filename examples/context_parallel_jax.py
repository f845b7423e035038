"""Context-parallel attention written in JAX as per-shard code: each function runs on one device's shard under
``jax.shard_map`` (attn-gradcheck builds the mesh of ``world_size`` devices and the shard_map; on the CPU the devices
are emulated by XLA). The arguments are FlashAttention's, with the mesh axis's name for the collectives:

    f(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size, return_lse=False)

q [B, Hq, n_r, d], k and v [B, Hkv, n_r, d] (GQA by contiguous groups); the positions are the shard's global rows
(zigzag code reads its chunks from them; every mask is built from them).

    ring_attention          K/V rotate by lax.ppermute, partial outputs merge by their LSE; JAX differentiates it
    ring_attention_vjp      the same forward with a hand-written two-ring backward (jax.custom_vjp): each block's P
                            recomputed from the merged LSE, dK/dV carried round with their block and home at the end
    allgather_attention     K/V and their positions gathered by lax.all_gather (tiled); takes sinks= too
    ulysses_attention       lax.all_to_all from sequence- to head-sharded, attention over the whole sequence, back

Broken on purpose (each forward is right but the last's):

    broken_ring_vjp_stale_kv        the backward uses the shard's own K/V at every step (diffusers #14265)
    broken_ring_vjp_dkv_not_home    dK/dV not sent home after the last step
    broken_ring_vjp_local_lse       the backward recomputes each block's P from that block's own LSE
    broken_allgather_local_positions the mask built from local row numbers (right on one device only)
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _scores(q, k, q_pos, k_pos, scale, causal, window_size):
    k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
    s = scale * jnp.einsum("bhid,bhjd->bhij", q, k)
    d = k_pos[None, :] - q_pos[:, None]  # j - i
    ok = jnp.ones(d.shape, dtype=bool)
    left, right = window_size
    if causal:
        ok &= d <= 0
    if right >= 0:
        ok &= d <= right
    if left >= 0:
        ok &= d >= -left
    return jnp.where(ok, s, -jnp.inf)


def _safe(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


def _block(q, k, v, q_pos, k_pos, scale, causal, window_size):
    """(o_b, lse_b) of one K/V block; a row that sees none of it: o_b 0, lse_b -inf (no NaN, in its gradient too)."""
    s = _scores(q, k, q_pos, k_pos, scale, causal, window_size)
    m = _safe(s.max(-1))
    e = jnp.exp(s - m[..., None])
    total = e.sum(-1)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    o = jnp.einsum("bhij,bhjd->bhid", e, jnp.repeat(v, q.shape[1] // v.shape[1], axis=1)) / total[..., None]
    return o, jnp.where(seen, m + jnp.log(total), -jnp.inf)


def _merge(o, lse, o_b, lse_b):
    m = _safe(jnp.maximum(lse, lse_b))
    a, b = jnp.exp(lse - m), jnp.exp(lse_b - m)
    total = a + b
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    return (a[..., None] * o + b[..., None] * o_b) / total[..., None], jnp.where(seen, m + jnp.log(total), -jnp.inf)


def _ring_forward(q, k, v, q_pos, k_pos, axis_name, scale, causal, window_size):
    ws = lax.axis_size(axis_name)
    perm = [(i, (i + 1) % ws) for i in range(ws)]
    kb, vb, pb = k, v, k_pos
    o, lse = _block(q, kb, vb, q_pos, pb, scale, causal, window_size)
    for _ in range(ws - 1):
        kb, vb, pb = (lax.ppermute(x, axis_name, perm) for x in (kb, vb, pb))
        o, lse = _merge(o, lse, *_block(q, kb, vb, q_pos, pb, scale, causal, window_size))
    return o, lse


def ring_attention(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size,
                   return_lse=False):
    o, lse = _ring_forward(q, k, v, q_positions, k_positions, axis_name, softmax_scale, causal, tuple(window_size))
    return (o, lse) if return_lse else o


def _make_ring_vjp(fault=""):
    """Ring attention with a hand-written backward (``fault``: one of the broken variants)."""

    def run(q, k, v, q_pos, k_pos, axis_name, scale, causal, window_size):
        @jax.custom_vjp
        def ring(q, k, v, q_pos, k_pos):  # the positions are arguments: a custom_vjp closes over no tracer
            return _ring_forward(q, k, v, q_pos, k_pos, axis_name, scale, causal, window_size)

        def fwd(q, k, v, q_pos, k_pos):
            o, lse = ring(q, k, v, q_pos, k_pos)
            return (o, lse), (q, k, v, q_pos, k_pos, o, lse)

        def bwd(saved, cotangents):
            q, k, v, q_pos, k_pos, o, lse = saved
            g, g_lse = cotangents
            ws = lax.axis_size(axis_name)
            perm = [(i, (i + 1) % ws) for i in range(ws)]
            rep = q.shape[1] // k.shape[1]
            d_row = (g * o).sum(-1) - g_lse  # dS = P (dP - D + G_L)
            dq = jnp.zeros_like(q)
            kb, vb, pb = k, v, k_pos
            dkb, dvb = jnp.zeros_like(k), jnp.zeros_like(v)
            for step in range(ws):
                kc, vc = (k, v) if fault == "stale-kv" else (kb, vb)
                s = _scores(q, kc, q_pos, pb, scale, causal, window_size)
                ref = _block(q, kc, vc, q_pos, pb, scale, causal, window_size)[1] if fault == "local-lse" else lse
                p = jnp.exp(s - _safe(ref)[..., None])
                dp = jnp.einsum("bhid,bhjd->bhij", g, jnp.repeat(vc, rep, axis=1))
                ds = p * (dp - d_row[..., None])
                dq = dq + scale * jnp.einsum("bhij,bhjd->bhid", ds, jnp.repeat(kc, rep, axis=1))
                dk_b = scale * jnp.einsum("bhij,bhid->bhjd", ds, q)
                dv_b = jnp.einsum("bhij,bhid->bhjd", p, g)
                dkb = dkb + dk_b.reshape(dk_b.shape[0], -1, rep, *dk_b.shape[2:]).sum(2)
                dvb = dvb + dv_b.reshape(dv_b.shape[0], -1, rep, *dv_b.shape[2:]).sum(2)
                if step < ws - 1:
                    kb, vb, pb, dkb, dvb = (lax.ppermute(x, axis_name, perm) for x in (kb, vb, pb, dkb, dvb))
            if fault != "dkv-not-home":  # the last block belongs to the next rank: one more step home
                dkb, dvb = (lax.ppermute(x, axis_name, perm) for x in (dkb, dvb))
            no_cotangent = np.zeros(q_pos.shape, dtype=jax.dtypes.float0)  # integers have none
            return dq, dkb, dvb, no_cotangent, no_cotangent

        ring.defvjp(fwd, bwd)
        return ring(q, k, v, q_pos, k_pos)

    def ring_attention_vjp(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size,
                           return_lse=False):
        o, lse = run(q, k, v, q_positions, k_positions, axis_name, softmax_scale, causal, tuple(window_size))
        return (o, lse) if return_lse else o

    return ring_attention_vjp


ring_attention_vjp = _make_ring_vjp()
broken_ring_vjp_stale_kv = _make_ring_vjp("stale-kv")
broken_ring_vjp_dkv_not_home = _make_ring_vjp("dkv-not-home")
broken_ring_vjp_local_lse = _make_ring_vjp("local-lse")


def _gathered(q, k, v, q_pos, k_pos, axis_name, scale, causal, window_size, sinks):
    k_all, v_all, p_all = (lax.all_gather(x, axis_name, axis=axis, tiled=True)
                           for x, axis in ((k, 2), (v, 2), (k_pos, 0)))
    s = _scores(q, k_all, q_pos, p_all, scale, causal, window_size)
    if sinks is not None:  # one more logit per head in the normaliser, no value row
        col = jnp.broadcast_to(sinks.astype(s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
        s = jnp.concatenate([s, col], axis=-1)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])[..., :k_all.shape[2]]
    return jnp.einsum("bhij,bhjd->bhid", p, jnp.repeat(v_all, q.shape[1] // v.shape[1], axis=1)), lse


def allgather_attention(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size,
                        return_lse=False, sinks=None):
    o, lse = _gathered(q, k, v, q_positions, k_positions, axis_name, softmax_scale, causal, tuple(window_size), sinks)
    return (o, lse) if return_lse else o


def broken_allgather_local_positions(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal,
                                     window_size, return_lse=False):
    local = jnp.arange(q.shape[2])  # the shard's own row numbers: the mask is wrong on every shard but the first
    o, lse = _gathered(q, k, v, local, local, axis_name, softmax_scale, causal, tuple(window_size), None)
    return (o, lse) if return_lse else o


def ulysses_attention(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size,
                      return_lse=False):
    """[B, H, n_r, d] -> [B, H / ws, n, d] by lax.all_to_all, attention with this device's heads, and back."""
    to_heads = lambda x: lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)  # noqa: E731
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    pos = lax.all_gather(q_positions, axis_name, axis=0, tiled=True)
    s = _scores(qh, kh, pos, pos, softmax_scale, causal, tuple(window_size))
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhij,bhjd->bhid", jnp.exp(s - lse[..., None]), jnp.repeat(vh, qh.shape[1] // vh.shape[1], axis=1))
    back = lambda x: lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)  # noqa: E731
    if not return_lse:
        return back(o)
    return back(o), back(lse[..., None])[..., 0]
