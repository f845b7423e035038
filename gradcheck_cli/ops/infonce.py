"""The dense-retriever contrastive loss (chapter 31, section 7): for query i with positive document
d+_i, l_i = -log softmax(s(q_i, c) / tau over its candidates c)[d+_i].

Shapes: q [B, dim], p [B, dim] (positives), n [B, k, dim] (hard negatives, k = hard_negatives >= 0),
tau a scalar (a differentiated input when learn_temperature). Candidates of query i: with
``in_batch`` every positive of the batch and every hard negative (the DPR setup; the positive is
column i), otherwise its own positive and its own hard negatives (column 0). Similarity ``dot``
(q . c) or ``cosine`` (q . c / |q| |c|). The op's output is l [B]; as everywhere L = sum(l * G).

Backward: G_z = G_i (softmax(z_i) - onehot(positive)), which sums to zero per query (softmax is
shift invariant); G_s = G_z / tau; dot: G_q = G_s C, G_C = G_s^T Q; cosine adds the normalisations'
Jacobians (u - u_hat (u_hat . u)) / |x|; G_tau = -sum(G_z * s) / tau^2.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .. import implementation, invariants
from ..numeric import SeedStream
from ..tolerance import INVARIANT_ULPS, machine_epsilon
from . import dense, user_engine
from .registry import Fault, Interface, Op, Param, Structure, user_code_engines

#: The user's implementation's check of the logit gradients' sum, seen from outside (``build_user``).
CANDIDATES_SUM = "candidate gradients sum to 0"

FAULTS = {f.name: f for f in (
    Fault("infonce-normaliser", "G_z = -G onehot(positive): drops the gradient of the softmax denominator "
                                "(log-sum-exp) over the candidates",
          ("gradient q", "gradient p", "gradient n", "gradient tau", "logit gradients sum to 0 per query",
           CANDIDATES_SUM, "backward agrees with the reference"), user=user_engine.ADDED),
)}


def _unit(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def _candidates(p, n, in_batch: bool):
    """in_batch: C [..., B + B*k, dim] shared by all queries; else C [..., B, 1 + k, dim] per query."""
    if n is None:
        return p if in_batch else p[..., :, None, :]
    if in_batch:
        lead = np.broadcast_shapes(p.shape[:-2], n.shape[:-3])
        flat = n.reshape(n.shape[:-3] + (-1, n.shape[-1]))
        return np.concatenate([np.broadcast_to(p, lead + p.shape[-2:]),
                               np.broadcast_to(flat, lead + flat.shape[-2:])], axis=-2)
    lead = np.broadcast_shapes(p.shape[:-2], n.shape[:-3])
    return np.concatenate([np.broadcast_to(p[..., :, None, :], lead + p.shape[-2:-1] + (1, p.shape[-1])),
                           np.broadcast_to(n, lead + n.shape[-3:])], axis=-2)


def similarities(q, p, n, similarity: str, in_batch: bool):
    """s [..., B, candidates]."""
    c = _candidates(p, n, in_batch)
    if similarity == "cosine":
        q, c = _unit(q), _unit(c)
    if in_batch:
        return q @ np.swapaxes(c, -1, -2)
    return np.einsum("...bd,...bcd->...bc", q, c)


def positives(batch: int, in_batch: bool) -> np.ndarray:
    return np.arange(batch) if in_batch else np.zeros(batch, dtype=np.intp)


def forward(q, p, n, tau, similarity: str, in_batch: bool):
    """l [..., B]: log-sum-exp of the logits minus the positive's logit."""
    z = similarities(q, p, n, similarity, in_batch) / tau
    m = z.max(axis=-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(z - m).sum(axis=-1))
    batch = q.shape[-2]
    return lse - z[..., np.arange(batch), positives(batch, in_batch)]


