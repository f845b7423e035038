"""Recipe: PyTorch's own context-parallel ring attention (``torch.distributed.tensor.experimental``), checked as it
is on gloo ranks (torch_context_parallel.yaml) and, through the public ``context_parallel()``, on NCCL ranks
(torch_context_parallel_cuda.yaml).

**The internals** (torch 2.13, ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``; the old
``experimental/_attention.py`` re-exports them):

- ``_templated_ring_attention(group, seq_dim, op, query, key, value, is_causal=False, **kwargs)`` -> ``(out, lse,
  *rest)``: K/V travel round the ring, each step calls ``op(q, k, v, is_causal=..., **kwargs)`` and merges the
  partial outputs by their LSE (``_SDPAMerger``);
- ``_templated_ring_attention_backward(group, seq_dim, op, grad_out, grad_out_name, query, key, value, out,
  logsumexp, is_causal, **kwargs)`` -> ``(dq, dk, dv, *rest)``: K/V go round again, each step calls the op's
  backward with the *merged* ``out`` and ``logsumexp``, and dK/dV travel home by all-to-all;
- the global ``_cp_options``: ``rotate_method`` (``set_rotate_method("allgather" | "alltoall")``: K/V gathered
  once or passed on by ``permute_tensor``), ``enable_load_balance`` (default True: the causal ring assumes each
  rank holds chunks r and 2 ws - 1 - r, ``_HeadTailLoadBalancer``'s layout, which is the tool's ``sharding:
  zigzag``), ``convert_to_f32`` (default True: the merge and the gradient accumulation run in float32 whatever the
  dtype).

torch ships no autograd for the pair (its public path reaches them through DTensor's dispatch of the SDPA ops), so
``_TorchRing`` glues them; the op is the one torch pairs for the CPU,
``aten._scaled_dot_product_flash_attention_for_cpu`` / ``..._for_cpu_backward``, which runs in float64, takes GQA
(contiguous groups; dK/dV come back with the KV heads) and returns the LSE as [B, H, n]. The options are set for
the forward *and again for the backward* (autograd runs it after the function returned) and restored each time;
``convert_to_f32=False`` so a float64 check sees float64 (with True the merge alone costs ~1e-7).

Each call checks, on every rank at once (two small collectives, once per layout), that the shards are equal (the
ring reshapes the K/V it receives to its own shape) and that the gathered ``q_positions`` are exactly torch's
layout: ``arange(n)`` (no load balancing) or ``_HeadTailLoadBalancer(n, ws)._generate_indices()`` (load
balancing, causal only). Non-causal attention runs with load balancing off on any layout (torch raises "Load
balancing requires `is_causal=True`." otherwise, pytorch #141429 / #141622; without a mask the order of the rows
does not matter). Windows are not supported (the op takes ``is_causal`` only).

**The LSE.** torch's backward takes no gradient of the LSE: the op's backward gets ``out`` and ``logsumexp`` and
computes D = rowsum(dO * out) itself. ``ring_*`` make the LSE's gradient flow through torch's backward unchanged by
giving it one more head column: q and k get a zero column (the scores do not change), v a column of ones, out a
zero column and dO the LSE's upstream gradient, so dS = P (dP - D + dLSE). ``broken_lse_grad_ignored`` returns
torch's LSE without that (its gradient is dropped).

Correct: ``ring_allgather``, ``ring_alltoall``. Broken on purpose, as a user of the internals writes them:

- ``broken_options_forward_only``: the options set and restored around the forward only; the backward then runs
  with torch's defaults (load balancing on over contiguous shards, the float32 merge);
- ``broken_backward_not_causal``: ``is_causal`` not passed on to the backward (False there);
- ``broken_backward_local_lse``: the backward given ``out``/``logsumexp`` recomputed from the local shard (to save
  memory) instead of the merged ones;
- ``broken_lse_grad_ignored``: the merged LSE returned as an output, its gradient ignored by torch's backward.

**The public path**, ``context_parallel_sdpa``: ``context_parallel(mesh, buffers=[positions], ...)`` patches
``F.scaled_dot_product_attention`` so that it dispatches, through DTensor, to the same ring with the flash,
efficient or cuDNN op. Its forward and backward must both run inside the context, so the function re-enters it for
the backward. CUDA only: on the CPU, SDPA picks ``_scaled_dot_product_flash_attention_for_cpu``, which CP does
not map, and DTensor raises ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
does not have a sharding strategy registered.``"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel._attention import (
    _cp_options,
    _templated_ring_attention,
    _templated_ring_attention_backward,
    set_rotate_method,
)
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2


@contextlib.contextmanager
def _options(rotate: str, load_balance: bool, convert_to_f32: bool = False):
    """torch's global CP options for the duration, restored after."""
    saved = (_cp_options.rotate_method, _cp_options.enable_load_balance, _cp_options.convert_to_f32)
    set_rotate_method(rotate)
    _cp_options.enable_load_balance = load_balance
    _cp_options.convert_to_f32 = convert_to_f32
    try:
        yield
    finally:
        _cp_options.rotate_method, _cp_options.enable_load_balance, _cp_options.convert_to_f32 = saved


