"""A user's implementation of an op without attention's block structure, as an engine: NumPy (forward and
backward), or torch (one callable, gradients by autograd: ``flavours.torch``).

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

from .. import fingerprints, flavours, implementation, precision
from ..numeric import SeedStream
from . import dense
from .convention import MASKS, MEANING
from .registry import Problem, Structure
from .user_modules import _from_module

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
    puts about eps x these in each element). invariants(calls, precision, output) -> checks, where
    ``calls()`` is the implementation's gradients (dict by input) at the scenario's inputs and g, and
    ``output`` its output; ``calls`` is a :class:`Calls`, which also calls the implementation on other
    inputs (``forward``, ``backward``) and says which settings are fixed inside the user's module
    (``fixed``). Invariants never change a setting of the code under test: each holds in the setting the
    code has, or is not applicable where it needs a setting the code keeps to itself. ``batched``: inputs
    (and arguments, such as a mask [B, ...]) whose axis 0 is the batch axis. ``shown``: faults that change what the
    implementation is shown instead (fault -> args -> args, e.g. every key visible for ``mask``); the others
    add their change to the reference gradients (``ADDED``). ``adapt(impl, backend)``: the user's
    implementation as the engine calls it (inputs, then args), when the op's interface passes them in another
    order or returns gradients that are not checked. ``alternatives``: when the forward disagrees with the
    reference, the conventions it may follow instead (the key to set -> the float64 built-in output under
    that convention); the one it agrees with is named in a hint."""
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
    shown: Mapping[str, Callable[[dict], dict]] = field(default_factory=dict)
    adapt: Callable[[Any, str], Any] | None = None
    alternatives: Mapping[str, Callable[[], np.ndarray]] = field(default_factory=dict)
    #: the wrong backwards ``backward(..., faults)`` computes on request, by name -> what each gets wrong: the op's
    #: faults that change gradients and its known mistakes, the candidate causes of a failed gradient check
    #: (``fingerprints``)
    mistakes: Mapping[str, str] = field(default_factory=dict)
    #: known mistakes of the forward: name -> (what it gets wrong, forward(*inputs, *args) -> y with it), named when
    #: the user's forward fails against the reference and equals one
    forward_mistakes: Mapping[str, tuple[str, Callable[..., np.ndarray]]] = field(default_factory=dict)


def mistakes(faults: Mapping, known: Mapping[str, str] | None = None) -> dict[str, str]:
    """The candidate causes of an op: its faults that add their change to the gradients (``ADDED``), then its known
    mistakes (name -> what it gets wrong). A sized fault (its size set from a clean run) is no candidate."""
    return {**{name: f.breaks for name, f in faults.items() if f.user == ADDED and not f.sized}, **(known or {})}


class Calls:
    """The implementation under test, for invariants: ``calls()`` its gradients at the scenario's inputs and g
    (dict by input: those already checked), ``forward(inputs)`` its output on other inputs (a dict, some of the
    scenario's replaced), ``backward(inputs, grad_y)`` its gradients there. ``fixed``: the op's arguments
    that do not reach the code (a module whose factory does not take them and whose call does not pass them),
    by name, with the words that say so."""

    def __init__(self, forward, gradients, checked: dict, fixed: Mapping[str, str]):
        self._forward, self._gradients, self._checked = forward, gradients, checked
        self.fixed = dict(fixed)

    def __call__(self) -> dict:
        return dict(self._checked)

    def forward(self, inputs: dict) -> np.ndarray:
        return self._forward({**inputs})

    def backward(self, inputs: dict, grad_y: np.ndarray) -> dict:
        return self._gradients(inputs, grad_y)


