"""The torch backend (``backend: torch``): the engine's closed-form formulas on torch tensors (with the
same named faults), torch autograd of the same forward as a second opinion, and
``torch.nn.functional.scaled_dot_product_attention`` as a third. Devices cpu and cuda; dtypes float64,
float32 (finite differences) and float16, bfloat16 (the FlashAttention low-precision policy).

Imported only when a scenario asks for torch; everything here takes and returns torch tensors except
``build``, which returns a ``Problem`` of NumPy arrays for the checker.
"""
from __future__ import annotations

from typing import Collection

import numpy as np
import torch
import torch.nn.functional as F

from .. import invariants
from ..ops import attention as engine
from ..implementation import ImplementationFailure, failure_check, guarded, in_copies
from ..ops.registry import Problem
from ..result import Check

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LOW_PRECISION = ("float16", "bfloat16")


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


def probabilities(q, k, visible, scale, kv_map):
    """A: softmax over each row's visible set of scale * q k^T, with the row max subtracted."""
    s = (q @ _repeat_kv(k, kv_map).transpose(-1, -2)) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def forward(q, k, v, visible, scale, kv_map, faults: Collection[str] = ()):
    """O = A V (A.10.1-A.10.3) on torch tensors; differentiable, so autograd gives a second opinion."""
    a = probabilities(q, k, None if "mask" in faults else visible, scale, kv_map)
    return a @ _repeat_kv(v, kv_map)


def backward(q, k, v, visible, scale, kv_map, grad_o, faults: Collection[str] = ()):
    """The closed forms of A.10.5-A.10.9 (as ``ops.attention.backward``), with its faults."""
    masked = None if ("mask" in faults or "mask-backward" in faults) else visible
    a = probabilities(q, k, masked, scale, kv_map)
    k_rep, v_rep = _repeat_kv(k, kv_map), _repeat_kv(v, kv_map)
    g_v = a.transpose(-1, -2) @ grad_o
    g_a = grad_o @ v_rep.transpose(-1, -2)
    g_s = a * g_a if "softmax-term" in faults else a * (g_a - (a * g_a).sum(dim=-1, keepdim=True))
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


def _autograd(fn, inputs, grad_o):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_o)
    return out.detach(), [g.detach() for g in grads]


def build(sc, faults: Collection[str] = ()) -> Problem:
    """The torch problem: numeric checks as the NumPy engine (float64/float32), plus autograd and SDPA
    agreement; for float16/bfloat16 the low-precision policy instead of finite differences."""
    device = torch.device(sc.device)
    dt = DTYPES[sc.dtype]
    low = sc.dtype in LOW_PRECISION
    inputs64, g64 = engine.seeded_inputs(sc, dtype=np.float64)  # the same draws the NumPy engine makes
    to = lambda a, dtype=dt: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = (to(inputs64[t]) for t in "qkv")
    g = to(g64)
    vis = torch.from_numpy(sc.visible).to(device)
    kv_map = torch.as_tensor(sc.kv_map, dtype=torch.long, device=device)
    scale = sc.scale

    user = sc.implementation_object

    def fwd(q_, k_, v_, vis_=vis):
        if user is not None:
            with torch.no_grad():
                return _call_user(user, (q_, k_, v_, vis_, scale, kv_map), (q_.shape[0],) + tuple(g.shape[1:]), dt)
        return forward(q_, k_, v_, vis_, scale, kv_map, faults)

    def bwd(q_, k_, v_, grad_o):
        if user is not None:
            return _user_gradients(user, (q_, k_, v_), (vis, scale, kv_map), grad_o, tuple(g.shape), dt)
        return backward(q_, k_, v_, vis, scale, kv_map, grad_o, faults)

    o = fwd(q, k, v)
    dq, dk, dv = bwd(q, k, v, g)
    grads = {"q": dq, "k": dk, "v": dv}
    np_ = lambda t: t.detach().to("cpu", torch.float64).numpy()  # noqa: E731
    if low:
        lowp = _low_precision(sc, q, k, v, g, vis, kv_map, o, grads, np_)
        policy = lowp.invariants
        lowp.invariants = lambda: policy() + _output_invariants(
            sc, fwd, bwd, {t: np_(x) for t, x in zip("qkv", (q, k, v))}, o, to, np_)
        return lowp

    inputs = {"q": np_(q).astype(sc.dtype), "k": np_(k).astype(sc.dtype), "v": np_(v).astype(sc.dtype)}
    blocks = engine._Blocks(sc, np.asarray(sc.kv_map))
    a64 = engine.attention_weights(*(inputs64[t] for t in "qk"), sc.visible, scale, np.asarray(sc.kv_map))
    rounding, total = blocks.rounding(inputs, g64, a64, scale, np.asarray(sc.kv_map))

    def copies_forward(name, x):
        args = {"q": q, "k": k, "v": v}
        args[name] = torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dt)
        if user is None:
            return fwd(args["q"], args["k"], args["v"])
        c = x.shape[0]  # a user's forward gets the copies stacked along the batch axis

        def stack(t):
            t = t.expand((c,) + tuple(t.shape)) if t.dim() == 4 else t
            return t.reshape((c * sc.batch,) + tuple(t.shape[2:]))

        try:
            return fwd(*(stack(args[t]) for t in "qkv"), stack(vis)).reshape((c,) + tuple(g.shape))
        except ImplementationFailure as exc:
            raise in_copies(exc, sc.batch, name) from None

    def loss(name, x):
        return np_((copies_forward(name, x) * g).to(torch.float64).sum(dim=(-4, -3, -2, -1)))

    def loss_parts(name, x):
        return blocks.sums(name, np_(copies_forward(name, x) * g))

    def checks():
        if user is None:
            out = _opinions(sc, q, k, v, g, vis, kv_map, o, grads, np_)
            a = np_(probabilities(q, k, None if "mask" in faults else vis, scale, kv_map))
            out.insert(0, invariants.bounded("attention is 0 off the visible set", "a", np.where(sc.visible, 0, a),
                                            0.0, "A_ij must be exactly 0 where key j is not visible to query i"))
        else:
            out = _reference(sc, inputs64, g64, o, grads, np_)
        return out + _output_invariants(sc, fwd, bwd, inputs, o, to, np_)

    itemsize = torch.finfo(dt).bits // 8
    return Problem(
        inputs=inputs, loss=loss, gradients={t: np_(grads[t]) for t in "qkv"},
        rounding=rounding, rounding_total=total,
        copy_bytes=3 * a64.size * itemsize + int(o.numel()) * itemsize,
        invariants=checks,
        arrays={**inputs, "visible": sc.visible, "grad_output": g64, "scale": np.asarray(scale),
                "kv_map": np.asarray(sc.kv_map), "output": np_(o), **{f"analytic_{t}": np_(grads[t]) for t in "qkv"}},
        output=np_(o), parts=blocks.parts, loss_parts=loss_parts, **engine.diagnosis_fields(sc),
    )


