"""A hand-written scaled dot-product attention in NumPy, in the interface attn-gradcheck checks.

    q [B, Hq, n_q, d_head], k [B, Hkv, n_k, d_head], v [B, Hkv, n_k, d_value]
    visible bool [B, Hq, n_q, n_k] (True = key j visible to query i), kv_map int [Hq]

attn-gradcheck may call ``forward`` with many perturbed copies stacked along the batch axis, so batch
elements must not interact (they do not here).
"""
import numpy as np


class Attention:
    """Point ``implementation: my_attention:attention`` at an instance of this."""

    @staticmethod
    def forward(q, k, v, visible, scale, kv_map):
        p = _probabilities(q, k[:, kv_map], visible, scale)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    @staticmethod
    def backward(q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _probabilities(q, k_rep, visible, scale)
        dv_rep = np.einsum("bhij,bhid->bhjd", p, grad_o)
        dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep)
        ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))  # softmax backward, row by row
        dq = scale * np.einsum("bhij,bhjd->bhid", ds, k_rep)
        dk_rep = scale * np.einsum("bhij,bhid->bhjd", ds, q)
        dk, dv = np.zeros_like(k), np.zeros_like(v)
        np.add.at(dk, (slice(None), kv_map), dk_rep)  # query heads sharing a KV head add up
        np.add.at(dv, (slice(None), kv_map), dv_rep)
        return dq, dk, dv

    @staticmethod
    def jvp(q, k, v, visible, scale, kv_map, dq, dk, dv):
        """Forward mode (checked with ``check: {mode: jvp}``): the tangent of O along (dq, dk, dv)."""
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = _probabilities(q, k_rep, visible, scale)
        ds = scale * (np.einsum("bhid,bhjd->bhij", dq, k_rep) + np.einsum("bhid,bhjd->bhij", q, dk[:, kv_map]))
        ds = np.where(visible, ds, 0.0)
        ds -= np.sum(p * ds, axis=-1, keepdims=True)  # the centring term mu_i = sum_j p_ij dS_ij
        return np.einsum("bhij,bhjd->bhid", p * ds, v_rep) + np.einsum("bhij,bhjd->bhid", p, dv[:, kv_map])


def _probabilities(q, k_rep, visible, scale):
    s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k_rep), -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


attention = Attention()
