"""The score path of the built-in ring and Ulysses on one rank, from global positions: ``S = scale q k^T``, capped
(``softcap=``: ``c tanh(S / c)``), ALiBi added (``alibi_slopes=``: ``-m_h |i - j|``, or ``m_h j`` with
``alibi_form="column"``), the hidden entries -inf (causal and ``window_size`` as FlashAttention's). The same order as
the stages' default (the cap before ALiBi, the mask last); the sinks join the normaliser after the ring's merge
(``ring.py``). :meth:`Scores.raw` takes the gradient at the softmax's input back through the cap, and
:meth:`Scores.slope_grad` gives the slopes' share of it (this rank's rows: the tool sums the ranks')."""
from __future__ import annotations

import torch


def allowed(q_pos, k_pos, causal: bool, window_size, cu_seqlens=None) -> torch.Tensor:
    """[n_q, n_k] True where query position i sees key position j (FlashAttention's window, causal right = 0;
    ``cu_seqlens``: a packed batch's document offsets, no position seeing another document's)."""
    d = k_pos[None, :] - q_pos[:, None]  # j - i
    ok = torch.ones(d.shape, dtype=torch.bool, device=d.device)
    if cu_seqlens is not None:
        bounds = cu_seqlens[1:].to(q_pos.dtype)
        ok &= (torch.searchsorted(bounds, q_pos, right=True)[:, None]
               == torch.searchsorted(bounds, k_pos, right=True)[None, :])
    left, right = window_size
    if causal:
        ok &= d <= 0
    if right >= 0:
        ok &= d <= right
    if left >= 0:
        ok &= d >= -left
    return ok


class Scores:
    def __init__(self, scale: float, causal: bool, window_size, softcap=None, slopes=None, column: bool = False,
                 cu_seqlens=None):
        self.scale, self.causal, self.window = scale, causal, tuple(window_size)
        self.cu = cu_seqlens
        self.cap = None if softcap is None else float(softcap)
        self.slopes, self.column = slopes, column

    def distance(self, q_pos, k_pos, dtype) -> torch.Tensor:
        """ALiBi's d(i, j) [n_q, n_k] (n_q = n_k: the distance form's lower-right offset is 0)."""
        if self.column:  # the key's index within its document
            start = 0 if self.cu is None else self.cu[torch.searchsorted(self.cu[1:].to(k_pos.dtype), k_pos,
                                                                          right=True)].to(k_pos.dtype)
            return (k_pos - start).to(dtype)[None, :].expand(q_pos.numel(), -1)
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
        return s.masked_fill(~allowed(q_pos, k_pos, self.causal, self.window, self.cu), float("-inf")), t

    def block(self, q, k, v, q_pos, k_pos):
        """(O_b [B, Hq, n_q, d_v], LSE_b [B, Hq, n_q]) of one K/V block, or None when the mask hides all of it (the
        ring's forward: the finite differences call it thousands of times). GQA without copies of K and V (the
        query heads of a group as one [rep n_q] matrix), one exponential, in place; a row that sees none of the block
        has O_b 0 and LSE_b -inf."""
        ok = allowed(q_pos, k_pos, self.causal, self.window, self.cu)
        if not bool(ok.any()):
            return None
        b, h, n_q, d = q.shape
        h_kv, rep = k.shape[1], h // k.shape[1]
        s = torch.matmul(q.reshape(b, h_kv, rep * n_q, d), k.transpose(-1, -2)).mul_(self.scale)
        grouped = s.view(b, h_kv, rep, n_q, -1)
        if self.cap is not None:
            s.div_(self.cap).tanh_().mul_(self.cap)
        if self.slopes is not None:
            m = self.slopes.to(s.dtype).view(h_kv, rep, 1, 1)
            grouped.add_(m * self.distance(q_pos, k_pos, s.dtype))
        if not bool(ok.all()):
            grouped.masked_fill_(~ok, float("-inf"))
        top = s.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        s.sub_(top).exp_()
        total = s.sum(dim=-1)
        o = torch.matmul(s, v).div_(torch.where(total > 0, total, torch.ones_like(total))[..., None])
        lse = top[..., 0] + total.log()
        return o.view(b, h, n_q, -1), lse.view(b, h, n_q)

    def raw(self, ds, t):
        """The gradient at the raw scores from the one at the softmax's input."""
        return ds if t is None else ds * (1 - t * t)

    def slope_grad(self, ds, q_pos, k_pos):
        """dm_h from ds [B, Hq, n_q, n_k] at the softmax's input: sum over b, i, j of ds d(i, j)."""
        return (ds * self.distance(q_pos, k_pos, ds.dtype)).sum(dim=(0, 2, 3))
