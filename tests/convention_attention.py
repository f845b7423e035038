"""Correct attention implementations written natively in another calling convention (the ``convention:``
keys and ``kv_map: interleaved``, docs/your-code.md "Checking your own implementation"), for the tests of those keys
and of the hints that name them (tests/ops/test_attention_convention.py, tests/ops/test_attention_hints.py).

Each takes its arguments the way its convention says and never reads kv_map (the KV-head layout is
built in, as in most kernels): under its own convention it passes; under the default one it fails."""
import numpy as np


class Native:
    """NumPy forward/backward in one convention: ``layout`` bhnd | bnhd, ``mask`` keep | drop | additive |
    additive-min, ``heads`` per-head | shared (squeezes the mask's head axis: it must be 1), ``scale``
    passed | omitted, ``kv`` contiguous | interleaved."""

    def __init__(self, layout="bhnd", mask="keep", heads="per-head", scale="passed", kv="contiguous"):
        self.layout, self.mask, self.heads, self.scale, self.kv = layout, mask, heads, scale, kv

    def _args(self, args):
        if self.scale == "passed":
            q, k, v, mask, scale, _ = args
        else:
            q, k, v, mask, _ = args
            scale = 1.0 / np.sqrt(q.shape[-1])
        return q, k, v, mask, scale

    def _bias(self, mask, dtype):
        """[B, H or 1, n_q, n_k] added to the scores."""
        if self.heads == "shared":
            mask = np.squeeze(mask, axis=1)[:, None]  # [B, n_q, n_k], as kernels that take one mask per batch
        if self.mask == "keep":
            return np.where(mask, 0.0, -np.inf).astype(dtype)
        if self.mask == "drop":
            return np.where(mask, -np.inf, 0.0).astype(dtype)
        if self.mask == "additive":
            return mask
        return np.where(mask == np.finfo(mask.dtype).min, -np.inf, 0.0).astype(dtype)  # additive-min

    def _eq(self, spec):
        """An einsum over [B, H, n, d] operands, rewritten for this layout."""
        if self.layout == "bhnd":
            return spec
        ins, out = spec.split("->")
        swap = lambda t: t if len(t) != 4 or t == "bhij" else t[0] + t[2] + t[1] + t[3]  # noqa: E731
        return ",".join(swap(t) for t in ins.split(",")) + "->" + swap(out)

    def _repeat(self, x, heads_q):
        axis = 1 if self.layout == "bhnd" else 2
        group = heads_q // x.shape[axis]
        return np.repeat(x, group, axis=axis) if self.kv == "contiguous" else np.tile(
            x, (1, group, 1, 1) if axis == 1 else (1, 1, group, 1))

    def _sum_groups(self, x, heads_kv):
        axis = 1 if self.layout == "bhnd" else 2
        shape = list(x.shape)
        group = shape[axis] // heads_kv
        if self.kv == "contiguous":
            shape[axis:axis + 1] = [heads_kv, group]
            return x.reshape(shape).sum(axis=axis + 1)
        shape[axis:axis + 1] = [group, heads_kv]
        return x.reshape(shape).sum(axis=axis)

    def _probs(self, q, k, mask, scale):
        heads_q = q.shape[1 if self.layout == "bhnd" else 2]
        s = scale * np.einsum(self._eq("bhid,bhjd->bhij"), q, self._repeat(k, heads_q)) + self._bias(mask, q.dtype)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    def forward(self, *args):
        q, k, v, mask, scale = self._args(args)
        heads_q = q.shape[1 if self.layout == "bhnd" else 2]
        p = self._probs(q, k, mask, scale)
        return np.einsum(self._eq("bhij,bhjd->bhid"), p, self._repeat(v, heads_q)).astype(q.dtype)

    def backward(self, *args):
        *rest, grad_o = args
        q, k, v, mask, scale = self._args(rest)
        axis = 1 if self.layout == "bhnd" else 2
        heads_q, heads_kv = q.shape[axis], k.shape[axis]
        p = self._probs(q, k, mask, scale)
        k_rep, v_rep = self._repeat(k, heads_q), self._repeat(v, heads_q)
        dv = np.einsum(self._eq("bhij,bhid->bhjd"), p, grad_o)
        dp = np.einsum(self._eq("bhid,bhjd->bhij"), grad_o, v_rep)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        dq = scale * np.einsum(self._eq("bhij,bhjd->bhid"), ds, k_rep)
        dk = scale * np.einsum(self._eq("bhij,bhid->bhjd"), ds, q)
        return (dq.astype(q.dtype), self._sum_groups(dk, heads_kv).astype(q.dtype),
                self._sum_groups(dv, heads_kv).astype(q.dtype))


bnhd = Native(layout="bnhd")
drop = Native(mask="drop")
additive = Native(mask="additive")
additive_min = Native(mask="additive-min")
shared = Native(heads="shared")
no_scale = Native(scale="omitted")
interleaved = Native(kv="interleaved")
#: Every key at once: flash-attn's layout, an HF-style additive mask shared by the heads, no scale.
everything = Native(layout="bnhd", mask="additive-min", heads="shared", scale="omitted", kv="interleaved")


def torch_native(layout="bhnd", mask="keep", heads="per-head", scale="passed", kv="contiguous"):
    """The same conventions as a torch callable on SDPA (which takes [B, H, n, d], a keep or an additive
    mask, and scale=None for 1/sqrt(d))."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    def f(q, k, v, m, *rest):
        if len(rest) != (2 if scale == "passed" else 1):  # f(q, k, v, mask[, scale], kv_map)
            raise TypeError(f"f() takes {5 + (scale == 'passed')} positional arguments but {4 + len(rest)} were given")
        s = rest[0] if scale == "passed" else None
        if layout == "bnhd":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        group = q.shape[1] // k.shape[1]
        rep = (lambda t: t.repeat_interleave(group, dim=1)) if kv == "contiguous" else (
            lambda t: t.repeat(1, group, 1, 1))
        if heads == "shared":
            m = m.squeeze(1).unsqueeze(1)  # one mask per batch element
            if m.dim() != 4:
                raise ValueError(f"expected a mask [B, 1, n_q, n_k], got {list(m.shape)}")
        if mask == "drop":
            m = ~m
        elif mask == "additive-min":
            m = torch.zeros_like(m).masked_fill(m == torch.finfo(m.dtype).min, float("-inf"))
        o = scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=m, scale=s)
        return o.transpose(1, 2) if layout == "bnhd" else o

    return f


def jax_sdpa(q, k, v, mask, scale, kv_map):
    """jax.nn.dot_product_attention as it comes: [B, T, N, H], a boolean keep mask [B, N, T, S]."""
    import jax
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
