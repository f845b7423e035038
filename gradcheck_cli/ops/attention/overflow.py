"""What NaN or inf means in an attention scenario (``Op.non_finite``)."""
from __future__ import annotations

import numpy as np

from ..registry import NonFinite
from .formulas import forward
from .inputs import seeded_inputs


def non_finite(sc) -> NonFinite:
    """A user's implementation that overflows where the built-in engine, in the same dtype on the same
    inputs, stays finite gets its own hint; otherwise the scores are the likely cause."""
    return NonFinite(hint=_needless_overflow(sc) if sc.implementation is not None else None,
                     cause=f", e.g. scores scale * q.k (scale is {sc.scale:g}) overflow; lower scale or use "
                           "a wider dtype",
                     unstable=f"scale is {sc.scale:g}")


def _needless_overflow(sc) -> str | None:
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    if sc.backend == "torch":
        import torch

        from . import torch_engine as tb
        x, _ = seeded_inputs(sc, dtype=np.float64)
        t = [torch.from_numpy(x[n]).to(tb.DTYPES[sc.dtype]) for n in "qkv"]
        o = tb.forward(*t, torch.from_numpy(sc.visible), sc.scale, torch.as_tensor(kv_map))
        finite = bool(torch.isfinite(o).all())
    else:
        x, _ = seeded_inputs(sc)
        with np.errstate(all="ignore"):
            finite = bool(np.isfinite(forward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map)).all())
    if not finite:
        return None
    return (f"NaN or inf from your implementation where the built-in engine, in {sc.dtype} on the same "
            "inputs, stays finite: it overflows or underflows where it need not (subtract each row's "
            "maximum before exp, mask with -inf rather than a large negative number, or accumulate in a "
            "wider type)")
