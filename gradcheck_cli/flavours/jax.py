"""A user's JAX function as the NumPy interface of ``user_engine``: ``f(*inputs, *args) -> y`` on JAX arrays
becomes ``forward(*inputs, *args) -> y`` and ``backward(*inputs, *args, grad_y) -> (d<input>, ...)`` on
NumPy arrays, the gradients by ``jax.vjp``. Both are compiled with ``jax.jit`` (once per shape: the
finite differences call the forward on one stacked shape over and over, small stacks padded to one size:
``stack_size``), and compiled programs are kept on disk across processes (``persistent_cache``). float64
scenarios enable JAX's x64 mode (without it JAX computes in float32 whatever it is given). Imported only when
a scenario names a JAX implementation (JAX is imported here, at the top)."""
from __future__ import annotations

import functools
import os
import stat
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

from ..implementation import ImplementationFailure

#: The compiled forward and VJP of each user function, kept for the life of the process: the negative
#: controls build a scenario once per fault, and each build would otherwise trace and compile again.
_COMPILED: dict[int, tuple] = {}


def _compiled_functions(user) -> tuple:
    if id(user) not in _COMPILED:
        @jax.jit
        def vjp(inputs, rest, grad_y):
            _, pull = jax.vjp(lambda *xs: user(*xs, *rest), *inputs)
            return pull(grad_y)

        @jax.jit
        def vjp_kw(inputs, rest, kw, grad_y):  # keyword arguments differentiated too (a bias, attn_bias=)
            _, pull = jax.vjp(lambda xs, ks: user(*xs, *rest, **ks), inputs, kw)
            return pull(grad_y)

        @jax.jit
        def jvp(inputs, rest, tangents):
            return jax.jvp(lambda *xs: user(*xs, *rest), inputs, tangents)[1]

        @jax.jit
        def hvp(inputs, rest, grad_y, directions):  # reverse over reverse: a custom_vjp's bwd is differentiated too
            def along(*xs):
                _, pull = jax.vjp(lambda *ys: user(*ys, *rest), *xs)
                return sum(jax.numpy.sum(g * d) for g, d in zip(pull(grad_y), directions))
            return jax.grad(along, argnums=tuple(range(len(inputs))))(*inputs)
        # keyword arguments (a bias per batch element, stacked with the copies) are traced like the others
        _COMPILED[id(user)] = (user, jax.jit(lambda *args, **kw: user(*args, **kw)), vjp, jvp, hvp,
                               vjp_kw)  # the user kept: its id stays its own
    return _COMPILED[id(user)][1:]


#: Stacked copies of at most this many bytes (inputs and output) are padded to one number of copies, so
#: that one compiled program serves every small stack of a scenario (the independence test's, the
#: Richardson probes', each tensor's colours): compiling a shape costs 0.3-1 s, evaluating the padding
#: copies of a small scenario microseconds.
PAD_BYTES = 2 * 2**20
#: ... and to at most this many copies.
MAX_STACK = 256


