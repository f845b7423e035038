"""Ring, zigzag-ring and Ulysses attention per rank, written as kernel and model authors write them (a helper
session wrote them cold from the interface in docs/distributed.md, and their bugs from the reports the issue cites;
checked in examples/context_parallel_ring.yaml):

    ring_attention           K/V rotate by batch_isend_irecv, partial outputs merge by their LSE; a hand-written
                             backward recomputes each block from the merged LSE, dK/dV travel home with their block
    zigzag_ring_attention    the same for zigzag shards (rank r holds chunks r and 2 ws - 1 - r), skipping hidden blocks
    ulysses_attention        all_to_all_single from sequence-sharded to head-sharded (uneven shards too) and back
    allgather_kv             K/V gathered in one all_gather under autograd

Broken (each docstring or comment names its bug): bug_stale_kv (diffusers #14265), bug_local_lse, bug_lse_grad_dropped,
bug_dkv_not_returned, bug_ring_direction (needs 3 ranks or more), bug_local_positions, bug_scale_twice,
bug_zigzag_branch, bug_zigzag_chunk, bug_ulysses_axes (needs 2 query heads per rank), bug_gqa_tile,
bug_separate_allgathers (correct here: autograd ran the backward's collectives in the same order on every rank),
bug_contiguous_positions, bug_loss_scale."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as distnn

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------- shared helpers
def _allowed(qp, kp, causal, window):
    d = kp[None, :] - qp[:, None]  # j - i
    ok = torch.ones(d.shape, dtype=torch.bool, device=d.device)
    left, right = window
    if causal:
        ok &= d <= 0
    if right >= 0:
        ok &= d <= right
    if left >= 0:
        ok &= d >= -left
    return ok


def _expand(x, hq, tile=False):
    g = hq // x.shape[1]
    return x.repeat(1, g, 1, 1) if tile else x.repeat_interleave(g, dim=1)


def _fold(dx, hkv):
    b, h, n, d = dx.shape
    return dx.view(b, hkv, h // hkv, n, d).sum(2)


def _safe(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _scores(q, k, qp, kp, scale, causal, window, tile=False):
    s = scale * q @ _expand(k, q.shape[1], tile).transpose(-1, -2)
    return s.masked_fill(~_allowed(qp, kp, causal, window), NEG_INF)


def _block_fwd(q, k, v, qp, kp, scale, causal, window):
    s = _scores(q, k, qp, kp, scale, causal, window)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _safe(lse)[..., None])
    return p @ _expand(v, q.shape[1]), lse


def _merge(o, lse, ob, lseb):
    new = torch.logaddexp(lse, lseb)
    m = _safe(new)
    return torch.exp(lse - m)[..., None] * o + torch.exp(lseb - m)[..., None] * ob, new


def _block_bwd(q, k, v, qp, kp, scale, causal, window, lse, do, dd):
    """dq, dk, dv of one block given the GLOBAL row lse and D = rowsum(dO * O) - dLSE."""
    hkv = k.shape[1]
    s = _scores(q, k, qp, kp, scale, causal, window)
    p = torch.exp(s - _safe(lse)[..., None])
    ke, ve = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    dv = _fold(p.transpose(-1, -2) @ do, hkv)
    ds = p * (do @ ve.transpose(-1, -2) - dd[..., None])
    dq = scale * ds @ ke
    dk = _fold(scale * ds.transpose(-1, -2) @ q, hkv)
    return dq, dk, dv


def _lengths(group, n, device):
    ws = dist.get_world_size(group)
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(ws)]
    dist.all_gather(out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return [int(x) for x in out]


def _all_positions(group, pos, lens):
    """Every rank's global positions (list, rank order)."""
    m = max(lens)
    padded = torch.full((m,), -1, dtype=pos.dtype, device=pos.device)
    padded[: pos.numel()] = pos
    out = [torch.empty_like(padded) for _ in lens]
    dist.all_gather(out, padded, group=group)
    return [o[:n] for o, n in zip(out, lens)]


