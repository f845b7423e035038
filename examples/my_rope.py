"""Rotary position embedding in NumPy, as a user would write it (the GPT-NeoX / Llama "half" layout:
feature k pairs with k + d/2; cos and sin are [n, d/2])."""
import numpy as np


def _rotate(x, cos, sin):
    half = cos.shape[-1]
    a, b, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos, rest], axis=-1)


class RoPE:
    @staticmethod
    def forward(x, cos, sin):
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(x, cos, sin, grad_y):
        return _rotate(grad_y, cos, -sin)  # a rotation's transpose: the opposite angle


class ForwardRotation(RoPE):
    @staticmethod
    def backward(x, cos, sin, grad_y):
        return _rotate(grad_y, cos, sin)  # bug: rotates the gradient by +angle, as the forward does


rope = RoPE()
forward_rotation = ForwardRotation()
