"""A SwiGLU MLP, y = (SiLU(x W1) * (x W3)) W2, in NumPy as a user would write it, weights [in, out]."""
import numpy as np


def _silu(a):
    return a / (1.0 + np.exp(-a))


class SwiGLU:
    @staticmethod
    def forward(x, w1, w3, w2):
        return (_silu(x @ w1) * (x @ w3)) @ w2

    @staticmethod
    def backward(x, w1, w3, w2, grad_y):
        a, b = x @ w1, x @ w3
        s = 1.0 / (1.0 + np.exp(-a))
        g_h = grad_y @ w2.T
        g_a = g_h * b * s * (1.0 + a * (1.0 - s))
        g_b = g_h * a * s
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        return (g_a @ w1.T + g_b @ w3.T, rows(x).T @ rows(g_a), rows(x).T @ rows(g_b),
                rows(a * s * b).T @ rows(grad_y))


class SigmoidForSilu(SwiGLU):
    @staticmethod
    def backward(x, w1, w3, w2, grad_y):
        a, b = x @ w1, x @ w3
        s = 1.0 / (1.0 + np.exp(-a))
        g_h = grad_y @ w2.T
        g_a = g_h * b * s * (1.0 - s)  # bug: the sigmoid's derivative where SiLU's belongs
        g_b = g_h * a * s
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        return (g_a @ w1.T + g_b @ w3.T, rows(x).T @ rows(g_a), rows(x).T @ rows(g_b),
                rows(a * s * b).T @ rows(grad_y))


swiglu = SwiGLU()
sigmoid_for_silu = SigmoidForSilu()
