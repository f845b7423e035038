"""A user's torch callable as the NumPy interface the engines call (attention's and the layers' alike):
``f(*inputs, *args, **kw) -> y`` on torch tensors becomes ``forward(*inputs, *args, **kw) -> y``,
``backward(*inputs, *args, grad_y) -> (d<input>, ...)`` (autograd, so a custom autograd.Function's backward is
what gets checked), ``jvp`` (``torch.func.jvp``) and ``hvp`` (double backward) on NumPy arrays. Every call then
goes through ``implementation.call`` (fresh copies in, copies out, shapes, dtypes and finiteness checked, an
argument changed in place named): the tensors the code gets share the memory of those copies, so an in-place
change is seen there. Imported only when a scenario names a torch implementation (torch is imported here, at
the top)."""
from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import numpy as np
import torch

from ..implementation import ImplementationFailure, guarded

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def tensor(a, device, grad: bool = False):
    """A NumPy array as a tensor on ``device`` in its own dtype (bfloat16, ml_dtypes', through its bits); on the
    CPU it shares the array's memory. Anything else passes as it is."""
    if not isinstance(a, np.ndarray):
        return a
    contiguous = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes a 0-d array 1-d
    if contiguous.dtype.name == "bfloat16":
        t = torch.from_numpy(contiguous.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(contiguous)
    return t.to(device=device).requires_grad_(grad)


def array(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array (bfloat16 as ml_dtypes' bfloat16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


#: What torch says when a function cannot be differentiated forward, and what to do about it.
NO_FORWARD_MODE = (
    ("setup_context", "a custom autograd.Function needs forward(*args) and setup_context(ctx, inputs, output) "
                      "(not forward(ctx, ...)) for torch.func.jvp"),
    ("implement the jvp", "a custom autograd.Function needs a jvp(ctx, *tangents) staticmethod for forward mode"),
    ("forward AD", "an operation in it has no forward-mode derivative in torch"),
    ("data pointer", "it leaves torch (e.g. through .numpy()), where forward-mode AD cannot follow"),
)


def wrap(user, count: int, dtype: str, device: str = "cpu", grad_kw: dict | None = None,
         output: str = "y") -> SimpleNamespace:
    """The numpy ``forward``/``backward``/``jvp``/``hvp`` of ``user`` (a torch callable), whose first ``count``
    arguments are the differentiable inputs; array arguments after them become tensors (in their own dtype),
    other values pass as they are. ``grad_kw``: keyword arguments differentiated too, by name -> value (a bias,
    ``attn_bias=``): ``backward`` passes them as leaves of autograd and returns their gradients after the
    inputs', in that order. What the code returns (``output``: its name in messages) must be a dense tensor of
    the scenario's ``dtype`` on ``device``."""
    tdtype, dev = DTYPES[dtype], torch.device(device)
    grad_kw = dict(grad_kw or {})

    def plain(name: str, t, what: str = "forward") -> np.ndarray:
        if not isinstance(t, torch.Tensor):
            raise ImplementationFailure(f"{what} must return a torch.Tensor, got {type(t).__name__}", name)
        try:
            dense = t.layout == torch.strided and not t.is_meta and t.device == dev
        except Exception as exc:  # noqa: BLE001 -- a tensor subclass may raise anything
            raise ImplementationFailure(f"{what} returned a {name} that cannot be read: {type(exc).__name__}: {exc}",
                                        name) from None
        if not dense:
            raise ImplementationFailure(f"{what} returned {name} as a {t.layout} tensor on {t.device}; expected a "
                                        f"dense (strided) tensor on {dev}", name)
        if t.is_floating_point() and t.dtype != tdtype:
            raise ImplementationFailure(f"{what} returned {name} of dtype {t.dtype}, expected {tdtype}", name)
        return array(t)

    def given(args, kw):
        return [tensor(a, dev) for a in args], {k: tensor(a, dev) for k, a in kw.items()}

    def written_back(arrays, tensors) -> None:
        """Off the CPU a tensor is a copy of its array: what the code changed in place is written back, so that
        ``implementation.call`` sees the change and names the argument."""
        if dev.type == "cpu":
            return
        for a, t in zip(arrays, tensors):
            if isinstance(a, np.ndarray) and isinstance(t, torch.Tensor) and a.flags.writeable:
                a[...] = array(t).reshape(a.shape)

    def forward(*args, **kw):
        ts, kws = given(args, kw)
        with torch.no_grad():
            y = user(*ts, **kws)
        written_back(args, ts)
        return plain(output, y)

    def forward_copies(index: int, *args):
        """The forward of each of the copies args[index] [C, ...] (the others as they are), in one call
        vectorised by torch.vmap: the copies of a weight, which no batch axis can hold."""
        ts, _ = given(args, {})

        def one(w):
            return user(*ts[:index], w, *ts[index + 1:])
        with torch.no_grad(), warnings.catch_warnings():  # an op without a batching rule is only slower
            warnings.filterwarnings("ignore", message=".*batching rule.*")
            return plain(output, torch.vmap(one)(ts[index]))

    def traced(args, kw):
        """(leaves, keyword leaves, y) of one call under autograd."""
        ts, kws = given(args, kw)
        leaves = [t.requires_grad_(True) if isinstance(t, torch.Tensor) else t for t in ts[:count]]
        kw_leaves = {k: tensor(a, dev, grad=True) for k, a in grad_kw.items()}
        with torch.enable_grad():
            y = user(*leaves, *ts[count:], **kws, **kw_leaves)
        written_back(args[count:], ts[count:])
        if not isinstance(y, torch.Tensor):
            raise ImplementationFailure(f"forward must return a torch.Tensor, got {type(y).__name__}", output)
        if not y.requires_grad:
            raise ImplementationFailure("the implementation's output does not require grad: it does not depend on "
                                        "its inputs through autograd (detached, or computed without torch "
                                        "operations)", output)
        return leaves, kw_leaves, y

    def backward(*args, **kw):
        *args, grad_y = args
        leaves, kw_leaves, y = traced(args, kw)
        g = tensor(grad_y, dev)
        wanted = leaves + list(kw_leaves.values())
        grads = guarded("backward", lambda: torch.autograd.grad(y, wanted, grad_outputs=g, allow_unused=True))
        written_back((grad_y,), (g,))
        names = [f"d{i}" for i in range(count)] + [f"d{k}" for k in kw_leaves]
        # the inputs autograd gave no gradient (None: not reached from the output): 0 to the checker, named in hints
        backward.no_gradient = tuple(i for i, gr in enumerate(grads) if gr is None)
        out = tuple(torch.zeros_like(w) if gr is None else gr for w, gr in zip(wanted, grads))
        out = tuple(plain(n, gr, "backward") for n, gr in zip(names, out))
        return out[0] if len(out) == 1 else out

    def jvp(*args):
        """(*inputs, *rest, *tangents) -> the output's tangent, by torch.func.jvp on the code as it is (a custom
        autograd.Function's ``jvp`` is what gets checked; it needs ``setup_context``, as torch.func requires)."""
        ts, _ = given(args, {})
        primals, rest, tangents = ts[:count], ts[count:-count], ts[-count:]
        try:
            out = guarded("torch.func.jvp of forward", torch.func.jvp, lambda *xs: user(*xs, *rest), tuple(primals),
                          tuple(tangents))
        except ImplementationFailure as exc:
            need = next((need for marker, need in NO_FORWARD_MODE if marker in exc.message), None)
            if need is None:
                raise
            raise ImplementationFailure(f"{exc.message}; it has no forward-mode derivative: {need}", "o_dot") from None
        o_dot = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        return plain("o_dot", o_dot, "jvp")

    def hvp(*args):
        """(*inputs, *rest, grad_y, *directions) -> the Hessian-vector product of sum(y * grad_y) by input, by
        double backward: the gradients with ``create_graph=True``, then the gradient of <gradients, directions>,
        so a custom autograd.Function's backward is differentiated as it is written."""
        inputs, grad_y, directions = args[:-count - 1], args[-count - 1], args[-count:]
        leaves, _, y = traced(inputs, {})
        g, dirs = tensor(grad_y, dev), [tensor(d, dev) for d in directions]
        with torch.enable_grad():
            grads = guarded("backward (with create_graph=True)",
                            lambda: torch.autograd.grad(y, leaves, g, create_graph=True, allow_unused=True))
            terms = [(gr * d).sum() for gr, d in zip(grads, dirs) if gr is not None and gr.requires_grad]
            if not terms:
                raise ImplementationFailure(
                    "the gradients do not depend on the inputs through autograd, so they cannot be differentiated "
                    "again: a custom autograd.Function's backward must itself be differentiable torch code (not "
                    "@once_differentiable, not NumPy) for double backward", output)
            try:
                second = guarded("double backward", lambda: torch.autograd.grad(sum(terms), leaves, allow_unused=True))
            except ImplementationFailure as exc:
                if "once_differentiable" not in exc.message and "does not require grad" not in exc.message:
                    raise
                raise ImplementationFailure(f"{exc.message}; the backward cannot be differentiated again: write it "
                                            "in differentiable torch operations for double backward", output) from None
        return tuple(plain(f"h{i}", torch.zeros_like(w) if h is None else h, "double backward")
                     for i, (w, h) in enumerate(zip(leaves, second)))

    return SimpleNamespace(forward=forward, backward=backward, jvp=jvp, hvp=hvp, forward_copies=forward_copies)


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


@contextlib.contextmanager
def seeded(seed: int):
    """torch's global generator (the CPU's) seeded with ``seed`` for the block, its state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def side_by_side(a, b):
    """``a`` [..., d] and ``b`` [...] as one tensor [..., d + 1] in ``a``'s dtype, through autograd."""
    return torch.cat([a, b.to(a.dtype)[..., None]], dim=-1)
