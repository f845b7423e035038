"""NumPy attention implementations written as a kernel author would; several are buggy on purpose."""
import numpy as np


def _scores(q, k_rep, scale):
    return scale * np.einsum("bhid,bhjd->bhij", q, k_rep)


def _softmax_masked(s, visible):
    s = np.where(visible, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _gqa_reduce(x_rep, kv_map, n_kv):
    out = np.zeros(x_rep.shape[:1] + (n_kv,) + x_rep.shape[2:], dtype=x_rep.dtype)
    np.add.at(out, (slice(None), kv_map), x_rep)
    return out


class Base:
    def forward(self, q, k, v, visible, scale, kv_map):
        p = _softmax_masked(_scores(q, k[:, kv_map], scale), visible)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])


# A01: dq missing the softmax scale (dk has it)
class DqNoScale(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _softmax_masked(_scores(q, k_rep, scale), visible)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = np.einsum("bhij,bhjd->bhid", ds, k_rep)          # bug: forgot * scale
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# A02: mask applied in forward, but backward recomputes P with the mask forgotten
class MaskForwardOnly(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        s = _scores(q, k_rep, scale)
        e = np.exp(s - s.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)                     # bug: no mask in the recompute
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# A03: GQA: dK/dV taken from the first query head of each group (strided slice) instead of summed
class GqaFirstHead(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _softmax_masked(_scores(q, k_rep, scale), visible)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        group = q.shape[1] // k.shape[1]
        return dq, dk_rep[:, ::group].copy(), dv_rep[:, ::group].copy()   # bug


# A05: dV computed with P not transposed (n_q == n_k so shapes fit)
class DvNoTranspose(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _softmax_masked(_scores(q, k_rep, scale), visible)
        dv_rep = p @ grad_o                                   # bug: should be p^T @ grad_o
        dp = grad_o @ np.swapaxes(v_rep, -1, -2)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * ds @ k_rep
        dk_rep = scale * np.swapaxes(ds, -1, -2) @ q
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# C1 (correct): plain einsum attention
class Correct(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _softmax_masked(_scores(q, k_rep, scale), visible)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# ---- softcap ----
class SoftcapBase:
    def _p(self, q, k_rep, visible, scale, softcap):
        t = np.tanh(_scores(q, k_rep, scale) / softcap)
        return _softmax_masked(softcap * t, visible), t

    def forward(self, q, k, v, visible, scale, kv_map, *, softcap):
        p, _ = self._p(q, k[:, kv_map], visible, scale, softcap)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def deriv(self, t):
        return 1 - t * t

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, softcap):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, t = self._p(q, k_rep, visible, scale, softcap)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        ds = ds * self.deriv(t)
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# A08: tanh' written as 1 - tanh (typo: missing square)
class SoftcapOneMinusT(SoftcapBase):
    def deriv(self, t):
        return 1 - t


# C2 (correct): softcap
class SoftcapCorrect(SoftcapBase):
    pass


# ---- ALiBi with learned slopes ----
def _dist(nq, nk, offset=True):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return -np.abs(i + (nk - nq if offset else 0) - j).astype(np.float64)


class AlibiBase:
    def _p(self, q, k_rep, visible, scale, slopes):
        d = _dist(q.shape[2], k_rep.shape[2]).astype(q.dtype)
        return _softmax_masked(_scores(q, k_rep, scale) + slopes[:, None, None] * d, visible), d

    def forward(self, q, k, v, visible, scale, kv_map, *, alibi_slopes):
        p, _ = self._p(q, k[:, kv_map], visible, scale, alibi_slopes)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def slope_grad(self, ds, d):
        return np.einsum("bhij,ij->h", ds, d)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, alibi_slopes):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, d = self._p(q, k_rep, visible, scale, alibi_slopes)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return (dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv),
                self.slope_grad(ds, d))


# A10: slope gradient with |i' - j| (sign of the distance form dropped)
class AlibiSlopeAbsDist(AlibiBase):
    def slope_grad(self, ds, d):
        return np.einsum("bhij,ij->h", ds, np.abs(d))


# A11: slope gradient reduced over the wrong axis: the author sums per KV group (as for dK) and hands
# every query head its group's total
class AlibiSlopeWrongAxis(AlibiBase):
    kv_map = None

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, alibi_slopes):
        out = super().backward(q, k, v, visible, scale, kv_map, grad_o, alibi_slopes=alibi_slopes)
        per_head = out[3]
        per_group = np.zeros(k.shape[1], dtype=per_head.dtype)
        np.add.at(per_group, kv_map, per_head)         # bug: slopes are per query head, not per KV head
        return out[:3] + (per_group[kv_map],)


# ---- sinks ----
class SinksBase:
    def _p(self, q, k_rep, visible, scale, sinks):
        s = np.where(visible, _scores(q, k_rep, scale), -np.inf)
        col = np.broadcast_to(np.asarray(sinks, dtype=s.dtype)[None, :, None, None], s.shape[:-1] + (1,))
        m = np.maximum(s.max(-1, keepdims=True), col)
        e = np.exp(s - m)
        tot = e.sum(-1, keepdims=True) + np.exp(col - m)
        return e / tot

    def forward(self, q, k, v, visible, scale, kv_map, *, sinks):
        return np.einsum("bhij,bhjd->bhid", self._p(q, k[:, kv_map], visible, scale, sinks), v[:, kv_map])

    def sink_grad(self, ds):
        return -ds.sum(axis=(0, 2, 3))

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, sinks):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k_rep, visible, scale, sinks)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return (dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv), self.sink_grad(ds))


