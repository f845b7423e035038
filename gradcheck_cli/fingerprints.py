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


#: A fitted factor c this close to 1 is no factor (the finite differences' noise).
NOT_A_FACTOR = 1e-9
#: Two factors are one within this relative difference.
SAME_FACTOR = 1e-2


def factor(ev) -> float | None:
    """c when the analytic gradient is c x the finite differences on every checked element (within the check's
    tolerance), c not 1; else None. ``ev``: a ``diagnose.Evidence`` (None: no evidence)."""
    if ev is None:
        return None
    a, n, allowed = ev.analytic[ev.checked], ev.numeric[ev.checked], ev.allowed[ev.checked]
    nn = float(n @ n)
    if not np.isfinite(nn) or nn == 0 or not np.isfinite(a).all():
        return None
    c = float(a @ n) / nn
    if not (np.abs(a - c * n) <= allowed).all() or abs(c - 1) <= NOT_A_FACTOR:
        return None
    return c


def grouped(factors: Mapping[str, float]) -> list[tuple[float, list[str]]]:
    """The tensors by shared factor (within SAME_FACTOR), in name order: [(c, tensors), ...]."""
    groups: list[tuple[float, list[str]]] = []
    for t in sorted(factors):
        c = factors[t]
        same = next((g for g in groups if abs(g[0] - c) <= SAME_FACTOR * abs(c)), None)
        if same is None:
            groups.append((c, [t]))
        else:
            same[1].append(t)
    return groups


def _within(ev, analytic: np.ndarray, numeric: np.ndarray) -> bool:
    checked = ev.checked
    return bool(checked.any() and (np.abs(analytic - numeric)[checked] <= ev.allowed[checked]).all())


def patterns(evidence: Mapping, failed: set[str]) -> list[str]:
    """What the failed gradients are, where no known mistake explains them, for any op: exactly 0 (no gradient), a
    constant factor times the finite differences (tensors sharing one factor said together), two same-shaped
    gradients in each other's place, or a square matrix's gradient transposed."""
    failed = sorted(t for t in failed if t in evidence and evidence[t].checked.all())
    out, factors, placed = [], {}, set()
    for a in failed:  # swapped: each one's analytic is the other's finite differences
        for b in failed:
            ea, eb = evidence[a], evidence[b]
            if a < b and ea.analytic.shape == eb.analytic.shape and {a, b}.isdisjoint(placed) and _within(
                    ea, ea.analytic, eb.numeric) and _within(eb, eb.analytic, ea.numeric):
                out.append(f"{_label(a)} and {_label(b)} are in each other's place: the analytic {_label(a)} is "
                           f"the finite differences of {b}, and {_label(b)} those of {a} (the order the backward "
                           "returns them in, or a mix-up of the two)")
                placed |= {a, b}
    for t in failed:
        ev = evidence[t]
        if t in placed:
            continue
        if ev.analytic.ndim == 2 and ev.analytic.shape[0] == ev.analytic.shape[1] and _within(
                ev, ev.analytic.T, ev.numeric):
            out.append(f"{_label(t)} is transposed: it is the finite differences of {t} with rows and columns "
                       "swapped (x^T G where G^T x belongs, or a weight stored [out, in] read as [in, out])")
            continue
        if not np.abs(ev.analytic[ev.checked]).any():
            out.append(f"{_label(t)} is 0 everywhere while its finite differences are not: {t} gets no gradient at "
                       "all (detached, stop_gradient, a buffer never written, or not the array the code was given)")
            continue
        c = factor(ev) if ev.checked.sum() > 1 else None  # one element is always some factor of another
        if c is not None:
            factors[t] = c
    for c, ts in grouped(factors):
        names = ", ".join(_label(t) for t in ts)
        each = "are each" if len(ts) > 1 else "is"
        if abs(c + 1) <= SAME_FACTOR:
            out.append(f"{names} {each} -1 x the finite differences everywhere: a sign flipped")
        else:
            out.append(f"{names} {each} {c:.6g} x the finite differences everywhere: a constant factor (a scale, "
                       "temperature or normaliser applied once too often or too rarely, a wrong divisor, or a mean "
                       "where a sum belongs)")
    return out