def _start_shift(group, x, recv_len, direction=1):
    """Async: send x to rank+direction, receive a tensor with recv_len rows (dim 2) from rank-direction."""
    ws, r = dist.get_world_size(group), dist.get_rank(group)
    shape = list(x.shape)
    shape[2] = recv_len
    buf = torch.empty(shape, dtype=x.dtype, device=x.device)
    dst = dist.get_global_rank(group, (r + direction) % ws)
    src = dist.get_global_rank(group, (r - direction) % ws)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), dst, group),
                                   dist.P2POp(dist.irecv, buf, src, group)])
    return reqs, buf


def _finish(handle):
    reqs, buf = handle
    for q in reqs:
        q.wait()
    return buf


def _ret(o, lse, return_lse):
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------ (a) all-gather K/V (autograd)
def _gather_seq_autograd(group, x, lens):
    """all_gather along dim 2 with torch.distributed.nn (pads uneven shards), differentiable."""
    m = max(lens)
    if x.shape[2] < m:
        x = torch.nn.functional.pad(x, (0, 0, 0, m - x.shape[2]))
    parts = distnn.all_gather(x, group=group)
    return torch.cat([p[:, :, :n] for p, n in zip(parts, lens)], dim=2)


def _allgather_core(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size,
                    separate=False, contiguous_positions=False):
    lens = _lengths(group, k.shape[2], q.device)
    if contiguous_positions:  # BUG variant: assumes contiguous, equal shards
        r, n_r = dist.get_rank(group), q.shape[2]
        qp = torch.arange(n_r) + r * n_r
        kp = torch.arange(sum(lens))
    else:
        qp = q_positions
        kp = torch.cat(_all_positions(group, k_positions, lens))
    if separate:  # BUG variant: two collectives under autograd
        kf = _gather_seq_autograd(group, k, lens)
        vf = _gather_seq_autograd(group, v, lens)
    else:  # K and V packed in ONE all_gather
        kv = _gather_seq_autograd(group, torch.cat([k, v], dim=-1), lens)
        kf, vf = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    s = softmax_scale * q @ _expand(kf, q.shape[1]).transpose(-1, -2)
    s = s.masked_fill(~_allowed(qp, kp, causal, tuple(window_size)), NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _safe(lse)[..., None])
    o = p @ _expand(vf, q.shape[1])
    return o, lse


def allgather_kv(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                 return_lse=False):
    """CORRECT: all-gather K/V (packed) with torch.distributed.nn, local attention by autograd."""
    o, lse = _allgather_core(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size)
    return _ret(o, lse, return_lse)


# ------------------------------------------------------------------------------ (b) ring, hand-written backward
class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qp, kp, group, scale, causal, window, bug):
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        lens = _lengths(group, k.shape[2], q.device)
        pos = _all_positions(group, kp, lens)
        dk_ = k.shape[-1]
        kv = torch.cat([k, v], dim=-1)
        b, h, n, _ = q.shape
        o = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype)
        lse = torch.full((b, h, n), NEG_INF, dtype=q.dtype)
        blk = []
        for s in range(ws):
            src = (r - s) % ws
            handle = _start_shift(group, kv, lens[(r - s - 1) % ws]) if s < ws - 1 else None
            kb, vb = kv.split([dk_, v.shape[-1]], dim=-1)
            if bug == "local_positions":
                qpos, kpos = torch.arange(n), torch.arange(kb.shape[2])
            else:
                qpos, kpos = qp, pos[src]
            ob, lseb = _block_fwd(q, kb, vb, qpos, kpos, scale, causal, window)
            o, lse = _merge(o, lse, ob, lseb)
            blk.append(lseb)
            if handle is not None:
                kv = _finish(handle)
        ctx.save_for_backward(q, k, v, qp, o, lse, *blk)
        ctx.meta = (group, scale, causal, window, bug, lens, pos)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, qp, o, lse, *blk = ctx.saved_tensors
        group, scale, causal, window, bug, lens, pos = ctx.meta
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        n = q.shape[2]
        dk_, dv_ = k.shape[-1], v.shape[-1]
        dd = (do * o).sum(-1)
        if dlse is not None and bug != "lse_grad_dropped":
            dd = dd - dlse
        dq = torch.zeros_like(q)
        kv = torch.cat([k, v], dim=-1)
        dkv = torch.zeros_like(kv)
        for s in range(ws):
            src = (r - s) % ws
            kb, vb = kv.split([dk_, dv_], dim=-1)
            if bug == "stale_kv":
                kb, vb = k, v
            if bug == "local_positions":
                qpos, kpos = torch.arange(n), torch.arange(kb.shape[2])
            else:
                qpos, kpos = qp, pos[src]
            ref = blk[s] if bug == "local_lse" else lse
            dqb, dkb, dvb = _block_bwd(q, kb, vb, qpos, kpos, scale, causal, window, ref, do, dd)
            dq = dq + dqb
            dkv = dkv + torch.cat([dkb, dvb], dim=-1)
            if s < ws - 1:  # K/V and their travelling dK/dV move on together (one message)
                both = _finish(_start_shift(group, torch.cat([kv, dkv], dim=-1), lens[(r - s - 1) % ws]))
                kv, dkv = both.split([dk_ + dv_, dk_ + dv_], dim=-1)
        if ws > 1 and bug != "dkv_not_returned":
            # rank r holds the dK/dV of rank r+1's block: send it home
            direction = -1 if bug == "ring_direction" else 1
            dkv = _finish(_start_shift(group, dkv, lens[r], direction))
        if bug == "scale_twice":
            dq = dq * scale
        dk, dv = dkv.split([dk_, dv_], dim=-1)
        return dq, dk, dv, None, None, None, None, None, None, None


