"""The naive engine's forward for stacked perturbed copies: the finite differences' fast path.

Finite differences evaluate ``formulas.forward`` on thousands of perturbed copies. This module
evaluates the same function, copy by copy as a black box (every copy's S, softmax and O are formed
from its own inputs; nothing is reused from the unperturbed inputs), with less work:

- by blocks of ``ROWS`` query rows, each over the span of keys that some row of the block can see:
  key blocks no query of a row block sees (above a causal diagonal, outside a window, padding) are
  never multiplied, as in FlashAttention; and 32-row products run near the machine's peak GEMM rate
  where one 128-row product does not (measured: 55 vs 38 GFLOP/s per core on stacked float64 products);
- exponentials only over the keys some row of each piece of ``PIECE_ROWS`` rows sees: NumPy's float64 exp
  (scalar without AVX-512) is the largest elementwise cost, and a causal diagonal tile of 32 x 32 then takes
  640 of them instead of 1,024 (the rest of the tile is set to 0, as hidden keys are);
- the scale on Q and K^T read in place by the products when K has the copies (most of them: K's n_k x d_head
  elements form one block per KV head), instead of a pass writing scale * K^T for every copy;
- without the softmax's max-subtraction when a bound proves it unnecessary: |S_ij| <= |scale|
  ||q_i|| ||k_j|| (Cauchy-Schwarz) below :func:`shift_free_limit` means exp(S) can neither overflow nor
  underflow, and softmax is shift invariant; otherwise each row's maximum over its visible keys is
  subtracted exactly as the reference does.

It is verified against ``formulas.forward`` in every run that uses it: the check ``fast forward
agrees with the reference`` (:func:`agreement`).
"""
from __future__ import annotations

import numpy as np

from ... import invariants
from ...tolerance import ENGINE_AGREEMENT_ULPS
from . import stages as score_stages
from .formulas import attention_weights, repeat_kv
from .rounding import output_term_sizes

#: Query rows per block.
ROWS = 32


def shift_free_limit(dtype) -> float:
    """|S| below this: exp(S) and n * exp(S) * |v| stay finite and normal, with room to spare."""
    return 0.5 * float(np.log(np.finfo(dtype).max))


