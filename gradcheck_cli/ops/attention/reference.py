"""The float64 reference and what a user's implementation is compared with: seeded inputs, the
interface variants of the faults, the reference and plain computations, and the hints' context."""
from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from ..registry import SecondOrder, Tangents
from . import lse as lse_output
from . import stages as score_stages
from .args import Args
from .directional import hvp, hvp_terms, jvp, jvp_terms
from .formulas import DIFFERENCE_FAULTS, HVP_FAULTS, JVP_FAULTS, backward, forward, log_sum_exp
from .hints import Context, diagnosis
from .hints.context import _convention
from .hints.tangent import jvp_hints
from .rounding import lse_term_sizes, output_term_sizes, term_sizes


def diagnosis_fields(sc, context=None) -> dict:
    """The structure and hints of the diagnosis (``hints``); ``context`` for an implementation."""
    structure, hints = diagnosis(sc, context)
    return {"structure": structure, "hints": hints}


def hint_context(inputs: dict, g, args: Args, results: dict, reference_results: dict, impl_forward=None,
                 grad_lse=None):
    """What the hints may consult about an implementation (``hints.Context``)."""
    x = {t: val.astype(np.float64) for t, val in inputs.items()}

    def reference_output(visible=args.visible, kv_map=args.kv_map, stages=None, scale=args.scale):
        return forward(x["q"], x["k"], x["v"], **args.but(visible=visible, kv_map=np.asarray(kv_map, dtype=np.intp),
                                                          stages=args.stages if stages is None else stages,
                                                          scale=scale).kw)

    return Context(output=np.asarray(results["o"], dtype=np.float64), reference=reference_output,
                   reference_gradients={t: reference_results[t] for t in "qkv"},
                   gradients={t: np.asarray(x, dtype=np.float64) for t, x in results.items() if t != "o"},
                   forward=impl_forward,
                   inputs=inputs, g=np.asarray(g, dtype=np.float64), stages=tuple(args.stages),
                   lse=None if "lse" not in reference_results else (
                       None if "lse" not in results else np.asarray(results["lse"], dtype=np.float64),
                       reference_results["lse"], None if grad_lse is None else np.asarray(grad_lse, np.float64)))


def called_as(sc, call, inputs: dict):
    """``call(sc.convention)``: the implementation's first call. When it fails and, called in another
    convention (``convention:`` keys), its forward agrees with the reference, the failure says so
    (``ImplementationFailure.hint``); when it refuses a variant's keyword argument (``softcap=``), the hint
    says which scenario key passes it."""
    from ...implementation import ImplementationFailure
    stages = score_stages.from_scenario(sc)
    try:
        return call(sc.convention)
    except ImplementationFailure as exc:
        if "unexpected keyword argument 'return_lse'" in str(exc):
            exc.hint = ("the scenario sets outputs: [o, lse]: your code is called with return_lse=True and returns "
                        "(o, lse), lse [B, Hq, n_q] in natural log (docs/variants.md); or set outputs: [o]")
            raise
        refused = [st for st in stages for kw in st.kwargs if f"unexpected keyword argument '{kw}'" in str(exc)]
        if refused:
            st = refused[0]
            exc.hint = (f"the scenario sets {st.name}: your code is passed {', '.join(f'{kw}=' for kw in st.kwargs)} "
                        "(keyword arguments): accept them (docs/variants.md), or remove the key to check it as plain "
                        "attention")
            raise
        if any(getattr(st, "drawn", None) is not None for st in stages):
            raise  # a keep mask the code draws: no reference without the code's mask
        x = {t: val.astype(np.float64) for t, val in inputs.items()}
        ref = forward(x["q"], x["k"], x["v"], **Args.of(sc, stages).kw)
        exc.hint = _convention(sc, call, ref)
        raise