def _ring(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, bug):
    o, lse = _Ring.apply(q, k, v, q_positions, k_positions, group, softmax_scale, causal, tuple(window_size), bug)
    return _ret(o, lse, return_lse)


def ring_attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                   return_lse=False):
    """CORRECT: ring attention, K/V rotated by batch_isend_irecv, LSE merge, dK/dV carried home."""
    return _ring(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, "")


# ------------------------------------------------------------------------------ (c) zigzag ring
def _chunk_len(n, c, i):
    return n // c + (1 if i < n % c else 0)


def _chunk_rows(n, c, i):
    start = sum(_chunk_len(n, c, j) for j in range(i))
    return torch.arange(start, start + _chunk_len(n, c, i))


def _p2p(group, send, recv_shape):
    """isend/irecv pair to the next / from the previous rank (blocking wait)."""
    ws, r = dist.get_world_size(group), dist.get_rank(group)
    buf = torch.empty(recv_shape, dtype=send.dtype)
    reqs = [dist.isend(send.contiguous(), (r + 1) % ws, group=group), dist.irecv(buf, (r - 1) % ws, group=group)]
    for x in reqs:
        x.wait()
    return buf


class _Zigzag(torch.autograd.Function):
    """Zigzag ring (zhuzilin/ring-flash-attention's zigzag_ring_flash_attn, on CPU): under a causal mask step s>0
    uses only the kv block's first chunk when the block comes from an earlier rank (s <= rank), otherwise only the
    local q's second chunk."""

    @staticmethod
    def _plan(ws, r, s, causal, bug):
        if s == 0 or not causal:
            return "full"
        early = (s < r) if bug == "zigzag_branch" else (s <= r)
        return "kv_first" if early else "q_second"

    @staticmethod
    def _positions(group, kp, lens, n, bug):
        ws = dist.get_world_size(group)
        pos = _all_positions(group, kp, lens)
        if bug == "zigzag_chunk":  # recomputed from the owner rank, second chunk index off by one
            c = 2 * ws
            pos = [torch.cat([_chunk_rows(n, c, src), _chunk_rows(n, c, c - 2 - src)])[:lens[src]]
                   for src in range(ws)]
            pos[dist.get_rank(group)] = kp
        return pos

    @staticmethod
    def forward(ctx, q, k, v, qp, kp, group, scale, causal, window, bug):
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        lens = _lengths(group, k.shape[2], q.device)
        n = sum(lens)
        pos = _Zigzag._positions(group, kp, lens, n, bug)
        c = 2 * ws
        hq = _chunk_len(n, c, r)  # length of the local first chunk
        b, h, nl, _ = q.shape
        o = torch.zeros(b, h, nl, v.shape[-1], dtype=q.dtype)
        lse = torch.full((b, h, nl), NEG_INF, dtype=q.dtype)
        kb, vb = k, v
        for s in range(ws):
            src = (r - s) % ws
            if s < ws - 1:
                nxt_len = lens[(r - s - 1) % ws]
                kvn = _p2p(group, torch.cat([kb, vb], -1), (b, k.shape[1], nxt_len, k.shape[-1] + v.shape[-1]))
            plan = _Zigzag._plan(ws, r, s, causal, bug)
            if plan == "full":
                ob, lseb = _block_fwd(q, kb, vb, qp, pos[src], scale, causal, window)
                o, lse = _merge(o, lse, ob, lseb)
            elif plan == "kv_first":
                hk = _chunk_len(n, c, src)
                ob, lseb = _block_fwd(q, kb[:, :, :hk], vb[:, :, :hk], qp, pos[src][:hk], scale, causal, window)
                o, lse = _merge(o, lse, ob, lseb)
            else:
                ob, lseb = _block_fwd(q[:, :, hq:], kb, vb, qp[hq:], pos[src], scale, causal, window)
                o2, l2 = _merge(o[:, :, hq:], lse[:, :, hq:], ob, lseb)
                o = torch.cat([o[:, :, :hq], o2], 2)
                lse = torch.cat([lse[:, :, :hq], l2], 2)
            if s < ws - 1:
                kb, vb = kvn.split([k.shape[-1], v.shape[-1]], -1)
        ctx.save_for_backward(q, k, v, qp, o, lse)
        ctx.meta = (group, scale, causal, window, bug, lens, pos)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, qp, o, lse = ctx.saved_tensors
        group, scale, causal, window, bug, lens, pos = ctx.meta
        ws, r = dist.get_world_size(group), dist.get_rank(group)
        n, c = sum(lens), 2 * ws
        hq = _chunk_len(n, c, r)
        dkd, dvd = k.shape[-1], v.shape[-1]
        dd = (do * o).sum(-1)
        if dlse is not None:
            dd = dd - dlse
        dq = torch.zeros_like(q)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k), torch.zeros_like(v)
        for s in range(ws):
            src = (r - s) % ws
            plan = _Zigzag._plan(ws, r, s, causal, bug)
            if plan == "full":
                a, bk, bv = _block_bwd(q, kb, vb, qp, pos[src], scale, causal, window, lse, do, dd)
                dq, dkb, dvb = dq + a, dkb + bk, dvb + bv
            elif plan == "kv_first":
                hk = _chunk_len(n, c, src)
                a, bk, bv = _block_bwd(q, kb[:, :, :hk], vb[:, :, :hk], qp, pos[src][:hk], scale, causal, window,
                                       lse, do, dd)
                dq = dq + a
                dkb = dkb + torch.nn.functional.pad(bk, (0, 0, 0, kb.shape[2] - hk))
                dvb = dvb + torch.nn.functional.pad(bv, (0, 0, 0, kb.shape[2] - hk))
            else:
                a, bk, bv = _block_bwd(q[:, :, hq:], kb, vb, qp[hq:], pos[src], scale, causal, window,
                                       lse[:, :, hq:], do[:, :, hq:], dd[:, :, hq:])
                dq = dq + torch.nn.functional.pad(a, (0, 0, hq, 0))
                dkb, dvb = dkb + bk, dvb + bv
            if s < ws - 1:
                nl = lens[(r - s - 1) % ws]
                pack = _p2p(group, torch.cat([kb, vb, dkb, dvb], -1),
                            (k.shape[0], k.shape[1], nl, 2 * (dkd + dvd)))
                kb, vb, dkb, dvb = pack.split([dkd, dvd, dkd, dvd], -1)
        if ws > 1:
            home = _p2p(group, torch.cat([dkb, dvb], -1), (k.shape[0], k.shape[1], lens[r], dkd + dvd))
            dkb, dvb = home.split([dkd, dvd], -1)
        return dq, dkb, dvb, None, None, None, None, None, None, None


