"""Realistic BUGGY attention implementations (NumPy flavour), one bug each, for the tests of the verdict and
the hints (tests/test_hints.py).

Interface (docs/your-code.md "Checking your own implementation"):
    forward(q, k, v, visible, scale, kv_map) -> o
    backward(q, k, v, visible, scale, kv_map, grad_o) -> (dq, dk, dv)
    q [B, Hq, n_q, d_head], k [B, Hkv, n_k, d_head], v [B, Hkv, n_k, d_value]
    visible bool [B, Hq, n_q, n_k] (True = visible), kv_map int [Hq]

Every bug starts from ``Correct`` (the plain reference, the same maths as examples/my_attention.py)
and changes exactly one thing. ``CATALOG = {name: (object, cause_tag, description)}``.
All arrays are computed and returned in the input dtype (Python-float scale does not upcast in NumPy 2).
"""
import numpy as np


# ----------------------------------------------------------------------------------------------- helpers
def _scores(q, k_rep, scale):
    return scale * np.einsum("bhid,bhjd->bhij", q, k_rep)


def _softmax(s, visible):
    """Masked softmax over the last axis; visible None means every key counts."""
    if visible is None:
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    s = np.where(visible, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _probs(q, k, visible, scale, kv_map):
    return _softmax(_scores(q, k[:, kv_map], scale), visible)


def _sum_groups(g_rep, kv_map, heads_kv):
    """[B, Hq, n, d] -> [B, Hkv, n, d], summing the query heads that share a KV head."""
    out = np.zeros(g_rep.shape[:1] + (heads_kv,) + g_rep.shape[2:], dtype=g_rep.dtype)
    np.add.at(out, (slice(None), kv_map), g_rep)
    return out


def _grads(q, k, v, p, scale, kv_map, grad_o):
    """Correct VJP given the attention weights p (used by several bugs)."""
    k_rep, v_rep = k[:, kv_map], v[:, kv_map]
    dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
    dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
    dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
    return dq, _sum_groups(dk_rep, kv_map, k.shape[1]), _sum_groups(dv_rep, kv_map, v.shape[1])


# --------------------------------------------------------------------------------------- the reference
class Correct:
    """The correct reference every bug starts from (passes every scenario)."""

    def forward(self, q, k, v, visible, scale, kv_map):
        p = _probs(q, k, visible, scale, kv_map)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        p = _probs(q, k, visible, scale, kv_map)
        return _grads(q, k, v, p, scale, kv_map, grad_o)


correct = Correct()


# ----------------------------------------------------------------------------------------- backward bugs
class SoftmaxRowsum(Correct):
    """Backward drops the softmax row-sum term: dS = P * dP."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _probs(q, k, visible, scale, kv_map)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * dp  # BUG: missing "- rowsum(p * dp)"
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        return dq, _sum_groups(dk_rep, kv_map, k.shape[1]), _sum_groups(dv_rep, kv_map, v.shape[1])


class _ScaleFactor(Correct):
    power = 0

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        f = scale ** (self.power - 1)  # Correct applied scale**1
        return dq * f, dk * f, dv


class ScaleMissing(_ScaleFactor):
    """dq and dk lack the scale factor."""
    power = 0


class ScaleTwice(_ScaleFactor):
    """dq and dk have the scale factor applied twice."""
    power = 2


class GqaOverwrite(Correct):
    """K/V gradients: the last query head of a group overwrites instead of summing (dk[:, kv_map] = ...)."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _probs(q, k, visible, scale, kv_map)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        dk[:, kv_map] = dk_rep  # BUG: '=' with repeated indices: the last head wins
        dv[:, kv_map] = dv_rep
        return dq, dk, dv


class GqaFirstOnly(Correct):
    """Only the first query head of each group contributes to dK/dV."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _probs(q, k, visible, scale, kv_map)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        for g in range(k.shape[1]):
            r = int(np.flatnonzero(np.asarray(kv_map) == g)[0])  # BUG: should loop over all heads of group g
            dk[:, g] = dk_rep[:, r]
            dv[:, g] = dv_rep[:, r]
        return dq, dk, dv


class MaskIgnored(Correct):
    """Forward and backward both ignore `visible` (every key is attended)."""

    def forward(self, q, k, v, visible, scale, kv_map):
        return Correct.forward(self, q, k, v, np.ones_like(visible), scale, kv_map)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        return Correct.backward(self, q, k, v, np.ones_like(visible), scale, kv_map, grad_o)


class MaskBackwardOnly(Correct):
    """Backward recomputes P without the mask (forward is right)."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        p = _softmax(_scores(q, k[:, kv_map], scale), None)  # BUG: mask forgotten in the recompute
        return _grads(q, k, v, p, scale, kv_map, grad_o)


class DvUnmasked(Correct):
    """Only dV uses the unmasked P; dQ and dK use the right one."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, _ = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        p_unmasked = _softmax(_scores(q, k[:, kv_map], scale), None)  # BUG
        dv = _sum_groups(np.einsum("bhij,bhid->bhjd", p_unmasked, grad_o), kv_map, v.shape[1])
        return dq, dk, dv


class _Factor(Correct):
    factors = (1.0, 1.0, 1.0)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        grads = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        return tuple(g if f == 1.0 else g * f for g, f in zip(grads, self.factors))


class DkTimes1001(_Factor):
    """dk multiplied by 1.001."""
    factors = (1.0, 1.001, 1.0)


class DvTimesHalf(_Factor):
    """dv halved."""
    factors = (1.0, 1.0, 0.5)


class DqTimes1001(_Factor):
    """dq multiplied by 1.001."""
    factors = (1.001, 1.0, 1.0)


class SwapDkDv(Correct):
    """Returns (dq, dv, dk) (only shape-compatible when d_head == d_value)."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        return dq, dv, dk


class TransposedDv(Correct):
    """dV computed as P @ dO instead of P^T @ dO (shape-compatible only when n_q == n_k)."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, _ = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        p = _probs(q, k, visible, scale, kv_map)
        dv_rep = p @ grad_o  # BUG: should be p^T @ grad_o
        return dq, dk, _sum_groups(dv_rep, kv_map, v.shape[1])


# ------------------------------------------------------------------------------ forward / semantics bugs
class OnlineSoftmaxNoRescale(Correct):
    """Tiled forward (key blocks of 4, online softmax) that rescales the running sum l but forgets to
    rescale the accumulator when the running max grows. Backward: correct for the true attention."""
    block = 4

    def forward(self, q, k, v, visible, scale, kv_map):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        shape = q.shape[:3]
        m = np.full(shape + (1,), -np.inf, dtype=q.dtype)
        l = np.zeros(shape + (1,), dtype=q.dtype)
        acc = np.zeros(shape + (v.shape[-1],), dtype=q.dtype)
        for j0 in range(0, k.shape[2], self.block):
            sl = slice(j0, j0 + self.block)
            vis = visible[..., sl]
            s = np.where(vis, _scores(q, k_rep[:, :, sl], scale), -np.inf)
            m_new = np.maximum(m, s.max(axis=-1, keepdims=True))
            safe = np.where(np.isfinite(m_new), m_new, 0)
            p = np.where(vis, np.exp(np.where(vis, s, 0) - safe), 0).astype(q.dtype)
            alpha = np.where(np.isfinite(m), np.exp(m - safe), 0).astype(q.dtype)
            l = alpha * l + p.sum(axis=-1, keepdims=True)
            acc = acc + p @ v_rep[:, :, sl]  # BUG: should be alpha * acc + p @ v
            m = m_new
        return (acc / l).astype(q.dtype)


class CausalUpperLeft(Correct):
    """Applies an upper-left causal mask (j <= i, like SDPA is_causal=True) in forward and backward and
    ignores `visible`; wrong for a query block against a KV cache (lower-right, n_q < n_k)."""

    @staticmethod
    def _mask(visible):
        n_q, n_k = visible.shape[-2:]
        return np.broadcast_to(np.tril(np.ones((n_q, n_k), dtype=bool)), visible.shape)

    def forward(self, q, k, v, visible, scale, kv_map):
        return Correct.forward(self, q, k, v, self._mask(visible), scale, kv_map)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        return Correct.backward(self, q, k, v, self._mask(visible), scale, kv_map, grad_o)


class KvInterleaved(Correct):
    """Uses query head r -> KV head r % Hkv (interleaved) instead of kv_map (contiguous r // group),
    consistently in forward and backward."""

    @staticmethod
    def _map(q, k):
        return np.arange(q.shape[1]) % k.shape[1]

    def forward(self, q, k, v, visible, scale, kv_map):
        return Correct.forward(self, q, k, v, visible, scale, self._map(q, k))

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        return Correct.backward(self, q, k, v, visible, scale, self._map(q, k), grad_o)


class BatchMixingMax(Correct):
    """Forward takes the softmax max over the batch axis too (s.max(axis=(0, -1))). Mathematically the
    max cancels, so this only matters numerically (rows far below the batch max lose precision/underflow)."""

    def forward(self, q, k, v, visible, scale, kv_map):
        s = np.where(visible, _scores(q, k[:, kv_map], scale), -np.inf)
        e = np.exp(s - s.max(axis=(0, -1), keepdims=True))  # BUG: axis 0 is the batch
        p = e / e.sum(axis=-1, keepdims=True)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])


class BatchMixingMean(Correct):
    """Forward adds 1e-3 * (mean over the batch axis of o) to o: batch elements interact.
    Backward: correct for the true attention."""

    def forward(self, q, k, v, visible, scale, kv_map):
        o = Correct.forward(self, q, k, v, visible, scale, kv_map)
        return o + 1e-3 * o.mean(axis=0, keepdims=True)  # BUG


class DroppedTailBlock(Correct):
    """Tiled over key blocks of 8, the loop skips the last partial block (n_k % 8 keys ignored), in
    forward and backward alike."""
    block = 8

    def _mask(self, visible):
        n_k = visible.shape[-1]
        covered = np.arange(n_k) < (n_k // self.block) * self.block  # BUG: range(n_k // 8) blocks
        return visible & covered

    def forward(self, q, k, v, visible, scale, kv_map):
        return Correct.forward(self, q, k, v, self._mask(visible), scale, kv_map)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        return Correct.backward(self, q, k, v, self._mask(visible), scale, kv_map, grad_o)


class AdditiveDv(Correct):
    """dv + 1e-4 everywhere."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        return dq, dk, dv + np.asarray(1e-4, dtype=dv.dtype)


class EpsInDenominator(Correct):
    """Forward divides by (l + 1e-6) (forward only); backward exact for the true softmax."""

    def forward(self, q, k, v, visible, scale, kv_map):
        s = np.where(visible, _scores(q, k[:, kv_map], scale), -np.inf)
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        p = e / (e.sum(axis=-1, keepdims=True) + 1e-6)  # BUG ("numerical safety")
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map]).astype(q.dtype)