class Forward:
    """O = formulas.forward(q, k, v, visible, scale, kv_map) for inputs with extra leading copy axes.
    ``visible`` None means every key is visible (the ``mask`` fault); ``stages``, the score stages (each block's
    scores go through them, with their rows and keys, before the softmax)."""

    def __init__(self, visible: np.ndarray | None, scale: float, kv_map: np.ndarray, n_q: int, n_k: int,
                 rows: int | None = None, stages=()):
        self.scale, self.kv_map, self.rows, self.stages = scale, kv_map, rows or ROWS, tuple(stages)
        if visible is not None:  # any shape that broadcasts to [B, Hq, n_q, n_k]
            visible = np.broadcast_to(visible, visible.shape[:-2] + (n_q, n_k))
        seen = np.ones((n_q, n_k), dtype=bool) if visible is None else visible.reshape(-1, n_q, n_k).any(axis=0)
        #: (query rows, key span, the visible set there or None: all visible, its pieces) per row block
        self.blocks = []
        for start in range(0, n_q, self.rows):
            span = slice(start, min(start + self.rows, n_q))
            cols = np.flatnonzero(seen[span].any(axis=0))
            keys = slice(int(cols[0]), int(cols[-1]) + 1)  # every row sees some key (the loader says so)
            shown = None if visible is None else visible[..., span, keys]
            if shown is None or shown.all():
                self.blocks.append((span, keys, None, None, ()))
                continue
            hidden = ~shown  # zeroed after the exponential
            self.blocks.append((span, keys, shown, hidden, _pieces(shown)))

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, stages=None, with_lse: bool = False):
        """O (and the log-sum-exp [..., B, Hq, n_q] with ``with_lse``); ``stages`` replaces the score stages for
        this call (a bias's perturbed copies)."""
        stages = self.stages if stages is None else tuple(stages)
        dt = np.result_type(q, k, v)
        shift = self._needs_shift(q, k, dt, stages)
        k_rep, scale = self._repeat(k), np.asarray(self.scale, dtype=dt)
        if q.size <= k_rep.size or len(self.blocks) == 1:
            # the scale on Q, K^T read in place by the products (BLAS takes the transpose): with copies of K
            # (the most numerous: n_k x d_head per block), a pass over them would cost a third of a product
            q, k_t = q * scale, np.swapaxes(k_rep, -1, -2)
        else:  # copies of Q: scale * K^T once, laid out [..., d, n_k], contiguous rows for every row block
            k_t = np.empty(k_rep.shape[:-2] + k_rep.shape[:-3:-1], dtype=dt)
            np.multiply(np.swapaxes(k_rep, -1, -2), scale, out=k_t)
        v_rep = self._repeat(v)
        lead = np.broadcast_shapes(q.shape[:-2], k_t.shape[:-2], v_rep.shape[:-2], score_stages.lead(stages))
        out = np.empty(lead + (q.shape[-2], v.shape[-1]), dtype=dt)
        lse = np.empty(lead + (q.shape[-2],), dtype=dt) if with_lse else None
        self._blocks(q, k_t, v_rep, shift, out, stages, lse)
        return (out, lse) if with_lse else out

    def _repeat(self, x: np.ndarray) -> np.ndarray:
        """repeat_kv, without its copy when every query head has its own KV head in order."""
        identity = x.shape[-3] == len(self.kv_map) and (self.kv_map == np.arange(len(self.kv_map))).all()
        return x if identity else repeat_kv(x, self.kv_map)

    def _needs_shift(self, q, k, dt, stages=None) -> bool:
        """False when |S_ij| <= |scale| max ||q_i|| max ||k_j|| < shift_free_limit (NaN or inf: True), the
        bound taken through the score stages (``Stage.bound``)."""
        stages = self.stages if stages is None else stages
        q_norm = np.sqrt(np.max(np.einsum("...d,...d->...", q, q), initial=0.0))
        k_norm = np.sqrt(np.max(np.einsum("...d,...d->...", k, k), initial=0.0))
        b = abs(self.scale) * q_norm * k_norm
        if stages and np.isfinite(b):
            b = score_stages.bound(stages, float(b))
        return not bool(b < shift_free_limit(dt))

    def _blocks(self, q, k_t, v_rep, shift: bool, out: np.ndarray, stages=None, lse=None) -> None:
        stages = self.stages if stages is None else stages
        sink = score_stages.sink_logits(stages) if stages else None
        if sink is not None:
            sink = np.asarray(sink).astype(out.dtype, copy=False)
        drop = score_stages.post(stages) if stages else None
        for span, keys, shown, hidden, pieces in self.blocks:
            s = np.matmul(q[..., span, :], k_t[..., keys])
            if stages:
                s = score_stages.apply(stages, s, span, keys)
            top = None
            with np.errstate(over="ignore", under="ignore", invalid="ignore"):
                if shift:
                    top = np.max(s, axis=-1, keepdims=True, where=True if shown is None else shown, initial=-np.inf)
                    if sink is not None:  # the sinks' logits join the normaliser (and its max)
                        top = np.maximum(top, sink)
                    if np.broadcast_shapes(s.shape, top.shape) == s.shape:
                        s -= top
                    else:  # perturbed copies of the sinks: more copies than the scores have
                        s = s - top
                if hidden is None or s.size < PIECE_MATRICES * hidden.shape[-2] * hidden.shape[-1]:
                    np.exp(s, out=s)
                    if hidden is not None:
                        np.copyto(s, 0, where=hidden)
                else:
                    for rows, cols, inner in pieces:  # exp only where some row of the piece sees a key
                        e = s[..., rows, cols]
                        np.exp(e, out=e)
                        if inner is not None:
                            np.copyto(e, 0, where=inner)
                        s[..., rows, :cols.start] = 0
                        s[..., rows, cols.stop:] = 0
            if drop is not None:  # dropout: the row's sum before the keep mask weights the exponentials
                with np.errstate(over="ignore", under="ignore"):
                    total = s.sum(axis=-1, keepdims=True)
                    if sink is not None:
                        total = total + np.exp(sink if top is None else sink - top)
                weighted = s * drop.weights(span, keys, s.dtype)
                out[..., span, :] = np.matmul(weighted, v_rep[..., keys, :]) / total
            elif sink is None:
                block = np.matmul(s, v_rep[..., keys, :], out=out[..., span, :])
                total = s.sum(axis=-1, keepdims=True)
                block /= total
            else:
                with np.errstate(over="ignore", under="ignore"):
                    total = s.sum(axis=-1, keepdims=True) + np.exp(sink if top is None else sink - top)
                out[..., span, :] = np.matmul(s, v_rep[..., keys, :]) / total
            if lse is not None:  # the log-sum-exp: log of the row's sum, the subtracted maximum added back
                lse[..., span] = (np.log(total) if top is None else np.log(total) + top)[..., 0]


