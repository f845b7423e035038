"""Calling a user's torch implementation so that whatever it does (change its inputs in place, return
something other than a dense finite tensor of the right shape, dtype and device) is an
ImplementationFailure naming the tensor: its forward on clones, its gradients by autograd."""
from __future__ import annotations

import torch

from ....implementation import ImplementationFailure, guarded

#: The names of a user's forward's arguments, by default (``convention.Convention.names``).
NAMES = ("q", "k", "v", "visible", "scale", "kv_map")


def call_user(user, args, shape, dtype, names=NAMES):
    """The user's torch forward on clones of the inputs (so changing them in place cannot affect the
    check; a change is reported), so that misbehaviour is a failed check naming the tensor."""
    given = tuple(a.clone() if isinstance(a, torch.Tensor) and not a.requires_grad else a for a in args)
    o = guarded("forward", user, *given)
    for name, before, after in zip(names, args, given):
        if isinstance(before, torch.Tensor) and not before.requires_grad and not torch.equal(before, after):
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


def _finite(what, name, t):
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ImplementationFailure(f"{what} returned a non-finite {name}: {t[index].item()} at {name}"
                                    f"[{', '.join(map(str, index))}]", name, index)


def user_gradients(user, qkv, rest, grad_o, shape, dtype, names=NAMES):
    """dq, dk, dv of the user's forward by autograd (so a custom autograd.Function's backward is what
    gets checked). ``grad_o`` is the implementation's own copy: a backward that changes it in place is
    reported, and cannot change the checker's upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(True) for t in qkv]
    kept = grad_o.clone()
    with torch.enable_grad():
        o = call_user(user, (*leaves, *rest), shape, dtype, names)
        if not o.requires_grad:
            raise ImplementationFailure("forward's output does not require grad: autograd cannot reach q, k, v", "o")
        grads = guarded("backward", lambda: torch.autograd.grad(o, leaves, grad_o, allow_unused=True))
    if not torch.equal(grad_o, kept):
        raise ImplementationFailure("backward changed grad_output in place: an implementation must not modify "
                                    "its inputs", "grad_o")
    for name, leaf, before in zip("qkv", leaves, qkv):
        if not torch.equal(leaf.detach(), before.detach()):
            raise ImplementationFailure(f"the implementation changed its argument {name} in place: it must not "
                                        "modify its inputs", name)
    out = []
    for name, leaf, grad in zip(("dq", "dk", "dv"), leaves, grads):
        if grad is not None:
            _dense("backward", name, grad, leaf.device)
        grad = torch.zeros_like(leaf) if grad is None else grad.detach().clone()
        _finite("backward", name, grad)
        out.append(grad)
    return tuple(out)
