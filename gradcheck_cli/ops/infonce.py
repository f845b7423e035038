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

from .. import invariants
from ..numeric import SeedStream
from ..tolerance import INVARIANT_ULPS
from . import dense
from .registry import Fault, Op, Param, Structure

FAULTS = {f.name: f for f in (
    Fault("infonce-normaliser", "G_z = -G onehot(positive): drops the gradient of the softmax denominator "
                                "(log-sum-exp) over the candidates",
          ("gradient q", "gradient p", "gradient n", "gradient tau", "logit gradients sum to 0 per query")),
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


def build(sc, faults: Collection[str] = ()):
    shapes = _shapes(sc)
    sim, in_batch = sc.p("similarity"), sc.p("in_batch")
    data = dense.seeded(sc, {t: s for t, s in shapes.items() if t != "tau"})
    rng = np.random.default_rng([sc.seed, SeedStream.INFONCE_WEIGHTS])
    g = rng.standard_normal(sc.batch).astype(np.dtype(sc.dtype))
    if "tau" in shapes:
        data["tau"] = np.asarray(sc.p("temperature"), dtype=np.dtype(sc.dtype))
    tau_fixed = np.asarray(sc.p("temperature"), dtype=np.dtype(sc.dtype))

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
        structure={"q": Structure(("query", "feature")), "p": Structure(("query", "feature")),
                   "n": Structure(("query", "negative", "feature")), "tau": Structure(())},
        arrays={"logit_gradient": g_z}, step_sizes={"tau": abs(float(tau_fixed))})


def _validate(params: dict, base: dict) -> list:
    batch, k = base["batch"], params["hard_negatives"]
    if (batch + batch * k if params["in_batch"] else 1 + k) < 2:
        key = "batch" if params["in_batch"] else "hard_negatives"
        return [(key, f"every query needs at least one negative candidate (batch {batch}, hard_negatives {k}, "
                      f"in_batch {str(params['in_batch']).lower()})",
                 "raise batch (in-batch negatives) or hard_negatives")]
    return []


#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 4, "dim": 8}

OP = Op(name="infonce", summary="InfoNCE retriever loss with in-batch and hard negatives: gradients of q, p, n "
                                "(and tau)",
        tensors=("q", "p", "n", "tau"), faults=FAULTS, build=build,
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
