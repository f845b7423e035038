"""How far an implementation may differ from the float64 reference, and what precision it really
computes in.

One rule for every dtype (docs/verdicts.md "How verdicts, power and precision work"): element i of a result may
differ from the reference by

    factor x E_plain + slack + ulps x eps x T_i     (in half precision the last at most PLAIN_SHARE x E_plain)

where E_plain is the largest error of the plain computations in the same precision on the same inputs
(FlashAttention's test policy, over a few plain ways of computing attention so that no one of them is
lucky; at least half an ulp of the tensor's largest element), T_i the size of the terms element i is made
of (so that rounding is judged against what it comes from, never against a result that cancels to nearly
nothing), and eps the dtype's machine epsilon. The terms' share keeps small tensors, whose plain error is
the maximum of a handful of elements, from false alarms; in half precision, where nothing else checks the
gradients, it is capped so that the whole allowance stays within (factor + PLAIN_SHARE) x E_plain + slack;
the first term keeps the rule honest on large tensors. In float64 the plain computation is the reference
itself: no E_plain (ulps x eps x T_i alone).

An implementation that computes internally in a lower precision than its dtype (float32 inside a
float64 scenario) is recognised by its forward: its error fits the float32 rule but not the float64
one, is the size of float32 rounding (LOWER_MIN_ULPS or more), not far below it, and is irregular, as
rounding is: moved a little along a random direction, the inputs give a fresh draw of it (``nearby``).
It gets a verdict of its own, inconclusive, instead of failing on rounding. A difference as small but
smooth in the inputs (a changed formula such as x / (rms + eps), or constants made in float32) is no
precision: it is judged by the rule of the dtype, and fails.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import verdict
from .tolerance import (
    AGREEMENT_ULPS,
    DEFAULT_FACTOR,
    DEFAULT_SLACK,
    LOWER_MIN_PLAIN,
    LOWER_MIN_ULPS,
    LOWER_PRECISION,
    NEARBY_STEP,
    PLAIN_FLOOR_ULPS,
    PLAIN_SHARE,
    SMOOTH_LIMIT,
    machine_epsilon,
)


@dataclass(frozen=True)
class Policy:
    """The allowed difference from the float64 reference of a computation in ``dtype``."""
    dtype: str
    factor: float
    slack: float
    ulps: float
    share: float | None = None  # the terms' share at most this x E_plain (None: not capped)

    @classmethod
    def for_dtype(cls, dtype: str, factor: float = DEFAULT_FACTOR, slack: float | None = None) -> Policy:
        return cls(dtype, factor, DEFAULT_SLACK[dtype] if slack is None else slack, AGREEMENT_ULPS[dtype],
                   PLAIN_SHARE.get(dtype))

    @property
    def eps(self) -> float:
        return machine_epsilon(self.dtype)

    def allowed(self, plain_error: float | None, terms: np.ndarray) -> np.ndarray:
        """Per element: factor x E_plain + slack + ulps x eps x T_i, the last at most ``share`` x E_plain where
        the policy caps it (half precision); ``plain_error`` None: no plain computation sets the rule."""
        terms_share = self.ulps * self.eps * np.asarray(terms, dtype=np.float64)
        if plain_error is None:
            return self.slack + terms_share
        if self.share is not None:
            terms_share = np.minimum(terms_share, self.share * plain_error)
        return self.factor * plain_error + self.slack + terms_share

    def plain_floor(self, reference: np.ndarray) -> float:
        """The least E_plain counts as: PLAIN_FLOOR_ULPS ulps of the dtype of the largest reference element."""
        return PLAIN_FLOOR_ULPS * self.eps * float(np.abs(reference).max(initial=0.0))

    def describe(self, plain_error: float | None) -> str:
        slack = f"{self.slack:g} + " if self.slack else ""
        if not plain_error:
            return f"allowed {slack}{self.ulps:g} ulps of {self.dtype} of each element's terms"
        if self.share is None:
            return (f"allowed {self.factor:g} x plain {self.dtype} error ({plain_error:.2g}) + {slack}{self.ulps:g} "
                    f"ulps of {self.dtype} of each element's terms")
        return (f"allowed {self.factor:g} x plain {self.dtype} error ({plain_error:.2g}) + {slack}{self.ulps:g} ulps "
                f"of {self.dtype} of each element's terms, those at most {self.share:g} x the plain error (in all at "
                f"most {self.factor + self.share:g} x plain + {self.slack:g})")


def detectable(got: np.ndarray, reference: np.ndarray, allowed: np.ndarray) -> float:
    """The smallest uniform relative error r such that ``got * (1 + r)`` or ``got * (1 - r)`` puts some
    element out of ``allowed`` (whichever sign is harder to see): errors of that size are caught,
    smaller ones may not be. 0 when an element is out already; inf when ``got`` is all zero."""
    a = np.asarray(got, dtype=np.float64)
    lim = np.broadcast_to(np.asarray(allowed, dtype=np.float64), a.shape).ravel()
    e = (a - np.asarray(reference, dtype=np.float64)).ravel()
    a = a.ravel()
    if not (np.isfinite(a).all() and np.isfinite(e).all()) or (np.abs(e) > lim).any():
        return 0.0
    return verdict.detectable(a, a - e, lim, np.zeros_like(lim))


def effective_ulps(diff: np.ndarray, terms: np.ndarray, dtype: str) -> float:
    """max_i |diff_i| / (eps x T_i): the error in units of the dtype's rounding of each element's terms
    (inf where an element with no terms at all, exactly 0 in the reference, is not 0)."""
    scale = np.broadcast_to(machine_epsilon(dtype) * np.asarray(terms, dtype=np.float64), np.shape(diff))
    d = np.abs(np.asarray(diff, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(d > 0, np.where(scale > 0, d / np.where(scale > 0, scale, 1.0), np.inf), 0.0)
    return float(ratio.max(initial=0.0))


def lower_precision(dtype: str, diff: np.ndarray, terms: np.ndarray, plain_error: float | None = None) -> str | None:
    """The lower precision an implementation's result looks computed in, when its difference from the
    reference (``diff``) is too large for ``dtype`` but fits that precision's rule; else None."""
    for lower in LOWER_PRECISION.get(dtype, ()):
        policy = Policy.for_dtype(lower)
        if (np.abs(diff) <= policy.allowed(plain_error, terms)).all():
            return lower
    return None