def _output_invariants(sc, fwd, bwd, inputs, o, to, np_) -> list[Check]:
    """The output-only invariants on the implementation under test, in its own precision."""
    backward_kv = lambda q_, k_, v_, go: [np_(t) for t in bwd(to(q_), to(k_), to(v_), to(go))[1:]]  # noqa: E731
    eps = torch.finfo(DTYPES[sc.dtype]).eps
    try:
        return invariants.attention_outputs(lambda q_, k_, v_: np_(fwd(to(q_), to(k_), to(v_))), backward_kv,
                                            inputs, sc.visible, np.asarray(sc.kv_map), np_(o),
                                            np.random.default_rng([sc.seed, 1]), eps=eps)
    except ImplementationFailure as exc:
        return [failure_check("invariants", exc)]


def _call_user(user, args, shape, dtype):
    """The user's torch forward on clones of the inputs (so changing them in place cannot affect the
    check), so that misbehaviour is a failed check naming the tensor."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) and not a.requires_grad else a for a in args)
    o = guarded("forward", user, *args)
    if not isinstance(o, torch.Tensor):
        raise ImplementationFailure(f"forward must return a torch.Tensor, got {type(o).__name__}", "o")
    if tuple(o.shape) != tuple(shape):
        raise ImplementationFailure(f"forward returned o of shape {list(o.shape)}, expected {list(shape)}", "o")
    if o.dtype != dtype:
        raise ImplementationFailure(f"forward returned o of dtype {o.dtype}, expected {dtype}", "o")
    _finite("forward", "o", o)
    return o


def _finite(what, name, t):
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ImplementationFailure(f"{what} returned a non-finite {name}: {t[index].item()} at {name}"
                                    f"[{', '.join(map(str, index))}]", name, index)


def _user_gradients(user, qkv, rest, grad_o, shape, dtype):
    """dq, dk, dv of the user's forward by autograd (so a custom autograd.Function's backward is what
    gets checked)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    with torch.enable_grad():
        o = _call_user(user, (*leaves, *rest), shape, dtype)
        if not o.requires_grad:
            raise ImplementationFailure("forward's output does not require grad: autograd cannot reach q, k, v", "o")
        grads = guarded("backward", lambda: torch.autograd.grad(o, leaves, grad_o, allow_unused=True))
    out = []
    for name, leaf, grad in zip(("dq", "dk", "dv"), leaves, grads):
        grad = torch.zeros_like(leaf) if grad is None else grad.detach()
        _finite("backward", name, grad)
        out.append(grad)
    return tuple(out)