class Interface:
    """The interface-level faults for a user's implementation (``Fault.user``): what it is shown
    (``visible``) and what its gradients become (``gradients``). No fault: both unchanged. ``args.stages``: the
    scenario's score stages (a stage fault's change to the reference's gradients is added like the others')."""

    def __init__(self, faults: Collection[str], sizes: dict[str, float] | None, args: Args, fault_visible=None):
        """``fault_visible``: the visible set a forward fault of a packed batch makes (``varlen.shown``), whose
        change to the float64 reference's output and gradients is added to the implementation's (the
        implementation may read the documents from cu_seqlens or from visible: either way it is the same bug)."""
        self.faults, self.sizes, self.args = tuple(faults), dict(sizes or {}), args
        self.stages = args.stages
        visible = args.visible
        # a stage fault of the backward adds its change to the gradients; one of the forward changes the arguments
        # the implementation is passed instead (``stages.shown``)
        stage_faults = [f for f in self.faults if f in score_stages.FAULTS and not score_stages.FAULTS[f].forward]
        self.wrong_stages = score_stages.inject(self.stages, visible, stage_faults)[1]  # the backward's
        self.true_visible = visible
        self.visible = visible
        if "mask" in self.faults:
            self.visible = np.ones_like(visible)
        if "leak-hidden-key" in self.faults:
            hidden = np.argwhere(~visible)
            if len(hidden):
                self.visible = visible.copy()
                self.visible[tuple(hidden[0])] = True
        self.fault_visible = None if fault_visible is None or fault_visible is visible else fault_visible
        self.added = tuple(f for f in self.faults if f in DIFFERENCE_FAULTS or f in stage_faults
                           or f == "lse-grad-ignored")

    def output(self, q, k, v, o):
        """The implementation's O as the active faults make it: a packed batch's forward fault adds its change to
        the float64 reference's O (at these inputs: stacked copies too)."""
        if self.fault_visible is None:
            return o
        x = [np.asarray(a, dtype=np.float64) for a in (q, k, v)]
        right = forward(*x, **self.args.kw)
        wrong = forward(*x, **self.args.but(visible=self.fault_visible).kw)
        return (np.asarray(o, dtype=np.float64) + wrong - right).astype(o.dtype)

    def lse(self, values):
        """The implementation's LSE as the active faults make it (``lse-log2``: in log2 units)."""
        return lse_output.returned(values, self.faults).astype(values.dtype)

    def gradients(self, q, k, v, grad_o, dq, dk, dv, *params, grad_lse=None):
        """The implementation's gradients as the active faults make them: (dq, dk, dv, then ``params``, the gradients
        of the stages' checked parameters, a bias's); ``grad_lse``: the LSE's upstream gradient they were taken at."""
        out = {"q": dq, "k": dk, "v": dv}
        extra = dict(zip(score_stages.params(self.stages), params))
        if self.added or self.fault_visible is not None:
            args = [x.astype(np.float64) for x in (q, k, v, grad_o)]
            g_l = None if grad_lse is None else np.asarray(grad_lse, dtype=np.float64)
            right = backward(*args[:3], grad_o=args[3], grad_lse=g_l, **self.args.kw)
            wrong = backward(*args[:3], grad_o=args[3], faults=self.added, grad_lse=g_l,
                             **self.args.but(stages=self.wrong_stages, visible=self.fault_visible
                                             if self.fault_visible is not None else self.args.visible).kw)
            for t in out:
                out[t] = (out[t].astype(np.float64) + getattr(wrong, t) - getattr(right, t)).astype(out[t].dtype)
            for t in extra:
                extra[t] = (np.asarray(extra[t], np.float64) + wrong.params[t] - right.params[t]).astype(
                    extra[t].dtype)
        for t in out:
            if f"scale-d{t}" in self.faults:
                out[t] = (out[t] * (1.0 + self.sizes.get(f"scale-d{t}", 0.0))).astype(out[t].dtype)
        if "swap-dk-dv" in self.faults and out["k"].shape == out["v"].shape:
            out["k"], out["v"] = out["v"], out["k"]
        return (out["q"], out["k"], out["v"], *extra.values())

    def _added(self, closed_form, kinds, arrays: tuple, values: tuple) -> tuple:
        """``values`` with the change the active faults of ``kinds`` make to ``closed_form(*arrays, faults)`` (a
        tuple of arrays, computed in float64 at the true visible set) added; unchanged without such faults."""
        faults = tuple(f for f in self.faults if f in kinds)
        if not faults:
            return tuple(values)
        x = [np.asarray(a, dtype=np.float64) for a in arrays]
        a = self.args
        args = (*x[:3], a.visible, a.scale, a.kv_map, *x[3:])
        right, wrong = closed_form(*args, stages=a.stages), closed_form(*args, faults=faults, stages=a.stages)
        return tuple((val.astype(np.float64) + b - a).astype(val.dtype) for val, a, b in zip(values, right, wrong))

    def hvp(self, q, k, v, grad_o, dq, dk, dv, h):
        """The implementation's Hessian-vector product ``h`` (hq, hk, hv) along (dq, dk, dv) with the HVP faults'
        change to the closed form's added."""
        return self._added(hvp, HVP_FAULTS, (q, k, v, grad_o, dq, dk, dv), h)

    def jvp(self, q, k, v, dq, dk, dv, o_dot):
        """The implementation's output tangent ``o_dot`` along (dq, dk, dv) with the JVP faults' change to the
        closed form's added (as the VJP faults' are to the gradients)."""
        return self._added(lambda *a, faults=(), stages=(): (jvp(*a, faults=faults, stages=stages),), JVP_FAULTS,
                           (q, k, v, dq, dk, dv),
                           (o_dot,))[0]