_LAYOUTS: dict = {}  # (ws, this rank's positions) -> "contiguous" | "head-tail" | error text


def _layout(group, q_positions: torch.Tensor) -> str:
    """The layout of the shards over the ranks ("contiguous" or "head-tail"), checked on every rank at once: equal
    lengths, and the gathered positions exactly torch's arange(n) or its _HeadTailLoadBalancer's indices."""
    ws = dist.get_world_size(group)
    key = (ws, tuple(q_positions.tolist()))
    if key not in _LAYOUTS:
        pos = q_positions.to(torch.int64).contiguous()
        lengths = [torch.zeros(1, dtype=torch.int64, device=pos.device) for _ in range(ws)]
        dist.all_gather(lengths, torch.tensor([pos.numel()], device=pos.device), group=group)
        lengths = [int(x) for x in lengths]
        if len(set(lengths)) > 1:
            _LAYOUTS[key] = (f"torch's ring needs equal shards (it reshapes the K/V it receives to its own shape); "
                             f"the ranks hold {lengths} rows")
        else:
            parts = [torch.empty_like(pos) for _ in range(ws)]
            dist.all_gather(parts, pos, group=group)
            order = torch.cat(parts).cpu()
            n = order.numel()
            if torch.equal(order, torch.arange(n)):
                _LAYOUTS[key] = "contiguous"
            elif n % (2 * ws) == 0 and torch.equal(
                    order, _HeadTailLoadBalancer(n, ws, "cpu")._generate_indices()[0].to(torch.int64)):
                _LAYOUTS[key] = "head-tail"
            else:
                _LAYOUTS[key] = (f"the ranks' rows {order.tolist()} are neither contiguous nor torch's head-tail "
                                 f"layout (_HeadTailLoadBalancer({n}, {ws}))")
    found = _LAYOUTS[key]
    if found not in ("contiguous", "head-tail"):
        raise ValueError(found)
    return found


def _plan(group, q_positions, causal, window_size) -> bool:
    """Whether torch's load balancing is on: causal over the head-tail layout."""
    if tuple(window_size) not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"torch's ring attention takes is_causal only, not window_size={tuple(window_size)}")
    layout = _layout(group, q_positions)
    return bool(causal) and layout == "head-tail"


def _pad(x: torch.Tensor, value: float) -> torch.Tensor:
    return torch.cat([x, torch.full_like(x[..., :1], value)], dim=-1)


class _TorchRing(torch.autograd.Function):
    """torch's ring forward and backward glued by autograd. ``bug`` names a misuse (see the module's docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal, rotate, load_balance, bug):
        ctx.set_materialize_grads(False)
        with _options(rotate, load_balance):
            out, lse = _templated_ring_attention(group, SEQ_DIM, FWD, q, k, v, is_causal=causal, dropout_p=0.0,
                                                 scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, causal, rotate, load_balance, bug)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, causal, rotate, load_balance, bug = ctx.args
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        d = q.shape[-1]
        if grad_lse is not None and bug != "lse-grad-ignored":
            # one more head column carries the LSE's gradient through torch's backward: dS = P (dP - D + dLSE)
            q, k, v, out = _pad(q, 0.0), _pad(k, 0.0), _pad(v, 1.0), _pad(out, 0.0)
            grad_out = torch.cat([grad_out, grad_lse.unsqueeze(-1).to(grad_out.dtype)], dim=-1)
        is_causal = False if bug == "backward-not-causal" else causal
        if bug == "backward-local-lse":
            with torch.no_grad():
                local_out, local_lse = FWD(q, k, v, 0.0, causal, scale=scale)
            out, lse = local_out, local_lse
        options = contextlib.nullcontext() if bug == "options-forward-only" else _options(rotate, load_balance)
        with options:
            dq, dk, dv = _templated_ring_attention_backward(group, SEQ_DIM, BWD, grad_out.contiguous(), "grad_out",
                                                            q, k, v, out, lse, is_causal,
                                                            dropout_p=0.0, scale=scale)[:3]
        return dq[..., :d], dk[..., :d], dv[..., :d], None, None, None, None, None, None


def _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, rotate, bug=""):
    load_balance = _plan(group, q_positions, causal, window_size)
    out, lse = _TorchRing.apply(q, k, v, group, float(softmax_scale), bool(causal), rotate, load_balance, bug)
    return (out, lse) if return_lse else out


def ring_allgather(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                   return_lse=False):
    """torch's ring with ``set_rotate_method("allgather")`` (K/V gathered once)."""
    return _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, "allgather")


