"""The score path of the built-in ring and Ulysses on one rank, from global positions: ``S = scale q k^T``, capped
(``softcap=``: ``c tanh(S / c)``), ALiBi added (``alibi_slopes=``: ``-m_h |i - j|``, or ``m_h j`` with
``alibi_form="column"``), the hidden entries -inf (causal and ``window_size`` as FlashAttention's). The same order as
the stages' default (the cap before ALiBi, the mask last); the sinks join the normaliser after the ring's merge
(``ring.py``). :meth:`Scores.raw` takes the gradient at the softmax's input back through the cap, and
:meth:`Scores.slope_grad` gives the slopes' share of it (this rank's rows: the tool sums the ranks')."""
from __future__ import annotations

import torch


def allowed(q_pos, k_pos, causal: bool, window_size) -> torch.Tensor:
    """[n_q, n_k] True where query position i sees key position j (FlashAttention's window, causal right = 0)."""
    d = k_pos[None, :] - q_pos[:, None]  # j - i
    ok = torch.ones(d.shape, dtype=torch.bool, device=d.device)
    left, right = window_size
    if causal:
        ok &= d <= 0
    if right >= 0:
        ok &= d <= right
    if left >= 0:
        ok &= d >= -left
    return ok


class Scores:
    def __init__(self, scale: float, causal: bool, window_size, softcap=None, slopes=None, column: bool = False):
        self.scale, self.causal, self.window = scale, causal, tuple(window_size)
        self.cap = None if softcap is None else float(softcap)
        self.slopes, self.column = slopes, column

    def distance(self, q_pos, k_pos, dtype) -> torch.Tensor:
        """ALiBi's d(i, j) [n_q, n_k] (n_q = n_k: the distance form's lower-right offset is 0)."""
        if self.column:
            return k_pos.to(dtype)[None, :].expand(q_pos.numel(), -1)
        return -(k_pos[None, :] - q_pos[:, None]).abs().to(dtype)

    def __call__(self, q, k, q_pos, k_pos, slopes=None):
        """(S [B, Hq, n_q, n_k] with the hidden entries -inf, tanh(S_raw / c) or None): k's heads repeated for GQA;
        ``slopes`` the heads' own slopes when they are not all of them (Ulysses)."""
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = self.scale * q @ k.transpose(-1, -2)
        t = None
        if self.cap is not None:
            t = torch.tanh(s / self.cap)
            s = self.cap * t
        m = self.slopes if slopes is None else slopes
        if m is not None:
            s = s + m.to(s.dtype)[:, None, None] * self.distance(q_pos, k_pos, s.dtype)
        return s.masked_fill(~allowed(q_pos, k_pos, self.causal, self.window), float("-inf")), t

    def raw(self, ds, t):
        """The gradient at the raw scores from the one at the softmax's input."""
        return ds if t is None else ds * (1 - t * t)

    def slope_grad(self, ds, q_pos, k_pos):
        """dm_h from ds [B, Hq, n_q, n_k] at the softmax's input: sum over b, i, j of ds d(i, j)."""
        return (ds * self.distance(q_pos, k_pos, ds.dtype)).sum(dim=(0, 2, 3))
