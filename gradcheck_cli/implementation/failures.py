"""An implementation's misbehaviour (``ImplementationFailure``) and the checks it becomes: a failed
check, the determinism check, a failure on perturbed copies in the user's own indices."""
from __future__ import annotations

import numpy as np


class ImplementationFailure(Exception):
    """The implementation under test misbehaved; ``tensor`` names what it returned (or None)."""

    def __init__(self, message: str, tensor: str | None = None, index: tuple[int, ...] | None = None,
                 non_finite: bool = False, on_copies: bool = False):
        super().__init__(message)
        self.message, self.tensor, self.index = message, tensor, index
        self.non_finite, self.on_copies = non_finite, on_copies  # what happened, for the hints
        self.hint: str | None = None  # a likely cause the report names as a hint, when the engine knows one


def determinism(name: str, first: dict[str, np.ndarray], second: dict[str, np.ndarray], tolerance: float):
    """The check that two calls on the same inputs gave the same results: every element of the second
    within ``tolerance`` x the tensor's largest value of the first (0: bit for bit, as
    ``torch.autograd.gradcheck``'s ``nondet_tol``, there absolute)."""
    from ..result import Check, Kind
    worst, worst_t, worst_i, allowed_w = 0.0, None, None, 0.0
    for t, a in first.items():
        b = second[t]
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        allowed = tolerance * float(np.abs(a).max(initial=0.0))
        if diff.size and (worst_t is None or float(diff.max()) - allowed > worst - allowed_w):
            flat = int(np.argmax(diff))
            worst, worst_t, allowed_w = float(diff.ravel()[flat]), t, allowed
            worst_i = tuple(int(i) for i in np.unravel_index(flat, diff.shape))
    passed = worst <= allowed_w
    differing = [t for t, a in first.items()
                 if float(np.abs(a.astype(np.float64) - second[t].astype(np.float64)).max(initial=0.0))
                 > tolerance * float(np.abs(a).max(initial=0.0))]
    where = f"{worst_t}[{', '.join(map(str, worst_i))}]" if worst_i else (worst_t or "-")
    detail = (f"{name} run twice on the same inputs: " + ("identical results" if worst == 0 else
              f"largest difference {worst:.3g} at {where}") + (f" (nondet_tol {tolerance:g} of the largest value)"
                                                              if tolerance else " (nondet_tol 0: must be identical)"))
    if not passed:
        part = "forward" if "o" in differing else "backward"
        detail += (f"; {', '.join('O' if t == 'o' else 'd' + t.upper() for t in differing)} differ; a {part} whose "
                   "result changes from call to call cannot be checked (finite differences, the "
                   "reference and the invariants compare separate calls); set check: {nondet_tol: ...} if that is "
                   "intended")
    return Check(kind=Kind.IMPLEMENTATION, name="deterministic", tensor=worst_t or "-",
                 shape=tuple(first[worst_t].shape) if worst_t else None, max_abs_error=worst, relative_error=worst,
                 tolerance=tolerance, noise_floor=0.0, worst_index=worst_i, passed=bool(passed), detail=detail,
                 facts={"differing": tuple(differing)} if not passed else {})


def failure_check(name: str, exc: ImplementationFailure, tensor: str | None = None, prefix: str = ""):
    """A check that failed because the implementation under test misbehaved."""
    from ..result import Check, Kind
    return Check(kind=Kind.IMPLEMENTATION, name=name, tensor=exc.tensor or tensor or "-", shape=None,
                 max_abs_error=float("inf"), relative_error=float("inf"), tolerance=0.0, noise_floor=0.0,
                 worst_index=exc.index, passed=False, detail=prefix + exc.message,
                 facts={"non_finite": exc.non_finite, "on_copies": exc.on_copies})


def in_copies(exc: ImplementationFailure, batch: int, name: str) -> ImplementationFailure:
    """Re-express a failure on copies stacked along the batch axis in the user's own indices."""
    if exc.index is None:
        return ImplementationFailure(f"{exc.message} (on perturbed copies of {name})", exc.tensor,
                                     non_finite=exc.non_finite, on_copies=True)
    copy, b = divmod(exc.index[0], batch)
    index = (b,) + tuple(exc.index[1:])
    where = f"{exc.tensor}[{', '.join(map(str, index))}]"
    message = exc.message.split(" at ")[0] + f" at {where} of perturbed copy {copy} of {name}"
    return ImplementationFailure(message, exc.tensor, index, non_finite=exc.non_finite, on_copies=True)
