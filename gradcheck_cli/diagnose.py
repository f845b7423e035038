"""Where a failed gradient check is wrong: its discrepancy broken down by the op's named axes and
classes of rows, a heat map over two axes, and the worst elements with both values. The op names
the likely cause from the pattern (its ``hints``). Returns plain data; never prints."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .ops.registry import Structure

#: Worst elements listed per failed check.
WORST = 5
#: Most rows / columns of a heat map; longer axes are binned (each cell the worst of its bin).
HEAT_MAX = 64


@dataclass(frozen=True)
class Evidence:
    """One gradient check, element by element, in the input's shape (float64). Elements the check
    did not evaluate (sample mode) hold NaN in ``numeric`` and ``allowed``."""
    analytic: np.ndarray
    numeric: np.ndarray
    allowed: np.ndarray

    @classmethod
    def from_sites(cls, analytic: np.ndarray, sites: np.ndarray, numeric: np.ndarray, allowed: np.ndarray) -> Evidence:
        num = np.full(analytic.size, np.nan)
        lim = np.full(analytic.size, np.nan)
        num[sites], lim[sites] = numeric, allowed
        return cls(np.asarray(analytic, dtype=np.float64), num.reshape(analytic.shape), lim.reshape(analytic.shape))

    @property
    def checked(self) -> np.ndarray:
        return ~np.isnan(self.allowed)

    @property
    def error(self) -> np.ndarray:
        """|analytic - numeric| where checked, 0 elsewhere (inf where either is not finite)."""
        with np.errstate(invalid="ignore"):
            err = np.abs(self.analytic - self.numeric)
        err = np.where(~np.isfinite(err) & self.checked, np.inf, err)
        return np.where(self.checked, err, 0.0)

    @property
    def bad(self) -> np.ndarray:
        """Checked elements out of tolerance."""
        return self.checked & (self.error > np.nan_to_num(self.allowed, nan=np.inf))


def _level(ratio: float) -> int:
    """Heat-map digit: 0 within tolerance, d when the error is 10^(d-1) to 10^d times what is allowed."""
    if not ratio > 1.0:
        return 0
    return 9 if not math.isfinite(ratio) else min(9, 1 + int(math.floor(math.log10(ratio))))


def breakdown(tensor: str, ev: Evidence, structure: Structure | None) -> dict:
    """The JSON-ready diagnosis of one failed gradient check (docs/verdicts.md "Diagnosing a failure")."""
    shape = ev.analytic.shape
    axes = structure.axes if structure else tuple(f"axis {i}" for i in range(len(shape)))
    err, bad, checked = ev.error, ev.bad, ev.checked
    lim = np.where(checked, ev.allowed, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err > 0, err / lim, 0.0)  # error over allowed; inf where nothing is allowed
    ratio = np.where(checked, ratio, np.nan)
    out: dict = {"checked": int(checked.sum()), "out_of_tolerance": int(bad.sum()), "axes": {}, "classes": [],
                 "heat": None, "worst": []}
    for i, axis in enumerate(axes):  # the report says the last axis (features) only where part of it is wrong
        other = tuple(j for j in range(len(shape)) if j != i)
        out["axes"][axis] = {"max_abs_error": [float(x) for x in err.max(axis=other)],
                             "out_of_tolerance": [int(x) for x in bad.sum(axis=other)]}
    if structure:
        for label, mask in structure.classes.items():
            m = np.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim)), shape) & checked
            out["classes"].append({"label": label, "checked": int(m.sum()), "out_of_tolerance": int((bad & m).sum()),
                                   "max_abs_error": float(err[m].max(initial=0.0))})
        if structure.heat:
            out["heat"] = _heat(ratio, axes, structure.heat)
    order = np.argsort(-np.where(checked, ratio, -1.0), axis=None, kind="stable")
    for flat in order[:min(WORST, int(bad.sum()))]:
        idx = np.unravel_index(int(flat), shape)
        out["worst"].append({"index": [int(i) for i in idx], "analytic": float(ev.analytic[idx]),
                             "numeric": float(ev.numeric[idx]), "allowed": float(ev.allowed[idx])})
    return out


def _heat(ratio: np.ndarray, axes: tuple[str, ...], pair: tuple[str, str]) -> dict:
    """Worst error/allowed ratio over (rows axis, columns axis), binned to HEAT_MAX; -1 = unchecked."""
    r, c = axes.index(pair[0]), axes.index(pair[1])
    other = tuple(j for j in range(ratio.ndim) if j not in (r, c))
    checked = (~np.isnan(ratio)).any(axis=other)
    worst = np.nan_to_num(ratio, nan=0.0).max(axis=other)
    if r > c:
        worst, checked = worst.T, checked.T
    bins = [max(1, math.ceil(n / HEAT_MAX)) for n in worst.shape]
    levels = []
    for i in range(0, worst.shape[0], bins[0]):
        row = []
        for j in range(0, worst.shape[1], bins[1]):
            cell = worst[i:i + bins[0], j:j + bins[1]]
            seen = checked[i:i + bins[0], j:j + bins[1]].any()
            row.append(_level(float(cell.max())) if seen else -1)
        levels.append(row)
    return {"rows": pair[0], "columns": pair[1], "bin": bins, "levels": levels}
