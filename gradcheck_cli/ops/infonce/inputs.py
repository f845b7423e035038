"""InfoNCE's inputs: their shapes, seeded values, G and tau, and their structure (what each axis means)."""
from __future__ import annotations

import numpy as np

from ...numeric import SeedStream
from .. import dense
from ..registry import Structure


def _shapes(sc) -> dict:
    b, d, k = sc.batch, sc.p("dim"), sc.p("hard_negatives")
    out = {"q": (b, d), "p": (b, d)}
    if k:
        out["n"] = (b, k, d)
    if sc.p("learn_temperature"):
        out["tau"] = ()
    return out


def _inputs(sc) -> tuple[dict, np.ndarray, np.ndarray]:
    """The differentiated inputs (q, p, n when hard_negatives, tau when learn_temperature), G and tau."""
    shapes = _shapes(sc)
    data = dense.seeded(sc, {t: s for t, s in shapes.items() if t != "tau"})
    rng = np.random.default_rng([sc.seed, SeedStream.INFONCE_WEIGHTS])
    g = rng.standard_normal(sc.batch).astype(np.dtype(sc.dtype))
    tau = np.asarray(sc.p("temperature"), dtype=np.dtype(sc.dtype))
    if "tau" in shapes:
        data["tau"] = tau
    return data, g, tau


_STRUCTURE = {"q": Structure(("query", "feature")), "p": Structure(("query", "feature")),
              "n": Structure(("query", "negative", "feature")), "tau": Structure(())}