def backward(q, p, n, tau, grad_l, similarity: str, in_batch: bool, faults: Collection[str] = ()) -> dict:
    """Gradients of L = sum(l * grad_l): q, p, n (when given), tau, and the logit gradient z."""
    s = similarities(q, p, n, similarity, in_batch)
    z = s / tau
    a = np.exp(z - z.max(axis=-1, keepdims=True))
    a /= a.sum(axis=-1, keepdims=True)
    onehot = np.zeros_like(z)
    onehot[np.arange(q.shape[0]), positives(q.shape[0], in_batch)] = 1.0
    g_z = grad_l[:, None] * ((0.0 if "infonce-normaliser" in faults else a) - onehot)
    g_s = g_z / tau
    c = _candidates(p, n, in_batch)
    uq, uc = (_unit(q), _unit(c)) if similarity == "cosine" else (q, c)
    if in_batch:
        g_uq, g_uc = g_s @ uc, g_s.T @ uq
    else:
        g_uq, g_uc = np.einsum("bc,bcd->bd", g_s, uc), g_s[..., None] * uq[:, None, :]
    if similarity == "cosine":
        g_q = (g_uq - uq * np.sum(uq * g_uq, axis=-1, keepdims=True)) / np.linalg.norm(q, axis=-1, keepdims=True)
        g_c = (g_uc - uc * np.sum(uc * g_uc, axis=-1, keepdims=True)) / np.linalg.norm(c, axis=-1, keepdims=True)
    else:
        g_q, g_c = g_uq, g_uc
    batch = q.shape[0]
    out = {"q": g_q}
    if in_batch:
        out["p"] = g_c[:batch]
        if n is not None:
            out["n"] = g_c[batch:].reshape(n.shape)
    else:
        out["p"] = g_c[:, 0]
        if n is not None:
            out["n"] = g_c[:, 1:]
    out["tau"] = np.asarray(-np.sum(g_z * s) / tau**2, dtype=q.dtype)
    out["z"] = g_z
    return out


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


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    shapes = _shapes(sc)
    sim, in_batch = sc.p("similarity"), sc.p("in_batch")
    data, g, tau_fixed = _inputs(sc)

    def fwd(q, p, n=None, tau=None):
        return forward(q, p, n, tau_fixed if tau is None else tau, sim, in_batch)

    grads = backward(data["q"], data["p"], data.get("n"), data.get("tau", tau_fixed), g, sim, in_batch, faults)
    g_z = grads.pop("z")
    if "tau" not in shapes:
        grads.pop("tau")

    def checks():
        # sum_c G_z[i, c] = G_i (sum_c a_ic - 1): the terms are G_i's share of each softmax weight and of
        # the one-hot, and a_ic carries eps (1 + |z_ic - max_c z_ic|) relative rounding (the bound is
        # never relative to the sum itself, which cancels to nothing when the softmax saturates)
        eps = float(np.finfo(np.dtype(sc.dtype)).eps)
        x64 = {t: data[t].astype(np.float64) for t in ("q", "p", "n") if t in data}
        z = similarities(x64["q"], x64["p"], x64.get("n"), sim, in_batch) / float(data.get("tau", tau_fixed))
        spread = z.max(axis=-1, keepdims=True) - z
        a = np.exp(-spread)
        a /= a.sum(axis=-1, keepdims=True)
        terms = np.abs(g.astype(np.float64)) * (1.0 + np.sum(a * (1.0 + spread), axis=-1)) * z.shape[-1]
        return [invariants.bounded_each("logit gradients sum to 0 per query", "g_z", g_z.sum(axis=-1),
                                        INVARIANT_ULPS * eps * terms,
                                        f"|sum_c G_z[i, c]| per query, allowed {INVARIANT_ULPS} ulps of "
                                        "the size of its terms: "
                                        "|G_i| (1 + sum_c a_ic (1 + |z_ic - max z_i|)) x candidates "
                                        "(softmax is shift invariant)")]

    s = similarities(data["q"], data["p"], data.get("n"), sim, in_batch)
    magnitude = np.abs(s / tau_fixed).max(axis=-1) * 4 + 1.0
    return dense.problem(
        sc, data, fwd, grads, g, lift={"tau": 2}, magnitude=magnitude, invariants=checks, work_factor=8.0 * s.shape[-1],
        structure=_STRUCTURE, arrays={"logit_gradient": g_z}, step_sizes={"tau": abs(float(tau_fixed))})


