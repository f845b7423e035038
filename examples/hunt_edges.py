"""Attention backwards (NumPy) with bugs that only show at the edges of the shape space, for
``attn-gradcheck hunt`` (examples/hunt.yaml): each passes the scenario its hunt starts from, and each bug is
one a kernel author writes (a loop over key blocks without the remainder, a code path for large heads, an
unrolled loop over a GQA group, a decode path's causal offset, an exponent without its row maximum).

The interface is examples/my_attention.py's: forward(q, k, v, visible, scale, kv_map) and
backward(..., grad_o) -> (dq, dk, dv), q [B, Hq, n_q, d], k and v [B, Hkv, n_k, d], visible [B, Hq, n_q, n_k].
"""
import numpy as np

BLOCK = 16


def _probabilities(q, k_rep, visible, scale, stable=True):
    s = np.where(visible, scale * np.einsum("bhid,bhjd->bhij", q, k_rep), -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True)) if stable else np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def _reduce_heads(d_rep, like, kv_map):
    out = np.zeros_like(like)
    np.add.at(out, (slice(None), kv_map), d_rep)  # query heads sharing a KV head add up
    return out


class Correct:
    """The reference every bug below departs from."""

    stable = True

    def forward(self, q, k, v, visible, scale, kv_map):
        p = _probabilities(q, k[:, kv_map], visible, scale, self.stable)
        return np.einsum("bhij,bhjd->bhid", p, v[:, kv_map])

    def key_blocks(self, n_k):
        """The key blocks the backward loops over: [start, stop) pairs."""
        return [(j, min(j + BLOCK, n_k)) for j in range(0, n_k, BLOCK)]

    def probabilities(self, q, k_rep, visible, scale):
        return _probabilities(q, k_rep, visible, scale, self.stable)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o):
        k_rep, v_rep = k[:, kv_map], v[:, kv_map]
        p = self.probabilities(q, k_rep, visible, scale)
        dq = np.zeros_like(q)
        dk_rep, dv_rep = np.zeros_like(k_rep), np.zeros_like(v_rep)
        delta = np.sum(grad_o * np.einsum("bhij,bhjd->bhid", p, v_rep), axis=-1, keepdims=True)
        for j0, j1 in self.key_blocks(k.shape[2]):  # FlashAttention's outer loop over key blocks
            pb = p[..., j0:j1]
            dv_rep[:, :, j0:j1] = np.einsum("bhij,bhid->bhjd", pb, grad_o)
            dp = np.einsum("bhid,bhjd->bhij", grad_o, v_rep[:, :, j0:j1])
            ds = pb * (dp - delta)
            dq += scale * np.einsum("bhij,bhjd->bhid", ds, k_rep[:, :, j0:j1])
            dk_rep[:, :, j0:j1] = self.key_scale(scale, q.shape[-1]) * np.einsum("bhij,bhid->bhjd", ds, q)
        return dq, self.reduce(dk_rep, k, kv_map), self.reduce(dv_rep, v, kv_map)

    def key_scale(self, scale, d_head):
        return scale

    def reduce(self, d_rep, like, kv_map):
        return _reduce_heads(d_rep, like, kv_map)


class TailBlockDropped(Correct):
    """The loop over key blocks stops at the last whole block: a tail of n_k % 16 keys gets no gradient, and
    adds none to dq. Only when n_k is not a multiple of 16."""

    def key_blocks(self, n_k):
        return [(j, j + BLOCK) for j in range(0, n_k - n_k % BLOCK, BLOCK)]


class LargeHeadUnscaled(Correct):
    """Heads over 128 take a second code path (two passes over the head dimension), which forgets the softmax
    scale in dK. Only when d_head > 128."""

    def key_scale(self, scale, d_head):
        return 1.0 if d_head > 128 else scale


class GroupOfFourHalfSummed(Correct):
    """The reduction over a GQA group is unrolled by two for groups of four (the common Llama ratio), and adds only
    the first pair of query heads to dK and dV. Only with 4 query heads per KV head."""

    def reduce(self, d_rep, like, kv_map):
        group = len(kv_map) // like.shape[1]
        if group != 4:
            return _reduce_heads(d_rep, like, kv_map)
        out = np.zeros_like(like)
        for h in range(like.shape[1]):
            heads = [i for i, m in enumerate(kv_map) if m == h][:2]  # the unrolled pair, the other two forgotten
            out[:, h] = d_rep[:, heads].sum(axis=1)
        return out


class DecodeCausalOffset(Correct):
    """The decode path (fewer queries than keys, a causal mask aligned to the bottom right, as in a KV cache)
    rebuilds the mask in its backward with offset 0: the top-left alignment. Only when n_q < n_k with
    lower-right causal masking."""

    def probabilities(self, q, k_rep, visible, scale):
        n_q, n_k = visible.shape[-2:]
        lower_right = np.tril(np.ones((n_q, n_k), bool), n_k - n_q)
        if n_q < n_k and np.array_equal(visible, np.broadcast_to(lower_right, visible.shape)):
            visible = np.broadcast_to(np.tril(np.ones((n_q, n_k), bool)), visible.shape)
        return _probabilities(q, k_rep, visible, scale)


class UnstableExp(Correct):
    """The softmax without its row maximum: exp(s) overflows float32 once a logit passes 88 (float64 holds to
    709). Only in float32, at large logits."""

    stable = False


correct = Correct()
tail_block_dropped = TailBlockDropped()
large_head_unscaled = LargeHeadUnscaled()
group_of_four_half_summed = GroupOfFourHalfSummed()
decode_causal_offset = DecodeCausalOffset()
unstable_exp = UnstableExp()