#: Query rows of a partly hidden block whose exponentials are taken over one span of keys: the span some
#: of them sees (a causal diagonal tile of 32 x 32 then takes 640 exponentials, not 1,024) ...
PIECE_ROWS = 8
#: ... in a call of at least this many score matrices (copies x batch x heads): on fewer, the exponentials
#: saved cost less than the pieces' extra calls.
PIECE_MATRICES = 16


def _pieces(shown: np.ndarray) -> tuple:
    """(rows, keys, hidden) of a partly hidden block's visible set ``shown`` [..., rows, keys], by PIECE_ROWS
    rows: the span of keys some of those rows sees (exponentials taken there; the others are zero), and
    where keys are hidden inside it (zeroed after the exponential), or None."""
    pieces = []
    for start in range(0, shown.shape[-2], PIECE_ROWS):
        rows = slice(start, min(start + PIECE_ROWS, shown.shape[-2]))
        part = shown[..., rows, :]
        cols = np.flatnonzero(part.reshape(-1, part.shape[-1]).any(axis=0))
        keys = slice(int(cols[0]), int(cols[-1]) + 1)
        inner = part[..., keys]
        pieces.append((rows, keys, None if inner.all() else ~inner))
    return tuple(pieces)


def agreement(fast: Forward, reference, inputs: dict, args, faults, rng: np.random.Generator):
    """The check that the fast path computes the reference forward, on O stacked [7, B, Hq, n_q, d_value]:
    copy 0 from the unperturbed inputs, then two copies each of q, k and v moved as finite differences
    stack them (every element by up to 1% of max(1, |x|)), each evaluated as the differences of its tensor
    are: a leading copy axis on the moved tensor alone, the others shared (so each path of the fast forward
    the differences take is the one checked), one copy at a time (the memory of one forward). Each element of O
    may differ by ENGINE_AGREEMENT_ULPS x eps x the size of its terms (``rounding.output_term_sizes``)."""
    dt = np.result_type(*inputs.values())
    scale, kv_map, stages = args.scale, args.kv_map, args.stages  # args: ``args.Args``, the reference's
    visible = np.broadcast_to(args.visible,
                              args.visible.shape[:-2] + inputs["q"].shape[-2:-1] + inputs["k"].shape[-2:-1])
    moved = [(inputs, {t: x[None] for t, x in inputs.items()})]
    for name, x in inputs.items():
        for _ in range(2):
            step = (rng.uniform(-0.01, 0.01, x.shape) * np.maximum(1.0, np.abs(x))).astype(x.dtype)
            moved.append(({**inputs, name: x + step}, {**inputs, name: (x + step)[None]}))
    relative = []
    for at, stacked in moved:
        ref = np.asarray(reference(**at), dtype=np.float64)
        gap = np.abs(np.asarray(fast(**stacked)[0], dtype=np.float64) - ref)
        sizes = output_term_sizes(
            at, lambda span, at=at: attention_weights(at["q"][..., span, :], at["k"], visible[..., span, :], scale,
                                                      kv_map, faults, stages, span),
            scale, kv_map, stages=stages)
        relative.append(gap / np.maximum(sizes, np.finfo(np.float64).tiny))
    return invariants.bounded(
        "fast forward agrees with the reference", "o", np.stack(relative),
        ENGINE_AGREEMENT_ULPS * float(np.finfo(dt).eps),
        "|fast - reference| / sum_j A_ij (1 + |scale| sum_c |q_ic k_jc|) |v_jc| per element of O (the size of "
        "the terms its rounding comes from), on the unperturbed inputs and two moved copies each of q, k, v "
        "(O stacked 7 x B x Hq x n_q x d_value)")
