"""The score path of the built-in ring and Ulysses on one rank, from global positions: ``S = scale q k^T``, capped
(``softcap=``: ``c tanh(S / c)``), ALiBi added (``alibi_slopes=``: ``-m_h |i - j|``, or ``m_h j`` with
``alibi_form="column"``), the hidden entries -inf (causal and ``window_size`` as FlashAttention's). The same order as
the stages' default (the cap before ALiBi, the mask last); the sinks join the normaliser after the ring's merge
(``ring.py``). :meth:`Scores.raw` takes the gradient at the softmax's input back through the cap, and
:meth:`Scores.slope_grad` gives the slopes' share of it (this rank's rows: the tool sums the ranks')."""
from __future__ import annotations

import numpy as np
import torch

#: The largest score block the ring's forward forms at once (bytes); the copies along B are taken a few at a time.
BLOCK_BYTES = 2**21
#: Query rows of a tile of the ring's forward.
ROWS = 32


def _on_numpy(*xs) -> bool:
    """Whether the block's products and exponential run in NumPy: on the CPU, outside autograd, float32/64 (torch's
    batched float64 products of these small blocks ran at a third of NumPy's BLAS, its exp at half: 0.18 vs 0.07 ms
    per copy for a 64 x 64 block of 4 heads, d = 32, one thread)."""
    return all(x.device.type == "cpu" and not x.requires_grad and x.dtype in (torch.float32, torch.float64)
               for x in xs)


def _matmul(a, b):
    if _on_numpy(a, b):
        return torch.from_numpy(np.matmul(a.numpy(), b.numpy()))
    return torch.matmul(a, b)


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


def _tiles(ok) -> list[tuple[slice, slice]]:
    """(query rows, the span of keys some of them see) of the tiles of a block whose visible set is ``ok``: ``ROWS``
    rows each, consecutive ones with the same span joined (a fully visible block is one tile: larger products)."""
    out = []
    for start in range(0, ok.shape[0], ROWS):
        seen = torch.nonzero(ok[start:start + ROWS].any(dim=0))
        if seen.numel() == 0:
            continue
        keys = (int(seen[0]), int(seen[-1]) + 1)
        if out and out[-1][1] == keys and out[-1][0][1] == start:
            out[-1] = ((out[-1][0][0], start + ROWS), keys)
        else:
            out.append(((start, start + ROWS), keys))
    return [(slice(*rows), slice(*keys)) for rows, keys in out]


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
        s = (_matmul if inplace else torch.matmul)(q.reshape(b, h_kv, (h // h_kv) * n_q, d),
                                                   k.transpose(-1, -2)).view(b, h, n_q, -1)
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
        ring's forward: the finite differences call it thousands of times, with their copies along B). As
        FlashAttention tiles it: ``ROWS`` query rows at a time over the span of keys some row of them sees (a causal
        diagonal block, or zigzag's late chunk seen by an early one, is not computed where it is hidden), a few
        batch elements at a time (scores of at most ``BLOCK_BYTES``: in cache, and reused by malloc rather than fresh
        pages each time); one exponential, in place. A row that sees none of the block has O_b 0 and LSE_b -inf."""
        ok = allowed(q_pos, k_pos, self.causal, self.window, self.cu)
        if not bool(ok.any()):
            return None
        b, h, n_q, _ = q.shape
        o = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        for rows, keys in _tiles(ok):
            args = (q_pos[rows], k_pos[keys], ok[rows, keys])
            width = q[:, :, rows].shape[2] * (keys.stop - keys.start)
            step = max(1, BLOCK_BYTES // (h * width * q.element_size()))
            for a in range(0, b, step):
                part = slice(a, a + step)
                o[part, :, rows], lse[part, :, rows] = self._block(q[part, :, rows], k[part, :, keys],
                                                                   v[part, :, keys], *args)
        return o, lse

    def _block(self, q, k, v, q_pos, k_pos, ok):
        b, h, n_q, _ = q.shape
        h_kv = k.shape[1]
        s, _ = self(q, k, q_pos, k_pos, ok=ok, inplace=True)
        top = s.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        s.sub_(top)
        if _on_numpy(s):
            np.exp(s.numpy(), out=s.numpy())
        else:
            s.exp_()
        total = s.sum(dim=-1)
        o = _matmul(s.view(b, h_kv, -1, s.shape[-1]), v).view(b, h, n_q, -1)
        o = o.div_(torch.where(total > 0, total, torch.ones_like(total))[..., None])
        return o, top[..., 0] + total.log()

    def raw(self, ds, t):
        """The gradient at the raw scores from the one at the softmax's input."""
        return ds if t is None else ds * (1 - t * t)

    def slope_grad(self, ds, q_pos, k_pos):
        """dm_h from ds [B, Hq, n_q, n_k] at the softmax's input: sum over b, i, j of ds d(i, j)."""
        return (ds * self.distance(q_pos, k_pos, ds.dtype)).sum(dim=(0, 2, 3))