def build(sc, op: UserOp, faults: Collection[str] = ()) -> Problem:
    """The problem of scenario ``sc`` for the implementation it names (``sc.implementation_object``)."""
    impl = sc.implementation_object
    if op.adapt is not None:
        impl = op.adapt(impl, sc.backend)
    order = tuple(op.inputs)
    module_rows, module_hints, transposed, fixed = [], [], lambda: [], {}
    if sc.module is not None:  # a module built by the user's factory, its weights mapped from the op's tensors
        impl, module_rows, module_hints, transposed, fixed = _from_module(sc, impl, order, tuple(op.args),
                                                                          {t: v.shape for t, v in op.inputs.items()})

    def flavoured(user):  # torch: one callable, by autograd; JAX: one function, by jax.vjp, compiled per shape
        return flavours.wrap(user, len(order), sc.backend, sc.dtype, sc.device)
    impl = flavoured(impl)
    dt = np.dtype(sc.dtype)
    names = order + tuple(op.args) + ("grad_y",)
    shape = np.shape(op.forward(*op.inputs.values(), *op.args.values()))
    shown = dict(op.args)  # what the implementation is shown: the scenario's arguments, or a fault's
    for fault in faults:
        shown = op.shown[fault](shown) if fault in op.shown else shown
    added = tuple(f for f in faults if f not in op.shown)
    shown = masked(shown, sc.convention, dt)

    def call_forward(xs: dict) -> np.ndarray:
        copies = len(xs[op.batched[0]]) // len(op.inputs[op.batched[0]]) if op.batched else 1
        out = (len(xs[op.batched[0]]),) + shape[1:] if op.batched else shape  # the batch axis may hold copies
        args = tuple(np.concatenate([a] * copies) if copies > 1 and name in op.batched else a
                     for name, a in shown.items())
        return implementation.call(impl.forward, "forward", tuple(xs[t] for t in order) + args,
                                   {"y": (out, dt)}, names)["y"]

    vectorise = [True] if hasattr(impl, "forward_copies") else []
    # one stacked copy's bytes: its inputs, its batched arguments and its output; what a compiled flavour pads to
    stack = impl.stack if sc.backend == "jax" else None
    stacked_bytes = (sum(op.inputs[t].nbytes for t in order) + int(np.prod(shape)) * dt.itemsize
                     + sum(np.asarray(a).nbytes for name, a in shown.items() if name in op.batched))

    def user_forward(**xs) -> np.ndarray:
        """``xs`` with perturbed copies on one input: on a batched one, copies [C, B, ...] stacked along the
        batch axis in one call; on another (a weight), one vectorised call where the flavour has one, else a
        call per copy."""
        moved = next((t for t in order if np.ndim(xs[t]) > op.inputs[t].ndim), None)
        if moved is None:
            return call_forward(xs)
        copies = xs[moved]
        if moved in op.batched:
            count = copies.shape[0]
            total = stack(count, stacked_bytes) if stack else count
            if total > count:  # a compiled flavour (JAX): small stacks padded with unmoved copies to one size
                pad = np.broadcast_to(op.inputs[moved], (total - count,) + copies.shape[1:])
                copies = np.concatenate([copies, pad])
            stacked = copies.reshape((-1,) + copies.shape[2:])
            rest = {t: (np.concatenate([v] * total) if t in op.batched else v)
                    for t, v in xs.items() if t != moved}
            return call_forward({**rest, moved: stacked}).reshape((total,) + shape)[:count]
        flat = copies.reshape((-1,) + op.inputs[moved].shape)
        out = vectorised(moved, xs, flat) if vectorise else None
        if out is None:
            out = np.stack([call_forward({**xs, moved: c}) for c in flat])
        lead = copies.shape[:copies.ndim - op.inputs[moved].ndim]  # [:-ndim] would drop them all for a 0-d input
        return out.reshape(lead + shape)

    def vectorised(moved: str, xs: dict, flat: np.ndarray) -> np.ndarray | None:
        """The forward of every copy in ``flat`` in one vectorised call (``forward_copies``: torch.vmap), or
        None where the implementation cannot be vectorised (from then on it is called once per copy, which
        also reports any failure of its own)."""
        position = order.index(moved)
        args = tuple(flat if t == moved else xs[t] for t in order) + tuple(shown.values())
        try:
            return implementation.call(lambda *a: impl.forward_copies(position, *a), "forward", args,
                                       {"y": ((len(flat),) + shape, dt)}, names)["y"]
        except implementation.ImplementationFailure:
            vectorise.clear()
            return None

    def gradients(at: dict | None, grad_y: np.ndarray | None) -> dict:
        at, grad_y = {**op.inputs, **(at or {})}, op.g if grad_y is None else grad_y
        expected = {f"d{t}": (op.inputs[t].shape, dt) for t in order}
        out = implementation.call(impl.backward, "backward", tuple(at[t] for t in order)
                                  + tuple(shown.values()) + (grad_y,), expected, names)
        grads = {t: out[f"d{t}"] for t in order}
        if added:  # the interface variants: the change each fault makes to the float64 reference's gradients
            xs = [at[t].astype(np.float64) for t in order]
            wrong = op.backward(*xs, *op.args.values(), grad_y.astype(np.float64), added)
            right = op.backward(*xs, *op.args.values(), grad_y.astype(np.float64), ())
            grads = {t: (grads[t] + w - r).astype(dt) for t, w, r in zip(order, wrong, right)}
        return grads

    def computed(dtype) -> dict:
        xs = [v.astype(dtype) for v in op.inputs.values()]
        return {"o": op.forward(*xs, *op.args.values()),
                **dict(zip(order, op.backward(*xs, *op.args.values(), op.g.astype(dtype), ())))}

    def other_conventions(y_now, target: np.ndarray) -> list[str]:
        """Why the forward disagrees with the float64 reference output ``target`` (giving ``y_now``) or fails
        (None), where the code tells: another mask convention it agrees with, a frozen parameter that changes
        it, a mask ``call`` leaves out, a square weight's missing transpose."""
        found = []
        if "visible" in op.args and sc.convention.mask in MASKS:
            wrong = None if y_now is None else float(np.max(np.abs(y_now.astype(np.float64) - target), initial=0.0))
            for key, value, conv in sc.convention.alternatives():
                if key != "mask" and key != "mask_heads":
                    continue
                args = tuple(masked({**op.args}, conv, dt).values())
                try:
                    other = implementation.call(impl.forward, "forward", tuple(op.inputs.values()) + args,
                                                {"y": (shape, dt)}, names)["y"]
                except implementation.ImplementationFailure:
                    continue
                off = float(np.max(np.abs(other.astype(np.float64) - target), initial=0.0))
                scale = float(np.max(np.abs(target), initial=0.0))
                if off <= 1e-3 * (scale if y_now is None else wrong):
                    found.append(f"called with convention: {{{key}: {value}}} ({MEANING[key, value]}) the forward "
                                 f"agrees with the reference: set convention: {{{key}: {value}}} in the scenario")
                    break
        found += module_hints
        if y_now is not None and not found:  # a square weight mapped without its transpose (or with one too many)
            wrong = float(np.max(np.abs(y_now.astype(np.float64) - target)))
            for text, user in transposed():
                try:
                    other = implementation.call(flavoured(user).forward, "forward",
                                                tuple(op.inputs.values()) + tuple(shown.values()), {"y": (shape, dt)},
                                                names)["y"]
                except implementation.ImplementationFailure:
                    continue
                if float(np.max(np.abs(other.astype(np.float64) - target), initial=0.0)) <= 1e-3 * wrong:
                    found.append(f"with weights: {{{text}}} the module agrees with the reference: a square weight "
                                 "mapped without its transpose (nn.Linear keeps [out, in]) or with one too many")
                    break
        return found

    try:
        y = call_forward(op.inputs)
    except implementation.ImplementationFailure as exc:
        hints = other_conventions(None, computed(np.float64)["o"])
        if hints and exc.hint is None:
            exc.hint = "; ".join(hints)
        raise
    grads = gradients(None, None)
    again = {"o": call_forward(op.inputs), **gradients(None, None)}
    results = {"o": y, **grads}
    deterministic = implementation.determinism("forward and backward", results, again, sc.nondet_tol)

    reference = computed(np.float64)
    terms = op.terms(op.inputs, op.args, op.g)
    names_of = {"o": FORWARD_CHECK, **dict.fromkeys(order, BACKWARD_CHECK)}
    def results_at(xs: dict) -> dict | None:
        try:
            return {"o": call_forward(xs), **gradients(xs, None)}
        except implementation.ImplementationFailure:
            return None

    def reference_at(xs: dict) -> dict:
        x64 = [xs[t].astype(np.float64) for t in order]
        return {"o": op.forward(*x64, *op.args.values()),
                **dict(zip(order, op.backward(*x64, *op.args.values(), op.g.astype(np.float64), ())))}

    nearby = precision.nearby(op.inputs, results_at, reference_at, [sc.seed, SeedStream.PRECISION])
    agree, computes_in = precision.judge(results, reference, terms, sc.dtype, computed, names_of, sc.factor, sc.slack,
                                         nearby_difference=nearby)

    def checks() -> list:
        try:
            out = [deterministic] + agree + op.invariants(Calls(call_forward, gradients, grads, fixed), computes_in, y)
        except implementation.ImplementationFailure as exc:
            out = [deterministic] + agree + [implementation.failure_check("invariants", exc)]
        return out + module_rows + flavours.compiled_rows(impl)

    rule = precision.Policy.for_dtype(computes_in)
    problem = dense.problem(sc, dict(op.inputs), user_forward, grads, op.g, invariants=checks, rounding=op.rounding,
                            structure=op.structure, arrays={"reference_output": reference["o"]},
                            analytic_rounding={t: rule.ulps * rule.eps * terms[t] for t in order},
                            rounding_forward=lambda **xs: op.forward(*(xs[t] for t in order), *op.args.values()),
                            forward_bound=terms.get("o"))
    problem.compute_dtype = None if computes_in == sc.dtype else computes_in
    problem.compile_s = flavours.compile_time(impl)
    x64, g64 = [op.inputs[t].astype(np.float64) for t in order], op.g.astype(np.float64)
    candidates = fingerprints.from_backward(
        op.mistakes, lambda wrong: dict(zip(order, op.backward(*x64, *op.args.values(), g64, wrong))))
    candidates += fingerprints.one_batch_element(
        order, op.batched, {**dict(zip(order, x64)), **op.args, "g": g64},
        lambda v: dict(zip(order, op.backward(*(v[t] for t in order), *(v[a] for a in op.args), v["g"], ()))),
        reference)

    def hints(evidence, checks) -> list[str]:
        out = []
        if any(c.name == FORWARD_CHECK and c.verdict == "fail" for c in checks):
            out += other_conventions(y, reference["o"]) + convention_hints(checks, y, reference["o"], op.alternatives)
            out += forward_named(y, reference["o"], {**{name: (says, lambda f=f: f(*x64, *op.args.values()))
                                                        for name, (says, f) in op.forward_mistakes.items()},
                                                     **square_transposed(op, order, x64), **copied(op, order, x64)})
        failed = {c.tensor for c in checks if c.kind == "gradient" and c.verdict == "fail"}
        none = no_gradient(impl, failed, order)
        named = fingerprints.named(evidence, failed, candidates, reference)  # the correct gradients, float64
        # what the gradients are (a factor, swapped, transposed, 0), where no known mistake or None says more
        return out + none + (named or ([] if none else fingerprints.patterns(evidence, failed, sizes(op))))
    problem.hints = hints
    return problem


