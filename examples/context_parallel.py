"""Context-parallel attention per rank, as users write it (``distributed:`` scenarios in context_parallel.yaml):
every rank holds its shard of q, k and v, gathers every rank's K and V, and attends with a mask built from the
global positions of its rows; its gradients are autograd's through torch.distributed.nn.functional.

    allgather_attention           K and V packed in ONE all_gather (two separate collectives may run in different
                                  orders on different ranks in the backward), the gradient reaching the all_gather
                                  made contiguous first (see allgather_unpatched)
    allgather_unpatched           the same without that: torch.distributed.nn.functional.all_gather's backward on
                                  gloo (torch 2.13) returns wrong gradients when the gradient reaching it is not
                                  contiguous (here: after a transpose), so dK and dV are wrong while O is right
    allgather_local_positions     broken: the causal mask built from local row numbers (arange(n_r)) instead of
                                  q_positions / k_positions: right on one rank, wrong on several
"""
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _attend(q, keys, values, q_pos, k_pos, softmax_scale, causal, window_size, return_lse):
    rep = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    d = k_pos[None, :] - q_pos[:, None]  # j - i
    ok = torch.ones(d.shape, dtype=torch.bool, device=q.device)
    if causal:
        ok &= d <= 0
    if window_size[0] >= 0:
        ok &= d >= -window_size[0]
    if window_size[1] >= 0:
        ok &= d <= window_size[1]
    s = (softmax_scale * q @ keys.transpose(-1, -2)).masked_fill(~ok, float("-inf"))
    o = torch.softmax(s, dim=-1) @ values
    return (o, torch.logsumexp(s, dim=-1)) if return_lse else o


def _lengths(group, n):
    """Every rank's shard length (shards may be uneven; gloo gathers equal sizes, so shards are padded)."""
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([n]), group=group)
    return [int(x) for x in lengths]


def _gather_kv(k, v, group):
    """Every rank's K and V, [B, Hkv, n, d] each, in rank order (one all_gather, the sequence first, each shard
    padded to the longest and trimmed after)."""
    lengths = _lengths(group, k.shape[2])
    pad = max(lengths) - k.shape[2]
    kv = torch.nn.functional.pad(torch.stack([k, v]), (0, 0, 0, pad)).transpose(0, 3).contiguous()  # [n_max, ...]
    parts = [_ContiguousGrad.apply(p) for p in dnn.all_gather(kv, group=group)]
    keys, values = torch.cat([p[:n] for p, n in zip(parts, lengths)]).transpose(0, 3)  # [2, B, Hkv, n, d]
    return keys, values


def _gather_positions(positions, group):
    lengths = _lengths(group, positions.numel())
    padded = torch.nn.functional.pad(positions, (0, max(lengths) - positions.numel()), value=-1)
    return torch.cat([x[:n] for x, n in zip(dnn.all_gather(padded, group=group), lengths)])


def allgather_attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                        return_lse=False):
    keys, values = _gather_kv(k, v, group)
    positions = _gather_positions(k_positions, group)
    return _attend(q, keys, values, q_positions, positions, softmax_scale, causal, window_size, return_lse)


def allgather_unpatched(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                        return_lse=False):
    """Equal shards, as most such code assumes: one all_gather of K and V packed, no padding, no patch."""
    kv = torch.stack([k, v]).transpose(0, 3).contiguous()  # [n_r, Hkv, B, 2, d]
    keys, values = torch.cat(dnn.all_gather(kv, group=group)).transpose(0, 3)
    positions = _gather_positions(k_positions, group)
    return _attend(q, keys, values, q_positions, positions, softmax_scale, causal, window_size, return_lse)


def allgather_local_positions(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                              return_lse=False):
    keys, values = _gather_kv(k, v, group)
    local = torch.arange(q.shape[2])  # the bug: this rank's row numbers, not its global positions
    every = torch.arange(keys.shape[2])
    return _attend(q, keys, values, local, every, softmax_scale, causal, window_size, return_lse)
