"""Two deliberately broken variants of my_attention.Attention, one bug of each kind."""
import numpy as np
from my_attention import Attention, _probabilities


class GqaOverwrite(Attention):
    """Backward bug: the V gradient is *assigned* per query head instead of summed, so with grouped
    KV heads only the last query head of each group counts. Finite differences catch it."""

    @staticmethod
    def backward(q, k, v, visible, scale, kv_map, grad_o):
        dq, dk, _ = Attention.backward(q, k, v, visible, scale, kv_map, grad_o)
        p = _probabilities(q, k[:, kv_map], visible, scale)
        dv = np.zeros_like(v)
        dv[:, kv_map] = np.einsum("bhij,bhid->bhjd", p, grad_o)  # the bug: '=' where '+=' was meant
        return dq, dk, dv


class IgnoresPadding(Attention):
    """Semantics bug: forward and backward both drop the padding part of the mask (keys past each
    sequence's length count). Its gradients are the exact derivative of its own forward, so finite
    differences agree; only the reference forward and the invariants can catch it."""

    @staticmethod
    def _no_padding(visible):
        return np.broadcast_to(visible.any(axis=0, keepdims=True), visible.shape)

    @classmethod
    def forward(cls, q, k, v, visible, scale, kv_map):
        return Attention.forward(q, k, v, cls._no_padding(visible), scale, kv_map)

    @classmethod
    def backward(cls, q, k, v, visible, scale, kv_map, grad_o):
        return Attention.backward(q, k, v, cls._no_padding(visible), scale, kv_map, grad_o)


gqa_overwrite = GqaOverwrite()
ignores_padding = IgnoresPadding()