def sizes(op: UserOp) -> dict[str, int]:
    """The op's sizes a wrong constant factor may be (``fingerprints.sized``): each named axis of its inputs, and the
    rows of a batched input (every axis but its last)."""
    out: dict[str, int] = {}
    for t, st in (op.structure or {}).items():
        if t not in op.inputs:
            continue
        shape = op.inputs[t].shape
        for axis, n in zip(st.axes, shape):
            out.setdefault("batch elements" if axis == "batch" else f"{axis} axis", int(n))
        if t in op.batched and len(shape) > 2:
            out.setdefault("rows (" + " x ".join(st.axes[:-1]) + ")", int(np.prod(shape[:-1])))
    return out


def no_gradient(impl, failed: set[str], order: tuple[str, ...]) -> list[str]:
    """The failed tensors autograd returned no gradient for (torch: None from autograd.grad), in those words."""
    none = [order[i] for i in getattr(getattr(impl, "backward", None), "no_gradient", ()) if i < len(order)]
    none = [t for t in none if t in failed]
    if not none:
        return []
    which = ", ".join(none)
    return [f"autograd returned no gradient for {which} (None: the output does not depend on {which} through "
            "autograd): it is detached somewhere (.detach(), .data, torch.no_grad(), a NumPy round trip, an "
            "in-place copy into a fresh tensor), or the code computes with another tensor than the one it was given; "
            "its gradient was taken as 0"]


