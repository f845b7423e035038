"""Per-dtype defaults for the finite-difference step and the pass threshold, and the error measures.

Tolerances are data: the table below is the only place a default number lives; a scenario's
``epsilon`` / ``tolerance`` override it.
"""
from __future__ import annotations

import numpy as np

#: Defaults per compute dtype. float64: the issue's figures. float32: measured (docs/verdicts.md
#: "Tolerances, float32 and the noise floor"): with a 3e-3 step correct gradients agree to <= 4e-4 relative on
#: the shipped shapes and on peaked rows (scale 5), while every registered fault is off by >= 0.58;
#: a 1e-2 step is 10x worse on peaked rows (truncation), a 1e-3 step 3x worse on the others (rounding).
DEFAULTS: dict[str, dict[str, float]] = {
    "float64": {"epsilon": 1e-6, "tolerance": 1e-6},
    "float32": {"epsilon": 3e-3, "tolerance": 2e-3},
    # No finite differences in half precision: the FlashAttention policy (factor x the error of a plain
    # implementation in the same precision) decides; these only bound the agreement checks.
    "float16": {"epsilon": 1e-2, "tolerance": 1e-2},
    "bfloat16": {"epsilon": 1e-2, "tolerance": 1e-2},
}

#: Invariants that hold exactly in real arithmetic are checked to this many ulps of the values involved.
INVARIANT_ULPS = 64

#: An implementation's result may differ from the float64 reference by factor x (the error of a plain
#: computation in the same precision) + slack + AGREEMENT_ULPS x eps x (the root sum of squares of each
#: element's terms) (gradcheck_cli/precision.py). Measured (benchmarks/agreement_calibration.py, correct
#: NumPy, torch, SDPA and float64-accumulating implementations, n = 1..128): at most 8.2 such ulps in
#: float64 (where the reference is the plain computation, E_plain = 0), 1.6 in float32, 0.09 in float16
#: and bfloat16 beyond 2 x E_plain. The half-precision figure is small because E_plain already carries
#: most of the rounding; larger values would hide 1% (float16) and 5% (bfloat16) errors.
AGREEMENT_ULPS: dict[str, float] = {"float64": 64.0, "float32": 8.0, "float16": 0.25, "bfloat16": 0.25}
#: Two engines computing the same attention in the same precision (the fast forward and the reference,
#: the tiled and the naive engine) agree to this many units of rounding of the terms each element is
#: made of: they differ only in the order of sums and in whether and where the softmax's maximum is
#: subtracted, so a score's rounding (eps * |scale| * sum_c |q_ic k_jc|) reaches O through A_ij.
ENGINE_AGREEMENT_ULPS = 256
#: The factor of that rule, FlashAttention's: its tests allow a kernel twice the error of a plain
#: computation in the same precision.
DEFAULT_FACTOR = 2.0
#: The absolute slack of that rule (FlashAttention's test-suite figure in half precision).
DEFAULT_SLACK: dict[str, float] = {"float64": 0.0, "float32": 0.0, "float16": 1e-5, "bfloat16": 1e-5}
#: In half precision, where the agreement with the reference is the only check of the gradients, the terms'
#: share of an element's allowance (ulps x eps x T_i) is at most this multiple of the plain computations'
#: error, so that the whole allowance stays within (factor + PLAIN_SHARE) x E_plain + slack: the terms keep a
#: small tensor, whose E_plain is the largest of a handful of errors, from being judged by luck, but never
#: outweigh the factor where they are large (bfloat16 at larger logits, where 0.25 ulps of them were 14 x
#: E_plain and a kernel at 4 x plain passed). Measured (benchmarks/agreement_calibration.py, 150 random
#: cases): correct torch, SDPA and float32-softmax implementations reach 2.5 x E_plain at most. float32 keeps
#: the terms uncapped: its finite differences check the gradients, and correct float32 code on small or
#: cancelling tensors needs them (up to 25 x a plain computation's error).
PLAIN_SHARE: dict[str, float] = {"float16": 1.0, "bfloat16": 1.0}
#: ... and E_plain is taken as at least this many ulps of the dtype of the tensor's largest reference element
#: (half an ulp: a plain computation that happens to be exact, such as O = V on rows that see one key,
#: cannot make the rule stricter than the dtype's own resolution).
PLAIN_FLOOR_ULPS = 0.5
#: The lower precisions an implementation of each dtype is recognised as computing in internally.
LOWER_PRECISION: dict[str, tuple[str, ...]] = {"float64": ("float32",)}
#: ... when its forward's error is at least this many ulps of that precision of its terms: code that
#: computes in float32 rounds its inputs to float32 and so errs by 0.12 to 3 such ulps (measured on the
#: float32-internal implementations of benchmarks/correct_grid.py); an error far smaller than float32's
#: rounding yet above float64's is no precision of any kind, but a FAIL.
LOWER_MIN_ULPS = 1.0 / 64
#: ... or at least this fraction of a plain computation's error in that precision on the same inputs: at large
#: logits the terms (with each logit's rounding) are so large that real float32 rounding is 0.009 of their
#: ulps, while it stays the size of a plain float32 computation's (measured: 0.5 to 2 times it).
LOWER_MIN_PLAIN = 1.0 / 8

