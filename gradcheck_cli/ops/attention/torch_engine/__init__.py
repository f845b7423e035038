"""The torch engine (``backend: torch``): the engine's closed-form formulas on torch tensors (with the
same named faults), torch autograd of the same forward as a second opinion, and
``torch.nn.functional.scaled_dot_product_attention`` as a third. Devices cpu and cuda; dtypes float64,
float32 (finite differences) and float16, bfloat16 (the FlashAttention low-precision policy).

Imported only when a scenario asks for torch; everything here takes and returns torch tensors except
``build``, which returns a ``Problem`` of NumPy arrays for the checker. The parts: ``formulas`` (the
closed forms, SDPA and autograd on torch tensors) and ``calls`` (a user's implementation, called guarded).
"""
from __future__ import annotations

import functools
from collections.abc import Collection

import numpy as np
import torch

from .... import invariants
from ....implementation import ImplementationFailure, in_copies
from ....numeric import SeedStream
from ....result import Check
from ...convention import Convention
from ...registry import Problem
from .. import stages as score_stages
from ..args import Args
from ..inputs import seeded_inputs
from ..reference import (
    LOW_PRECISION,
    LOW_PRECISION_CHECKS,
    REFERENCE_CHECKS,
    Interface,
    called_as,
    diagnosis_fields,
    hint_context,
    implementation_second,
    implementation_tangents,
    reference,
    results64,
    varies,
)
from ..rounding import Blocks, output_terms
from .calls import call_user, user_gradients, user_hvp, user_jvp
from .checks import implementation_determinism, opinions, output_invariants_of
from .formulas import DTYPES, backward, by_autograd, forward, probabilities, sdpa

