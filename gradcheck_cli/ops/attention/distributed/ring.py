"""The tool's own context-parallel attention, per rank (the shipped example, and the host of the context-parallel
faults): ``ring_attention`` (contiguous or zigzag shards: K/V blocks rotate around the ring by send/recv, partial
outputs merge by their log-sum-exp; a hand-written backward recomputes each block's P from the *global* LSE and a
second rotation carries dK/dV with their block back to its owner) and ``ulysses_attention`` (an all-to-all from
sequence-sharded to head-sharded, attention over the whole sequence, and back; the backward is the all-to-all with
its axes swapped).

Both take FlashAttention's arguments: local q [B, Hq, n_r, d], k/v [B, Hkv, n_r, d] (GQA by contiguous groups),
``group``, ``q_positions``/``k_positions`` (the global rows of the shard), ``softmax_scale``, ``causal``,
``window_size`` and ``return_lse``, and the variants' ``softcap=``, ``alibi_slopes=`` (``alibi_form=``) and
``sinks=`` (the score path in ``scores.py``; the sinks join the normaliser after the merge). ``fault`` switches on
the named faults (comma-separated):

- ``cp-stale-kv``: the backward computes every step with the rank's own K/V block (diffusers #14265);
- ``cp-local-lse``: the backward recomputes each block's P from that block's own LSE, not the merged one;
- ``cp-lse-grad-dropped``: the backward drops the LSE's upstream gradient (the merge's dLSE);
- ``cp-dkv-not-returned``: dK/dV are not sent back to their owner after the last step;
- ``cp-zigzag-chunk``: the zigzag positions of a rotated block are recomputed with the second chunk off by one;
- ``cp-param-not-summed`` is the gathering's (``proxy.py``): the sinks' and slopes' gradients as rank 0 holds them;
- ``cp-ulysses-order``: the Ulysses backward all-to-all puts the gathered chunks in reversed rank order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .scores import Scores


def _finite(lse):
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _rotate(group, tensors, length: int, axes, wait: bool = True):
    """Send ``tensors`` to the next rank and receive the previous rank's, whose sequence axes (``axes``, one per
    tensor) hold ``length`` rows (shards may be uneven); world size 1: themselves. Their bytes travel as one message
    (three messages a rotation cost a quarter of a rank's time at world size 4 on two cores). ``wait`` False: a
    function giving the received tensors once they are in, so that the exchange overlaps the next block's work."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    if ws == 1:
        return tensors if wait else (lambda: tensors)
    shapes = []
    for t, axis in zip(tensors, axes):
        shape = list(t.shape)
        shape[axis] = length
        shapes.append((shape, t.dtype, torch.Size(shape).numel() * t.element_size()))
    sent = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
    got = torch.empty(sum(size for _, _, size in shapes), dtype=torch.uint8, device=sent.device)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % ws), dist.get_global_rank(group, (rank - 1) % ws)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, nxt, group),
                                       dist.P2POp(dist.irecv, got, prv, group)])

    def received():
        for req in requests:
            req.wait()
        return [part.view(dtype).view(shape)
                for part, (shape, dtype, _) in zip(got.split([size for _, _, size in shapes]), shapes)]

    return received() if wait else received


def _lengths(group, n: int, device) -> list[int]:
    """Every rank's shard length."""
    ws = dist.get_world_size(group)
    sizes = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(ws)]
    dist.all_gather(sizes, torch.tensor([n], device=device), group=group)
    return [int(x.item()) for x in sizes]