def every_tangent(inputs: dict, t: dict) -> list:
    """The tangents (or directions) of q, k, v, a missing one zero: what an implementation's jvp/hvp is given."""
    return [t[n] if t.get(n) is not None else np.zeros_like(inputs[n]) for n in "qkv"]


#: Names of the reference checks of each result (a score stage's parameter's gradient takes q's).
REFERENCE_CHECKS = {"o": "forward agrees with the reference", "q": "backward agrees with the reference",
                    "k": "backward agrees with the reference", "v": "backward agrees with the reference"}

#: The dtypes without finite differences: an implementation's results are judged against the float64 reference
#: by the factor policy alone (``precision.judge``), with a plain computation in the same precision.
LOW_PRECISION = ("float16", "bfloat16")

#: The checks of an implementation in half precision (torch or JAX; and of the torch closed forms there).
LOW_PRECISION_CHECKS = dict.fromkeys("oqkv", "low-precision error within factor of plain")


def reference(inputs: dict, g: np.ndarray, args: Args, grad_lse=None) -> tuple[dict, dict, np.ndarray]:
    """The float64 reference on the given inputs: ({o, q, k, v}, term sizes (root sum of squares) of
    each, A); with ``grad_lse`` (the LSE an output) the gradients take it and the LSE is a result too."""
    x = {t: val.astype(np.float64) for t, val in inputs.items()}
    g64 = np.asarray(g, dtype=np.float64)
    g_l = None if grad_lse is None else np.asarray(grad_lse, dtype=np.float64)
    o = forward(x["q"], x["k"], x["v"], **args.kw)
    grads = backward(x["q"], x["k"], x["v"], grad_o=g64, grad_lse=g_l, **args.kw)
    a_rows = lambda span: grads.a[..., span, :]  # noqa: E731
    terms = term_sizes(x, g64, a_rows, args.scale, args.kv_map, rss=True, stages=args.stages, params=True,
                       grad_lse=g_l)
    out = {"o": o, "q": grads.q, "k": grads.k, "v": grads.v, **grads.params}
    if g_l is not None:
        out["lse"] = log_sum_exp(x["q"], x["k"], **args.kw)
        terms["lse"] = lse_term_sizes(x, a_rows, args.scale, args.kv_map, out["lse"], stages=args.stages)
    return out, terms, grads.a


def results64(inputs: dict, g, args: Args, grad_lse=None) -> dict:
    """The float64 reference's O, G_Q, G_K and G_V (and LSE with ``grad_lse``) on the given inputs (q, k, v) and
    upstream gradient."""
    x = [np.asarray(inputs[t], dtype=np.float64) for t in "qkv"]
    g_l = None if grad_lse is None else np.asarray(grad_lse, dtype=np.float64)
    grads = backward(*x, grad_o=np.asarray(g, dtype=np.float64), grad_lse=g_l, **args.kw)
    out = {"o": forward(*x, **args.kw), "q": grads.q, "k": grads.k, "v": grads.v, **grads.params}
    return out if g_l is None else {**out, "lse": log_sum_exp(*x[:2], **args.kw)}