class NondeterministicBackward(Correct):
    """dk gets tiny random noise on each call (relative 1e-9 x max|dk|), like an atomic-add reduction."""

    def __init__(self):
        self.rng = np.random.default_rng()

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        noise = self.rng.standard_normal(dk.shape) * 1e-9 * float(np.abs(dk).max())
        return dq, (dk + noise).astype(dk.dtype), dv


class NondeterministicBackwardRel(Correct):
    """dk gets relative noise on each call (dk * (1 + 1e-9 * randn)): like atomics summing in a different
    order, exact zeros stay zero."""

    def __init__(self):
        self.rng = np.random.default_rng()

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)
        return dq, (dk * (1 + 1e-9 * self.rng.standard_normal(dk.shape))).astype(dk.dtype), dv


class Float32Internal(Correct):
    """NOT a bug: computes everything in float32 internally and casts back to the input dtype."""

    def forward(self, q, k, v, visible, scale, kv_map):
        f = np.float32
        return Correct.forward(self, q.astype(f), k.astype(f), v.astype(f), visible, scale, kv_map).astype(q.dtype)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        f = np.float32
        grads = Correct.backward(self, q.astype(f), k.astype(f), v.astype(f), visible, scale, kv_map,
                                 grad_o.astype(f))
        return tuple(g.astype(q.dtype) for g in grads)