def _zigzag_rows(n: int, ws: int, rank: int, device) -> torch.Tensor:
    """The fault's zigzag positions of rank ``rank``: its second chunk taken one chunk early (2 ws - 2 - r instead of
    2 ws - 1 - r; as long as the right one: chunk lengths differ by at most one, earlier ones longer)."""
    chunks = torch.arange(n, device=device).tensor_split(2 * ws)
    right = chunks[2 * ws - 1 - rank]
    return torch.cat([chunks[rank], chunks[2 * ws - 2 - rank][:right.numel()]])


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, q_pos, k_pos, group, scores: Scores, faults, lengths):
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, n_r, _ = q.shape
        o = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        lse = torch.full((b, h, n_r), float("-inf"), dtype=q.dtype, device=q.device)
        block_lses = []
        kb, vb, pb = k, v, k_pos
        lengths = _lengths(group, k.shape[2], q.device) if lengths is None else list(lengths)
        zigzag_n = sum(lengths) if "cp-zigzag-chunk" in faults else None
        for step in range(ws):
            if step < ws - 1:  # the next block (the one owned by rank r - step - 1) travels during this one's work
                nxt = _rotate(group, [kb, vb, pb], lengths[(rank - step - 1) % ws], (2, 2, 0), wait=False)
            if zigzag_n is not None and step > 0:  # the block's positions recomputed from its owner's rank
                pb = _zigzag_rows(zigzag_n, ws, (rank - step) % ws, q.device)
            part = scores.block(q, kb, vb, q_pos, pb)
            if part is None:  # every key of the block hidden from every row here: it adds nothing
                block_lses.append(torch.full_like(lse, float("-inf")))
            else:
                o_b, lse_b = part
                new = torch.logaddexp(lse, lse_b)
                fin = _finite(new)
                o = torch.exp(lse - fin)[..., None] * o + torch.exp(lse_b - fin)[..., None] * o_b
                lse = new
                block_lses.append(lse_b)
            if step < ws - 1:
                kb, vb, pb = nxt()
        ctx.save_for_backward(q, k, v, q_pos, k_pos, o, lse, *block_lses)
        ctx.args = (group, scores, faults, zigzag_n, lengths)
        return o, lse

    @staticmethod
    def backward(ctx, grad_o, grad_lse):
        q, k, v, q_pos, k_pos, o, lse, *block_lses = ctx.saved_tensors
        group, scores, faults, zigzag_n, lengths = ctx.args
        scale = scores.scale
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        h, h_kv = q.shape[1], k.shape[1]
        rep = h // h_kv
        if grad_lse is None or "cp-lse-grad-dropped" in faults:
            grad_lse = torch.zeros_like(lse)
        d_row = (grad_o * o).sum(-1) - grad_lse  # dS = P (dP - D + G_L)
        dq = torch.zeros_like(q)
        dm = 0
        kb, vb, pb = k, v, k_pos
        dkb, dvb = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(ws):
            kc, vc, pc = (k, v, k_pos) if "cp-stale-kv" in faults else (kb, vb, pb)
            if zigzag_n is not None and step > 0:
                pc = _zigzag_rows(zigzag_n, ws, (rank - step) % ws, q.device)
            s, t = scores(q, kc, q_pos, pc)
            ref = block_lses[step] if "cp-local-lse" in faults else lse
            p = torch.exp(s - _finite(ref)[..., None])
            v_rep = vc.repeat_interleave(rep, dim=1)
            dp = grad_o @ v_rep.transpose(-1, -2)
            ds = p * (dp - d_row[..., None])  # at the softmax's input
            if scores.slopes is not None:
                dm = dm + scores.slope_grad(ds, q_pos, pc)
            ds = scores.raw(ds, t)
            dq = dq + scale * ds @ kc.repeat_interleave(rep, dim=1)
            dk_blk = (scale * ds.transpose(-1, -2) @ q).unflatten(1, (h_kv, rep)).sum(2)
            dv_blk = (p.transpose(-1, -2) @ grad_o).unflatten(1, (h_kv, rep)).sum(2)
            if dk_blk.shape[2] != dkb.shape[2]:  # the stale fault on uneven shards: its own block's rows, fitted
                n = dkb.shape[2]
                dk_blk, dv_blk = (torch.nn.functional.pad(x, (0, 0, 0, max(0, n - x.shape[2])))[:, :, :n]
                                  for x in (dk_blk, dv_blk))
            dkb, dvb = dkb + dk_blk, dvb + dv_blk
            if step < ws - 1:
                kb, vb, pb, dkb, dvb = _rotate(group, [kb, vb, pb, dkb, dvb], lengths[(rank - step - 1) % ws],
                                               (2, 2, 0, 2, 2))
        if ws > 1 and "cp-dkv-not-returned" not in faults:  # home: the last block belongs to the next rank
            dkb, dvb = _rotate(group, [dkb, dvb], lengths[rank], (2, 2))
        elif ws > 1 and dkb.shape != k.shape:  # kept by the wrong rank: shaped as this rank's, the rest lost
            dkb, dvb = (torch.zeros_like(x) for x in (k, v))
        dm = dm if ctx.needs_input_grad[3] else None
        return dq, dkb, dvb, dm, None, None, None, None, None, None


def _with_sinks(o, lse, sinks):
    """The sinks joined to each row's normaliser after the merge: L = logaddexp(LSE, s_h), O scaled by exp(LSE - L)
    (autograd carries the gradients back into the ring's O and LSE, and to the sinks)."""
    if sinks is None:
        return o, lse
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None].expand_as(lse))
    return o * torch.exp(lse - total)[..., None], total