# A12: sink gradient with the wrong sign
class SinkGradSign(SinksBase):
    def sink_grad(self, ds):
        return ds.sum(axis=(0, 2, 3))


# ---- additive bias ----
class BiasBase:
    def _p(self, q, k_rep, visible, scale, attn_bias):
        return _softmax_masked(_scores(q, k_rep, scale) + attn_bias, visible)

    def forward(self, q, k, v, visible, scale, kv_map, *, attn_bias):
        return np.einsum("bhij,bhjd->bhid", self._p(q, k[:, kv_map], visible, scale, attn_bias), v[:, kv_map])

    def bias_grad(self, ds, attn_bias):
        axes = tuple(i for i in (0, 1) if attn_bias.shape[i] == 1 and ds.shape[i] != 1)
        return ds.sum(axis=axes, keepdims=True)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, attn_bias):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self._p(q, k_rep, visible, scale, attn_bias)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return (dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv),
                self.bias_grad(ds, attn_bias))


# A13: dbias averaged over the broadcast batch axis instead of summed
class BiasMeanOverBatch(BiasBase):
    def bias_grad(self, ds, attn_bias):
        axes = tuple(i for i in (0, 1) if attn_bias.shape[i] == 1 and ds.shape[i] != 1)
        return ds.mean(axis=axes, keepdims=True)


# ---- LSE output ----
class LseBase:
    def _p(self, q, k_rep, visible, scale):
        s = np.where(visible, _scores(q, k_rep, scale), -np.inf)
        m = s.max(-1, keepdims=True)
        e = np.exp(s - m)
        tot = e.sum(-1, keepdims=True)
        return e / tot, (m + np.log(tot))[..., 0]

    def forward(self, q, k, v, visible, scale, kv_map, *, return_lse=False):
        p, lse = self._p(q, k[:, kv_map], visible, scale)
        o = np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])
        return (o, lse) if return_lse else o

    def shift(self, p, dp, grad_lse):
        return (p * dp).sum(-1, keepdims=True) - grad_lse[..., None]

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, grad_lse=None):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, _ = self._p(q, k_rep, visible, scale)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - self.shift(p, dp, grad_lse))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# A15: LSE gradient added with the wrong sign
class LseGradSign(LseBase):
    def shift(self, p, dp, grad_lse):
        return (p * dp).sum(-1, keepdims=True) + grad_lse[..., None]


