"""Calling a user's torch implementation so that whatever it does (change its inputs in place, return
something other than a dense finite tensor of the right shape, dtype and device) is an
ImplementationFailure naming the tensor: its forward on clones, its gradients by autograd."""
from __future__ import annotations

import functools

import numpy as np
import torch

from ....implementation import ImplementationFailure, guarded

#: The names of a user's forward's arguments, by default (``convention.Convention.names``).
NAMES = ("q", "k", "v", "visible", "scale", "kv_map")


def call_user(user, args, shape, dtype, names=NAMES, sources=None):
    """The user's torch forward on clones of the inputs (so changing them in place cannot affect the
    check; a change is reported), so that misbehaviour is a failed check naming the tensor.

    ``sources``: argument index -> the tensor [B, ...] that argument was stacked from (copies along the
    batch axis, made for this call alone and used by nothing else): it is passed as it is, without a
    clone, and checked against its source after the call instead."""
    sources = sources or {}
    # a stacked argument that is a view of its source (stride 0 along the copies: a batch of one) is read
    # through the source's own memory: a snapshot of the source (one copy, not C) is compared instead
    views = {i: src.clone() for i, src in sources.items() if _views(args[i], src)}
    given = tuple(a.clone() if isinstance(a, torch.Tensor) and not a.requires_grad and i not in sources else a
                  for i, a in enumerate(args))
    o = guarded("forward", user, *given)
    for i, (name, before, after) in enumerate(zip(names, args, given)):
        if not isinstance(before, torch.Tensor) or before.requires_grad:
            continue
        if i in views:
            unchanged = same(views[i], sources[i])
        else:
            unchanged = repeats(after, sources[i]) if i in sources else same(before, after)
        if not unchanged:
            raise ImplementationFailure(f"forward changed its argument {name} in place: an implementation must "
                                        "not modify its inputs", name)
    if not isinstance(o, torch.Tensor):
        raise ImplementationFailure(f"forward must return a torch.Tensor, got {type(o).__name__}", "o")
    _dense("forward", "o", o, args[0].device)
    if tuple(o.shape) != tuple(shape):
        raise ImplementationFailure(f"forward returned o of shape {list(o.shape)}, expected {list(shape)}", "o")
    if o.dtype != dtype:
        raise ImplementationFailure(f"forward returned o of dtype {o.dtype}, expected {dtype}", "o")
    _finite("forward", "o", o)
    return o


def _dense(what, name, t, device):
    """A plain dense tensor on the inputs' device (not meta, sparse or elsewhere), or a failure."""
    try:
        ok = t.layout == torch.strided and not t.is_meta and t.device == device
        kind = f"a {t.layout} tensor on {t.device}"
    except Exception as exc:  # noqa: BLE001 -- a tensor subclass may raise anything
        raise ImplementationFailure(f"{what} returned a {name} that cannot be read: {type(exc).__name__}: {exc}",
                                    name) from None
    if not ok:
        raise ImplementationFailure(f"{what} returned {name} as {kind}; expected a dense (strided) tensor on "
                                    f"{device}", name)


#: dtypes whose CPU tensors NumPy reads without a copy (``same`` compares those there).
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bool, torch.int64, torch.int32})


def same(before: torch.Tensor, after: torch.Tensor) -> bool:
    """torch.equal(before, after), by NumPy where it reads both in place: on the CPU, NumPy's comparison is
    several times faster than torch.equal's (a bool tensor about 30 times), and it runs on every call."""
    if before.dtype == after.dtype and numpy_readable(before) and numpy_readable(after):
        return bool(np.array_equal(before.numpy(), after.numpy()))
    return torch.equal(before, after)