__all__ = ["DTYPES", "LOW_PRECISION", "LOW_PRECISION_CHECKS", "backward", "build", "forward", "probabilities", "sdpa"]


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """The torch problem: numeric checks as the NumPy engine (float64/float32), plus agreement with the
    float64 reference (``precision``); for float16/bfloat16 that agreement instead of finite
    differences. A user's implementation gets the faults' interface variants (``reference.Interface``)."""
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
    # softcap=, alibi_slopes=, ... passed when the scenario has them (tensors on the device, in float64 or float32)
    given = torch.float64 if sc.dtype == "float64" else torch.float32
    user = score_stages.bind(sc.implementation_object, score_stages.shown(stages, sc.visible, faults),
                             lambda a, same: torch.as_tensor(a, dtype=dt if same else given, device=device),
                             f"{device}/{given}")
    args64 = Args(sc.visible, scale, kv_np, stages)  # the float64 reference's (NumPy arrays)
    interface = Interface(faults, sizes, args64) if user is not None else None
    # the closed forms' stages, a stage fault's wrong one in place (and the visible set their softmax then sees)
    wrong, wrong_back, shown = (score_stages.inject(stages, sc.visible, faults) if user is None
                                else (stages, stages, sc.visible))
    vis = torch.from_numpy(shown if interface is None else interface.visible).to(device)
    closed = Args(vis, scale, kv_map, wrong)  # the closed forms' (torch tensors), a fault's stages in place
    batched = score_stages.batched(score_stages.shown(stages, sc.visible, faults))
    # a bias whose gradient is checked (a torch implementation's): an input, its gradient by autograd after dv
    extra = score_stages.params(stages) if user is not None else {}
    extra_t = {t: to(x) for t, x in extra.items()}
    kw_leaves = {kw: (f"d{t}", extra_t[t]) for t, kw in score_stages.param_kwargs(stages).items() if t in extra}
    rounded = {t: np_(x) for t, x in zip("qkv", (q, k, v))}  # the inputs as the dtype holds them
    g_rounded = np_(g)

    lowest = float(torch.finfo(dt).min)

    def fwd(q_, k_, v_, vis_=vis, conv=sc.convention, sources=None, given=None):
        if user is not None:  # called in its convention (layout, mask, scale), O back in the tool's layout
            plain = conv == Convention()  # the arguments are the tensors given: stacked ones need no clone
            call = functools.partial(user, **given) if given else user  # a per-batch bias stacked with the copies
            with torch.no_grad():
                return conv.tensor(call_user(call, conv.arguments(q_, k_, v_, vis_, scale, kv_map, dt, lowest),
                                             conv.shape((q_.shape[0],) + tuple(g.shape[1:])), dt, conv.names(),
                                             sources if plain else None))
        return forward(q_, k_, v_, faults=faults, **closed.but(visible=vis_).kw)

    def bwd(q_, k_, v_, grad_o):
        if user is None:
            return backward(q_, k_, v_, grad_o=grad_o, faults=faults, **closed.but(stages=wrong_back).kw)
        conv = sc.convention
        args = conv.arguments(q_, k_, v_, vis, scale, kv_map, dt, lowest)
        grads = user_gradients(user, args[:3], args[3:], conv.tensor(grad_o).clone(), conv.shape(g.shape), dt,
                               conv.names(), kw_leaves)
        grads, params = tuple(conv.tensor(x) for x in grads[:3]), tuple(grads[3:])
        if not interface.faults:
            return grads + params
        changed = interface.gradients(*(np_(x) for x in (q_, k_, v_, grad_o)), *(np_(x) for x in grads + params))
        return tuple(to(x) for x in changed)

    o = fwd(q, k, v) if user is None else called_as(sc, lambda conv: fwd(q, k, v, conv=conv), rounded)
    dq, dk, dv, *dparams = bwd(q, k, v, g)
    names_all = ("q", "k", "v", *extra)
    grads = {"q": dq, "k": dk, "v": dv, **dict(zip(extra, dparams))}
    results = {"o": np_(o), **{t: np_(x) for t, x in grads.items()}}
    checks_first, again = [], None
    if user is not None:
        again = {"o": np_(fwd(q, k, v)), **{t: np_(x) for t, x in zip(names_all, bwd(q, k, v, g))}}
        checks_first.append(implementation_determinism(results, again, sc.nondet_tol))
    ref, terms, a64 = reference(rounded, g_rounded, args64)

    def plain(precision: str) -> dict | list[dict]:
        """torch autograd of the plain forward in ``precision``, on the same inputs; in half precision also
        the closed forms without faults and SDPA, so that no one plain way is lucky (torch's softmax backward
        rounds less than the closed forms' steps: either alone would judge the other; SDPA has no score stages)."""
        pdt = DTYPES[precision]
        args = [to(rounded[t], pdt) for t in "qkv"] + [to(extra[t], pdt) for t in extra]
        mask, gp = vis if user is None else torch.from_numpy(sc.visible).to(device), to(g_rounded, pdt)
        right = Args(mask, scale, kv_map, stages)

        def plain_forward(q_, k_, v_, *ps):  # a bias's values as a leaf of autograd too
            at = stages
            for t, p in zip(extra, ps):
                at = score_stages.moved(at, t, p)
            return forward(q_, k_, v_, **right.but(stages=at).kw)

        out, gr = by_autograd(plain_forward, args, gp)
        args = args[:3]
        ways = [{"o": np_(out), **{t: np_(x) for t, x in zip(names_all, gr)}}]
        if precision not in LOW_PRECISION:
            return ways[0]
        closed_grads = backward(*args, grad_o=gp, **right.kw)
        ways.append({"o": np_(forward(*args, **right.kw)), **{t: np_(x) for t, x in zip("qkv", closed_grads)}})
        if stages:
            return ways
        sd_o, sd = by_autograd(lambda q_, k_, v_: sdpa(q_, k_, v_, mask, scale, kv_map, sc.heads_q), args, gp)
        return ways + [{"o": np_(sd_o), **{t: np_(x) for t, x in zip("qkv", sd)}}]

    if user is not None:
        names = LOW_PRECISION_CHECKS if low else {**REFERENCE_CHECKS, **dict.fromkeys(extra, REFERENCE_CHECKS["q"])}

        def results_at(xs: dict) -> dict | None:
            try:
                moved = [to(xs[t]) for t in "qkv"]
                return {"o": np_(fwd(*moved)), **{t: np_(x) for t, x in zip(names_all, bwd(*moved, g))}}
            except ImplementationFailure:
                return None

        nearby = None if low else precision.nearby(rounded, results_at,
                                                   lambda xs: results64(xs, g_rounded, args64),
                                                   [sc.seed, SeedStream.PRECISION])
        agree, computes_in = precision.judge(results, ref, terms, sc.dtype, plain, names, sc.factor, sc.slack,
                                             nearby_difference=nearby)
    elif low:
        agree, computes_in = precision.judge(results, ref, terms, sc.dtype, plain, LOW_PRECISION_CHECKS,
                                             sc.factor, sc.slack, what="closed forms")
    else:
        agree, computes_in = opinions(sc, q, k, v, g, vis, kv_map, results, ref, terms, plain, np_, stages), sc.dtype

    def invariants_of_output() -> list[Check]:
        terms = output_terms(rounded, a64, scale, kv_np, stages)
        return output_invariants_of(sc, fwd, bwd, rounded, o, to, np_, terms, computes_in,
                                  (g_rounded, results["k"], results["v"]))

    context = None
    if user is not None:
        def impl_forward(q_, k_, v_, visible, conv=sc.convention):
            return np_(fwd(to(q_), to(k_), to(v_), torch.from_numpy(visible).to(device), conv))
        context = hint_context(rounded, g_rounded, args64, results, ref, impl_forward)
    if low:
        return Problem(inputs={}, loss=None, gradients={t: np_(grads[t]) for t in "qkv"}, rounding={},
                       rounding_total=0.0, copy_bytes=0,
                       invariants=lambda: checks_first + agree + invariants_of_output(), output=np_(o),
                       arrays={**rounded, "visible": sc.visible, "grad_output": g_rounded,
                               "scale": np.asarray(sc.scale), "kv_map": kv_np, "output": np_(o),
                               "reference_output": ref["o"], **{f"analytic_{t}": np_(grads[t]) for t in "qkv"}},
                       **diagnosis_fields(sc, context))

    inputs = {t: rounded[t].astype(sc.dtype) for t in "qkv"}
    blocks = Blocks(sc, kv_np, {t: x.shape for t, x in extra.items()})
    rounding, total = blocks.rounding({**inputs, **extra}, g64, a64, scale, kv_np, stages=stages)

    def moved_forward(**moved):
        """O of C copies of the inputs, the ``moved`` ones replaced by [C, B, ...] arrays, as a tensor."""
        args = {"q": q, "k": k, "v": v, **extra_t}
        for name, x in moved.items():
            args[name] = torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dt)
        if user is None:
            return fwd(args["q"], args["k"], args["v"])
        c = next(iter(moved.values())).shape[0]  # a user's forward gets the copies stacked along the batch axis

        def stack(t):
            t = t.expand((c,) + tuple(t.shape)) if t.dim() == 4 else t
            return t.reshape((c * sc.batch,) + tuple(t.shape[2:]))

        # the unmoved inputs and the mask are stacked afresh for this call: they need no clone (call_user)
        sources = {i: t for i, t in enumerate((*(args[u] for u in "qkv"), vis)) if t.dim() == 4}
        given = {kw: stack(torch.as_tensor(value, dtype=dt, device=device)) for kw, (_, value) in batched.items()
                 if value.shape[0] > 1}  # a bias per batch element goes with the copies
        for kw, (name, _) in batched.items():
            if name in moved:  # its perturbed copies [C, B|1, ...], stacked with the copies of the inputs
                x = args[name]
                given[kw] = x.expand((c, sc.batch) + tuple(x.shape[2:])).reshape((c * sc.batch,) + tuple(x.shape[2:]))
        try:
            return fwd(*(stack(args[t]) for t in "qkv"), stack(vis), sources=sources, given=given).reshape(
                (c,) + tuple(g.shape))
        except ImplementationFailure as exc:
            raise in_copies(exc, sc.batch, " and ".join(moved)) from None

    def copies_forward(name, x):
        return moved_forward(**{name: x})

    def loss(name, x):
        return np_((copies_forward(name, x) * g).to(torch.float64).sum(dim=(-4, -3, -2, -1)))

    def loss_parts(name, x):  # the product is a tensor of its own: read in place, not copied as np_ does
        return blocks.sums(name, (copies_forward(name, x) * g).detach().to("cpu", torch.float64).numpy())

    def checks():
        out = list(checks_first)
        if user is None:
            a = np_(probabilities(q, k, None if "mask" in faults else vis, scale, kv_map, wrong))
            out.append(invariants.bounded("attention is 0 off the visible set", "a", np.where(sc.visible, 0, a),
                                          0.0, "A_ij must be exactly 0 where key j is not visible to query i"))
        return out + agree + invariants_of_output()

    tangents = None
    if user is not None and sc.mode == "jvp":
        def impl_jvp(dq, dk, dv):
            conv = sc.convention
            args = conv.arguments(q, k, v, vis, scale, kv_map, dt, lowest)
            return np_(conv.tensor(user_jvp(user, args[:3], [conv.tensor(to(t)) for t in (dq, dk, dv)], args[3:],
                                            conv.shape(g.shape), dt)))

        tangents = implementation_tangents(inputs, g64, a64, lambda **moved: np_(moved_forward(**moved)), impl_jvp,
                                           interface,
                                           [sc.seed, SeedStream.TANGENT_HINTS],
                                           precision.Policy.for_dtype(computes_in, sc.factor, sc.slack))
    second = None
    if user is not None and sc.mode == "hvp":
        def impl_gradients(**moved):
            args = {"q": q, "k": k, "v": v}
            args.update({n: to(x) for n, x in moved.items()})
            return {t: np_(x) for t, x in zip("qkv", bwd(args["q"], args["k"], args["v"], g))}

        def impl_hvp(dq, dk, dv):
            conv = sc.convention
            args = conv.arguments(q, k, v, vis, scale, kv_map, dt, lowest)
            out = user_hvp(user, args[:3], [conv.tensor(to(t)) for t in (dq, dk, dv)], args[3:], conv.tensor(g),
                           conv.shape(g.shape), dt, conv.names())
            return tuple(np_(conv.tensor(x)) for x in out)

        second = implementation_second(inputs, g64, impl_gradients, impl_hvp, interface,
                                       precision.Policy.for_dtype(computes_in, sc.factor, sc.slack))
    itemsize = torch.finfo(dt).bits // 8
    rule = precision.Policy.for_dtype(computes_in)
    return Problem(
        inputs={**inputs, **extra}, loss=loss, gradients={t: np_(grads[t]) for t in names_all},
        rounding=rounding, rounding_total=total,
        copy_bytes=3 * a64.size * itemsize + int(o.numel()) * itemsize,
        invariants=checks,
        arrays={**inputs, "visible": sc.visible, "grad_output": g64, "scale": np.asarray(scale),
                "kv_map": kv_np, "output": np_(o), **extra, **{f"analytic_{t}": np_(grads[t]) for t in names_all}},
        output=np_(o), parts=blocks.parts, loss_parts=loss_parts,
        compute_dtype=None if computes_in == sc.dtype else computes_in,
        analytic_rounding={t: rule.ulps * rule.eps * terms[t] for t in names_all} if user is not None else None,
        nondeterministic=user is not None and varies(results["o"], again["o"], sc.nondet_tol),
        tangents=tangents, second=second,
        **diagnosis_fields(sc, context),
    )
