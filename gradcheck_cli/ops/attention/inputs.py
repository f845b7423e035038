"""The seeded inputs of an attention scenario. Shapes as in ``formulas``."""
from __future__ import annotations

import numpy as np


def seeded_inputs(sc, dtype=None):
    """Seeded q, k, v and upstream gradient g (zero outside ``loss_rows``) in the scenario's dtype
    (or ``dtype``; the draws are the same)."""
    rng = np.random.default_rng(sc.seed)
    dt = np.dtype(dtype or sc.dtype)
    q = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_head)).astype(dt)
    k = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_head)).astype(dt)
    v = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_value)).astype(dt)
    g = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_value)).astype(dt)
    if sc.loss_rows is not None:
        keep = np.zeros(sc.n_q, dtype=bool)
        keep[list(sc.loss_rows)] = True
        g[..., ~keep, :] = 0
    return {"q": q, "k": k, "v": v}, g