def stack_size(copies: int, copy_bytes: int) -> int:
    """The number of copies to call the compiled forward with for ``copies`` stacked copies of
    ``copy_bytes`` each: a stack that fits in PAD_BYTES is padded to the one size that does (at most
    MAX_STACK); a larger one, whose evaluation costs more than its compilation, keeps its own size."""
    fixed = max(1, min(MAX_STACK, PAD_BYTES // max(1, copy_bytes)))
    return fixed if copies <= fixed else copies


#: The persistent compilation cache's folder, instead of ``$XDG_CACHE_HOME/attn-gradcheck/jax``; 0 or off
#: turns the cache off.
CACHE_ENV = "ATTN_GRADCHECK_JAX_CACHE"
#: The cache's size, kept by JAX (least recently used entries deleted first; needs the filelock package).
CACHE_BYTES = 512 * 2**20


@functools.lru_cache(maxsize=1)
def persistent_cache() -> str | None:
    """Keep compiled programs on disk (JAX's persistent compilation cache), so that a later process (the next
    scenario's worker, the next run) loads what an earlier one compiled: each scenario runs in a fresh worker
    process. The folder is ``$ATTN_GRADCHECK_JAX_CACHE`` or ``$XDG_CACHE_HOME/attn-gradcheck/jax`` (default
    ``~/.cache/attn-gradcheck/jax``), made private to the user: JAX runs what it finds there, so a folder
    others can write to is not used. ``ATTN_GRADCHECK_JAX_CACHE=0`` (or ``off``) turns it off; a cache folder
    set in JAX's own configuration (``JAX_COMPILATION_CACHE_DIR``) is left as it is. Returns the folder used
    (None: no cache of ours)."""
    setting = os.environ.get(CACHE_ENV, "")
    if setting.strip().lower() in ("0", "off", "false", "no") or jax.config.jax_compilation_cache_dir:
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = Path(setting).expanduser() if setting.strip() else base / "attn-gradcheck" / "jax"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError:
        return None
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # a small program compiles in 0.3-1 s
    try:
        import filelock  # noqa: F401 -- JAX's size limit needs it
        jax.config.update("jax_compilation_cache_max_size", CACHE_BYTES)
    except ImportError:
        pass
    return str(folder)


def enable(dtype: str) -> None:
    """JAX's x64 mode for a float64 scenario (without it JAX computes in float32 whatever it is given); before
    a factory builds a module, so that its parameters can be float64."""
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)


def wrap(user, count: int, dtype: str, grad_kw: dict | None = None) -> SimpleNamespace:
    """The numpy ``forward``/``backward`` of ``user`` (a JAX function), whose first ``count`` arguments are the
    differentiable inputs; the arguments after them are passed as they are (arrays become JAX arrays).
    ``grad_kw``: keyword arguments differentiated too, by name -> value (a bias, ``attn_bias=``): ``backward``
    passes them and returns their gradients after the inputs', in that order.
    ``state.shapes`` are the shapes compiled, ``state.compile_s`` the time the first call of each took."""
    enable(dtype)
    persistent_cache()
    state = SimpleNamespace(compile_s=0.0, shapes=set())

    def as_jax(a):
        return jax.numpy.asarray(a) if isinstance(a, np.ndarray) else a

    def plain(name: str, t) -> np.ndarray:
        if not isinstance(t, jax.Array):
            raise ImplementationFailure(f"the implementation must return a JAX array, got {type(t).__name__}", name)
        return np.array(t)  # a fresh, writable copy: JAX may reuse the buffer behind np.asarray's view

    forward_jit, vjp, jvp_jit, hvp_jit, vjp_kw = _compiled_functions(user)
    grad_kw = dict(grad_kw or {})

    def timed(key, fn, *args):
        first = key not in state.shapes
        start = time.perf_counter()
        out = fn(*args)
        if first:
            jax.block_until_ready(out)
            state.compile_s += time.perf_counter() - start
            state.shapes.add(key)
        return out

    def forward(*args, **kw):
        key = ("forward",) + tuple(np.shape(a) for a in args) + tuple((k, np.shape(a)) for k, a in sorted(kw.items()))
        return plain("y", timed(key, lambda *a: forward_jit(*a, **{k: as_jax(x) for k, x in kw.items()}),
                                *(as_jax(a) for a in args)))

    def backward(*args):
        *given, grad_y = args
        inputs = tuple(as_jax(a) for a in given[:count])
        rest = tuple(as_jax(a) for a in given[count:])
        key = ("backward",) + tuple(np.shape(a) for a in args)
        if grad_kw:
            key += tuple((k, np.shape(a)) for k, a in grad_kw.items())
            grads, by_kw = timed(key, vjp_kw, inputs, rest, {k: as_jax(a) for k, a in grad_kw.items()},
                                 as_jax(grad_y))
            return tuple(plain(f"d{i}", g) for i, g in enumerate(grads)) + tuple(plain(f"d{k}", by_kw[k])
                                                                                 for k in grad_kw)
        grads = timed(key, vjp, inputs, rest, as_jax(grad_y))
        out = tuple(plain(f"d{i}", g) for i, g in enumerate(grads))
        return out[0] if count == 1 else out

    def jvp(*args):
        """(*inputs, *rest, *tangents) -> the output's tangent, by jax.jvp (``check: {mode: jvp}``)."""
        inputs, rest, tangents = args[:count], args[count:-count], args[-count:]
        key = ("jvp",) + tuple(np.shape(a) for a in args)
        try:
            out = timed(key, jvp_jit, tuple(map(as_jax, inputs)), tuple(map(as_jax, rest)),
                        tuple(map(as_jax, tangents)))
        except TypeError as exc:
            if "forward-mode" not in str(exc) and "custom_vjp" not in str(exc):
                raise
            raise ImplementationFailure(f"jax.jvp cannot differentiate the function forward: {exc} (a jax.custom_vjp "
                                        "function has no forward mode: give it a jax.custom_jvp rule instead, which "
                                        "JAX transposes for the VJP)", "o_dot") from None
        return plain("o_dot", out)

    def hvp(*args):
        """(*inputs, *rest, grad_y, *directions) -> the Hessian-vector product of sum(y * grad_y) by input, by
        jax.grad of <jax.vjp's gradients, directions> (``check: {mode: hvp}``)."""
        inputs, rest = args[:count], args[count:-count - 1]
        grad_y, directions = args[-count - 1], args[-count:]
        key = ("hvp",) + tuple(np.shape(a) for a in args)
        out = timed(key, hvp_jit, tuple(map(as_jax, inputs)), tuple(map(as_jax, rest)), as_jax(grad_y),
                    tuple(map(as_jax, directions)))
        return tuple(plain(f"h{i}", h) for i, h in enumerate(out))

    # the code gets JAX arrays (immutable, converted from the checker's) and what it returns is converted
    # into fresh NumPy arrays: implementation.call needs no copies around these
    forward.immutable = backward.immutable = jvp.immutable = hvp.immutable = True
    return SimpleNamespace(forward=forward, backward=backward, jvp=jvp, hvp=hvp, state=state, stack=stack_size)


def from_module(built, spec, order: tuple[str, ...], arg_names: tuple[str, ...], shapes: dict):
    """The function f(*inputs, *args) of what the factory of ``spec`` (``implementation.modules.ModuleSpec``)
    built: a flax ``nnx.Module``; a flax ``linen.Module`` with its variables, as a pair (module, variables);
    or a pair (fn, params) with fn(params, *args) -> y. Each mapped leaf of the parameters (a dotted path;
    a linen path may leave out its leading ``params.``) is replaced by its expression of the op's tensors, the
    module called with ``spec.call`` and, when it returns a tuple or list, its first element taken. Returns
    (f, frozen, nonzero): the leaves not replaced, and those of them that are not zero."""
    from ..implementation import modules
    from ..implementation.modules import expression_shape, fitted, suggest
    apply, params = _functional(built, spec.factory)
    leaves = dict(_flatten(params))
    paths = {}
    for path, expr in spec.weights:
        full = path if path in leaves else f"params.{path}" if f"params.{path}" in leaves else None
        if full is None:
            raise ImplementationFailure(f"the module built by {spec.factory} has no parameter {path!r}"
                                        f"{suggest(path, leaves)}; its parameters: {', '.join(leaves) or 'none'}")
        paths[full] = (expr, fitted(expression_shape(expr, shapes), tuple(np.shape(leaves[full])), path, expr))
    frozen, nonzero = modules.frozen(leaves.items(), paths, _unread, lambda leaf: np.count_nonzero(np.asarray(leaf)))
    names = order + arg_names

    def f(*values):
        named = dict(zip(names, values))
        new = {}
        for p, (e, shape) in paths.items():
            w = e.evaluate(named, lambda t: jax.numpy.swapaxes(t, -1, -2), lambda ts: jax.numpy.concatenate(ts, 0))
            new[p] = w if shape is None else w.reshape(shape)
        args = tuple(named[c] for c in spec.call)
        p = _replaced(params, new)
        out = apply(p, **dict(zip(spec.keywords, args))) if spec.keywords is not None else apply(p, *args)
        return out[0] if isinstance(out, (tuple, list)) and out else out

    return f, frozen, nonzero


def _unread(leaf) -> str | None:
    """Why a frozen leaf's values are not read (None: they are): an empty array has none, and what is not a
    dense numeric array (a sparse BCOO matrix, None, a string) is listed as it is, never reduced."""
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return f"{type(leaf).__name__}, not inspected"
    if np.asarray(leaf).dtype.kind not in "biufc":
        return f"{np.asarray(leaf).dtype}, not inspected"
    if np.size(leaf) == 0:
        return f"empty, {list(np.shape(leaf))}"
    return None


def _functional(built, factory: str):
    """(apply(params, *args, **kwargs), params) of what a factory built."""
    try:
        from flax import nnx
    except ImportError:
        nnx = None
    if nnx is not None and isinstance(built, nnx.Module):
        graphdef, state = nnx.split(built)
        return (lambda p, *args, **kwargs: nnx.merge(graphdef, p)(*args, **kwargs)), nnx.to_pure_dict(state)
    if isinstance(built, tuple) and len(built) == 2:
        first, params = built
        if hasattr(first, "apply") and hasattr(first, "init"):  # a flax.linen Module and its variables
            return (lambda p, *args, **kwargs: first.apply(p, *args, **kwargs)), _plain(params)
        if callable(first):
            return first, params
    raise ImplementationFailure(f"the factory {factory} must return a flax nnx.Module, a pair (linen module, "
                                f"variables) or a pair (fn, params) with fn(params, *args); got {type(built).__name__}")


def _plain(tree):
    """Nested mappings (flax FrozenDict included) as dicts."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


def _flatten(tree, prefix: str = ""):
    """(dotted path, leaf) of nested mappings and sequences."""
    if hasattr(tree, "items"):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _replaced(tree, new: dict, prefix: str = ""):
    """``tree`` with the leaves at the paths of ``new`` replaced."""
    if hasattr(tree, "items"):
        return {k: _replaced(v, new, f"{prefix}{k}.") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replaced(v, new, f"{prefix}{i}.") for i, v in enumerate(tree))
    return new.get(prefix[:-1], tree)


def side_by_side(a, b):
    """``a`` [..., d] and ``b`` [...] as one array [..., d + 1] in ``a``'s dtype, differentiable."""
    return jax.numpy.concatenate([a, jax.numpy.asarray(b, dtype=a.dtype)[..., None]], axis=-1)