def _split_candidates(t: np.ndarray, batch: int, n_shape, in_batch: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A candidate-shaped array (``_candidates``'s layout) as its positives' and hard negatives' parts."""
    if in_batch:
        return t[:batch], (t[batch:].reshape(n_shape) if n_shape is not None else None)
    return t[:, 0], (t[:, 1:] if n_shape is not None else None)


def _terms(q, p, n, tau, grad_l, similarity: str, in_batch: bool) -> dict[str, np.ndarray]:
    """The size of the terms of l and of each gradient (float64), rounding being about eps x these. Every
    product and sum is taken on absolute values; the logits z = s / tau carry their own terms T_z, the
    softmax weights a relative eps (1 + |z - max z| + T_z), and l = lse - z[positive] is charged its
    parts (|max z|, |z[positive]|), never its value (it cancels when the positive dominates)."""
    q, p, tau, gl = (np.asarray(t, dtype=np.float64) for t in (q, p, tau, grad_l))
    n = None if n is None else np.asarray(n, dtype=np.float64)
    batch = q.shape[0]
    c = _candidates(p, n, in_batch)
    cosine = similarity == "cosine"
    uq, uc = (_unit(q), _unit(c)) if cosine else (q, c)
    aq, ac = np.abs(uq), np.abs(uc)

    def pair(a, b):  # [B, candidates]: sum over features of a_i b_c
        return a @ b.T if in_batch else np.einsum("bd,bcd->bc", a, b)

    s = similarities(q, p, n, similarity, in_batch)
    abs_tau = abs(float(tau))
    z = s / float(tau)
    t_z = (3.0 if cosine else 1.0) * pair(aq, ac) / abs_tau + np.abs(z)  # the normalisations' rounding too
    spread = z.max(axis=-1, keepdims=True) - z
    a = np.exp(-spread)
    a /= a.sum(axis=-1, keepdims=True)
    rows = np.arange(batch)
    onehot = np.zeros_like(z)
    onehot[rows, positives(batch, in_batch)] = 1.0
    t_o = (2.0 * (np.abs(z).max(axis=-1) + t_z.max(axis=-1) + np.sum(a * (1.0 + spread), axis=-1))
           + np.log(z.shape[-1]) + np.abs(z[rows, positives(batch, in_batch)]))
    g_abs = np.abs(gl)[:, None]
    g_z = g_abs * (a + onehot)
    t_gz = g_abs * (a * (2.0 + spread + t_z + np.sum(a * t_z, axis=-1, keepdims=True)) + onehot)
    t_gs = (t_gz + g_z) / abs_tau
    if in_batch:
        t_uq, t_uc = t_gs @ ac, t_gs.T @ aq
    else:
        t_uq, t_uc = np.einsum("bc,bcd->bd", t_gs, ac), t_gs[..., None] * aq[:, None, :]
    if cosine:  # G_x = (G_u - u (u . G_u)) / |x|, the unit vectors' rounding on top
        t_q = 2.0 * (t_uq + aq * np.sum(aq * t_uq, axis=-1, keepdims=True)) / np.linalg.norm(q, axis=-1,
                                                                                          keepdims=True)
        t_c = 2.0 * (t_uc + ac * np.sum(ac * t_uc, axis=-1, keepdims=True)) / np.linalg.norm(c, axis=-1,
                                                                                          keepdims=True)
    else:
        t_q, t_c = t_uq, t_uc
    t_p, t_n = _split_candidates(t_c, batch, None if n is None else n.shape, in_batch)
    out = {"o": t_o, "q": t_q, "p": t_p, "tau": np.asarray(np.sum((t_gz + g_z) * (np.abs(z) + t_z)) / abs_tau)}
    if t_n is not None:
        out["n"] = t_n
    return out


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


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``): it is called with (q, p, n, tau)
    always, n [B, 0, dim] without hard negatives and tau a 0-d array; the engine differentiates n only
    with hard negatives and tau only when learned."""
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

    problem = user_engine.build(sc, user_engine.UserOp(
        inputs=data, args=args, g=g, forward=fwd, backward=bwd, terms=terms, invariants=checks,
        batched=() if in_batch else tuple(t for t in ("q", "p", "n") if t in data), structure=_STRUCTURE,
        adapt=_adapt(engine_order, checked)), faults)
    if "tau" in data:
        problem.step_sizes = {"tau": abs(float(tau))}
    return problem


def _validate(params: dict, base: dict) -> list:
    batch, k = base["batch"], params["hard_negatives"]
    if (batch + batch * k if params["in_batch"] else 1 + k) < 2:
        key = "batch" if params["in_batch"] else "hard_negatives"
        return [(key, f"every query needs at least one negative candidate (batch {batch}, hard_negatives {k}, "
                      f"in_batch {str(params['in_batch']).lower()})",
                 "raise batch (in-batch negatives) or hard_negatives")]
    return []


#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(q, p, n, tau) -> l [B] and backward(q, p, n, tau, grad_l) -> (dq, dp, dn, "
    "dtau); torch: a callable f(q, p, n, tau) -> l, differentiated by autograd; jax: the same function on JAX "
    "arrays, differentiated by jax.vjp. n is [B, hard_negatives, dim] ([B, 0, dim] without hard negatives), "
    "tau a 0-d array, differentiated only with learn_temperature (dn is checked with hard negatives, dtau "
    "with learn_temperature); "
    "similarity and in_batch say what your loss computes"), modules=False)

#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 4, "dim": 8}

OP = Op(name="infonce", summary="InfoNCE retriever loss with in-batch and hard negatives: gradients of q, p, n "
                                "(and tau)",
        tensors=("q", "p", "n", "tau"), faults=FAULTS,
        **user_code_engines("gradcheck_cli.ops.infonce"),
        backends=("numpy", "torch", "jax"),
        implementation=INTERFACE,
        keys={"dim": Param("int", help="embedding width, e.g. 'dim: 8'"),
              "hard_negatives": Param("int", 0, "hard negatives per query", minimum=0),
              "in_batch": Param("bool", True, "candidates: every document of the batch (true) or the query's own"),
              "similarity": Param("choice", "dot", "dot or cosine", choices=("dot", "cosine")),
              "temperature": Param("float", 0.1, "tau > 0"),
              "learn_temperature": Param("bool", False, "differentiate tau too")},
        validate=_validate, shapes=_shapes,
        describe=lambda sc: f"B={sc.batch} dim={sc.p('dim')} hard={sc.p('hard_negatives')} "
                            f"{'in-batch' if sc.p('in_batch') else 'own'} {sc.p('similarity')} "
                            f"tau={sc.p('temperature'):g}{' learned' if sc.p('learn_temperature') else ''} "
                            f"{sc.dtype} {sc.mode}",
        example=EXAMPLE)