def plain(inputs: dict, g: np.ndarray, args: Args, dtype: str, grad_lse=None) -> dict:
    """The built-in engine computed in ``dtype`` (float64 or float32) on the inputs: a plain
    implementation's rounding, for the agreement rule (the LSE too with ``grad_lse``)."""
    x = {t: val.astype(dtype) for t, val in inputs.items()}
    g_l = None if grad_lse is None else np.asarray(grad_lse).astype(dtype)
    o = forward(x["q"], x["k"], x["v"], **args.kw)
    grads = backward(x["q"], x["k"], x["v"], grad_o=np.asarray(g).astype(dtype), grad_lse=g_l, **args.kw)
    out = {"o": o, "q": grads.q, "k": grads.k, "v": grads.v, **grads.params}
    return out if g_l is None else {**out, "lse": log_sum_exp(x["q"], x["k"], **args.kw)}


def varies(first: np.ndarray, second: np.ndarray, tolerance: float) -> bool:
    """Two calls on the same inputs differ by more than ``tolerance`` x the largest value."""
    gap = float(np.abs(np.asarray(first, dtype=np.float64) - second).max(initial=0.0))
    return gap > tolerance * float(np.abs(first).max(initial=0.0))


#: The name of the reference check of an implementation's JVP.
JVP_REFERENCE = "JVP agrees with the reference"


def implementation_tangents(inputs: dict, g, a64, moved_forward, user_jvp, interface: Interface, seed,
                            policy) -> Tangents:
    """What the JVP checks need of an implementation (``registry.Tangents``): ``moved_forward(**moved)`` its
    forward with inputs replaced by stacked copies [C, ...], ``user_jvp(dq, dk, dv)`` its output tangent (every
    tangent given: a missing one is zero), the faults' change added (``Interface.jvp``); the rounding of both
    sides from the float64 reference's terms; and the JVP against the float64 closed form under ``policy``
    (``precision.Policy``: the precision the implementation computes in), the plain error that of the closed
    form in that precision (``JVP_REFERENCE``)."""
    from ... import precision
    x64 = {t: val.astype(np.float64) for t, val in inputs.items()}
    args = interface.args

    def agreement(tangent: dict, o_dot: np.ndarray):
        t64 = dict(zip(("dq", "dk", "dv"), (np.asarray(tangent[n], dtype=np.float64) for n in "qkv")))
        ref = jvp(x64["q"], x64["k"], x64["v"], **t64, **args.kw)
        terms = jvp_terms(x64["q"], x64["k"], x64["v"], **t64, **args.kw)
        def plain_error(dtype: str) -> float | None:  # of the closed form computed in dtype (none in float64)
            if dtype == "float64":
                return None
            low = [x.astype(dtype) for x in (x64["q"], x64["k"], x64["v"])]
            dlow = {n: t.astype(dtype) for n, t in t64.items()}
            return float(np.abs(jvp(*low, **dlow, **args.kw) - ref).max(initial=0.0))

        check = precision.agreement(JVP_REFERENCE, "o_dot", o_dot, ref, terms, policy, plain_error(policy.dtype))
        lower = None if check.passed or policy.dtype != "float64" else precision.lower_precision(
            policy.dtype, np.abs(np.asarray(o_dot, dtype=np.float64) - ref), terms, plain_error("float32"))
        if lower:  # e.g. a tangent computed in float32 inside a float64 scenario, whose forward is float64
            check = dataclasses.replace(check, detail=f"{check.detail}; within {lower}'s rule: the JVP computes in "
                                                      f"about {lower}, the forward and gradients in {policy.dtype}")
        return check

    def o_dot(t: dict) -> np.ndarray:
        full = every_tangent(inputs, t)
        return interface.jvp(inputs["q"], inputs["k"], inputs["v"], *full, user_jvp(*full))

    return Tangents(
        forward=moved_forward, jvp=o_dot,
        jvp_terms=lambda t: jvp_terms(x64["q"], x64["k"], x64["v"], dq=t.get("q"), dk=t.get("k"), dv=t.get("v"),
                                      **args.kw),
        output_terms=output_term_sizes(x64, lambda span: a64[..., span, :], args.scale, args.kv_map,
                                       stages=args.stages), upstream=g,
        explain=jvp_hints(o_dot, inputs, args, seed), agreement=agreement)