def agreement(name: str, tensor: str, mine: np.ndarray, reference: np.ndarray, terms: np.ndarray, policy: Policy,
              plain_error: float | None = None, what: str = "implementation"):
    """A ``reference`` check: ``mine`` against the float64 ``reference`` under ``policy`` (per element
    ``policy.allowed(plain_error, terms)``; ``plain_error`` None: no plain computation sets the rule, as in
    float64). ``tolerance`` holds the allowed difference at the element closest to failing; ``detectable``
    the smallest uniform relative error the check would catch."""
    from .result import Check, Kind
    mine64 = np.asarray(mine, dtype=np.float64)
    if plain_error is not None and policy.dtype != "float64":
        plain_error = max(plain_error, policy.plain_floor(reference))
    diff = np.abs(mine64 - reference)
    allowed = np.broadcast_to(policy.allowed(plain_error, terms), diff.shape)
    # values among the dtype's subnormals round absolutely, to a multiple of its smallest one: never allow less
    allowed = np.maximum(allowed, policy.ulps * _smallest_subnormal(policy.dtype))
    scale = max(float(np.abs(reference).max(initial=0.0)), float(np.abs(mine64).max(initial=0.0)))
    if diff.size == 0:
        return Check(kind=Kind.REFERENCE, name=name, tensor=tensor, shape=tuple(mine64.shape), max_abs_error=0.0,
                     relative_error=0.0, tolerance=0.0, noise_floor=0.0, worst_index=None, passed=True,
                     detail="empty")
    bad = ~np.isfinite(diff)
    with np.errstate(invalid="ignore"):
        margin = np.where(bad, -np.inf, allowed - diff)
    tight = int(np.argmin(margin))
    worst = int(np.argmax(np.where(bad, np.inf, diff)))
    # the table's tolerance: what the largest difference was allowed when everything passes (so the
    # two columns compare), what the most violating element was allowed when something fails
    shown = worst if margin.ravel()[tight] >= 0 else tight
    index = tuple(int(i) for i in np.unravel_index(tight, diff.shape))
    where = f"{tensor}[{', '.join(map(str, index))}]" if index else tensor
    max_abs = float(diff.ravel()[worst])
    ulps = effective_ulps(np.where(bad, 0.0, diff), terms, policy.dtype)
    passed = bool(margin.ravel()[tight] >= 0)
    detect = detectable(mine64, reference, allowed) if passed else None
    worst_ulps = (f"worst {ulps:.3g} ulps of {policy.dtype} of its terms" if np.isfinite(ulps) else
                  _termless(tensor, what, np.where(bad, 0.0, diff), terms, mine64, reference, index))
    detail = (f"closest to failing at {where}: {what} {mine64.ravel()[tight]:.9g}, reference "
              f"{reference.ravel()[tight]:.9g} (allowed {allowed.ravel()[tight]:.3g}); {worst_ulps}; "
              f"{policy.describe(plain_error)}")
    return Check(kind=Kind.REFERENCE, name=name, tensor=tensor, shape=tuple(mine64.shape), max_abs_error=max_abs,
                 relative_error=max_abs / scale if scale > 0 else 0.0, tolerance=float(allowed.ravel()[shown]),
                 noise_floor=0.0, worst_index=index, passed=passed, detail=detail, detectable=detect)