def _zigzag(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, bug):
    o, lse = _Zigzag.apply(q, k, v, q_positions, k_positions, group, softmax_scale, causal, tuple(window_size), bug)
    return _ret(o, lse, return_lse)


def zigzag_ring_attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                          return_lse=False):
    """CORRECT (zigzag sharding only): zigzag ring with causal block skipping, isend/irecv."""
    return _zigzag(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, "")


# ------------------------------------------------------------------------------ (d) Ulysses
def _a2a_seq_to_heads(x, group, lens, bug=""):
    """[B, H, n_r, d] -> [B, H/ws, n, d] with all_to_all_single (uneven n_r allowed)."""
    ws = dist.get_world_size(group)
    b, h, nr, d = x.shape
    hl = h // ws
    send = x.reshape(b, ws, hl, nr, d).permute(1, 0, 2, 3, 4).contiguous().reshape(-1)
    chunk = b * hl * d
    recv = torch.empty(chunk * sum(lens), dtype=x.dtype)
    dist.all_to_all_single(recv, send, output_split_sizes=[chunk * m for m in lens],
                           input_split_sizes=[chunk * nr] * ws, group=group)
    parts = recv.split([chunk * m for m in lens])
    return torch.cat([p.reshape(b, hl, m, d) for p, m in zip(parts, lens)], dim=2)