dq_no_scale = DqNoScale()
mask_forward_only = MaskForwardOnly()
gqa_first_head = GqaFirstHead()
dv_no_transpose = DvNoTranspose()
correct = Correct()
softcap_one_minus_t = SoftcapOneMinusT()
softcap_correct = SoftcapCorrect()
alibi_slope_abs = AlibiSlopeAbsDist()
alibi_slope_wrong_axis = AlibiSlopeWrongAxis()
sink_grad_sign = SinkGradSign()
bias_mean_batch = BiasMeanOverBatch()
lse_grad_sign = LseGradSign()


# A24: dK and dV returned in swapped order (d_value == d_head, so shapes fit)
class DkDvSwapped(Correct):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = super().backward(q, k, v, visible, scale, kv_map, grad_o)
        return dq, dv, dk


# A25: softcap: tanh' applied to dQ but forgotten on dK (dk computed from ds before the factor)
class SoftcapDkNoDeriv(SoftcapBase):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, softcap):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, t = self._p(q, k_rep, visible, scale, softcap)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)          # bug: before the tanh' factor
        ds = ds * (1 - t * t)
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# A26: backward's causal mask rebuilt upper-left (tril) while the forward uses the given lower-right mask
class MaskBwdUpperLeft(Base):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        nq, nk = q.shape[2], k.shape[2]
        vis_bwd = np.broadcast_to(np.tril(np.ones((nq, nk), bool)), visible.shape)   # bug: offset nk - nq lost
        p = _softmax_masked(_scores(q, k_rep, scale), vis_bwd)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


# A27: softcap derivative divided by the cap (same bug as the JAX A09, NumPy flavour)
class SoftcapOverC(SoftcapBase):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, softcap):
        dq, dk, dv = SoftcapBase.backward(self, q, k, v, visible, scale, kv_map, grad_o, softcap=softcap)
        return dq / softcap, dk / softcap, dv


dk_dv_swapped = DkDvSwapped()
softcap_dk_no_deriv = SoftcapDkNoDeriv()
mask_bwd_upper_left = MaskBwdUpperLeft()
softcap_over_c = SoftcapOverC()


# GQA: each KV head's gradient averaged over its query heads instead of summed
class GqaMean(Correct):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, dv = super().backward(q, k, v, visible, scale, kv_map, grad_o)
        group = q.shape[1] // k.shape[1]
        return dq, dk / group, dv / group


gqa_mean = GqaMean()


# ------------------------------------------------ the kinds a second cold trial found unnamed, written from scratch
class Hooked(Base):
    """Correct, in steps a buggy subclass replaces one at a time."""

    def visible_bwd(self, visible):
        return visible

    def weights_bwd(self, q, k_rep, visible, scale):
        return _softmax_masked(_scores(q, k_rep, scale), visible)

    def dv_rep(self, p, q, k_rep, visible, scale, grad_o):
        return np.einsum("bhij,bhid->bhjd", p, grad_o)

    def dq(self, ds, k_rep, scale):
        return scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)

    def fold(self, x_rep, kv_map, n_kv):
        return _gqa_reduce(x_rep, kv_map, n_kv)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        visible = self.visible_bwd(visible)
        p = self.weights_bwd(q, k_rep, visible, scale)
        dv_rep = self.dv_rep(p, q, k_rep, visible, scale, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return self.dq(ds, k_rep, scale), self.fold(dk_rep, kv_map, n_kv), self.fold(dv_rep, kv_map, n_kv)


def _lower_right(nq, nk, left=None):
    i, j = np.arange(nq)[:, None] + (nk - nq), np.arange(nk)[None, :]
    return (j <= i) & (True if left is None else j >= i - left)


class MaskBwdCausalOnly(Hooked):
    def visible_bwd(self, visible):
        return np.broadcast_to(_lower_right(*visible.shape[-2:]), visible.shape)  # the padding mask not passed on


class WindowBwdOffByOne(Hooked):
    def visible_bwd(self, visible):
        return np.broadcast_to(_lower_right(*visible.shape[-2:], left=2), visible.shape)  # < where <= belongs


class GqaInterleavedFold(Hooked):
    def fold(self, x_rep, kv_map, n_kv):
        return _gqa_reduce(x_rep, np.arange(len(kv_map)) % n_kv, n_kv)  # the other repeat layout's reduction


class DvUnnormalised(Hooked):
    def dv_rep(self, p, q, k_rep, visible, scale, grad_o):
        s = np.where(visible, _scores(q, k_rep, scale), -np.inf)
        return np.einsum("bhij,bhid->bhjd", np.exp(s - s.max(-1, keepdims=True)), grad_o)  # the row sum forgotten


class DqFromScoresTransposed(Hooked):
    def dq(self, ds, k_rep, scale):
        return scale * np.einsum("bhji,bhjd->bhid", ds, k_rep)  # dS^T: runs when n_q == n_k


class ScaleIgnored(Hooked):
    def forward(self, q, k, v, visible, scale, kv_map):
        return super().forward(q, k, v, visible, q.shape[-1] ** -0.5, kv_map)  # the usual default, hard-wired

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        return super().backward(q, k, v, visible, q.shape[-1] ** -0.5, kv_map, grad_o)


class SoftcapSlopeAtRaw(SoftcapBase):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, softcap):
        self.raw = _scores(q, k[:, kv_map], scale)
        return super().backward(q, k, v, visible, scale, kv_map, grad_o, softcap=softcap)

    def deriv(self, t):
        return 1 - np.tanh(self.raw) ** 2  # tanh' at S, not at S / c