def _termless(tensor: str, what: str, diff, terms, mine, reference, shown: tuple) -> str:
    """Where an element with no terms at all (its exact value 0: no product reaches it) came out nonzero: the
    first such element, named when it is not the one shown as closest to failing."""
    none = np.broadcast_to(np.asarray(terms, dtype=np.float64), np.shape(diff)) <= 0
    at = np.unravel_index(int(np.argmax(none & (diff > 0))), np.shape(diff))
    if tuple(int(i) for i in at) == tuple(shown):
        return "an element with no terms at all: its exact value is 0"
    where = f"{tensor}[{', '.join(str(int(i)) for i in at)}]" if at else tensor
    return (f"{where} has no terms at all (its exact value is 0) but the {what} gives {mine[at]:.3g} "
            f"(reference {reference[at]:.3g})")


Differences = Callable[[float], "dict[str, np.ndarray] | None"]


def nearby(inputs: dict[str, np.ndarray], results_at: Callable[[dict], dict | None],
           reference_at: Callable[[dict], dict], seed) -> Differences:
    """``difference(t)``: the implementation's results (``results_at``: the output ``o`` and the gradients, by
    name) minus the float64 reference's (``reference_at``) with every floating input moved by t x NEARBY_STEP
    of its root mean square along one random direction (drawn once, from ``seed``); both take the moved inputs
    (a dict). ``results_at`` returns None where the code fails; so does ``difference``. Each t is evaluated
    once."""
    rng = np.random.default_rng(seed)
    floating = {t: x for t, x in inputs.items() if np.asarray(x).dtype.kind == "f"}
    step = {t: NEARBY_STEP * float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) * rng.standard_normal(x.shape)
            for t, x in floating.items()}
    done: dict[float, dict | None] = {}

    def difference(t: float) -> dict | None:
        if t not in done:
            moved = {**inputs, **{n: (x + t * step[n]).astype(x.dtype) for n, x in floating.items()}}
            out = results_at(moved)
            ref = None if out is None else reference_at(moved)
            done[t] = None if out is None else {
                k: np.asarray(v, dtype=np.float64) - np.asarray(ref[k], dtype=np.float64) for k, v in out.items()
                if k in ref}
        return done[t]
    return difference


def irregularity(difference: np.ndarray, nearby_difference: Differences, key: str = "o") -> float | None:
    """How irregular an implementation's ``difference`` from the reference in result ``key`` is along a random
    direction: the root mean square of how far it moves when the inputs move by -1 and +1 steps
    (``nearby``), over sqrt(2) times that of the difference. About 1 for rounding (independent draws), near 0
    for a smooth, systematic difference. (First differences: the rounding of the inputs alone is a sawtooth
    of them, whose second difference over two equal steps is exactly 0.) None where the moved inputs could
    not be evaluated."""
    d0 = np.asarray(difference, dtype=np.float64)
    size = float(np.sqrt(np.mean(d0 * d0))) if d0.size else 0.0
    if size == 0.0 or not np.isfinite(size):
        return None
    plus, minus = nearby_difference(1.0), nearby_difference(-1.0)
    if plus is None or minus is None or key not in plus or key not in minus:
        return None
    plus, minus = plus[key], minus[key]
    if plus.shape != d0.shape or minus.shape != d0.shape:
        return None
    moves = np.concatenate([(plus - d0).ravel(), (minus - d0).ravel()])
    return float(np.sqrt(np.mean(moves * moves)) / (np.sqrt(2.0) * size))


