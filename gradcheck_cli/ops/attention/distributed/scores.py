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

    def __call__(self, q, k, q_pos, k_pos, slopes=None, ok=None, inplace: bool = False):
        """(S [B, Hq, n_q, n_k] with the hidden entries -inf, tanh(S_raw / c) or None). GQA without copies of K: the
        query heads of a group as one [rep n_q] matrix; ``slopes`` the heads' own slopes when they are not all of
        them (Ulysses); ``ok`` the visible block when known; ``inplace`` (no autograd through it, no tanh kept):
        every step on S itself."""
        b, h, n_q, d = q.shape
        h_kv = k.shape[1]
        s = torch.matmul(q.reshape(b, h_kv, (h // h_kv) * n_q, d), k.transpose(-1, -2)).view(b, h, n_q, -1)
        s = s.mul_(self.scale) if inplace else self.scale * s
        t = None
        if self.cap is not None and inplace:
            s.div_(self.cap).tanh_().mul_(self.cap)
        elif self.cap is not None:
            t = torch.tanh(s / self.cap)
            s = self.cap * t
        m = self.slopes if slopes is None else slopes
        if m is not None:
            bias = m.to(s.dtype)[:, None, None] * self.distance(q_pos, k_pos, s.dtype)
            s = s.add_(bias) if inplace else s + bias
        ok = allowed(q_pos, k_pos, self.causal, self.window, self.cu) if ok is None else ok
        if not bool(ok.all()):
            s = s.masked_fill_(~ok, float("-inf")) if inplace else s.masked_fill(~ok, float("-inf"))
        return s, t

    def block(self, q, k, v, q_pos, k_pos):
        """(O_b [B, Hq, n_q, d_v], LSE_b [B, Hq, n_q]) of one K/V block, or None when the mask hides all of it (the
        ring's forward: the finite differences call it thousands of times). One exponential, in place; a row that
        sees none of the block has O_b 0 and LSE_b -inf."""
        ok = allowed(q_pos, k_pos, self.causal, self.window, self.cu)
        if not bool(ok.any()):
            return None
        b, h, n_q, _ = q.shape
        h_kv = k.shape[1]
        s, _ = self(q, k, q_pos, k_pos, ok=ok, inplace=True)
        top = s.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        s.sub_(top).exp_()
        total = s.sum(dim=-1)
        o = torch.matmul(s.view(b, h_kv, -1, s.shape[-1]), v).view(b, h, n_q, -1)
        o = o.div_(torch.where(total > 0, total, torch.ones_like(total))[..., None])
        return o, top[..., 0] + total.log()

    def raw(self, ds, t):
        """The gradient at the raw scores from the one at the softmax's input."""
        return ds if t is None else ds * (1 - t * t)

    def slope_grad(self, ds, q_pos, k_pos):
        """dm_h from ds [B, Hq, n_q, n_k] at the softmax's input: sum over b, i, j of ds d(i, j)."""
        return (ds * self.distance(q_pos, k_pos, ds.dtype)).sum(dim=(0, 2, 3))
