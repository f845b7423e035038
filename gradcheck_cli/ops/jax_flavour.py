"""A user's JAX function as the NumPy interface of ``user_engine``: ``f(*inputs, *args) -> y`` on JAX arrays
becomes ``forward(*inputs, *args) -> y`` and ``backward(*inputs, *args, grad_y) -> (d<input>, ...)`` on
NumPy arrays, the gradients by ``jax.vjp``. Both are compiled with ``jax.jit`` (once per shape: the
finite differences call the forward on one stacked shape over and over). float64 scenarios enable JAX's
x64 mode (without it JAX computes in float32 whatever it is given). Imported only when a scenario names a
JAX implementation (JAX is imported here, at the top)."""
from __future__ import annotations

import time
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
        _COMPILED[id(user)] = (user, jax.jit(lambda *args: user(*args)), vjp)  # user kept: its id stays its own
    return _COMPILED[id(user)][1:]


def wrap(user, count: int, dtype: str) -> SimpleNamespace:
    """The numpy ``forward``/``backward`` of ``user`` (a JAX function), whose first ``count`` arguments are the
    differentiable inputs; the arguments after them are passed as they are (arrays become JAX arrays).
    ``state.shapes`` are the shapes compiled, ``state.compile_s`` the time the first call of each took."""
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    state = SimpleNamespace(compile_s=0.0, shapes=set())

    def as_jax(a):
        return jax.numpy.asarray(a) if isinstance(a, np.ndarray) else a

    def plain(name: str, t) -> np.ndarray:
        if not isinstance(t, jax.Array):
            raise ImplementationFailure(f"the implementation must return a JAX array, got {type(t).__name__}", name)
        return np.asarray(t)

    forward_jit, vjp = _compiled_functions(user)

    def timed(key, fn, *args):
        first = key not in state.shapes
        start = time.perf_counter()
        out = fn(*args)
        if first:
            jax.block_until_ready(out)
            state.compile_s += time.perf_counter() - start
            state.shapes.add(key)
        return out

    def forward(*args):
        key = ("forward",) + tuple(np.shape(a) for a in args)
        return plain("y", timed(key, forward_jit, *(as_jax(a) for a in args)))

    def backward(*args):
        *given, grad_y = args
        inputs = tuple(as_jax(a) for a in given[:count])
        rest = tuple(as_jax(a) for a in given[count:])
        key = ("backward",) + tuple(np.shape(a) for a in args)
        grads = timed(key, vjp, inputs, rest, as_jax(grad_y))
        out = tuple(plain(f"d{i}", g) for i, g in enumerate(grads))
        return out[0] if count == 1 else out

    return SimpleNamespace(forward=forward, backward=backward, state=state)
