"""The torch engine's cross-checks: the output invariants in the precision the closed forms compute in, and
the closed forms against autograd and SDPA (``opinions``)."""
from __future__ import annotations

import numpy as np

from ....implementation import ImplementationFailure, failure_check
from ....numeric import SeedStream
from ....result import Check
from ..invariants import output_invariants
from .formulas import by_autograd, sdpa


def output_invariants_of(sc, fwd, bwd, inputs, o, to, np_, terms: dict, precision: str, checked,
                         sink=None) -> list[Check]:
    """The output-only invariants on the closed forms, in the precision they compute in
    (``checked``: the scenario's upstream gradient and the K/V gradients under test at it; ``sink``: the sinks'
    weight per row, float64, or None)."""
    backward_kv = lambda q_, k_, v_, go: [np_(t) for t in bwd(to(q_), to(k_), to(v_), to(go))[1:3]]  # noqa: E731
    try:
        return output_invariants(lambda q_, k_, v_: np_(fwd(to(q_), to(k_), to(v_))), backward_kv,
                                 inputs, sc.visible, np.asarray(sc.kv_map), np_(o),
                                 np.random.default_rng([sc.seed, SeedStream.INVARIANTS]), terms, precision,
                                 checked, sc.documents, sink)
    except ImplementationFailure as exc:
        return [failure_check("invariants", exc)]

def opinions(sc, q, k, v, g, vis, kv_map, results, ref, terms, plain, np_, stages=()) -> list[Check]:
    """The built-in closed forms against the float64 reference with autograd of the plain forward as the
    plain computation (``autograd agrees``: as accurate as autograd), and torch's SDPA likewise (not with score
    stages, which SDPA does not have)."""
    from .... import precision
    policy = precision.Policy.for_dtype(sc.dtype, sc.factor, sc.slack)
    auto = plain(sc.dtype)
    checks = []
    for t in "qkv":
        e = float(np.abs(auto[t] - ref[t]).max(initial=0.0))
        checks.append(precision.agreement("autograd agrees", t, results[t], ref[t], terms[t], policy, e,
                                          "closed forms"))
    if stages:
        return checks
    sd_o, sd = by_autograd(lambda q_, k_, v_: sdpa(q_, k_, v_, vis, sc.scale, kv_map, sc.heads_q), (q, k, v), g)
    for t, got in zip("oqkv", (sd_o, *sd)):
        e = float(np.abs(auto[t] - ref[t]).max(initial=0.0))
        checks.append(precision.agreement("SDPA agrees", t, np_(got), ref[t], terms[t], policy, e, "SDPA"))
    return checks