def ring_attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                   return_lse=False, softcap=None, alibi_slopes=None, alibi_form="distance", sinks=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, fault="",
                   shard_lengths=None):
    """Ring attention on this rank's shard (contiguous, zigzag or per-document: the positions say which rows it
    holds; a packed batch's documents by their global offsets ``cu_seqlens_q``). ``shard_lengths``: every rank's
    number of rows, when the caller knows them (the tool does: they are its sharding), as a varlen kernel is given
    cu_seqlens; else asked of the ranks by an all_gather in every call (4 ms of a call's 13 at world size 4 on two
    cores)."""
    faults = tuple(f for f in fault.split(",") if f)
    scores = Scores(softmax_scale, causal, window_size, softcap, alibi_slopes, alibi_form == "column", cu_seqlens_q)
    o, lse = _Ring.apply(q, k, v, alibi_slopes, q_positions, k_positions, group, scores, faults, shard_lengths)
    o, lse = _with_sinks(o, lse, sinks)
    return (o, lse) if return_lse else o


class _AllToAll(torch.autograd.Function):
    """x split along ``scatter`` over the ranks and gathered along ``gather``; the backward the inverse (with the
    fault: its chunks gathered in reversed rank order)."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int, wrong: bool):
        ctx.args = (group, scatter, gather, wrong)
        return _all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        group, scatter, gather, wrong = ctx.args
        return _all_to_all(grad, group, gather, scatter, reverse=wrong), None, None, None, None


def _all_to_all(x, group, scatter: int, gather: int, reverse: bool = False):
    """x's chunk r along ``scatter`` sent to rank r, the chunks received concatenated along ``gather`` in rank order
    (uneven along ``gather``: flattened through ``all_to_all_single``, which gloo takes with uneven splits)."""
    ws, me = dist.get_world_size(group), dist.get_rank(group)
    if ws == 1:
        return x
    parts = [p.contiguous() for p in x.tensor_split(ws, dim=scatter)]
    lengths = _lengths(group, x.shape[gather], x.device)
    shapes = []
    for r in range(ws):  # what rank r sends this rank: its chunk ``me``, its own length along ``gather``
        shape = list(x.shape)
        shape[scatter], shape[gather] = parts[me].shape[scatter], lengths[r]
        shapes.append(shape)
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    out = torch.empty(sum(sizes), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, torch.cat([p.reshape(-1) for p in parts]), sizes, [p.numel() for p in parts],
                           group=group)
    pieces = [piece.reshape(shape) for piece, shape in zip(out.split(sizes), shapes)]
    return torch.cat(pieces[::-1] if reverse else pieces, dim=gather)


def ulysses_attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                      return_lse=False, softcap=None, alibi_slopes=None, alibi_form="distance", sinks=None, fault="",
                      shard_lengths=None):
    """Ulysses: [B, H, n_r, d] -> [B, H / ws, n, d] by an all-to-all, attention over the whole sequence with this
    rank's heads, and the inverse all-to-all (``shard_lengths`` as the ring's)."""
    wrong = "cp-ulysses-order" in fault
    lengths = _lengths(group, q_positions.numel(), q.device) if shard_lengths is None else list(shard_lengths)
    padded = torch.full((max(lengths),), -1, dtype=q_positions.dtype, device=q.device)  # gloo gathers equal sizes
    padded[:q_positions.numel()] = q_positions
    every = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(every, padded, group=group)
    pos = torch.cat([x[:n] for x, n in zip(every, lengths)])
    qh, kh, vh = (_AllToAll.apply(x, group, 1, 2, wrong) for x in (q, k, v))
    mine = torch.arange(q.shape[1], device=q.device).tensor_split(dist.get_world_size(group))[dist.get_rank(group)]
    scores = Scores(softmax_scale, causal, window_size, softcap, alibi_slopes, alibi_form == "column")
    s, _ = scores(qh, kh, pos, pos, None if alibi_slopes is None else alibi_slopes[mine])
    lse = torch.logsumexp(s, dim=-1)
    if sinks is not None:  # this rank's heads' sinks in the normaliser (autograd gives their gradient)
        lse = torch.logaddexp(lse, sinks[mine].to(s.dtype)[:, None].expand_as(lse))
    o = torch.exp(s - lse[..., None]) @ vh.repeat_interleave(qh.shape[1] // vh.shape[1], dim=1)
    o = _AllToAll.apply(o, group, 2, 1, wrong)
    if not return_lse:
        return o
    return o, _AllToAll.apply(lse[..., None], group, 2, 1, wrong)[..., 0]
