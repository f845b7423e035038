"""Fingerprints of known mistakes: a failed gradient check named by its cause.

An op lists the mistakes its authors make (its registered faults that change gradients, and known mistakes without
a CLI switch: ``MISTAKES`` in the op's module), each a wrong backward its built-in ``backward(..., faults)`` computes
on request. When the user's analytic gradients equal one such wrong backward, evaluated in float64 on the very same
inputs, to within each check's own tolerance on every element of every checked tensor (the ones that passed too),
while the finite differences put them out of tolerance, the hint names that mistake and the tensors it explains.

A candidate is never named when another explains the gradients as well (two mistakes that coincide on this
scenario are named together), when it changes no failed tensor, or when the correct backward explains them too.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Candidate:
    """A known wrong backward: ``says`` what it gets wrong (one line); ``gradients()`` its gradients by tensor
    (float64), on the scenario's inputs and upstream gradient."""
    name: str
    says: str
    gradients: Callable[[], Mapping[str, np.ndarray]]


def _fits(ev, wrong: np.ndarray, analytic: np.ndarray | None = None) -> tuple[bool, float]:
    """(``analytic`` (default: the check's, ``ev.analytic``; ``ev`` a ``diagnose.Evidence``) equals ``wrong`` within
    the check's tolerance on every checked element, the largest |analytic - wrong| / allowed)."""
    checked = ev.checked
    analytic = ev.analytic if analytic is None else analytic
    if wrong.shape != analytic.shape or not checked.any():
        return False, np.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.abs(analytic - wrong)[checked] / np.maximum(ev.allowed[checked], np.finfo(np.float64).tiny)
    worst = float(np.max(ratio, initial=0.0))
    return bool(np.isfinite(worst) and worst <= 1.0), worst


def _label(t: str) -> str:
    return f"d{t}"


def named(evidence: Mapping, failed: set[str], candidates: list[Candidate],
          reference: Mapping[str, np.ndarray]) -> list[str]:
    """The hint naming the candidate(s) that explain every checked tensor's analytic gradient, failed ones included;
    [] when none does, or when nothing failed. ``reference``: the correct gradients (float64): a candidate that
    equals them on a failed tensor explains nothing there (the forward under test may be what is wrong)."""
    failed = {t for t in failed if t in evidence}
    if not failed:
        return []
    matches = []
    for cand in candidates:
        try:
            wrong = cand.gradients()
        except (ValueError, FloatingPointError, ArithmeticError):  # a mistake that does not apply to these shapes
            continue
        if not failed <= set(wrong):
            continue
        fits = {t: _fits(ev, np.asarray(wrong[t], dtype=np.float64)) for t, ev in evidence.items() if t in wrong}
        same = any(_fits(evidence[t], np.asarray(reference[t], dtype=np.float64),
                         np.asarray(wrong[t], dtype=np.float64))[0] for t in failed if t in reference)
        if not same and all(ok for ok, _ in fits.values()):
            matches.append((cand, max(worst for _, worst in fits.values())))
    if not matches:
        return []
    tensors = ", ".join(_label(t) for t in sorted(failed))
    worst = max(w for _, w in matches)
    if len(matches) == 1:
        cand = matches[0][0]
        return [f"{tensors} {'is' if len(failed) == 1 else 'are'} the backward with a known mistake: {cand.says} "
                f"(`{cand.name}`): no element differs from it by more than {worst:.1g} of the check's tolerance"]
    said = "; or ".join(f"{c.says} (`{c.name}`)" for c, _ in matches)
    return [f"{tensors} {'is' if len(failed) == 1 else 'are'} the backward with one of these known mistakes (they "
            f"give the same gradients here; no element differs by more than {worst:.1g} of the check's tolerance): "
            f"{said}"]


def from_backward(names: Mapping[str, str], backward: Callable[[tuple], Mapping[str, np.ndarray]]) -> list[Candidate]:
    """Candidates from an op's ``backward`` run with one fault or mistake name at a time (name -> what it says)."""
    return [Candidate(name, says, lambda name=name: backward((name,))) for name, says in names.items()]
