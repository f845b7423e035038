"""A user's implementation of an op without attention's block structure, as an engine: NumPy (forward and
backward), or torch (one callable, gradients by autograd: ``torch_flavour``).

The op describes itself in a :class:`UserOp`: its differentiable inputs (in the order its interface
passes them), the arguments that follow them (eps, angles, ...), its built-in forward and backward, the
size of the terms of its output and gradients, and its invariants. From that, one engine for every such op:

- the user's ``forward(*inputs, *args) -> y`` is differenced (copies of the batched inputs stacked along
  their batch axis, one call on all of them; copies of the others, such as weights, one call each) against
  the user's ``backward(*inputs, *args, grad_y) -> (d<input>, ...)``;
- its output and gradients are compared with the float64 reference under the precision rule
  (``precision.judge``: the same as attention's), and the op's invariants run on its gradients, in the
  precision it computes in;
- each call gets fresh copies and is guarded (``implementation.call``): misbehaviour is a failed check;
- negative controls add each fault's change to the reference gradients to the user's (``Fault.user``).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import implementation, precision
from ..result import Check, Kind
from . import dense
from .registry import Problem, Structure

#: What a fault does to a user's implementation of such an op (``Fault.user``).
ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"

#: Names of the reference checks of the output (``o``) and of each gradient.
FORWARD_CHECK, BACKWARD_CHECK = "forward agrees with the reference", "backward agrees with the reference"


@dataclass(frozen=True)
class UserOp:
    """What the engine needs of an op.

    forward(*inputs, *args) -> y and backward(*inputs, *args, grad_y, faults) -> tuple of gradients (in the
    inputs' order): the built-in formulas, in whatever dtype they are given. terms(inputs, args, g) -> dict
    of float64 arrays, the size of the terms of ``o`` (the output) and of each input's gradient (rounding
    puts about eps x these in each element). invariants(gradients, precision, output) -> checks, where
    ``gradients(**args)`` is the implementation's gradients (dict by input) at the scenario's g, with some
    of the args replaced (e.g. eps = 0), and ``output`` its output. ``batched``: inputs whose axis 0 is the
    batch axis. ``adapt(impl, backend)``: the user's implementation as the engine calls it (inputs, then args),
    when the op's interface passes them in another order or returns gradients that are not checked."""
    inputs: dict[str, np.ndarray]
    args: dict[str, Any]
    g: np.ndarray
    forward: Callable[..., np.ndarray]
    backward: Callable[..., tuple]
    terms: Callable[[dict, dict, np.ndarray], dict]
    invariants: Callable[[Callable[..., dict], str, np.ndarray], list] = lambda gradients, dtype, output: []
    batched: tuple[str, ...] = ()
    rounding: Callable[[np.ndarray], dict] | None = None
    structure: dict[str, Structure] | None = None
    lift: Mapping[str, int] = field(default_factory=dict)
    adapt: Callable[[Any, str], Any] | None = None