def _reference(sc, inputs64, g64, o, grads, np_) -> list[Check]:
    """A user's implementation against the NumPy engine in float64 on the same inputs."""
    kv = np.asarray(sc.kv_map)
    rounded = {t: np_(torch.from_numpy(inputs64[t]).to(DTYPES[sc.dtype])) for t in "qkv"}
    ref_o = engine.forward(rounded["q"], rounded["k"], rounded["v"], sc.visible, sc.scale, kv)
    ref = engine.backward(rounded["q"], rounded["k"], rounded["v"], sc.visible, sc.scale, kv, g64)
    out = [invariants.agreement("forward agrees with the reference", "o", np_(o), ref_o, sc.tolerance)]
    out += [invariants.agreement("backward agrees with the reference", t, np_(grads[t]), theirs, sc.tolerance)
            for t, theirs in (("q", ref.q), ("k", ref.k), ("v", ref.v))]
    return out


def _opinions(sc, q, k, v, g, vis, kv_map, o, grads, np_) -> list[Check]:
    """Autograd of the same forward, and torch's SDPA, against the closed-form gradients."""
    checks = []
    tol = sc.tolerance
    auto_o, auto = _autograd(lambda q_, k_, v_: forward(q_, k_, v_, vis, sc.scale, kv_map), (q, k, v), g)
    for t, got in zip("qkv", auto):
        checks.append(invariants.agreement("autograd agrees", t, np_(grads[t]), np_(got).astype(np.float64), tol))
    sd_o, sd = _autograd(lambda q_, k_, v_: sdpa(q_, k_, v_, vis, sc.scale, kv_map, sc.heads_q), (q, k, v), g)
    checks.append(invariants.agreement("SDPA agrees", "o", np_(o), np_(sd_o), tol))
    for t, got in zip("qkv", sd):
        checks.append(invariants.agreement("SDPA agrees", t, np_(grads[t]), np_(got), tol))
    return checks


def _low_precision(sc, q, k, v, g, vis, kv_map, o, grads, np_) -> Problem:
    """FlashAttention's policy: the implementation's error against a float64 reference must be at most
    ``factor`` times the error of a plain implementation run in the same precision, plus ``slack``."""
    ref_in = {t: np_(x) for t, x in zip("qkv", (q, k, v))}
    kv_np = np.asarray(sc.kv_map)
    ref_o = engine.forward(ref_in["q"], ref_in["k"], ref_in["v"], sc.visible, sc.scale, kv_np)
    ref = engine.backward(ref_in["q"], ref_in["k"], ref_in["v"], sc.visible, sc.scale, kv_np, np_(g))
    plain_o, plain = _autograd(lambda q_, k_, v_: forward(q_, k_, v_, vis, sc.scale, kv_map), (q, k, v), g)

    def checks():
        out = []
        for t, mine, theirs, reference in (("o", o, plain_o, ref_o), ("q", grads["q"], plain[0], ref.q),
                                           ("k", grads["k"], plain[1], ref.k), ("v", grads["v"], plain[2], ref.v)):
            err = np.abs(np_(mine) - reference)
            err_plain = float(np.abs(np_(theirs) - reference).max())
            worst = int(np.argmax(err))
            index = tuple(int(i) for i in np.unravel_index(worst, err.shape))
            allowed = sc.factor * err_plain + sc.slack
            out.append(Check("reference", "low-precision error within factor of plain", t, tuple(err.shape),
                             float(err.max()), float(err.max()) / max(err_plain, 1e-300), allowed, 0.0, index,
                             bool(err.max() <= allowed),
                             f"{sc.dtype}: max|impl - float64 ref| = {err.max():.3g} at {t}[{', '.join(map(str, index))}]"
                             f"; plain {sc.dtype} autograd: {err_plain:.3g}; allowed {sc.factor:g} x plain + {sc.slack:g}"))
        return out

    return Problem(inputs={}, loss=None, gradients={t: np_(grads[t]) for t in "qkv"}, rounding={},
                   rounding_total=0.0, copy_bytes=0, invariants=checks, output=np_(o),
                   arrays={**ref_in, "visible": sc.visible, "grad_output": np_(g), "scale": np.asarray(sc.scale),
                           "kv_map": kv_np, "output": np_(o), "reference_output": ref_o,
                           **{f"analytic_{t}": np_(grads[t]) for t in "qkv"}}, **engine.diagnosis_fields(sc))