class InplaceGradO(Correct):
    """Backward scales grad_o in place (grad_o *= 0.35) and computes correct-looking gradients from it."""

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        grad_o *= 0.35  # BUG: mutates the caller's array, and the gradients come out 0.35x
        return Correct.backward(self, q, k, v, visible, scale, kv_map, grad_o)


class InplaceInput(Correct):
    """Forward modifies q in place (q *= 1.001) after computing o: the output is right, the caller's q
    is not (a pure side effect)."""

    def forward(self, q, k, v, visible, scale, kv_map):
        o = Correct.forward(self, q, k, v, visible, scale, kv_map)
        q *= 1.0 + 1e-3  # BUG: side effect on the caller's array
        return o


class InplaceInputUsed(Correct):
    """Forward modifies q in place (q *= 1.001) first and computes o from the modified q."""

    def forward(self, q, k, v, visible, scale, kv_map):
        q *= 1.0 + 1e-3  # BUG: mutates the caller's array, and the output uses it
        return Correct.forward(self, q, k, v, visible, scale, kv_map)


# ------------------------------------------------------------------------------------------- instances
softmax_rowsum = SoftmaxRowsum()
scale_missing = ScaleMissing()
scale_twice = ScaleTwice()
gqa_overwrite = GqaOverwrite()
gqa_first_only = GqaFirstOnly()
mask_ignored = MaskIgnored()
mask_backward_only = MaskBackwardOnly()
dv_unmasked = DvUnmasked()
dk_times_1001 = DkTimes1001()
dv_times_half = DvTimesHalf()
dq_times_1001 = DqTimes1001()
swap_dk_dv = SwapDkDv()
transposed_dv = TransposedDv()
online_softmax_no_rescale = OnlineSoftmaxNoRescale()
causal_upper_left = CausalUpperLeft()
kv_interleaved = KvInterleaved()
batch_mixing_max = BatchMixingMax()
batch_mixing_mean = BatchMixingMean()
dropped_tail_block = DroppedTailBlock()
additive_dv = AdditiveDv()
eps_in_denominator = EpsInDenominator()
nondeterministic_backward = NondeterministicBackward()
nondeterministic_backward_rel = NondeterministicBackwardRel()
float32_internal_correct = Float32Internal()
inplace_grad_o = InplaceGradO()
inplace_input = InplaceInput()
inplace_input_used = InplaceInputUsed()