def ring_alltoall(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                  return_lse=False):
    """torch's ring with ``set_rotate_method("alltoall")`` (K/V passed on each step by ``permute_tensor``)."""
    return _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, "alltoall")


def broken_options_forward_only(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                                return_lse=False):
    """Broken: the options set around the forward only; the backward runs later under torch's defaults."""
    return _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, "allgather",
                 "options-forward-only")


def broken_backward_not_causal(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                               return_lse=False):
    """Broken: the backward called with is_causal=False after a causal forward."""
    return _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, "alltoall",
                 "backward-not-causal")


def broken_backward_local_lse(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                              return_lse=False):
    """Broken: the backward given the local shard's out and LSE, recomputed, instead of the merged ones."""
    return _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, "allgather",
                 "backward-local-lse")


def broken_lse_grad_ignored(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                            return_lse=False):
    """Broken: the merged LSE returned, its upstream gradient dropped (torch's backward takes none)."""
    return _ring(q, k, v, group, q_positions, softmax_scale, causal, window_size, return_lse, "allgather",
                 "lse-grad-ignored")


# ------------------------------------------------------------------------------------------ the public path (CUDA)
class _PublicCP(torch.autograd.Function):
    """SDPA under ``context_parallel()``, forward and backward each inside the context (it patches SDPA and DTensor's
    dispatch only while open)."""

    @staticmethod
    def forward(ctx, q, k, v, mesh, n, scale, causal, load_balance):
        ctx.args = (mesh, n, load_balance)
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        with torch.enable_grad(), _public(mesh, n, load_balance, q.device):
            o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale,
                                                                 enable_gqa=q.shape[1] != k.shape[1])
        ctx.graph = (leaves, o)
        return o.detach()

    @staticmethod
    def backward(ctx, grad_o):
        mesh, n, load_balance = ctx.args
        leaves, o = ctx.graph
        with _public(mesh, n, load_balance, grad_o.device):
            grads = torch.autograd.grad(o, leaves, grad_o)
        return (*grads, None, None, None, None, None)


@contextlib.contextmanager
def _public(mesh, n, load_balance, device):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    saved = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = load_balance
    # float32 on a GPU: the efficient op (flash takes half precision only; the math fallback is not CP's)
    kernel = sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if torch.device(device).type == "cuda" else \
        contextlib.nullcontext()
    try:
        positions = torch.arange(n, device=device)  # a buffer torch shards as it shards the batch
        with kernel, context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0]):
            yield positions
    finally:
        _cp_options.enable_load_balance = saved


def context_parallel_sdpa(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size,
                          return_lse=False):
    """``F.scaled_dot_product_attention`` under the public ``context_parallel()`` (CUDA: flash, efficient or cuDNN
    op). SDPA returns no LSE, so ``return_lse`` is refused."""
    from torch.distributed.device_mesh import DeviceMesh
    if return_lse:
        raise NotImplementedError("F.scaled_dot_product_attention returns no LSE")
    load_balance = _plan(group, q_positions, causal, window_size)
    ws = dist.get_world_size(group)
    n = q_positions.numel() * ws
    mesh = DeviceMesh.from_group(group, q.device.type)
    with _public(mesh, n, load_balance, q.device) as mine:  # torch's own shard of the positions: the same rows?
        if not torch.equal(mine.cpu(), q_positions.cpu()):
            raise ValueError(f"context_parallel() gives this rank rows {mine.tolist()}, the tool "
                             f"{q_positions.tolist()}")
    return _PublicCP.apply(q, k, v, mesh, n, float(softmax_scale), bool(causal), load_balance)