def masked(args: dict, convention, dtype) -> dict:
    """``args`` with the visible set (if any) as the implementation's convention takes it (``convention:``
    mask, mask_heads: ``ops.convention``)."""
    if "visible" not in args or (convention.mask, convention.mask_heads) == ("keep", "per-head"):
        return args
    return {**args, "visible": convention.mask_of(args["visible"], dtype)}


def square_transposed(op: UserOp, order: tuple[str, ...], x64: list) -> dict:
    """Forward mistakes of any op with square weights: one of them used transposed (a weight stored [out, in], as
    nn.Linear keeps it, read as [in, out])."""
    out = {}
    for i, t in enumerate(order):
        if x64[i].ndim == 2 and x64[i].shape[0] == x64[i].shape[1] > 1 and t not in op.batched:
            out[f"{t.replace('_', '-')}-transposed"] = (
                f"{t} is used transposed in the forward (a weight stored [out, in] read as [in, out])",
                lambda i=i: op.forward(*x64[:i], x64[i].T, *x64[i + 1:], *op.args.values()))
    return out


def copied(op: UserOp, order: tuple[str, ...], x64: list) -> dict:
    """Forward mistakes of any op with same-shaped inputs: two of them swapped, or one given another's value (a
    copy-paste of the wrong name)."""
    out = {}
    for i, a in enumerate(order):
        for j, b in enumerate(order):
            if i == j or x64[i].shape != x64[j].shape or a in op.batched or b in op.batched:
                continue
            values = list(x64)
            values[i] = x64[j]
            out[f"{a}-given-{b}".replace("_", "-")] = (
                f"{a} is given {b}'s value in the forward (a copy-paste of the wrong name; {a} unused)",
                lambda values=values: op.forward(*values, *op.args.values()))
            if i < j:
                swapped = list(x64)
                swapped[i], swapped[j] = x64[j], x64[i]
                out[f"{a}-{b}-swapped".replace("_", "-")] = (
                    f"{a} and {b} are swapped in the forward (each used where the other belongs)",
                    lambda swapped=swapped: op.forward(*swapped, *op.args.values()))
    return out