def _a2a_heads_to_seq(x, group, lens, bug=""):
    """[B, H/ws, n, d] -> [B, H, n_r, d] (the inverse)."""
    ws, r = dist.get_world_size(group), dist.get_rank(group)
    b, hl, n, d = x.shape
    nr = lens[r]
    chunk = b * hl * d
    send = torch.cat([p.reshape(-1) for p in x.split(lens, dim=2)])
    recv = torch.empty(chunk * nr * ws, dtype=x.dtype)
    dist.all_to_all_single(recv, send, output_split_sizes=[chunk * nr] * ws,
                           input_split_sizes=[chunk * m for m in lens], group=group)
    if bug == "ulysses_axes":  # head groups and rank axis swapped when reassembling
        return recv.reshape(b, hl, ws, nr, d).reshape(b, hl * ws, nr, d)
    return recv.reshape(ws, b, hl, nr, d).permute(1, 0, 2, 3, 4).reshape(b, ws * hl, nr, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, lens, bug):
        ctx.meta = (group, lens, bug)
        return _a2a_seq_to_heads(x, group, lens)

    @staticmethod
    def backward(ctx, g):
        group, lens, bug = ctx.meta
        return _a2a_heads_to_seq(g.contiguous(), group, lens, bug), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, lens, bug):
        ctx.meta = (group, lens, bug)
        return _a2a_heads_to_seq(x, group, lens)

    @staticmethod
    def backward(ctx, g):
        group, lens, bug = ctx.meta
        if bug == "ulysses_axes":
            # BUG: the inverse reassembles the gathered sequence chunks in head-major order
            return _a2a_seq_to_heads_wrong(g.contiguous(), group, lens), None, None, None
        return _a2a_seq_to_heads(g.contiguous(), group, lens), None, None, None


def _a2a_seq_to_heads_wrong(x, group, lens):
    ws = dist.get_world_size(group)
    b, h, nr, d = x.shape
    hl = h // ws
    # BUG: splits heads as [hl, ws] (interleaved) instead of [ws, hl]
    send = x.reshape(b, hl, ws, nr, d).permute(2, 0, 1, 3, 4).contiguous().reshape(-1)
    chunk = b * hl * d
    recv = torch.empty(chunk * sum(lens), dtype=x.dtype)
    dist.all_to_all_single(recv, send, output_split_sizes=[chunk * m for m in lens],
                           input_split_sizes=[chunk * nr] * ws, group=group)
    parts = recv.split([chunk * m for m in lens])
    return torch.cat([p.reshape(b, hl, m, d) for p, m in zip(parts, lens)], dim=2)


def _ulysses(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, bug):
    lens = _lengths(group, q.shape[2], q.device)
    pos = torch.cat(_all_positions(group, q_positions, lens))
    qh, kh, vh = (_SeqToHeads.apply(x, group, lens, bug) for x in (q, k, v))
    s = softmax_scale * qh @ _expand(kh, qh.shape[1], tile=bug == "gqa_tile").transpose(-1, -2)
    s = s.masked_fill(~_allowed(pos, pos, causal, tuple(window_size)), NEG_INF)
    lse = torch.logsumexp(s, -1)
    o = torch.exp(s - _safe(lse)[..., None]) @ _expand(vh, qh.shape[1], tile=bug == "gqa_tile")
    o = _HeadsToSeq.apply(o, group, lens, bug)
    if not return_lse:
        return o
    return o, _HeadsToSeq.apply(lse[..., None], group, lens, bug)[..., 0]


