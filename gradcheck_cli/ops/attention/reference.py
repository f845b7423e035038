"""The float64 reference and what a user's implementation is compared with: seeded inputs, the
interface variants of the faults, the reference and plain computations, and the hints' context."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .formulas import DIFFERENCE_FAULTS, backward, forward
from .hints import Context, diagnosis
from .hints.context import _convention
from .rounding import term_sizes


def diagnosis_fields(sc, context=None) -> dict:
    """The structure and hints of the diagnosis (``hints``); ``context`` for an implementation."""
    structure, hints = diagnosis(sc, context)
    return {"structure": structure, "hints": hints}


def hint_context(inputs: dict, g, visible, scale, kv_map, results: dict, reference_results: dict, impl_forward=None):
    """What the hints may consult about an implementation (``hints.Context``)."""
    x = {t: val.astype(np.float64) for t, val in inputs.items()}

    def reference_output(visible=visible, kv_map=kv_map):
        return forward(x["q"], x["k"], x["v"], visible, scale, np.asarray(kv_map, dtype=np.intp))

    return Context(output=np.asarray(results["o"], dtype=np.float64), reference=reference_output,
                   reference_gradients={t: reference_results[t] for t in "qkv"},
                   gradients={t: np.asarray(results[t], dtype=np.float64) for t in "qkv"}, forward=impl_forward,
                   inputs=inputs, g=np.asarray(g, dtype=np.float64))


def called_as(sc, call, inputs: dict):
    """``call(sc.convention)``: the implementation's first call. When it fails and, called in another
    convention (``convention:`` keys), its forward agrees with the reference, the failure says so
    (``ImplementationFailure.hint``)."""
    from ...implementation import ImplementationFailure
    try:
        return call(sc.convention)
    except ImplementationFailure as exc:
        x = {t: val.astype(np.float64) for t, val in inputs.items()}
        ref = forward(x["q"], x["k"], x["v"], sc.visible, sc.scale, np.asarray(sc.kv_map, dtype=np.intp))
        exc.hint = _convention(sc, call, ref)
        raise


class Interface:
    """The interface-level faults for a user's implementation (``Fault.user``): what it is shown
    (``visible``) and what its gradients become (``gradients``). No fault: both unchanged."""

    def __init__(self, faults: Collection[str], sizes: dict[str, float] | None, visible, scale, kv_map):
        self.faults, self.sizes, self.scale, self.kv_map = tuple(faults), dict(sizes or {}), scale, kv_map
        self.true_visible = visible
        self.visible = visible
        if "mask" in self.faults:
            self.visible = np.ones_like(visible)
        if "leak-hidden-key" in self.faults:
            hidden = np.argwhere(~visible)
            if len(hidden):
                self.visible = visible.copy()
                self.visible[tuple(hidden[0])] = True
        self.added = tuple(f for f in self.faults if f in DIFFERENCE_FAULTS)

    def gradients(self, q, k, v, grad_o, dq, dk, dv):
        out = {"q": dq, "k": dk, "v": dv}
        if self.added:
            args = [x.astype(np.float64) for x in (q, k, v, grad_o)]
            right = backward(*args[:3], self.true_visible, self.scale, self.kv_map, args[3])
            wrong = backward(*args[:3], self.true_visible, self.scale, self.kv_map, args[3], self.added)
            for t in out:
                out[t] = (out[t].astype(np.float64) + getattr(wrong, t) - getattr(right, t)).astype(out[t].dtype)
        for t in out:
            if f"scale-d{t}" in self.faults:
                out[t] = (out[t] * (1.0 + self.sizes.get(f"scale-d{t}", 0.0))).astype(out[t].dtype)
        if "swap-dk-dv" in self.faults and out["k"].shape == out["v"].shape:
            out["k"], out["v"] = out["v"], out["k"]
        return out["q"], out["k"], out["v"]


#: Names of the reference checks of each result.
REFERENCE_CHECKS = {"o": "forward agrees with the reference", "q": "backward agrees with the reference",
                    "k": "backward agrees with the reference", "v": "backward agrees with the reference"}

#: The dtypes without finite differences: an implementation's results are judged against the float64 reference
#: by the factor policy alone (``precision.judge``), with a plain computation in the same precision.
LOW_PRECISION = ("float16", "bfloat16")

#: The checks of an implementation in half precision (torch or JAX; and of the torch closed forms there).
LOW_PRECISION_CHECKS = dict.fromkeys("oqkv", "low-precision error within factor of plain")


def reference(inputs: dict, g: np.ndarray, visible, scale, kv_map) -> tuple[dict, dict, np.ndarray]:
    """The float64 reference on the given inputs: ({o, q, k, v}, term sizes (root sum of squares) of
    each, A)."""
    x = {t: val.astype(np.float64) for t, val in inputs.items()}
    g64 = np.asarray(g, dtype=np.float64)
    o = forward(x["q"], x["k"], x["v"], visible, scale, kv_map)
    grads = backward(x["q"], x["k"], x["v"], visible, scale, kv_map, g64)
    terms = term_sizes(x, g64, lambda span: grads.a[..., span, :], scale, kv_map, rss=True)
    return {"o": o, "q": grads.q, "k": grads.k, "v": grads.v}, terms, grads.a


def plain(inputs: dict, g: np.ndarray, visible, scale, kv_map, dtype: str) -> dict:
    """The built-in engine computed in ``dtype`` (float64 or float32) on the inputs: a plain
    implementation's rounding, for the agreement rule."""
    x = {t: val.astype(dtype) for t, val in inputs.items()}
    o = forward(x["q"], x["k"], x["v"], visible, scale, kv_map)
    grads = backward(x["q"], x["k"], x["v"], visible, scale, kv_map, np.asarray(g).astype(dtype))
    return {"o": o, "q": grads.q, "k": grads.k, "v": grads.v}


def varies(first: np.ndarray, second: np.ndarray, tolerance: float) -> bool:
    """Two calls on the same inputs differ by more than ``tolerance`` x the largest value."""
    gap = float(np.abs(np.asarray(first, dtype=np.float64) - second).max(initial=0.0))
    return gap > tolerance * float(np.abs(first).max(initial=0.0))