def judge(results: dict[str, np.ndarray], reference: dict[str, np.ndarray], terms: dict[str, np.ndarray],
          dtype: str, plain, names: dict[str, str], factor: float = DEFAULT_FACTOR, slack: float | None = None,
          what: str = "implementation", nearby_difference: Differences | None = None) -> tuple[list, str]:
    """``reference`` checks of each result (``o`` first, then ``q``, ...) under the rule of ``dtype``;
    ``plain(dtype)`` gives a plain computation's results in that precision, or a list of several plain
    computations' (E_plain is the largest error of any; called only for dtypes other than float64). The
    forward decides the precision the implementation computes in, or where it agrees with the reference to
    ``dtype``'s rule, the first gradient that does not: when that result is out of the rule of ``dtype``
    but fits that of a lower precision (LOWER_PRECISION) by an error the size of its rounding, it "computes
    in about float32", and every result is judged by that rule: within it is inconclusive (run it with that
    dtype), beyond it a FAIL. Unless that difference is smooth in the inputs (``nearby_difference``: the
    results' differences from the reference at nearby inputs, ``nearby``; ``irregularity`` below
    SMOOTH_LIMIT): then it is no rounding but another function, judged by the rule of ``dtype``. Returns
    (checks, the precision it computes in)."""
    plains: dict[str, list[dict]] = {}

    def plain_error(precision: str, t: str) -> float | None:
        if precision == "float64":
            return None
        if precision not in plains:
            computed = plain(precision)
            plains[precision] = [computed] if isinstance(computed, dict) else list(computed)
        return max(float(np.abs(np.asarray(p[t], dtype=np.float64) - reference[t]).max(initial=0.0))
                   for p in plains[precision])

    def check(t: str, precision: str):
        policy = Policy.for_dtype(precision, factor, slack if precision == dtype else None)
        return agreement(names[t], t, results[t], reference[t], terms[t], policy, plain_error(precision, t), what)

    computes_in, own, systematic = dtype, {t: check(t, dtype) for t in results}, False
    for t in results:  # "o" first: the forward decides; else the first gradient that can (a float32 backward)
        c = own[t]
        if c.passed or not np.isfinite(c.max_abs_error):
            continue
        signed = np.asarray(results[t], dtype=np.float64) - reference[t]
        diff = np.abs(signed)
        for lower in LOWER_PRECISION.get(dtype, ()):
            rounding_sized = (effective_ulps(diff, terms[t], lower) >= LOWER_MIN_ULPS
                              or float(diff.max()) >= LOWER_MIN_PLAIN * plain_error(lower, t))
            if check(t, lower).passed and rounding_sized:
                smooth = None if nearby_difference is None else irregularity(signed, nearby_difference, t)
                if smooth is not None and smooth < SMOOTH_LIMIT:  # another function: no precision of any kind
                    own[t] = dataclasses.replace(c, detail=_systematic(c, reference[t], smooth, lower))
                    systematic = True
                else:
                    computes_in = lower
                break
        if computes_in != dtype or systematic:
            break
    checks = []
    for t in results:
        c = own[t]
        if computes_in != dtype and not c.passed:
            lower = check(t, computes_in)
            if lower.passed:
                diff = np.abs(np.asarray(results[t], dtype=np.float64) - reference[t])
                c = dataclasses.replace(
                    c, verdict="inconclusive",
                    detail=(f"computes in about {computes_in}, not {dtype}: its difference from the float64 "
                            f"reference ({c.max_abs_error:.3g}, {effective_ulps(diff, terms[t], computes_in):.3g} "
                            f"ulps of {computes_in} of its terms) is {computes_in} rounding, far above {dtype}'s; "
                            f"run the scenario with dtype: {computes_in} to check it at that precision; " + c.detail),
                    facts={"computes_in": computes_in})
            else:
                c = dataclasses.replace(lower, detail=f"beyond {computes_in} rounding, the precision its forward "
                                                      f"computes in: " + lower.detail)
        checks.append(c)
    return checks, computes_in


def _systematic(check, reference: np.ndarray, smooth: float, lower: str) -> str:
    """The detail of a forward whose difference from the reference is small enough for ``lower``'s rounding
    but smooth in the inputs (``irregularity`` ``smooth``)."""
    size = float(np.abs(reference).max(initial=0.0))
    relative = f" ({check.max_abs_error / size:.2g} of the reference's largest element)" if size > 0 else ""
    return (f"a systematic difference of up to {check.max_abs_error:.3g}{relative}, not {lower} rounding: it is "
            f"smooth in the inputs (moved a little along a random direction, it moves by {smooth:.2g} of itself; "
            f"rounding's is about 1), so the code computes another function: a changed formula, or "
            f"constants (an eps, a scale, frequencies) made in {lower}; " + check.detail)


def _smallest_subnormal(dtype: str) -> float:
    """The dtype's smallest positive subnormal (bfloat16's 2^-133 where NumPy does not know it)."""
    try:
        return float(np.finfo(dtype).smallest_subnormal)
    except (TypeError, ValueError):
        return 2.0 ** -133