def _views(t: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``t`` reads ``source``'s memory and nothing else (copies stacked as a stride-0 view)."""
    try:
        return (t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
                and t.storage_offset() == source.storage_offset() and t.dim() == source.dim()
                and t.stride()[0] == 0 and tuple(t.stride()[1:]) == tuple(source.stride()[1:]))
    except Exception:  # noqa: BLE001 -- a tensor subclass or another device: compare the copies instead
        return False


def repeats(t: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``t`` [c*B, ...] is still c copies of ``source`` [B, ...] stacked along the batch axis."""
    b = source.shape[0]
    if t.dtype != source.dtype or t.shape[1:] != source.shape[1:] or b == 0 or t.shape[0] % b:
        return False
    copies = t.reshape((t.shape[0] // b,) + tuple(source.shape))
    if numpy_readable(copies) and numpy_readable(source):
        return bool((copies.numpy() == source.numpy()).all())
    return bool((copies == source).all())


def numpy_readable(t: torch.Tensor) -> bool:
    """NumPy can read ``t`` in place (``same`` and ``repeats`` compare there: several times faster)."""
    return (t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad
            and type(t) is torch.Tensor)


def _finite(what, name, t):
    # a sum is finite only if every element is (inf and NaN propagate; an overflow of the sum of finite
    # values takes the elementwise test): one pass, where isfinite(t).any() allocates and passes twice
    if t.is_floating_point() and bool(torch.isfinite(t.sum(dtype=torch.float64))):
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ImplementationFailure(f"{what} returned a non-finite {name}: {t[index].item()} at {name}"
                                    f"[{', '.join(map(str, index))}]", name, index)


def user_gradients(user, qkv, rest, grad_o, shape, dtype, names=NAMES, kw_leaves=None):
    """dq, dk, dv of the user's forward by autograd (so a custom autograd.Function's backward is what
    gets checked). ``grad_o`` is the implementation's own copy: a backward that changes it in place is
    reported, and cannot change the checker's upstream gradient. ``kw_leaves``: keyword -> (its gradient's
    name, tensor) of keyword arguments whose gradients are wanted too (a bias, ``attn_bias=``), after dv."""
    leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    kw = {key: t.detach().clone().requires_grad_(True) for key, (_, t) in (kw_leaves or {}).items()}
    kept = grad_o.clone()
    with torch.enable_grad():
        o = call_user(functools.partial(user, **kw) if kw else user, (*leaves, *rest), shape, dtype, names)
        if not o.requires_grad:
            raise ImplementationFailure("forward's output does not require grad: autograd cannot reach q, k, v", "o")
        grads = guarded("backward", lambda: torch.autograd.grad(o, leaves + list(kw.values()), grad_o,
                                                                allow_unused=True))
    leaves = leaves + list(kw.values())
    if not same(grad_o, kept):
        raise ImplementationFailure("backward changed grad_output in place: an implementation must not modify "
                                    "its inputs", "grad_o")
    for name, leaf, before in zip("qkv", leaves, qkv):
        if not same(leaf.detach(), before.detach()):
            raise ImplementationFailure(f"the implementation changed its argument {name} in place: it must not "
                                        "modify its inputs", name)
    out = []
    for name, leaf, grad in zip(("dq", "dk", "dv", *(n for n, _ in (kw_leaves or {}).values())), leaves, grads):
        if grad is not None:
            _dense("backward", name, grad, leaf.device)
        grad = torch.zeros_like(leaf) if grad is None else grad.detach().clone()
        _finite("backward", name, grad)
        out.append(grad)
    return tuple(out)


def user_jvp(user, qkv, tangents, rest, shape, dtype):
    """The output tangent of the user's forward along ``tangents`` by ``torch.func.jvp`` (so a custom
    autograd.Function's ``jvp`` is what gets checked; it needs ``setup_context``, as torch.func requires), on
    clones; a function without forward-mode support is a failure saying what it needs."""
    primals = tuple(t.detach().clone() for t in qkv)
    directions = tuple(t.detach().clone() for t in tangents)
    try:
        out = guarded("torch.func.jvp of forward", torch.func.jvp, lambda *xs: user(*xs, *rest), primals, directions)
    except ImplementationFailure as exc:
        need = next((need for marker, need in NO_FORWARD_MODE if marker in exc.message), None)
        if need is None:
            raise
        raise ImplementationFailure(f"{exc.message}; it has no forward-mode derivative: {need}", "o_dot") from None
    o, o_dot = out if isinstance(out, tuple) and len(out) == 2 else (None, None)
    if not isinstance(o_dot, torch.Tensor):
        raise ImplementationFailure(f"forward must return a torch.Tensor, got {type(o).__name__}", "o_dot")
    _dense("jvp", "o_dot", o_dot, qkv[0].device)
    if tuple(o_dot.shape) != tuple(shape) or o_dot.dtype != dtype:
        raise ImplementationFailure(f"the JVP is of shape {list(o_dot.shape)} and dtype {o_dot.dtype}, expected "
                                    f"{list(shape)} and {dtype}", "o_dot")
    _finite("jvp", "o_dot", o_dot)
    return o_dot.detach()


#: What torch says when a function cannot be differentiated forward, and what to do about it.
NO_FORWARD_MODE = (
    ("setup_context", "a custom autograd.Function needs forward(*args) and setup_context(ctx, inputs, output) "
                      "(not forward(ctx, ...)) for torch.func.jvp"),
    ("implement the jvp", "a custom autograd.Function needs a jvp(ctx, *tangents) staticmethod for forward mode"),
    ("forward AD", "an operation in it has no forward-mode derivative in torch"),
    ("data pointer", "it leaves torch (e.g. through .numpy()), where forward-mode AD cannot follow"),
)



def user_hvp(user, qkv, directions, rest, grad_o, shape, dtype, names=NAMES):
    """The Hessian-vector product of L = sum(O * grad_o) along ``directions`` for the user's forward, by double
    backward (the gradients taken with ``create_graph=True``, then the gradient of <gradients, directions>), so a
    custom autograd.Function's backward is differentiated as it is written; a backward that cannot be
    differentiated again is a failure saying why."""
    leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    dirs = [d.detach().clone() for d in directions]
    with torch.enable_grad():
        o = call_user(user, (*leaves, *rest), shape, dtype, names)
        if not o.requires_grad:
            raise ImplementationFailure("forward's output does not require grad: autograd cannot reach q, k, v", "o")
        grads = guarded("backward (with create_graph=True)", lambda: torch.autograd.grad(
            o, leaves, grad_o.clone(), create_graph=True, allow_unused=True))
        terms = [(gr * d).sum() for gr, d in zip(grads, dirs) if gr is not None and gr.requires_grad]
        if not terms:
            raise ImplementationFailure(
                "the gradients do not depend on q, k, v through autograd, so they cannot be differentiated again: "
                "a custom autograd.Function's backward must itself be differentiable torch code (not "
                "@once_differentiable, not NumPy) for double backward", "o")
        try:
            second = guarded("double backward", lambda: torch.autograd.grad(sum(terms), leaves, allow_unused=True))
        except ImplementationFailure as exc:
            if "once_differentiable" not in exc.message and "does not require grad" not in exc.message:
                raise
            raise ImplementationFailure(f"{exc.message}; the backward cannot be differentiated again: write it in "
                                        "differentiable torch operations for double backward", "o") from None
    out = []
    for name, leaf, h in zip(("hq", "hk", "hv"), leaves, second):
        h = torch.zeros_like(leaf) if h is None else h.detach()
        _finite("double backward", name, h)
        out.append(h)
    return tuple(out)
