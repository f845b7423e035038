"""The torch engine (``backend: torch`` without an implementation): the engine's closed-form formulas on torch
tensors (with the same named faults), torch autograd of the same forward as a second opinion, and
``torch.nn.functional.scaled_dot_product_attention`` as a third. Devices cpu and cuda; dtypes float64,
float32 (finite differences) and float16, bfloat16 (the FlashAttention low-precision policy). A user's torch
code is checked by ``user_engine`` through the torch flavour (``flavours.torch``), as NumPy and JAX code is.

Imported only when a scenario asks for torch; everything here takes and returns torch tensors except
``build``, which returns a ``Problem`` of NumPy arrays for the checker. The parts: ``formulas`` (the
closed forms, SDPA and autograd on torch tensors), ``peers`` (the plain computations a result is judged
against) and ``checks`` (the cross-checks).
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from .... import invariants
from ....result import Check
from ...registry import Problem
from .. import stages as score_stages
from .. import varlen
from ..args import Args
from ..formulas import sink_weight
from ..inputs import seeded_inputs
from ..reference import LOW_PRECISION, LOW_PRECISION_CHECKS, diagnosis_fields, reference
from ..rounding import Blocks, output_terms
from . import peers
from .checks import opinions, output_invariants_of
from .formulas import DTYPES, backward, forward, probabilities, sdpa

__all__ = ["DTYPES", "LOW_PRECISION", "LOW_PRECISION_CHECKS", "backward", "build", "forward", "probabilities", "sdpa"]


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """The torch problem: numeric checks as the NumPy engine (float64/float32), plus agreement with the
    float64 reference (``precision``); for float16/bfloat16 that agreement instead of finite differences."""
    from .... import precision
    device = torch.device(sc.device)
    dt = DTYPES[sc.dtype]
    low = sc.dtype in LOW_PRECISION
    inputs64, g64 = seeded_inputs(sc, dtype=np.float64)  # the same draws the NumPy engine makes
    to = lambda a, dtype=dt: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)  # noqa: E731
    np_ = lambda t: t.detach().to("cpu", torch.float64).numpy().copy()  # noqa: E731
    q, k, v = (to(inputs64[t]) for t in "qkv")
    g = to(g64)
    kv_np = np.asarray(sc.kv_map)
    kv_map = torch.as_tensor(sc.kv_map, dtype=torch.long, device=device)
    scale = sc.scale
    stages = score_stages.from_scenario(sc)
    args64 = Args(sc.visible, scale, kv_np, stages)  # the float64 reference's (NumPy arrays)
    # the closed forms' stages, a stage fault's wrong one in place (and the visible set their softmax then sees)
    wrong, wrong_back, shown = score_stages.inject(stages, sc.visible, faults)
    shown = varlen.shown(sc, shown, faults)  # a packed batch's fault: the visible set it makes
    vis = torch.from_numpy(shown).to(device)
    closed = Args(vis, scale, kv_map, wrong)  # the closed forms' (torch tensors), a fault's stages in place
    rounded = {t: np_(x) for t, x in zip("qkv", (q, k, v))}  # the inputs as the dtype holds them
    g_rounded = np_(g)

    def fwd(q_, k_, v_, vis_=vis):
        return forward(q_, k_, v_, faults=faults, **closed.but(visible=vis_).kw)

    def bwd(q_, k_, v_, grad_o):
        return backward(q_, k_, v_, grad_o=grad_o, faults=faults, **closed.but(stages=wrong_back).kw)

    o = fwd(q, k, v)
    dq, dk, dv = bwd(q, k, v, g)
    grads = {"q": dq, "k": dk, "v": dv}
    results = {"o": np_(o), **{t: np_(x) for t, x in grads.items()}}
    ref, terms, a64 = reference(rounded, g_rounded, args64)
    peer_args = Args(shown, scale, kv_np, stages)

    def plain(precision_: str) -> dict | list[dict]:
        return peers.plain(rounded, g_rounded, peer_args, sc.heads_q, device, precision_)

    if low:
        agree, computes_in = precision.judge(results, ref, terms, sc.dtype, plain, LOW_PRECISION_CHECKS,
                                             sc.factor, sc.slack, what="closed forms")
    else:
        agree, computes_in = opinions(sc, q, k, v, g, vis, kv_map, results, ref, terms, plain, np_, stages), sc.dtype

    def invariants_of_output() -> list[Check]:
        terms = output_terms(rounded, a64, scale, kv_np, stages)
        sink = sink_weight(rounded["q"], rounded["k"], sc.visible, scale, kv_np, stages) if stages else None
        return output_invariants_of(sc, fwd, bwd, rounded, o, to, np_, terms, computes_in,
                                    (g_rounded, results["k"], results["v"]), sink)

    if low:
        return Problem(inputs={}, loss=None, gradients={t: np_(grads[t]) for t in "qkv"}, rounding={},
                       rounding_total=0.0, copy_bytes=0,
                       invariants=lambda: agree + invariants_of_output(), output=np_(o),
                       arrays={**rounded, "visible": sc.visible, "grad_output": g_rounded,
                               "scale": np.asarray(sc.scale), "kv_map": kv_np, "output": np_(o),
                               "reference_output": ref["o"], **{f"analytic_{t}": np_(grads[t]) for t in "qkv"}},
                       **diagnosis_fields(sc, None))

    inputs = {t: rounded[t].astype(sc.dtype) for t in "qkv"}
    blocks = Blocks(sc, kv_np, {})
    rounding, total = blocks.rounding(inputs, g64, a64, scale, kv_np, stages=stages)

    def copies_forward(name, x):
        """O of C copies of the inputs, input ``name`` replaced by the [C, B, ...] array ``x``, as a tensor."""
        args = {"q": q, "k": k, "v": v, name: torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dt)}
        return fwd(args["q"], args["k"], args["v"])

    def loss(name, x):
        return np_((copies_forward(name, x) * g).to(torch.float64).sum(dim=(-4, -3, -2, -1)))

    def loss_parts(name, x):  # the product is a tensor of its own: read in place, not copied as np_ does
        return blocks.sums(name, (copies_forward(name, x) * g).detach().to("cpu", torch.float64).numpy())

    def checks():
        a = np_(probabilities(q, k, None if "mask" in faults else vis, scale, kv_map, wrong))
        return [invariants.bounded("attention is 0 off the visible set", "a", np.where(sc.visible, 0, a), 0.0,
                                   "A_ij must be exactly 0 where key j is not visible to query i")] \
            + agree + invariants_of_output()

    itemsize = torch.finfo(dt).bits // 8
    return Problem(
        inputs=inputs, loss=loss, gradients={t: np_(grads[t]) for t in "qkv"},
        rounding=rounding, rounding_total=total,
        copy_bytes=3 * a64.size * itemsize + int(o.numel()) * itemsize,
        invariants=checks,
        arrays={**inputs, "visible": sc.visible, "grad_output": g64, "scale": np.asarray(scale),
                "kv_map": kv_np, "output": np_(o), **{f"analytic_{t}": np_(grads[t]) for t in "qkv"}},
        output=np_(o), parts=blocks.parts, loss_parts=loss_parts,
        compute_dtype=None if computes_in == sc.dtype else computes_in,
        **diagnosis_fields(sc, None),
    )