#: The name of the reference checks of an implementation's double backward.
HVP_REFERENCE = "double backward agrees with the reference"

#: Why a double backward fails while the gradients it differentiates are right (torch and JAX alike).
CONSTANTS_HINT = (
    "the gradients are right but their derivative is not: the double backward differentiates your backward as it "
    "is written. Most often it reads tensors computed outside autograd's view (attention weights or statistics "
    "saved from an autograd.Function's forward or setup_context, anything under no_grad, detach() or "
    "jax.lax.stop_gradient), which count as constants there: recompute them in backward from the saved inputs, or "
    "return them as outputs. Otherwise a hand-written second-order rule (a backward of your backward, a custom "
    "rule JAX differentiates) is wrong. A backward that cannot be differentiated correctly can be marked "
    "once_differentiable, so that double backward refuses instead of answering wrong")


def implementation_second(inputs: dict, g, gradients, user_hvp, interface: Interface, policy) -> SecondOrder:
    """What the double-backward checks need of an implementation (``registry.SecondOrder``): ``gradients(**moved)``
    its gradients with inputs replaced, ``user_hvp(dq, dk, dv)`` its Hessian-vector product (hq, hk, hv), the
    HVP faults' change added (``Interface.hvp``); the rounding of both sides from the float64 closed form's
    terms; H u against the float64 closed form under ``policy`` (``HVP_REFERENCE``, the plain error that of the
    closed form in the precision the implementation computes in); the hint ``CONSTANTS_HINT``."""
    from ... import precision
    x64 = {t: val.astype(np.float64) for t, val in inputs.items()}
    g64 = np.asarray(g, dtype=np.float64)
    args = interface.args
    grads = backward(x64["q"], x64["k"], x64["v"], grad_o=g64, **args.kw)

    def agreement(u: dict, hu: dict) -> list:
        u64 = dict(zip(("dq", "dk", "dv"), (np.asarray(u[n], dtype=np.float64) for n in "qkv")))
        ref = hvp(x64["q"], x64["k"], x64["v"], grad_o=g64, **u64, **args.kw)
        terms = hvp_terms(x64["q"], x64["k"], x64["v"], grad_o=g64, **u64, **args.kw)
        plain = [np.zeros_like(r) for r in ref]
        if policy.dtype != "float64":
            low = [x.astype(policy.dtype) for x in (x64["q"], x64["k"], x64["v"], g64)]
            plain = hvp(*low[:3], grad_o=low[3], **{n: t.astype(policy.dtype) for n, t in u64.items()}, **args.kw)
        return [precision.agreement(HVP_REFERENCE, f"h{n}", hu[n], r, t, policy,
                                    float(np.abs(np.asarray(p, dtype=np.float64) - r).max(initial=0.0))
                                    if policy.dtype != "float64" else 0.0)
                for n, r, t, p in zip("qkv", ref, terms, plain)]

    def explain(checks: list) -> list[str]:
        gradients_right = all(c.passed for c in checks if c.name == "backward agrees with the reference")
        return [CONSTANTS_HINT] if gradients_right else []

    def h(u: dict) -> dict:
        full = every_tangent(inputs, u)
        return dict(zip("qkv", interface.hvp(inputs["q"], inputs["k"], inputs["v"], g, *full, user_hvp(*full))))

    return SecondOrder(
        gradients=gradients, hvp=h,
        hvp_terms=lambda u: dict(zip("qkv", hvp_terms(x64["q"], x64["k"], x64["v"], grad_o=g64, dq=u.get("q"),
                                                       dk=u.get("k"), dv=u.get("v"), **args.kw))),
        gradient_terms=term_sizes(x64, g64, lambda span: grads.a[..., span, :], args.scale, args.kv_map,
                                  stages=args.stages),
        agreement=agreement, explain=explain)
