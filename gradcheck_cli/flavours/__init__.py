"""The flavours of a user's code: how the engines call an implementation written in NumPy, torch or JAX, for
every op (attention and the layers alike).

- **numpy**: the user's object itself, ``forward(...)`` and ``backward(..., grad)`` (and ``jvp``/``hvp`` where
  a mode needs them);
- **torch** (``flavours.torch``): one callable, differentiated by autograd, presented as the same
  forward/backward object on NumPy arrays;
- **jax** (``flavours.jax``): one function, differentiated by ``jax.vjp`` (``jax.jvp``, ``jax.grad`` over it),
  compiled once per shape, presented likewise.

Every call then goes through ``implementation.call`` (fresh copies in, copies out, results checked for shape,
dtype and finiteness, a failure a failed check, not a crash), which is the one guard contract; a torch
callable's tensors share the memory of those copies, so its in-place change of an input is named like a NumPy
implementation's; JAX arrays are immutable. Torch and JAX are imported here only when a scenario asks for them."""
from __future__ import annotations

from ..result import Check, Kind


def wrap(user, count: int, backend: str, dtype: str, device: str = "cpu", grad_kw: dict | None = None,
         output: str = "y"):
    """The user's implementation as the engines call it: ``forward(*inputs, *args)`` and
    ``backward(*inputs, *args, grad)`` on NumPy arrays (``count``: how many leading arguments are
    differentiated; ``grad_kw``: keyword arguments differentiated too, their gradients returned after the
    inputs'; ``output``: the output's name in messages). A NumPy implementation is already that (its backward
    returns those gradients itself)."""
    if backend == "torch":
        from . import torch as torch_flavour
        return torch_flavour.wrap(user, count, dtype, device, grad_kw, output)
    if backend == "jax":
        from . import jax as jax_flavour
        return jax_flavour.wrap(user, count, dtype, grad_kw)
    return user


def side_by_side(backend: str, a, b):
    """``a`` [..., d] and ``b`` [...] (in ``a``'s dtype) as one array of the flavour [..., d + 1], differentiable
    (torch.cat, jnp.concatenate): a second output joined to the first (attention's log-sum-exp)."""
    if backend == "torch":
        from . import torch as torch_flavour
        return torch_flavour.side_by_side(a, b)
    from . import jax as jax_flavour
    return jax_flavour.side_by_side(a, b)


def from_module(sc, factory, available: dict, spec, order, arg_names, shapes) -> tuple:
    """(f, frozen, nonzero) of a fresh build of the scenario's factory with weights ``spec``, in its flavour
    (torch or JAX: the loader refuses the mapping form elsewhere)."""
    from ..implementation import modules
    if sc.backend == "torch":
        from . import torch as torch_flavour
        built = modules.build(factory, available, sc.implementation)
        return torch_flavour.from_module(built, spec, order, arg_names, shapes, sc.dtype, sc.device)
    from . import jax as jax_flavour
    jax_flavour.enable(sc.dtype)
    built = modules.build(factory, available, sc.implementation)
    return jax_flavour.from_module(built, spec, order, arg_names, shapes)


def compile_time(impl):
    """For a compiled flavour (JAX), the seconds it has spent compiling so far (``Problem.compile_s``)."""
    state = getattr(impl, "state", None)
    return None if state is None else (lambda: state.compile_s)


def compiled_rows(impl) -> list:
    """For a compiled flavour (JAX), how many shapes it compiled: a passing ``implementation`` row (the
    invariants run last, so every shape the run needed is counted)."""
    state = getattr(impl, "state", None)
    if state is None:
        return []
    return [Check(kind=Kind.IMPLEMENTATION, name="compiled once per shape", tensor="-", shape=None,
                  max_abs_error=0.0, relative_error=0.0, tolerance=0.0, noise_floor=0.0, worst_index=None,
                  passed=True, detail=f"jax.jit compiled the forward and the VJP once for each of "
                                      f"{len(state.shapes)} shape(s) (its time is reported apart: compile_s, a part of "
                                      "elapsed_s, both left out of run_id)")]