def ulysses_attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                      return_lse=False):
    """CORRECT: DeepSpeed-Ulysses layer, all_to_all_single heads<->sequence, backward the inverse all_to_all."""
    return _ulysses(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, "")


# =============================================================================================== BUGGY ONES
def _ringbug(bug):
    def f(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse=False):
        return _ring(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, bug)
    return f


# the backward recomputes every step with iteration 0's (own) K/V (diffusers #14265)
bug_stale_kv = _ringbug("stale_kv")
bug_local_lse = _ringbug("local_lse")            # backward P from the block's own LSE
bug_lse_grad_dropped = _ringbug("lse_grad_dropped")  # dLSE ignored in D
bug_dkv_not_returned = _ringbug("dkv_not_returned")  # no final rotation of dK/dV
bug_ring_direction = _ringbug("ring_direction")  # final dK/dV sent to the previous rank (ws>=3)
bug_local_positions = _ringbug("local_positions")  # causal mask from local row indices
bug_scale_twice = _ringbug("scale_twice")        # dq scaled by softmax_scale twice


def _zigzagbug(bug):
    def f(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse=False):
        return _zigzag(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, bug)
    return f


def _ulyssesbug(bug):
    def f(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse=False):
        return _ulysses(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size, return_lse, bug)
    return f


# zigzag: the 'kv first chunk' branch taken for step < rank instead of step <= rank (off by one)
bug_zigzag_branch = _zigzagbug("zigzag_branch")
# zigzag: a peer block's positions recomputed with its second chunk 2 ws - 2 - src (off by one)
bug_zigzag_chunk = _zigzagbug("zigzag_chunk")
# Ulysses: the backward all_to_all with the head axes mixed up ([hl, ws] instead of [ws, hl])
bug_ulysses_axes = _ulyssesbug("ulysses_axes")
# Ulysses GQA: local KV heads tiled (h % Hkv_local) instead of grouped (h // group) (needs Hkv / ws > 1)
bug_gqa_tile = _ulyssesbug("gqa_tile")


def bug_separate_allgathers(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                            return_lse=False):
    """All-gather K and V in two separate differentiable all_gathers (backward order may differ per rank)."""
    o, lse = _allgather_core(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size,
                             separate=True)
    return _ret(o, lse, return_lse)


def bug_contiguous_positions(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                             return_lse=False):
    """All-gather, but positions assumed arange(n_r) + rank * n_r (wrong for zigzag and uneven shards)."""
    o, lse = _allgather_core(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size,
                             contiguous_positions=True)
    return _ret(o, lse, return_lse)


class _GatherOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, group, lens, rows):
        ctx.meta = (dist.get_world_size(group), rows)
        full = _gather_plain(o, group, lens)
        return full

    @staticmethod
    def backward(ctx, g):
        ws, (a, b) = ctx.meta
        # BUG: "every rank holds the whole loss, so scale by world size" -- the gradient multiplied by ws
        return g[:, :, a:b] * ws, None, None, None


def _gather_plain(x, group, lens):
    m = max(lens)
    xp = torch.nn.functional.pad(x, (0, 0, 0, m - x.shape[2]))
    out = [torch.empty_like(xp) for _ in lens]
    dist.all_gather(out, xp.contiguous(), group=group)
    return torch.cat([p[:, :, :n] for p, n in zip(out, lens)], dim=2)


def bug_loss_scale(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                   return_lse=False):
    """All-gather attention whose output is all-gathered and sliced; the gather's backward multiplies by ws."""
    o, lse = _allgather_core(q, k, v, group, q_positions, k_positions, softmax_scale, causal, window_size)
    lens = _lengths(group, q.shape[2], q.device)
    r = dist.get_rank(group)
    a = sum(lens[:r])
    full = _GatherOut.apply(o, group, lens, (a, a + lens[r]))
    return _ret(full[:, :, a:a + lens[r]], lse, return_lse)
