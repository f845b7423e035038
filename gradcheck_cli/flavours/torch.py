"""A user's torch callable as the NumPy interface of ``user_engine``: ``f(*inputs, *args) -> y`` on torch
tensors becomes ``forward(*inputs, *args) -> y`` and ``backward(*inputs, *args, grad_y) -> (d<input>, ...)``
on arrays, the gradients by autograd. Imported only when a scenario names a torch implementation (torch is
imported here, at the top)."""
from __future__ import annotations

import warnings
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

    def forward_copies(index: int, *args):
        """The forward of each of the copies args[index] [C, ...] (the others as they are), in one call
        vectorised by torch.vmap: the copies of a weight, which no batch axis can hold."""
        given = [tensor(a) for a in args]

        def one(w):
            return user(*given[:index], w, *given[index + 1:])
        with torch.no_grad(), warnings.catch_warnings():  # an op without a batching rule is only slower
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return plain("y", torch.vmap(one)(given[index]))

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

    return SimpleNamespace(forward=forward, backward=backward, forward_copies=forward_copies)


def from_module(module, spec, order: tuple[str, ...], arg_names: tuple[str, ...], shapes: dict, dtype: str,
                device: str = "cpu"):
    """The callable f(*inputs, *args) of a ``torch.nn.Module`` built by the factory of ``spec``
    (``implementation.modules.ModuleSpec``): each mapped parameter replaced by its expression of the op's
    tensors (``torch.func.functional_call``, so autograd reaches them), the module called with ``spec.call``
    and, when it returns a tuple or list, its first element taken. The module is put in ``dtype`` on
    ``device`` and in eval mode (dropout off). Returns (f, frozen, nonzero): the parameters
    not replaced (kept as built, not differentiated), and those of them that are not zero."""
    from ..implementation import modules
    from ..implementation.modules import expression_shape, fitted, suggest
    if not isinstance(module, torch.nn.Module):
        raise ImplementationFailure(f"the factory {spec.factory} must return a torch.nn.Module, got "
                                    f"{type(module).__name__}")
    module = module.to(device=torch.device(device), dtype=DTYPES[dtype]).eval()
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    reshape = {}
    for path, expr in spec.weights:
        if path not in params:
            raise ImplementationFailure(f"the module built by {spec.factory} has no parameter {path!r}"
                                        f"{suggest(path, params)}; its parameters: {', '.join(params) or 'none'}")
        reshape[path] = fitted(expression_shape(expr, shapes), tuple(params[path].shape), path, expr)
    mapped = [path for path, _ in spec.weights]
    frozen, nonzero = modules.frozen(module.named_parameters(), mapped, _unread,
                                     lambda t: bool(torch.count_nonzero(t.detach()) > 0))
    names = order + arg_names

    def f(*values):
        named = dict(zip(names, values))
        weights = {path: expr.evaluate(named, lambda t: t.transpose(-1, -2), lambda ts: torch.cat(ts, 0))
                   for path, expr in spec.weights}
        weights = {path: w if reshape[path] is None else w.reshape(reshape[path]) for path, w in weights.items()}
        args = tuple(named[c] for c in spec.call)
        if spec.keywords is not None:
            out = torch.func.functional_call(module, weights, (), dict(zip(spec.keywords, args)))
        else:
            out = torch.func.functional_call(module, weights, args)
        return out[0] if isinstance(out, (tuple, list)) and out else out

    return f, frozen, nonzero


def _unread(t: torch.Tensor) -> str | None:
    """Why a frozen parameter's values are not read (None: they are): an empty one has none, and a sparse,
    quantised or meta one is listed as it is, never reduced (a max over it has no meaning or no kernel)."""
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')}, {list(t.shape)}, not inspected"
    if t.is_meta or t.is_quantized:
        return f"{'meta' if t.is_meta else 'quantised'}, {list(t.shape)}, not inspected"
    if t.numel() == 0:
        return f"empty, {list(t.shape)}"
    return None
