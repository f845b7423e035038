"""LayerNorm forward and backward in NumPy, as a user would write them."""
import numpy as np


class LayerNorm:
    @staticmethod
    def forward(x, gamma, beta, eps):
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        return gamma * (x - mu) / np.sqrt(var + eps) + beta

    @staticmethod
    def backward(x, gamma, beta, eps, grad_y):
        d = x.shape[-1]
        mu = x.mean(axis=-1, keepdims=True)
        inv = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
        xhat = (x - mu) * inv
        g = grad_y * gamma
        dx = inv / d * (d * g - g.sum(axis=-1, keepdims=True) - xhat * (g * xhat).sum(axis=-1, keepdims=True))
        return dx, (grad_y * xhat).reshape(-1, d).sum(0), grad_y.reshape(-1, d).sum(0)


class Broken(LayerNorm):
    @staticmethod
    def backward(x, gamma, beta, eps, grad_y):
        d = x.shape[-1]
        mu = x.mean(axis=-1, keepdims=True)
        inv = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
        xhat = (x - mu) * inv
        g = grad_y * gamma
        dx = inv / d * (d * g - g.sum(axis=-1, keepdims=True) - xhat * (g * xhat).sum(axis=-1, keepdims=True))
        # bug: the biased variance's gradient written with d - 1 (a Bessel correction that the forward does not use)
        dx = dx - inv / d * xhat * (g * xhat).sum(axis=-1, keepdims=True) / (d - 1)
        return dx, (grad_y * xhat).reshape(-1, d).sum(0), grad_y.reshape(-1, d).sum(0)


layernorm = LayerNorm()
broken = Broken()