class LseGradNoWeights(LseBase):
    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, grad_lse=None):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p, _ = self._p(q, k_rep, visible, scale)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - (p * dp).sum(-1, keepdims=True)) + np.where(visible, grad_lse[..., None], 0.0)  # no P
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


class DropoutDpUnmasked:
    def forward(self, q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):
        p = _softmax_masked(_scores(q, k[:, kv_map], scale), visible)
        return np.einsum("bhij,bhjd->bhid", p * keep_mask / (1 - dropout_p), v[:, kv_map])

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, keep_mask, dropout_p):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _softmax_masked(_scores(q, k_rep, scale), visible)
        dv_rep = np.einsum("bhij,bhid->bhjd", p * keep_mask / (1 - dropout_p), grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)  # the keep mask forgotten here
        ds = p * (dp - (p * dp).sum(-1, keepdims=True))
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        n_kv = k.shape[1]
        return dq, _gqa_reduce(dk_rep, kv_map, n_kv), _gqa_reduce(dv_rep, kv_map, n_kv)


hooked = Hooked()
mask_bwd_causal_only = MaskBwdCausalOnly()
window_bwd_off_by_one = WindowBwdOffByOne()
gqa_interleaved_fold = GqaInterleavedFold()
dv_unnormalised = DvUnnormalised()
dq_from_scores_transposed = DqFromScoresTransposed()
scale_ignored = ScaleIgnored()
softcap_slope_at_raw = SoftcapSlopeAtRaw()
lse_grad_no_weights = LseGradNoWeights()
dropout_dp_unmasked = DropoutDpUnmasked()


# ------------------------------------------------ the kinds a fourth and fifth cold trial found unnamed
class LseSavedHalf(Hooked):
    def weights_bwd(self, q, k_rep, visible, scale):
        s = np.where(visible, _scores(q, k_rep, scale), -np.inf)
        m = s.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True))).astype(np.float16).astype(q.dtype)  # a half buffer
        return np.exp(s - lse)


class BackwardUnscaled(Hooked):
    def weights_bwd(self, q, k_rep, visible, scale):
        return _softmax_masked(_scores(q, k_rep, 1.0), visible)  # the recompute forgot the scale


class ScaleDivided(Hooked):
    def forward(self, q, k, v, visible, scale, kv_map):
        return super().forward(q, k, v, visible, 1.0 / scale, kv_map)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        return super().backward(q, k, v, visible, 1.0 / scale, kv_map, grad_o)


lse_saved_half = LseSavedHalf()
backward_unscaled = BackwardUnscaled()
scale_divided = ScaleDivided()
