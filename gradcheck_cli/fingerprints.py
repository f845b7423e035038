"""Fingerprints of known mistakes: a failed gradient check named by its cause.

An op lists the mistakes its authors make (its registered faults that change gradients, and known mistakes without
a CLI switch: ``MISTAKES`` in the op's module), each a wrong backward its built-in ``backward(..., faults)`` computes
on request. When the user's analytic gradients equal one such wrong backward, evaluated in float64 on the very same
inputs, to within each check's own tolerance on every element of every checked tensor (the ones that passed too),
while the finite differences put them out of tolerance, the hint names that mistake and the tensors it explains. A
mistake that explains the failed tensors while the others are right is named as made on their path alone (softcap's
tanh' dropped in dK only).

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
    """The hint naming the candidate(s) that explain every checked tensor's analytic gradient, failed ones included
    (or, where none does, the failed ones while the others are right); [] when none does, or when nothing failed.
    ``reference``: the correct gradients (float64): a candidate that equals them on a failed tensor explains nothing
    there (the forward under test may be what is wrong)."""
    failed = {t for t in failed if t in evidence}
    if not failed:
        return []
    matches, alone = [], []
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
        if same or not all(fits[t][0] for t in failed):
            continue
        worst = max(fits[t][1] for t in failed)
        if all(ok for ok, _ in fits.values()):
            matches.append((cand, max(w for _, w in fits.values())))
        else:  # the mistake made on the failed tensors' path alone: the others are right
            alone.append((cand, worst))
    tensors = ", ".join(_label(t) for t in sorted(failed))
    verb = "is" if len(failed) == 1 else "are"
    where = ""
    if not matches and alone:
        matches = alone
        where = f" in the computation of {tensors} alone (the other gradients are right)"
    if not matches:
        return []
    worst = max(w for _, w in matches)
    if len(matches) == 1:
        cand = matches[0][0]
        return [f"{tensors} {verb} the backward with a known mistake{where}: {cand.says} (`{cand.name}`): no element "
                f"differs from it by more than {worst:.1g} of the check's tolerance"]
    said = "; or ".join(f"{c.says} (`{c.name}`)" for c, _ in matches)
    return [f"{tensors} {verb} the backward with one of these known mistakes{where} (they give the same gradients "
            f"here; no element differs by more than {worst:.1g} of the check's tolerance): {said}"]


def from_backward(names: Mapping[str, str], backward: Callable[[tuple], Mapping[str, np.ndarray]]) -> list[Candidate]:
    """Candidates from an op's ``backward`` run with one fault or mistake name at a time (name -> what it says)."""
    return [Candidate(name, says, lambda name=name: backward((name,))) for name, says in names.items()]


def one_batch_element(order: tuple[str, ...], batched: tuple[str, ...], values: Mapping[str, np.ndarray],
                      backward: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
                      reference: Mapping[str, np.ndarray]) -> list[Candidate]:
    """Candidates for a parameter's gradient (an input without a batch axis: a weight, gamma) taken from the first or
    the last batch element alone: an accumulator overwritten instead of added to in a loop over the batch, or a loop
    that stops after one. ``values``: the inputs and arguments by name (``batched``: those whose axis 0 is the batch,
    and ``g``, the upstream gradient); ``backward(values)`` the correct gradients on them; the batched inputs keep
    their ``reference`` gradients."""
    shared = [t for t in order if t not in batched]
    size = next((values[t].shape[0] for t in batched if t in values), 0)
    if not shared or size < 2:
        return []

    def sliced(b):
        grads = backward({k: v[b:b + 1] if k in batched or k == "g" else v for k, v in values.items()})
        return {**reference, **{t: grads[t] for t in shared}}

    which = ", ".join(_label(t) for t in shared)
    return [Candidate("one-batch-first", f"{which} from batch element 0 alone (a loop over the batch that stops after "
                                         "one element)", lambda: sliced(0)),
            Candidate("one-batch-last", f"{which} from the last batch element alone (an accumulator overwritten, "
                                        "= where += belongs, in a loop over the batch)", lambda: sliced(size - 1))]


