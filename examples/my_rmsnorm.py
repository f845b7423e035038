"""RMSNorm forward and backward in NumPy, as a user would write them (Llama's RMSNorm, without the cast)."""
import numpy as np


class RMSNorm:
    @staticmethod
    def forward(x, gamma, eps):
        return gamma * x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)

    @staticmethod
    def backward(x, gamma, eps, grad_y):
        d = x.shape[-1]
        inv = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        g = grad_y * gamma
        dx = inv * g - x * inv**3 * (g * x).mean(axis=-1, keepdims=True)
        return dx, (grad_y * x * inv).reshape(-1, d).sum(0)


class MissingFeedback(RMSNorm):
    @staticmethod
    def backward(x, gamma, eps, grad_y):
        d = x.shape[-1]
        inv = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
        # bug: treats the normalisation scale as a constant (no -x mean(g x) / r^3 term)
        return grad_y * gamma * inv, (grad_y * x * inv).reshape(-1, d).sum(0)


rmsnorm = RMSNorm()
missing_feedback = MissingFeedback()