def build(sc, op: UserOp, faults: Collection[str] = ()) -> Problem:
    """The problem of scenario ``sc`` for the implementation it names (``sc.implementation_object``)."""
    impl = sc.implementation_object
    if op.adapt is not None:
        impl = op.adapt(impl, sc.backend)
    order = tuple(op.inputs)
    if sc.backend == "torch":  # one callable, differentiated by autograd
        from . import torch_flavour
        impl = torch_flavour.wrap(impl, len(order), sc.dtype, sc.device)
    elif sc.backend == "jax":  # one function, differentiated by jax.vjp, compiled once per shape
        from . import jax_flavour
        impl = jax_flavour.wrap(impl, len(order), sc.dtype)
    dt = np.dtype(sc.dtype)
    names = order + tuple(op.args) + ("grad_y",)
    shape = np.shape(op.forward(*op.inputs.values(), *op.args.values()))

    def call_forward(xs: dict) -> np.ndarray:
        out = (len(xs[op.batched[0]]),) + shape[1:] if op.batched else shape  # the batch axis may hold copies
        return implementation.call(impl.forward, "forward", tuple(xs[t] for t in order) + tuple(op.args.values()),
                                   {"y": (out, dt)}, names)["y"]

    def user_forward(**xs) -> np.ndarray:
        """``xs`` with perturbed copies on one input: on a batched one, copies [C, B, ...] stacked along the
        batch axis in one call; on another, a call per copy."""
        moved = next((t for t in order if np.ndim(xs[t]) > op.inputs[t].ndim), None)
        if moved is None:
            return call_forward(xs)
        copies = xs[moved]
        if moved in op.batched:
            stacked = copies.reshape((-1,) + copies.shape[2:])
            rest = {t: (np.concatenate([v] * copies.shape[0]) if t in op.batched else v)
                    for t, v in xs.items() if t != moved}
            return call_forward({**rest, moved: stacked}).reshape(copies.shape[:1] + shape)
        flat = copies.reshape((-1,) + op.inputs[moved].shape)
        lead = copies.shape[:copies.ndim - op.inputs[moved].ndim]  # [:-ndim] would drop them all for a 0-d input
        return np.stack([call_forward({**xs, moved: c}) for c in flat]).reshape(lead + shape)

    def gradients(grad_y: np.ndarray, **changed) -> dict:
        args = {**op.args, **changed}
        expected = {f"d{t}": (op.inputs[t].shape, dt) for t in order}
        out = implementation.call(impl.backward, "backward",
                                  tuple(op.inputs.values()) + tuple(args.values()) + (grad_y,), expected, names)
        grads = {t: out[f"d{t}"] for t in order}
        if faults:  # the interface variants: the change each fault makes to the float64 reference's gradients
            xs = [v.astype(np.float64) for v in op.inputs.values()]
            wrong = op.backward(*xs, *args.values(), grad_y.astype(np.float64), faults)
            right = op.backward(*xs, *args.values(), grad_y.astype(np.float64), ())
            grads = {t: (grads[t] + w - r).astype(dt) for t, w, r in zip(order, wrong, right)}
        return grads

    y = call_forward(op.inputs)
    grads = gradients(op.g)
    again = {"o": call_forward(op.inputs), **gradients(op.g)}
    results = {"o": y, **grads}
    deterministic = implementation.determinism("forward and backward", results, again, sc.nondet_tol)

    def computed(dtype) -> dict:
        xs = [v.astype(dtype) for v in op.inputs.values()]
        return {"o": op.forward(*xs, *op.args.values()),
                **dict(zip(order, op.backward(*xs, *op.args.values(), op.g.astype(dtype), ())))}

    reference = computed(np.float64)
    terms = op.terms(op.inputs, op.args, op.g)
    names_of = {"o": FORWARD_CHECK, **dict.fromkeys(order, BACKWARD_CHECK)}
    agree, computes_in = precision.judge(results, reference, terms, sc.dtype, computed, names_of, sc.factor, sc.slack)

    def checks() -> list:
        try:
            under_test = lambda **changed: gradients(op.g, **changed)  # noqa: E731
            out = [deterministic] + agree + op.invariants(under_test, computes_in, y)
        except implementation.ImplementationFailure as exc:
            out = [deterministic] + agree + [implementation.failure_check("invariants", exc)]
        return out + compiled_rows(impl)

    rule = precision.Policy.for_dtype(computes_in)
    problem = dense.problem(sc, dict(op.inputs), user_forward, grads, op.g, invariants=checks, rounding=op.rounding,
                            structure=op.structure, arrays={"reference_output": reference["o"]},
                            analytic_rounding={t: rule.ulps * rule.eps * terms[t] for t in order},
                            rounding_forward=lambda **xs: op.forward(*(xs[t] for t in order), *op.args.values()))
    problem.compute_dtype = None if computes_in == sc.dtype else computes_in
    return problem


def compiled_rows(impl) -> list:
    """For a compiled flavour (JAX), how many shapes it compiled: a passing ``implementation`` row (the
    invariants run last, so every shape the run needed is counted)."""
    state = getattr(impl, "state", None)
    if state is None:
        return []
    return [Check(kind=Kind.IMPLEMENTATION, name="compiled once per shape", tensor="-", shape=None,
                  max_abs_error=0.0, relative_error=0.0, tolerance=0.0, noise_floor=0.0, worst_index=None,
                  passed=True, detail=f"jax.jit compiled the forward and the VJP once for each of "
                                      f"{len(state.shapes)} shape(s) (the compilation is part of the scenario's "
                                      "time; the report holds no timing but elapsed_s, so that run_id is stable)")]