#: A fitted factor c this close to 1 is no factor (the finite differences' noise).
NOT_A_FACTOR = 1e-9
#: Two factors are one within this relative difference.
SAME_FACTOR = 1e-2
#: A factor is a size (or 1 over it, or its square root) within this relative difference.
SIZE_FACTOR = 1e-3


#: Elements of a gradient that must stand clear of their tolerance before a constant factor is claimed: with fewer,
#: any wrong gradient is "a factor" (two keys' dK, one the other's negative, fit every c).
MIN_FACTOR_ELEMENTS = 4


def factor(ev) -> float | None:
    """c when the analytic gradient is c x the finite differences on every checked element (within the check's
    tolerance), c not 1, over at least MIN_FACTOR_ELEMENTS elements clear of their tolerance; else None. ``ev``: a
    ``diagnose.Evidence`` (None: no evidence)."""
    if ev is None:
        return None
    a, n, allowed = ev.analytic[ev.checked], ev.numeric[ev.checked], ev.allowed[ev.checked]
    if int(np.sum(np.abs(n) > allowed)) < MIN_FACTOR_ELEMENTS:
        return None
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


def sized(c: float, sizes: Mapping[str, int] | None) -> str:
    """What a factor c is, among the scenario's sizes (name -> size, e.g. "rows (batch x row)" -> 8): " (1 over 8, the
    rows (batch x row): a mean over them where a sum belongs, or a division by their count too many)" for c = 1/8;
    '' when it is none of them, 1 over one, or a square root of either."""
    kinds = ((lambda k: 1 / k, "1 over {k}", "a mean over them where a sum belongs, or a division by their count "
                                              "too many"),
             (lambda k: float(k), "{k}", "a sum over them where a mean belongs, or a division by their count missing"),
             (lambda k: k ** -0.5, "1 / sqrt({k})", "a 1/sqrt(size) scale applied once too often"),
             (lambda k: k ** 0.5, "sqrt({k})", "a 1/sqrt(size) scale missing"))
    for value, what, means in kinds:
        for k in sorted({k for k in (sizes or {}).values() if k > 1}):
            if abs(c - value(k)) <= SIZE_FACTOR * value(k):
                names = ", ".join(f"the {name}" for name, n in sizes.items() if n == k)
                return f" (it is {what.format(k=k)}, {names}: {means})"
    return ""


def patterns(evidence: Mapping, failed: set[str], sizes: Mapping[str, int] | None = None) -> list[str]:
    """What the failed gradients are, where no known mistake explains them, for any op: exactly 0 (no gradient), a
    constant factor times the finite differences (tensors sharing one factor said together, and what the factor is
    among the scenario's ``sizes``), two same-shaped gradients in each other's place, or a square matrix's gradient
    transposed."""
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
                       "swapped (a product's operands in the wrong order, G^T x for x^T G or the reverse, or a weight "
                       "stored [out, in] read as [in, out])")
            continue
        if ev.analytic.ndim == 2 and _within(ev, ev.analytic, ev.numeric.T.reshape(ev.analytic.shape)):
            out.append(f"{_label(t)} is its gradient transposed and then reshaped to {t}'s shape: a reshape (or .view) "
                       "where a transpose belongs, somewhere on its path")
            continue
        if ev.analytic.ndim == 2 and ev.analytic.shape[0] != ev.analytic.shape[1] and _within(
                ev, ev.analytic.reshape(ev.analytic.shape[::-1]).T, ev.numeric):
            out.append(f"{_label(t)} is its gradient laid out the other way: a reshape (or .view) where a transpose "
                       "belongs, somewhere on its path")
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
            out.append(f"{names} {each} {c:.6g} x the finite differences everywhere{sized(c, sizes)}: a constant "
                       "factor (a scale, temperature or normaliser applied once too often or too rarely, a wrong "
                       "divisor, or a mean where a sum belongs)")
    return out
