"""A user's torch callable as the NumPy interface of ``user_engine``: ``f(*inputs, *args) -> y`` on torch
tensors becomes ``forward(*inputs, *args) -> y`` and ``backward(*inputs, *args, grad_y) -> (d<input>, ...)``
on arrays, the gradients by autograd. Imported only when a scenario names a torch implementation (torch is
imported here, at the top)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ..implementation import ImplementationFailure

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def wrap(user, count: int, dtype: str, device: str = "cpu") -> SimpleNamespace:
    """The numpy ``forward``/``backward`` of ``user`` (a torch callable), whose first ``count`` arguments are
    the differentiable inputs; array arguments after them become tensors, other values pass as they are."""
    tdtype, dev = DTYPES[dtype], torch.device(device)

    def tensor(a, grad: bool = False):
        if not isinstance(a, np.ndarray):
            return a
        contiguous = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes a 0-d array 1-d
        t = torch.from_numpy(contiguous).to(device=dev, dtype=tdtype if a.dtype.kind == "f" else None)
        return t.requires_grad_(grad)

    def plain(name: str, t) -> np.ndarray:
        if not isinstance(t, torch.Tensor):
            raise ImplementationFailure(f"the implementation must return a torch.Tensor, got {type(t).__name__}",
                                        name)
        if t.layout != torch.strided or t.is_meta or t.device != dev:
            raise ImplementationFailure(f"the implementation returned a {t.layout} tensor on {t.device} "
                                        f"({'meta' if t.is_meta else 'data'}); expected a dense tensor on {dev}", name)
        return t.detach().cpu().numpy()

    def forward(*args):
        with torch.no_grad():
            return plain("y", user(*(tensor(a) for a in args)))

    def backward(*args):
        *given, grad_y = args
        inputs = [tensor(a, grad=True) for a in given[:count]]
        y = user(*inputs, *(tensor(a) for a in given[count:]))
        if not isinstance(y, torch.Tensor) or not y.requires_grad:
            raise ImplementationFailure("the implementation's output does not depend on its inputs through "
                                        "autograd (detached, or computed without torch operations)", "y")
        grads = torch.autograd.grad(y, inputs, grad_outputs=tensor(grad_y), allow_unused=True)
        out = tuple(np.zeros_like(given[i]) if g is None else plain(f"d{i}", g) for i, g in enumerate(grads))
        return out[0] if count == 1 else out

    return SimpleNamespace(forward=forward, backward=backward)
