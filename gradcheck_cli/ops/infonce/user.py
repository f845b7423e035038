"""A user's InfoNCE through the shared user-code engine (``user_engine``): the interface's argument order
(q, p, n, tau) adapted to the engine's, and the invariants seen from outside."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ... import implementation, invariants
from ...tolerance import INVARIANT_ULPS, machine_epsilon
from .. import user_engine
from .formulas import _terms, backward, forward, similarities
from .inputs import _STRUCTURE, _inputs

#: The user's implementation's check of the logit gradients' sum, seen from outside (``build_user``).
CANDIDATES_SUM = "candidate gradients sum to 0"


def _black_box_invariants(inputs: dict, grads: dict, terms: dict, tau: float, similarity: str, in_batch: bool,
                          dtype: str) -> list:
    """The invariants that a user's gradients show from outside, each to INVARIANT_ULPS ulps of ``dtype``
    of the size of its terms (``terms``: ``_terms``). Dot: moving every candidate of a query by one vector
    moves all its logits together, which softmax ignores, so the candidates' gradients sum to 0 (per query
    with its own candidates; over the batch, weighted by the queries, when they are shared); z is bilinear
    in q and the candidates, so <G_q, q> = <G_p, p> + <G_n, n> (= sum G_z z), and with a learned tau also
    = -tau G_tau. Cosine: l does not change when any one vector is scaled, so <G_x, x> = 0 per vector of
    q, p and n. (The logit gradients' own sum per query needs G_z, internal to the implementation: the
    dot checks see it through the candidates; cosine's normalisations hide it.)"""
    bound = INVARIANT_ULPS * machine_epsilon(dtype)
    g64 = {t: np.asarray(v, dtype=np.float64) for t, v in grads.items()}
    x64 = {t: np.asarray(v, dtype=np.float64) for t, v in inputs.items()}
    docs = [t for t in ("p", "n") if t in g64]
    out = []
    if similarity == "cosine":
        for t in ("q", "p", "n"):
            if t in g64:
                out.append(invariants.bounded_each(
                    "<G_x, x> = 0 per vector (cosine)", f"g_{t}", np.sum(g64[t] * x64[t], axis=-1),
                    bound * np.sum(np.abs(x64[t]) * terms[t], axis=-1),
                    f"|<G_{t}, {t}>| per vector, allowed {INVARIANT_ULPS} ulps of {dtype} of the size of its "
                    f"terms (cosine similarity does not change when one vector is scaled)"))
        return out
    if in_batch:  # [dim]: every document of the batch is a candidate of every query
        total = sum(g64[t].reshape(-1, g64[t].shape[-1]).sum(axis=0) for t in docs)
        size = sum(terms[t].reshape(-1, terms[t].shape[-1]).sum(axis=0) for t in docs)
        where = "over the batch (sum_i q_i sum_c G_z[i, c] / tau: the candidates are shared)"
    else:  # [B, dim]: each query's own positive and hard negatives
        total = g64["p"] + (g64["n"].sum(axis=1) if "n" in g64 else 0.0)
        size = terms["p"] + (terms["n"].sum(axis=1) if "n" in terms else 0.0)
        where = "per query (q_i sum_c G_z[i, c] / tau)"
    out.append(invariants.bounded_each(
        CANDIDATES_SUM, "g_candidates", total, bound * size,
        f"|sum of the candidates' gradients| {where}, allowed {INVARIANT_ULPS} ulps of {dtype} of the size of "
        "its terms (moving every candidate by one vector shifts the logits together; softmax is shift "
        "invariant)"))
    gq = float(np.sum(g64["q"] * x64["q"]))
    gc = sum(float(np.sum(g64[t] * x64[t])) for t in docs)
    size_q = float(np.sum(np.abs(x64["q"]) * terms["q"]))
    size_c = sum(float(np.sum(np.abs(x64[t]) * terms[t])) for t in docs)
    out.append(invariants.bounded(
        "<G_q, q> = <G_p, p> + <G_n, n>", "g_q", np.asarray([gq - gc]), bound * (size_q + size_c),
        f"z is bilinear in q and the candidates: <G_q, q> = {gq:.9g} against <G_p, p> + <G_n, n> = {gc:.9g}"))
    if "tau" in g64:
        gt = -tau * float(g64["tau"])
        out.append(invariants.bounded(
            "<G_q, q> = -tau G_tau", "g_tau", np.asarray([gq - gt]),
            bound * (size_q + abs(tau) * float(terms["tau"])),
            f"z is linear in q and in 1 / tau: <G_q, q> = {gq:.9g} against -tau G_tau = {gt:.9g}"))
    return out


#: The user's function's arguments, in the interface's order.
ARGUMENTS = ("q", "p", "n", "tau")


#: Adapted implementations, kept for the life of the process (a JAX function compiles once per object).
_ADAPTED: dict[tuple, tuple] = {}


def _adapt(engine_order: tuple[str, ...], checked: tuple[str, ...]):
    """``adapt`` for ``user_engine``: the engine passes the differentiated inputs first (``engine_order``),
    the interface passes (q, p, n, tau) always, and a NumPy backward returns (dq, dp, dn, dtau) of which
    the engine takes ``checked``."""
    where = tuple(engine_order.index(t) for t in ARGUMENTS)
    picks = tuple(ARGUMENTS.index(t) for t in checked)

    def adapt(impl, backend: str):
        key = (id(impl), backend, engine_order, checked)
        if key not in _ADAPTED:
            _ADAPTED[key] = (impl, _adapted(impl, backend, where, picks))
        return _ADAPTED[key][1]
    return adapt


def _adapted(impl, backend: str, where: tuple[int, ...], picks: tuple[int, ...]):
    def ordered(args):
        return tuple(args[i] for i in where)

    if backend != "numpy":  # one callable, differentiated by its framework
        if where == tuple(range(len(ARGUMENTS))):
            return impl
        return lambda *args: impl(*ordered(args))

    class Adapted:
        @staticmethod
        def forward(*args):
            return impl.forward(*ordered(args))

        @staticmethod
        def backward(*args):
            *given, grad_l = args
            out = impl.backward(*ordered(given), grad_l)
            if not isinstance(out, (tuple, list)) or len(out) != len(ARGUMENTS):
                got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
                raise implementation.ImplementationFailure(f"backward must return (dq, dp, dn, dtau), got {got}", "dq")
            return tuple(out[i] for i in picks)
    return Adapted()


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None, mistakes=None):
    """A user's implementation, through the shared engine (``user_engine``): it is called with (q, p, n, tau)
    always, n [B, 0, dim] without hard negatives and tau a 0-d array; the engine differentiates n only
    with hard negatives and tau only when learned. ``mistakes``: the candidate causes of a failed check (the
    package's faults and known mistakes, ``user_engine.mistakes``)."""
    data, g, tau = _inputs(sc)
    sim, in_batch = sc.p("similarity"), sc.p("in_batch")
    dt = np.dtype(sc.dtype)
    args = {}
    if "n" not in data:
        args["n"] = np.zeros((sc.batch, 0, sc.p("dim")), dtype=dt)
    if "tau" not in data:
        args["tau"] = tau
    engine_order = tuple(data) + tuple(args)
    checked = tuple(data)

    def named(values) -> dict:
        given = dict(zip(engine_order, values))
        n = given["n"]
        return {"q": given["q"], "p": given["p"], "n": n if n.shape[-2] else None, "tau": given["tau"]}

    def fwd(*values):
        x = named(values)
        return forward(x["q"], x["p"], x["n"], x["tau"], sim, in_batch)

    def bwd(*values):  # (*inputs, *args, grad_l, faults), as the engine calls it
        *given, grad_l, faults = values
        x = named(given)
        grads = backward(x["q"], x["p"], x["n"], x["tau"], grad_l, sim, in_batch, faults)
        return tuple(grads[t] for t in checked)

    def terms(inputs, args, g):
        x = named(tuple(inputs.values()) + tuple(args.values()))
        return _terms(x["q"], x["p"], x["n"], x["tau"], g, sim, in_batch)

    def checks(gradients, dtype, y):
        return _black_box_invariants(data, gradients(), terms(data, args, g), float(tau), sim, in_batch, dtype)

    def negatives_first(*values):
        x = named(values)
        if not in_batch or x["n"] is None:
            raise ValueError("no in-batch hard negatives")
        z = similarities(x["q"], x["p"], x["n"], sim, in_batch) / x["tau"]
        batch = x["q"].shape[-2]
        z = np.concatenate([z[..., batch:], z[..., :batch]], axis=-1)  # [negatives, positives]
        top = z.max(axis=-1)
        return top + np.log(np.exp(z - top[..., None]).sum(axis=-1)) - z[..., np.arange(batch), np.arange(batch)]

    def tau_as(power):
        def output(*values):
            x = named(values)
            return forward(x["q"], x["p"], x["n"], np.asarray(x["tau"], dtype=np.float64) ** power, sim, in_batch)
        return output

    def half_cosine(normalised: str):
        def output(*values):
            x = named(values)
            if sim != "cosine":
                raise ValueError("dot similarity")
            q = x["q"] / np.linalg.norm(x["q"], axis=-1, keepdims=True) if normalised == "q" else x["q"]
            p, n = x["p"], x["n"]
            if normalised == "c":
                p = p / np.linalg.norm(p, axis=-1, keepdims=True)
                n = None if n is None else n / np.linalg.norm(n, axis=-1, keepdims=True)
            return forward(q, p, n, x["tau"], "dot", in_batch)
        return output

    def labels_zero(*values):
        x = named(values)
        if not in_batch:
            raise ValueError("the positive is column 0 already")
        z = similarities(x["q"], x["p"], x["n"], sim, in_batch) / x["tau"]
        top = z.max(axis=-1)
        return top + np.log(np.exp(z - top[..., None]).sum(axis=-1)) - z[..., 0]

    def over_batch(joint: bool):
        def output(*values):
            x = named(values)
            if sim != "cosine" or (joint and (not in_batch or x["n"] is None)):
                raise ValueError("dot similarity, or no candidates to join")
            q, p, n = x["q"], x["p"], x["n"]
            if joint:  # the candidates [p; n] normalised as one matrix over its rows
                norm = np.linalg.norm(np.concatenate([p, n.reshape(-1, n.shape[-1])]), axis=0, keepdims=True)
                p, n = p / norm, n / norm
            else:
                p = p / np.linalg.norm(p, axis=0, keepdims=True)
                n = None if n is None else n / np.linalg.norm(n, axis=0, keepdims=True)
            return forward(q / np.linalg.norm(q, axis=0, keepdims=True), p, n, x["tau"], "dot", in_batch)
        return output

    def matrix_norm(*values):
        x = named(values)
        if sim != "cosine":
            raise ValueError("dot similarity")
        c = np.sqrt(np.sum(x["p"] ** 2) + (0.0 if x["n"] is None else np.sum(x["n"] ** 2)))  # [p; n] as one matrix
        return forward(x["q"] / np.linalg.norm(x["q"]), x["p"] / c, None if x["n"] is None else x["n"] / c, x["tau"],
                       "dot", in_batch)

    forward_mistakes = {"infonce-normalised-by-matrix-norm": ("cosine similarity: each matrix divided by its whole "
                                                              "norm (no axis), not each vector by its own",
                                                              matrix_norm),
                        "infonce-labels-zero": ("the labels are all 0 (column 0 taken as every query's positive) "
                                                "where query i's positive is column i", labels_zero),
                        "infonce-normalised-over-batch": ("cosine similarity: the vectors are normalised over the "
                                                          "batch axis (dim=0), not over their features",
                                                          over_batch(False)),
                        "infonce-normalised-over-batch-joint": ("cosine similarity: the vectors are normalised over "
                                                                "the batch axis (dim=0), the candidates [p; n] as one "
                                                                "matrix, not each over its features",
                                                                over_batch(True)),
                        "infonce-candidates-unnormalised": ("cosine similarity: the queries are normalised but not "
                                                            "the candidates (positives, negatives)", half_cosine("q")),
                        "infonce-queries-unnormalised": ("cosine similarity: the candidates are normalised but not "
                                                         "the queries", half_cosine("c")),
                        "infonce-no-temperature": ("the logits are not divided by the temperature (tau taken as 1)",
                                                   tau_as(0)),
                        "infonce-times-temperature": ("the logits are multiplied by the temperature where z = s / tau "
                                                      "divides by it", tau_as(-1)),
                        "infonce-labels-misplaced": (
        "the candidates are [hard negatives, positives] while the labels stay arange(B): the loss takes a hard "
        "negative's logit as each query's positive", negatives_first)}
    problem = user_engine.build(sc, user_engine.UserOp(
        inputs=data, args=args, g=g, forward=fwd, backward=bwd, terms=terms, invariants=checks,
        forward_mistakes=forward_mistakes,
        batched=() if in_batch else tuple(t for t in ("q", "p", "n") if t in data), structure=_STRUCTURE,
        adapt=_adapt(engine_order, checked), mistakes=mistakes or {}), faults)
    if "tau" in data:
        problem.step_sizes = {"tau": abs(float(tau))}
    return problem
