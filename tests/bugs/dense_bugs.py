"""Hand-written backwards of RMSNorm, LayerNorm, SwiGLU and RoPE with the mistakes their authors make, each written
from scratch as a kernel or model author would (not through the tool's own formulas), and the correct ones. The
fingerprint table test (tests/test_fingerprints.py) checks that each failing one is named by its cause, and no
other. ``BUGS``: (op, class name, the cause the report must name, scenario keys)."""
import numpy as np


def _sig(a):
    return 1.0 / (1.0 + np.exp(-a))


# ---------------------------------------------------------------- RMSNorm: forward(x, gamma, eps), backward -> dx, dg
class RMSNorm:
    """Correct."""
    feedback_sign = -1.0

    def forward(self, x, gamma, eps):
        return gamma * x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)

    def backward(self, x, gamma, eps, grad_y):
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        gy = grad_y * gamma
        dx = gy / rms + self.feedback_sign * x * (gy * x).mean(-1, keepdims=True) / rms ** 3
        dgamma = (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)
        return dx, dgamma


class RMSNormNoFeedback(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):  # "rms is a constant": the normaliser's own derivative forgotten
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        return grad_y * gamma / rms, (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)


class RMSNormFeedbackSign(RMSNorm):
    feedback_sign = +1.0


class RMSNormFeedbackSum(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        gy = grad_y * gamma
        dx = gy / rms - x * (gy * x).sum(-1, keepdims=True) / rms ** 3  # sum where the mean belongs
        return dx, (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)


class RMSNormFeedbackNoGamma(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        dx = grad_y * gamma / rms - x * (grad_y * x).mean(-1, keepdims=True) / rms ** 3  # gamma forgotten here
        return dx, (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)


class RMSNormFeedbackR2(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        gy = grad_y * gamma
        dx = gy / rms - x * (gy * x).mean(-1, keepdims=True) / rms ** 2  # a power of rms short
        return dx, (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)


class RMSNormDgammaRawX(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        dx, _ = super().backward(x, gamma, eps, grad_y)
        return dx, (grad_y * x).reshape(-1, x.shape[-1]).sum(0)  # x, not the normalised x


class RMSNormDgammaMean(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        dx, _ = super().backward(x, gamma, eps, grad_y)
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        return dx, (grad_y * x / rms).reshape(-1, x.shape[-1]).mean(0)  # averaged over tokens


class RMSNormNoGamma(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):  # derived for the unscaled norm, gamma applied "later" and forgotten
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        dx = grad_y / rms - x * (grad_y * x).mean(-1, keepdims=True) / rms ** 3
        return dx, (grad_y * x / rms).reshape(-1, x.shape[-1]).sum(0)


# ---------------------------------------------------- LayerNorm: forward(x, gamma, beta, eps), backward -> dx, dg, db
class LayerNorm:
    """Correct (the textbook three-term form)."""

    def stats(self, x, eps):
        mu = x.mean(-1, keepdims=True)
        s = np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
        return mu, s, (x - mu) / s

    def forward(self, x, gamma, beta, eps):
        return gamma * self.stats(x, eps)[2] + beta

    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y * gamma
        dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) / s
        d = x.shape[-1]
        return dx, (grad_y * xhat).reshape(-1, d).sum(0), grad_y.reshape(-1, d).sum(0)


class LayerNormNoMeanTerm(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y * gamma
        dx = (g - xhat * (g * xhat).mean(-1, keepdims=True)) / s
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, db


class LayerNormNoScaleTerm(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y * gamma
        dx = (g - g.mean(-1, keepdims=True)) / s
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, db


class LayerNormStatsConstant(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):  # mean and std treated as constants
        mu, s, xhat = self.stats(x, eps)
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return grad_y * gamma / s, dg, db


class LayerNormScaleTermSign(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y * gamma
        dx = (g - g.mean(-1, keepdims=True) + xhat * (g * xhat).mean(-1, keepdims=True)) / s
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, db


class LayerNormNotDividedByS(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y * gamma
        dx = g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)  # the final / s forgotten
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, db


class LayerNormDgammaCentred(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        dx, _, db = super().backward(x, gamma, beta, eps, grad_y)
        mu = x.mean(-1, keepdims=True)
        return dx, (grad_y * (x - mu)).reshape(-1, x.shape[-1]).sum(0), db  # centred, not normalised


class LayerNormMeanReductions(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        dx, _, _ = super().backward(x, gamma, beta, eps, grad_y)
        xhat = self.stats(x, eps)[2]
        d = x.shape[-1]
        return dx, (grad_y * xhat).reshape(-1, d).mean(0), grad_y.reshape(-1, d).mean(0)  # torch .mean habit


class LayerNormDbetaGamma(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        dx, dg, _ = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, (grad_y * gamma).reshape(-1, x.shape[-1]).sum(0)  # beta is added after the scale


class LayerNormNoGamma(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y  # gamma forgotten in dx
        dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) / s
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, db


# ------------------------------------------------- SwiGLU: forward(x, w1, w3, w2), backward -> dx, dw1, dw3, dw2
class SwiGLU:
    """Correct."""

    def silu_grad(self, a):
        s = _sig(a)
        return s * (1 + a * (1 - s))

    def forward(self, x, w1, w3, w2):
        a = x @ w1
        return (a * _sig(a) * (x @ w3)) @ w2

    def backward(self, x, w1, w3, w2, grad_y):
        a, b = x @ w1, x @ w3
        act = a * _sig(a)
        dh = grad_y @ w2.T
        da, db = dh * b * self.silu_grad(a), dh * act
        x2, d = x.reshape(-1, x.shape[-1]), lambda t: t.reshape(-1, t.shape[-1])
        return (da @ w1.T + db @ w3.T, x2.T @ d(da), x2.T @ d(db), d(act * b).T @ d(grad_y))


class SwiGLUSiluAsIdentity(SwiGLU):
    def silu_grad(self, a):
        return np.ones_like(a)


class SwiGLUSiluSigmoid(SwiGLU):
    def silu_grad(self, a):
        return _sig(a)


class SwiGLUSiluSigmoidPrime(SwiGLU):
    def silu_grad(self, a):
        s = _sig(a)
        return s * (1 - s)


class SwiGLUSiluNoProductRule(SwiGLU):
    def silu_grad(self, a):
        s = _sig(a)
        return a * s * (1 - s)


class SwiGLUGateBranch(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        a, b = x @ w1, x @ w3
        act = a * _sig(a)
        dh = grad_y @ w2.T
        da, db = dh * b * self.silu_grad(a), dh  # the up branch's gradient without the gate's value
        x2, d = x.reshape(-1, x.shape[-1]), lambda t: t.reshape(-1, t.shape[-1])
        return (da @ w1.T + db @ w3.T, x2.T @ d(da), x2.T @ d(db), d(act * b).T @ d(grad_y))


class SwiGLUBranchesSwapped(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        a, b = x @ w1, x @ w3
        act = a * _sig(a)
        dh = grad_y @ w2.T
        da, db = dh * act * self.silu_grad(a), dh * b  # each branch multiplied by its own value
        x2, d = x.reshape(-1, x.shape[-1]), lambda t: t.reshape(-1, t.shape[-1])
        return (da @ w1.T + db @ w3.T, x2.T @ d(da), x2.T @ d(db), d(act * b).T @ d(grad_y))


class SwiGLUDxGateOnly(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        dx, dw1, dw3, dw2 = super().backward(x, w1, w3, w2, grad_y)
        a, b = x @ w1, x @ w3
        da = (grad_y @ w2.T) * b * self.silu_grad(a)
        return da @ w1.T, dw1, dw3, dw2  # x also feeds the up projection


class SwiGLUDw2NoGate(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        dx, dw1, dw3, _ = super().backward(x, w1, w3, w2, grad_y)
        b = x @ w3
        return dx, dw1, dw3, b.reshape(-1, b.shape[-1]).T @ grad_y.reshape(-1, grad_y.shape[-1])


# --------------------------------------------------------- RoPE: forward(x, cos, sin), backward(x, cos, sin, gy) -> dx
def _rotate_half(x, cos, sin, sign):
    h = cos.shape[-1]
    a, b = x[..., :h], x[..., h:2 * h]
    out = x.copy()
    out[..., :h], out[..., h:2 * h] = a * cos - sign * b * sin, sign * a * sin + b * cos
    return out


def _rotate_interleaved(x, cos, sin, sign):
    even, odd = slice(0, 2 * cos.shape[-1], 2), slice(1, 2 * cos.shape[-1], 2)
    a, b = x[..., even], x[..., odd]
    out = x.copy()
    out[..., even], out[..., odd] = a * cos - sign * b * sin, sign * a * sin + b * cos
    return out


class RoPE:
    """Correct, layout half (GPT-NeoX / Llama)."""

    def forward(self, x, cos, sin):
        return _rotate_half(x, cos, sin, +1)

    def backward(self, x, cos, sin, grad_y):
        return _rotate_half(grad_y, cos, sin, -1)


class RoPESameRotation(RoPE):
    def backward(self, x, cos, sin, grad_y):
        return _rotate_half(grad_y, cos, sin, +1)  # the forward's rotation, not its transpose


class RoPEOtherPairing(RoPE):
    def backward(self, x, cos, sin, grad_y):
        return _rotate_interleaved(grad_y, cos, sin, -1)  # GPT-J's pairs in the backward of a NeoX forward


class RoPEIdentity(RoPE):
    def backward(self, x, cos, sin, grad_y):
        return grad_y.copy()  # "a rotation preserves norms"


class RoPECosOnly(RoPE):
    def backward(self, x, cos, sin, grad_y):
        h = cos.shape[-1]
        out = grad_y.copy()
        out[..., :h], out[..., h:2 * h] = grad_y[..., :h] * cos, grad_y[..., h:2 * h] * cos
        return out


RMS = {"op": "rmsnorm", "batch": 2, "n": 5, "d_model": 16}
LN = {"op": "layernorm", "batch": 2, "n": 4, "d_model": 8}
SWIGLU = {"op": "swiglu", "batch": 2, "n": 4, "d_model": 8, "d_ff": 12}
ROPE = {"op": "rope", "batch": 2, "heads": 2, "n": 6, "d_head": 8}

#: (class name, the cause the report must name, scenario keys); None: correct code, no cause named.
BUGS = [
    ("RMSNorm", None, RMS),
    ("RMSNormNoFeedback", "rmsnorm-feedback", RMS),
    ("RMSNormFeedbackSign", "rmsnorm-feedback-sign", RMS),
    ("RMSNormFeedbackSum", "rmsnorm-feedback-sum", RMS),
    ("RMSNormFeedbackNoGamma", "rmsnorm-feedback-no-gamma", RMS),
    ("RMSNormFeedbackR2", "rmsnorm-feedback-r2", RMS),
    ("RMSNormDgammaRawX", "rmsnorm-dgamma-raw-x", RMS),
    ("RMSNormDgammaMean", "rmsnorm-dgamma-mean", RMS),
    ("RMSNormNoGamma", "rmsnorm-no-gamma", RMS),
    ("LayerNorm", None, LN),
    ("LayerNormNoMeanTerm", "layernorm-mean-term", LN),
    ("LayerNormNoScaleTerm", "layernorm-scale-term", LN),
    ("LayerNormStatsConstant", "layernorm-both-feedbacks", LN),
    ("LayerNormScaleTermSign", "layernorm-scale-term-sign", LN),
    ("LayerNormNotDividedByS", "layernorm-not-divided-by-s", LN),
    ("LayerNormDgammaCentred", "layernorm-dgamma-centred-x", LN),
    ("LayerNormMeanReductions", "layernorm-reductions-mean", LN),
    ("LayerNormDbetaGamma", "layernorm-dbeta-gamma", LN),
    ("LayerNormNoGamma", "layernorm-no-gamma", LN),
    ("SwiGLU", None, SWIGLU),
    ("SwiGLUSiluAsIdentity", "silu-derivative", SWIGLU),
    ("SwiGLUSiluSigmoid", "silu-derivative-sigmoid", SWIGLU),
    ("SwiGLUSiluSigmoidPrime", "silu-derivative-sigmoid-prime", SWIGLU),
    ("SwiGLUSiluNoProductRule", "silu-derivative-no-product-rule", SWIGLU),
    ("SwiGLUGateBranch", "gate-branch", SWIGLU),
    ("SwiGLUBranchesSwapped", "swiglu-branches-swapped", SWIGLU),
    ("SwiGLUDxGateOnly", "swiglu-dx-gate-only", SWIGLU),
    ("SwiGLUDw2NoGate", "swiglu-dw2-no-gate", SWIGLU),
    ("RoPE", None, ROPE),
    ("RoPESameRotation", "rope-transpose", ROPE),
    ("RoPEOtherPairing", "rope-other-pairing", ROPE),
    ("RoPEIdentity", "rope-backward-identity", ROPE),
    ("RoPECosOnly", "rope-backward-cos-only", ROPE),
]


# ------------------------------------------------------ from a cold trial by a helper session (its own code, kept)
class RMSNormBackwardNoEps(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        r = np.sqrt((x * x).mean(-1, keepdims=True))  # no + eps
        g = grad_y * gamma
        dx = g / r - x * (g * x).mean(-1, keepdims=True) / r ** 3
        return dx, (grad_y * x / r).reshape(-1, x.shape[-1]).sum(0)


class LayerNormUnbiasedStd(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu = x.mean(-1, keepdims=True)
        s = np.sqrt(x.var(-1, ddof=1, keepdims=True) + eps)  # ddof=1 here, biased in the forward
        xhat = (x - mu) / s
        g = grad_y * gamma
        dx = (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True)) / s
        d = x.shape[-1]
        return dx, (grad_y * xhat).reshape(-1, d).sum(0), grad_y.reshape(-1, d).sum(0)


class SwiGLUDw1Dw3Swapped(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        dx, dw1, dw3, dw2 = super().backward(x, w1, w3, w2, grad_y)
        return dx, dw3, dw1, dw2  # gate and up mixed up in the return tuple


class RoPEPartialDropsRest(RoPE):
    def backward(self, x, cos, sin, grad_y):
        dx = np.zeros_like(grad_y)
        h = cos.shape[-1]
        dx[..., :2 * h] = _rotate_half(grad_y[..., :2 * h], cos, sin, -1)  # the pass-through features left at 0
        return dx


BUGS += [
    ("RMSNormBackwardNoEps", ("rmsnorm-backward-no-eps", "rmsnorm-backward-eps-1e-06"), {**RMS, "eps": 0.01}),
    ("LayerNormUnbiasedStd", "layernorm-backward-unbiased-var", LN),
    ("SwiGLUDw1Dw3Swapped", "swiglu-dw1-dw3-swapped", {**SWIGLU, "d_ff": 8}),
    ("RoPEPartialDropsRest", "rope-passthrough-zero", {**ROPE, "rotary_dim": 4}),
    ("RoPE", None, {**ROPE, "rotary_dim": 4}),
]

# ------------------------------------------------ the kinds a second cold trial found unnamed, written from scratch
class RMSNormDgammaFirstBatch(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        dx, _ = super().backward(x, gamma, eps, grad_y)
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        return dx, (grad_y[0] * x[0] / rms[0]).sum(0)  # the batch loop written for B = 1


class RMSNormDgammaOverwritten(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        dx, _ = super().backward(x, gamma, eps, grad_y)
        rms = np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)
        for b in range(x.shape[0]):
            dgamma = (grad_y[b] * x[b] / rms[b]).sum(0)  # = where += belongs
        return dx, dgamma


class RMSNormHardcodedEps(RMSNorm):
    def backward(self, x, gamma, eps, grad_y):
        return super().backward(x, gamma, 1e-5, grad_y)  # the backward kernel's own default eps


class RMSNormEpsOutsideSqrt(RMSNorm):
    def forward(self, x, gamma, eps):
        return gamma * x / (np.sqrt((x ** 2).mean(-1, keepdims=True)) + eps)


class LayerNormScaleTermCentred(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        mu, s, xhat = self.stats(x, eps)
        g = grad_y * gamma
        dx = (g - g.mean(-1, keepdims=True) - (x - mu) * (g * xhat).mean(-1, keepdims=True)) / s  # x - mu, not xhat
        _, dg, db = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, db


class LayerNormDbetaMean(LayerNorm):
    def backward(self, x, gamma, beta, eps, grad_y):
        dx, dg, _ = super().backward(x, gamma, beta, eps, grad_y)
        return dx, dg, grad_y.reshape(-1, x.shape[-1]).mean(0)


class LayerNormUnbiasedForward(LayerNorm):
    def forward(self, x, gamma, beta, eps):
        mu = x.mean(-1, keepdims=True)
        return gamma * (x - mu) / np.sqrt(x.var(-1, ddof=1, keepdims=True) + eps) + beta  # torch.var's default


class SwiGLUUpGradRawGate(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        a, b = x @ w1, x @ w3
        dh = grad_y @ w2.T
        da, db = dh * b * self.silu_grad(a), dh * a  # the gate's pre-activation where SiLU(a) belongs
        x2, d = x.reshape(-1, x.shape[-1]), lambda t: t.reshape(-1, t.shape[-1])
        return (da @ w1.T + db @ w3.T, x2.T @ d(da), x2.T @ d(db), d(a * _sig(a) * b).T @ d(grad_y))


class SwiGLUSiluSignSlip(SwiGLU):
    def silu_grad(self, a):
        s = _sig(a)
        return s * (1 + a * s)  # (1 - s) slipped to s


class SwiGLUDw2NoUp(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        dx, dw1, dw3, _ = super().backward(x, w1, w3, w2, grad_y)
        a = x @ w1
        d = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        return dx, dw1, dw3, d(a * _sig(a)).T @ d(grad_y)  # h without the up branch


class SwiGLUDxW1Untransposed(SwiGLU):
    def backward(self, x, w1, w3, w2, grad_y):
        _, dw1, dw3, dw2 = super().backward(x, w1, w3, w2, grad_y)
        a, b = x @ w1, x @ w3
        dh = grad_y @ w2.T
        da, db = dh * b * self.silu_grad(a), dh * a * _sig(a)
        return da @ w1 + db @ w3.T, dw1, dw3, dw2  # square weights: w1 where w1.T belongs runs


class RoPEOneSign(RoPE):
    def backward(self, x, cos, sin, grad_y):
        h = cos.shape[-1]
        a, b = grad_y[..., :h], grad_y[..., h:2 * h]
        out = grad_y.copy()
        out[..., :h], out[..., h:2 * h] = a * cos + b * sin, a * sin + b * cos  # second row: -a sin belongs
        return out


class RoPEHalvesSwapped(RoPE):
    def backward(self, x, cos, sin, grad_y):
        h = cos.shape[-1]
        g = _rotate_half(grad_y, cos, sin, -1)
        out = g.copy()
        out[..., :h], out[..., h:2 * h] = g[..., h:2 * h], g[..., :h]  # written back to the wrong halves
        return out


class RoPEFirstPosition(RoPE):
    def backward(self, x, cos, sin, grad_y):
        return _rotate_half(grad_y, cos[:1], sin[:1], -1)  # the decode path's single position, reused


BUGS += [
    ("RMSNormDgammaFirstBatch", "one-batch-first", RMS),
    ("RMSNormDgammaOverwritten", "one-batch-last", RMS),
    ("RMSNormHardcodedEps", "rmsnorm-backward-eps-1e-05", {**RMS, "eps": 0.01}),
    ("RMSNormEpsOutsideSqrt", "rmsnorm-eps-outside-sqrt", {**RMS, "eps": 0.01}),
    ("LayerNormScaleTermCentred", "layernorm-scale-term-centred", LN),
    ("LayerNormDbetaMean", "layernorm-dbeta-mean", LN),
    ("LayerNormUnbiasedForward", "layernorm-unbiased-var", LN),
    ("SwiGLUUpGradRawGate", "swiglu-up-grad-raw-gate", SWIGLU),
    ("SwiGLUSiluSignSlip", "silu-derivative-sign", SWIGLU),
    ("SwiGLUDw2NoUp", "swiglu-dw2-no-up", SWIGLU),
    ("SwiGLUDxW1Untransposed", "swiglu-dx-w1-untransposed", {**SWIGLU, "d_ff": 8}),
    ("RoPEOneSign", "rope-sign-second", ROPE),
    ("RoPEHalvesSwapped", "rope-pair-outputs-swapped", ROPE),
    ("RoPEFirstPosition", "rope-backward-first-position", {**ROPE, "position_offset": 3}),
    ("RoPE", None, {**ROPE, "position_offset": 3}),
]

# A scenario names an object: each class's instance, as ``implementation: dense_bugs:<ClassName>_``.
for _name, _value in list(globals().items()):
    if isinstance(_value, type) and hasattr(_value, "backward"):
        globals()[_name + "_"] = _value()