def forward_named(y: np.ndarray, reference: np.ndarray, mistakes: Mapping[str, tuple[str, Callable]]) -> list[str]:
    """The forward's known mistake ``y`` equals (its difference from that output a thousandth of its difference from
    the reference, or less): name -> (what it gets wrong, its float64 output)."""
    y = y.astype(np.float64)
    wrong = float(np.max(np.abs(y - reference), initial=0.0))
    found = []
    for name, (says, output) in mistakes.items():
        try:
            other = np.asarray(output(), dtype=np.float64)
        except (ValueError, ArithmeticError):  # a mistake that does not apply to these shapes or settings
            continue
        if other.shape == y.shape and float(np.max(np.abs(y - other), initial=0.0)) <= 1e-3 * wrong:
            found.append(f"the forward has a known mistake: {says} (`{name}`); its output equals that forward's")
    return found[:1] if len(found) == 1 else ([f"the forward has one of these known mistakes (they give the same "
                                               f"output here): {'; or '.join(found)}"] if found else [])


def convention_hints(checks, y: np.ndarray, reference: np.ndarray, alternatives: Mapping) -> list[str]:
    """When ``forward agrees with the reference`` failed: the alternative convention whose output ``y``
    matches (its error against that output a thousandth of its error against the reference, or less)."""
    if not any(c.name == FORWARD_CHECK and c.verdict == "fail" for c in checks):
        return []
    y = y.astype(np.float64)
    wrong = float(np.max(np.abs(y - reference), initial=0.0))
    for key, output in alternatives.items():
        other = output()
        if other.shape == y.shape and float(np.max(np.abs(y - other), initial=0.0)) <= 1e-3 * wrong:
            return [f"the forward agrees with the reference computed with {key} (not with the scenario's "
                    f"convention): set {key} in the scenario, or change the code"]
    return []
