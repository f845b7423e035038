"""attention's closed forms on torch tensors, with the same named faults (as ``..formulas``): the
probabilities, the forward, the backward, torch's SDPA on the same inputs, and autograd of any of them.
Imports torch: only the torch engine imports this module."""
from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

from .. import stages as score_stages

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _repeat_kv(x, kv_map):
    return x.index_select(-3, kv_map)


def _sum_groups(g, kv_map, heads_kv: int, overwrite: bool = False):
    out = torch.zeros(g.shape[:-3] + (heads_kv,) + g.shape[-2:], dtype=g.dtype, device=g.device)
    for r, kv in enumerate(kv_map.tolist()):
        if overwrite:
            out[..., kv, :, :] = g[..., r, :, :]
        else:
            out[..., kv, :, :] += g[..., r, :, :]
    return out


def _masked_scores(q, k, visible, scale, kv_map, stages):
    """(scale * q k^T through the score ``stages``, -inf off the visible set; the sinks' logits as a tensor beside
    them (a leaf of autograd where their gradient is checked), or None)."""
    s = (q @ _repeat_kv(k, kv_map).transpose(-1, -2)) * scale
    if stages:
        s = score_stages.apply(stages, s, xp=torch)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    sink = score_stages.sink_logits(stages) if stages else None
    if sink is not None:
        sink = sink.to(s.dtype) if isinstance(sink, torch.Tensor) else torch.as_tensor(sink, dtype=s.dtype,
                                                                                        device=s.device)
    return s, sink


def probabilities(q, k, visible, scale, kv_map, stages=()):
    """A: softmax over each row's visible set of scale * q k^T (through the score ``stages``), with the row max
    subtracted."""
    s, sink = _masked_scores(q, k, visible, scale, kv_map, stages)
    if sink is None:
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        return e / e.sum(dim=-1, keepdim=True)
    # the sinks' logits join each row's normaliser
    top = torch.maximum(s.amax(dim=-1, keepdim=True), sink).detach()
    e = torch.exp(s - top)
    return e / (e.sum(dim=-1, keepdim=True) + torch.exp(sink - top))


def forward_softmax(q, k, v, visible, scale, kv_map, stages=()):
    """O through ``torch.softmax`` (torch's own kernel, which accumulates half precision in float32, with its own
    backward): the library way a torch attention is most often written, whose half-precision rounding differs from
    the explicit exponentials' (the sinks as one more column, dropped after, as gpt-oss does)."""
    s, sink = _masked_scores(q, k, visible, scale, kv_map, stages)
    if sink is None:
        return _dropped(torch.softmax(s, dim=-1), stages) @ _repeat_kv(v, kv_map)
    col = sink.expand(s.shape[:-1] + (1,))
    return _dropped(torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1], stages) @ _repeat_kv(v, kv_map)


def _dropped(a, stages):
    """A times dropout's weights W (the keep mask / (1 - p)) where a scenario has dropout."""
    drop = score_stages.post(stages) if stages else None
    return a if drop is None else a * torch.as_tensor(drop.weights(), dtype=a.dtype, device=a.device)


def forward(q, k, v, visible, scale, kv_map, faults: Collection[str] = (), stages=()):
    """O = A V (A.10.1-A.10.3) on torch tensors; differentiable, so autograd gives a second opinion."""
    a = probabilities(q, k, None if "mask" in faults else visible, scale, kv_map, stages)
    return _dropped(a, stages) @ _repeat_kv(v, kv_map)


def backward(q, k, v, visible, scale, kv_map, grad_o, faults: Collection[str] = (), stages=()):
    """The closed forms of A.10.5-A.10.9 (as ``formulas.backward``), with its faults; G_S back through the score
    ``stages``' derivative."""
    masked = None if ("mask" in faults or "mask-backward" in faults) else visible
    a = probabilities(q, k, masked, scale, kv_map, stages)
    k_rep, v_rep = _repeat_kv(k, kv_map), _repeat_kv(v, kv_map)
    g_v = a.transpose(-1, -2) @ grad_o
    g_a = grad_o @ v_rep.transpose(-1, -2)
    g_s = a * g_a if "softmax-term" in faults else a * (g_a - (a * g_a).sum(dim=-1, keepdim=True))
    if stages:
        slope = score_stages.with_slope(stages, (q @ k_rep.transpose(-1, -2)) * scale, xp=torch)[1]
        g_s = g_s if slope is None else g_s * slope
    s = 1.0 if "scale" in faults else scale
    g_q = (g_s @ k_rep) * s
    g_k = (g_s.transpose(-1, -2) @ q) * s
    heads_kv, overwrite = k.shape[-3], "gqa-sum" in faults
    return g_q, _sum_groups(g_k, kv_map, heads_kv, overwrite), _sum_groups(g_v, kv_map, heads_kv, overwrite)


def sdpa(q, k, v, visible, scale, kv_map, heads_q: int):
    """torch's fused attention on the same inputs: boolean mask; enable_gqa for contiguous groups."""
    contiguous = kv_map.tolist() == [r // (heads_q // k.shape[-3]) for r in range(heads_q)]
    if contiguous and k.shape[-3] != heads_q:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, _repeat_kv(k, kv_map), _repeat_kv(v, kv_map), attn_mask=visible,
                                          scale=scale)


def by_autograd(fn, inputs, grad_o):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_o.clone())
    return out.detach(), [g.detach() for g in grads]