#: Rounding or a changed function? A result whose difference from the reference fits a lower precision's
#: rule is evaluated with the inputs moved along a random direction by +-NEARBY_STEP of each input's size
#: (about 1,700 float32 ulps, so float32 rounding is drawn afresh, while a smooth difference barely moves),
#: and how far the difference moves is compared with the difference itself: rounding gives about 1
#: (independent errors), a changed function h times its relative slope (~1e-4, ~1e-2 at logits of 100).
#: First differences, not the second difference: rounding of the inputs alone is a sawtooth of them, whose
#: second difference over two equal steps is zero. Below SMOOTH_LIMIT the difference is systematic, a FAIL of
#: its own size, not the lower precision's rounding.
NEARBY_STEP = 1e-4
SMOOTH_LIMIT = 0.1

DTYPES = ("float64", "float32")  # what the NumPy engine computes in; the others need backend: torch


def defaults_for(dtype: str) -> dict[str, float]:
    return dict(DEFAULTS[dtype])


#: Unit roundoff of the float64 accumulation of L.
EPS64 = float(np.finfo(np.float64).eps)


def machine_epsilon(dtype: str) -> float:
    return {"bfloat16": 2.0**-7}.get(dtype) or float(np.finfo(np.dtype(dtype)).eps)


def relative_error(analytic: np.ndarray, numeric: np.ndarray) -> tuple[float, float, int]:
    """(max |a - n|, max|a - n| / max(max|a|, max|n|), flat index of the worst element).

    The relative error is 0 when both arrays are identically 0; both errors are inf, at the first
    such element, when either array holds a NaN or an infinity.
    """
    a = np.asarray(analytic, dtype=np.float64).ravel()
    n = np.asarray(numeric, dtype=np.float64).ravel()
    if a.size == 0:
        return 0.0, 0.0, 0
    bad = ~(np.isfinite(a) & np.isfinite(n))
    if bad.any():
        return float("inf"), float("inf"), int(np.argmax(bad))
    diff = np.abs(a - n)
    worst = int(np.argmax(diff))
    max_abs = float(diff[worst])
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(n))))
    rel = max_abs / scale if scale > 0 else 0.0
    return max_abs, rel, worst


def passes(analytic: np.ndarray, numeric: np.ndarray, tolerance: float,
           noise_floor: np.ndarray | float) -> tuple[bool, float]:
    """Every element: |a - n| <= tolerance * max(max|a|, max|n|) + its noise floor. Non-finite values
    never pass. Returns (passed, the noise floor at the element that is closest to failing)."""
    a = np.asarray(analytic, dtype=np.float64).ravel()
    n = np.asarray(numeric, dtype=np.float64).ravel()
    floor = np.broadcast_to(np.asarray(noise_floor, dtype=np.float64), a.shape)
    if a.size == 0:
        return True, 0.0
    if not (np.isfinite(a).all() and np.isfinite(n).all()):
        return False, float(floor.max())
    allowed = tolerance * max(float(np.abs(a).max()), float(np.abs(n).max())) + floor
    margin = allowed - np.abs(a - n)
    tightest = int(np.argmin(margin))
    return bool(margin[tightest] >= 0), float(floor[tightest])