CATALOG = {
    "correct": (correct, "none", "the correct reference every bug starts from"),
    "softmax-rowsum": (softmax_rowsum, "softmax-rowsum", "backward drops the row-sum term: dS = P * dP"),
    "scale-missing": (scale_missing, "scale", "dq and dk lack the scale factor"),
    "scale-twice": (scale_twice, "scale", "dq and dk have the scale applied twice"),
    "gqa-overwrite": (gqa_overwrite, "gqa", "K/V grads: last query head of a group overwrites instead of summing"),
    "gqa-first-only": (gqa_first_only, "gqa", "only the first query head of each group contributes to dK/dV"),
    "mask-ignored": (mask_ignored, "forward-mask-leak", "forward and backward both ignore `visible`"),
    "mask-backward-only": (mask_backward_only, "backward-mask", "backward recomputes P without the mask"),
    "dv-unmasked": (dv_unmasked, "backward-mask", "only dV uses the unmasked P"),
    "dk-times-1.001": (dk_times_1001, "constant-factor-k", "dk multiplied by 1.001"),
    "dv-times-0.5": (dv_times_half, "constant-factor-v", "dv halved"),
    "dq-times-1.001": (dq_times_1001, "constant-factor-q", "dq multiplied by 1.001"),
    "swap-dk-dv": (swap_dk_dv, "swapped", "returns (dq, dv, dk); d_head == d_value only"),
    "transposed-dv": (transposed_dv, "other", "dV = P @ dO instead of P^T @ dO; n_q == n_k only"),
    "online-softmax-no-rescale": (online_softmax_no_rescale, "normalisation",
                                  "tiled forward (key blocks of 4) never rescales the accumulator; backward exact"),
    "causal-upper-left": (causal_upper_left, "causal-alignment",
                          "upper-left causal (j <= i) in forward and backward, ignoring `visible`"),
    "kv-interleaved": (kv_interleaved, "kv-layout", "query head r reads KV head r % Hkv instead of kv_map"),
    "batch-mixing-max": (batch_mixing_max, "batch-mixing",
                         "softmax max over (batch, keys): cancels mathematically, numerics only"),
    "batch-mixing-mean": (batch_mixing_mean, "batch-mixing", "o += 1e-3 * mean over the batch of o"),
    "dropped-tail-block": (dropped_tail_block, "missing-keys",
                           "key blocks of 8: the last partial block (n_k % 8 keys) is skipped, fwd and bwd"),
    "additive-1e-4-dv": (additive_dv, "other", "dv + 1e-4 everywhere"),
    "eps-in-denominator": (eps_in_denominator, "other", "forward divides by (l + 1e-6); backward exact"),
    "nondeterministic-backward": (nondeterministic_backward, "nondeterminism",
                                  "dk + random noise of 1e-9 x max|dk| on every call"),
    "nondeterministic-backward-rel": (nondeterministic_backward_rel, "nondeterminism",
                                      "dk * (1 + 1e-9 randn) on every call: zeros stay zero (atomics-like)"),
    "float32-internal-correct": (float32_internal_correct, "precision",
                                 "NOT a bug: computes in float32 internally, casts back"),
    "inplace-grad-o": (inplace_grad_o, "mutation", "backward does grad_o *= 0.35 and uses it"),
    "inplace-input": (inplace_input, "mutation", "forward does q *= 1.001 after computing o (side effect only)"),
    "inplace-input-used": (inplace_input_used, "mutation", "forward does q *= 1.001 first and uses it"),
}
