"""The A.10.4 argument for the 1/sqrt(d_head) scale, as an experiment (no gradients).

With q, k of d zero-mean coordinates, independent, of variances sigma_q^2 and sigma_k^2:
Var(q . k) = d sigma_q^2 sigma_k^2, so Var(q . k / sqrt(d)) = sigma_q^2 sigma_k^2 whatever d is. The
experiment draws ``draws`` pairs per d, estimates both variances with a confidence interval from the
sample's fourth moment (Var(s^2) ~ (m4 - s^4) / N), and passes when the prediction lies inside.

With ``correlation`` rho > 0 the coordinates of each vector are equicorrelated (q_i = sigma
(sqrt(1 - rho) a_i + sqrt(rho) c)): the independence assumption fails and so does the prediction,
as the seed warns; then Var(q . k) = d sigma_q^2 sigma_k^2 (1 + (d - 1) rho^2), and the experiment
shows the naive prediction outside the interval and this exact one inside.
"""
from __future__ import annotations

from collections.abc import Collection
from statistics import NormalDist

import numpy as np

from ..numeric import SeedStream
from ..result import Check, Kind
from .registry import Fault, Op, Param, Problem

FAULTS = {f.name: f for f in (
    Fault("logit-scale-divisor", "scales the logits by 1/d instead of 1/sqrt(d)",
          ("Var(q.k / sqrt(d)) = sq^2 sk^2", "Var(q.k / sqrt(d)) = sq^2 sk^2 (1 + (d-1) rho^2)"), forward=True),
)}


def sample(rng, d: int, draws: int, sigma: float, rho: float) -> np.ndarray:
    """[draws, d] vectors of zero-mean coordinates with variance sigma^2, pairwise correlation rho."""
    shared = rng.standard_normal((draws, 1))
    own = rng.standard_normal((draws, d))
    return sigma * (np.sqrt(1.0 - rho) * own + np.sqrt(rho) * shared)


def variance_interval(x: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """(sample variance, lower, upper): normal approximation with Var(s^2) = (m4 - s^4) / N."""
    centred = x - x.mean()
    s2 = float(np.mean(centred**2))
    m4 = float(np.mean(centred**4))
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * np.sqrt(max(m4 - s2 * s2, 0.0) / len(x))
    return s2, s2 - half, s2 + half


def build(sc, faults: Collection[str] = ()) -> Problem:
    rho, sq, sk = sc.p("correlation"), sc.p("sigma_q"), sc.p("sigma_k")
    draws, confidence = sc.p("draws"), sc.p("confidence")
    rng = np.random.default_rng([sc.seed, SeedStream.LOGIT_SCALE])
    rows, scaled = [], []
    for d in sc.p("d_heads"):
        q, k = sample(rng, d, draws, sq, rho), sample(rng, d, draws, sk, rho)
        logits = np.einsum("nd,nd->n", q, k)
        divisor = d if "logit-scale-divisor" in faults else np.sqrt(d)
        rows.append((d, variance_interval(logits, confidence), variance_interval(logits / divisor, confidence)))
        scaled.append(rows[-1][2][0])

    def checks() -> list:
        out = []
        for d, raw, after in rows:
            naive = d * sq**2 * sk**2
            exact = naive * (1.0 + (d - 1) * rho**2)
            for lhs, rhs, (value, lo, hi), factor in (("Var(q.k)", "d sq^2 sk^2", raw, 1.0),
                                                      ("Var(q.k / sqrt(d))", "sq^2 sk^2", after, 1.0 / d)):
                predicted, truth = naive * factor, exact * factor
                inside = lo <= predicted <= hi
                seen = f"d={d}: {lhs} = {value:.5g}, {confidence:.1%} interval [{lo:.5g}, {hi:.5g}] ({draws} draws)"
                if rho == 0:
                    out.append(_check(f"{lhs} = {rhs}", d, value, predicted, lo, hi, inside,
                                      f"{seen}; predicted {predicted:.5g}"))
                    continue
                out.append(_check(f"{lhs} != {rhs} (correlated)", d, value, predicted, lo, hi, not inside,
                                  f"{seen}; the independent-coordinates prediction {predicted:.5g} is "
                                  + ("outside, as the seed warns" if not inside else
                                     "inside: too few draws to show the violation; raise draws, d or rho")))
                out.append(_check(f"{lhs} = {rhs} (1 + (d-1) rho^2)", d, value, truth, lo, hi, lo <= truth <= hi,
                                  f"{seen}; exact for equicorrelated coordinates (rho={rho:g}): {truth:.5g}"))
        return out

    return Problem(inputs={}, loss=None, gradients={}, rounding={}, rounding_total=0.0, copy_bytes=0,
                   invariants=checks, output=np.asarray(scaled),
                   arrays={"d_heads": np.asarray(sc.p("d_heads")), "scaled_variance": np.asarray(scaled)})


def _check(name: str, d: int, value: float, predicted: float, lo: float, hi: float, ok: bool, detail: str) -> Check:
    miss = 0.0 if lo <= predicted <= hi else min(abs(predicted - lo), abs(predicted - hi))
    return Check(kind=Kind.EXPERIMENT, name=name, tensor=f"d={d}", shape=None, max_abs_error=float(miss),
                 relative_error=float(miss / max(abs(value), 1e-300)), tolerance=float((hi - lo) / 2),
                 noise_floor=0.0, worst_index=None, passed=bool(ok), detail=detail)


def _validate(params: dict, _base: dict) -> list:
    if not 0.0 <= params["correlation"] < 1.0:
        return [("correlation", f"must be in [0, 1), got {params['correlation']:g}", None)]
    if not 0.5 <= params["confidence"] < 1.0:
        return [("confidence", f"must be in [0.5, 1), got {params['confidence']:g}", "e.g. 0.99")]
    if params["draws"] < 100:
        return [("draws", f"at least 100 draws are needed for an interval, got {params['draws']}", None)]
    return []


#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"d_heads": [16, 64, 256], "sigma_q": 1.0, "sigma_k": 0.5}

OP = Op(name="logit-scale", summary="A.10.4 as an experiment: Var(q.k) = d sigma_q^2 sigma_k^2 and the 1/sqrt(d) scale",
        tensors=(), faults=FAULTS, build=build,
        keys={"d_heads": Param("ints", (16, 64, 256), "head widths to try"),
              "sigma_q": Param("float", 1.0, "standard deviation of q's coordinates"),
              "sigma_k": Param("float", 1.0, "standard deviation of k's coordinates"),
              "draws": Param("int", 20000, "pairs (q, k) drawn per d"),
              "correlation": Param("float", 0.0, "rho in [0, 1): correlation between a vector's coordinates",
                                   minimum=0.0),
              "confidence": Param("float", 0.999, "of the intervals")},
        validate=_validate, shapes=lambda sc: {}, common_keys=("name", "op", "seed"),
        memory=lambda sc: 4 * 8 * sc.p("draws") * max(sc.p("d_heads")),  # it has no tensors of its own
        describe=lambda sc: f"d in {list(sc.p('d_heads'))} sigma_q={sc.p('sigma_q'):g} sigma_k={sc.p('sigma_k'):g} "
                            f"rho={sc.p('correlation'):g} {sc.p('draws')} draws",
        example=EXAMPLE)
