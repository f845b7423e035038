"""Per-dtype defaults for the finite-difference step and the pass threshold, and the error measures.

Tolerances are data: the table below is the only place a default number lives; a scenario's
``epsilon`` / ``tolerance`` override it.
"""
from __future__ import annotations

import numpy as np

#: Defaults per compute dtype. float64: the issue's figures. float32: measured on the shipped
#: configs (README "float32"): central differences with a 1e-2 step have truncation error ~1e-5 and
#: rounding error ~eps32 * sum|O*G| / h; correct gradients then agree to ~1e-4 relative while every
#: registered fault is off by more than 1e-1, so 2e-3 separates them with margin on both sides.
DEFAULTS: dict[str, dict[str, float]] = {
    "float64": {"epsilon": 1e-6, "tolerance": 1e-6},
    "float32": {"epsilon": 1e-2, "tolerance": 2e-3},
}

#: Invariants that hold exactly in real arithmetic are checked to this many ulps of the values involved.
INVARIANT_ULPS = 64

DTYPES = tuple(DEFAULTS)


def defaults_for(dtype: str) -> dict[str, float]:
    return dict(DEFAULTS[dtype])


def machine_epsilon(dtype: str) -> float:
    return float(np.finfo(np.dtype(dtype)).eps)


def relative_error(analytic: np.ndarray, numeric: np.ndarray) -> tuple[float, float, int]:
    """(max |a - n|, max|a - n| / max(max|a|, max|n|), flat index of the worst element).

    The relative error is 0 when both arrays are identically 0.
    """
    a = np.asarray(analytic, dtype=np.float64).ravel()
    n = np.asarray(numeric, dtype=np.float64).ravel()
    if a.size == 0:
        return 0.0, 0.0, 0
    diff = np.abs(a - n)
    worst = int(np.argmax(diff))
    max_abs = float(diff[worst])
    scale = max(float(np.max(np.abs(a))), float(np.max(np.abs(n))))
    rel = max_abs / scale if scale > 0 else 0.0
    return max_abs, rel, worst


def passes(max_abs: float, analytic: np.ndarray, numeric: np.ndarray, tolerance: float,
           noise_floor: float) -> bool:
    """max|a - n| <= tolerance * max(max|a|, max|n|) + noise_floor."""
    scale = max(float(np.max(np.abs(analytic), initial=0.0)), float(np.max(np.abs(numeric), initial=0.0)))
    return bool(max_abs <= tolerance * scale + noise_floor)
