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

from ... import invariants
from ...tolerance import INVARIANT_ULPS
from .. import dense, user_engine
from ..registry import Axis, Fault, Interface, Op, Param, user_code_engines
from . import user
from .formulas import _terms, backward, forward, similarities
from .inputs import _STRUCTURE, _inputs, _shapes
from .user import CANDIDATES_SUM as CANDIDATES_SUM

FAULTS = {f.name: f for f in (
    Fault("infonce-normaliser", "G_z = -G onehot(positive): drops the gradient of the softmax denominator "
                                "(log-sum-exp) over the candidates",
          ("gradient q", "gradient p", "gradient n", "gradient tau", "logit gradients sum to 0 per query",
           CANDIDATES_SUM, "backward agrees with the reference"), user=user_engine.ADDED),
)}


#: Known mistakes of an InfoNCE backward (no CLI switch): candidate causes of a failed gradient check
#: (``fingerprints``), computed by ``formulas.backward`` on request.
MISTAKES = {
    "infonce-tau-once": "the similarities' gradient is the logits' (G_s = G_z): the 1 / tau of z = s / tau dropped",
    "infonce-tau-times": "the similarities' gradient multiplied by tau where z = s / tau divides by it (G_s = G_z "
                         "tau)",
    "infonce-dtau-one-tau": "G_tau = -sum(G_z s) / tau: d(s / tau) / d tau = -s / tau^2 taken with one tau",
    "infonce-dtau-tau-cubed": "G_tau = -sum(G_z s) / tau^3: divided by tau once too often (-sum(G_z z) / tau^2 with "
                              "z = s / tau already divided)",
    "infonce-positive-own-query-only": "in-batch: each positive's gradient comes from its own query alone (G_s[j, j] "
                                       "q_j), not also from every other query it is a negative for",
    "infonce-upstream-along-candidates": "the upstream gradient G_l [B] broadcast along the candidates (column j "
                                         "scaled by G_l[j]) where each query row's belongs (G_l[:, None])",
    "infonce-candidates-no-normalisation": "cosine similarity: the candidates' gradient skips the backward of their "
                                           "normalisation (d(c / |c|) taken as the identity); the queries' has it",
    "infonce-queries-no-normalisation": "cosine similarity: the queries' gradient skips the backward of their "
                                        "normalisation (d(q / |q|) taken as the identity); the candidates' has it",
    "infonce-dtau-sign": "G_tau = +sum(G_z s) / tau^2: the sign of d(s / tau) / d tau lost",
    "infonce-cosine-no-projection": "cosine similarity: d(x / |x|) taken as 1 / |x|, without the projection "
                                    "-u (u . g) / |x| that removes the gradient along x (the norm treated as a "
                                    "constant: detached, stop_gradient)",
    "infonce-softmax-axis": "the softmax of the backward normalised over the queries (axis 0) instead of the "
                            "candidates",
    "infonce-upstream-ignored": "the backward ignores the upstream gradient of each query's loss (G_z = A - onehot, "
                                "as if every G_l were 1: right only for a plain sum)",
    "infonce-dtau-no-upstream": "G_tau ignores the upstream gradient of each query's loss (-sum((A - onehot) s) / "
                                "tau^2, as if every G_l were 1), while G_q and the candidates' take it",
    "infonce-negatives-order": "in-batch: the hard negatives' gradient unflattened in (k, B) order where the forward "
                               "flattened them (B, k)",
    "infonce-dq-untransposed": "G_Q = G_s^T C: the logits' gradient transposed (G_s C belongs; the shapes agree when "
                               "every query has as many candidates as there are queries)",
    "infonce-candidates-untransposed": "G_C = G_s Q without the transpose of G_s (G_s^T Q; the shapes agree when "
                                       "every query has as many candidates as there are queries)",
}


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation (``user.build_user``), its faults and known mistakes the candidate causes."""
    return user.build_user(sc, faults, sizes, mistakes=user_engine.mistakes(FAULTS, MISTAKES))


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
    # the analytic gradients' own rounding (their terms, as for a user's code): where the softmax saturates the
    # true gradient is far below it, and a rounding-sized analytic value against a numeric 0 is no error
    terms = _terms(data["q"], data["p"], data.get("n"), data.get("tau", tau_fixed), g, sim, in_batch)
    eps = float(np.finfo(np.dtype(sc.dtype)).eps)
    return dense.problem(
        sc, data, fwd, grads, g, lift={"tau": 2}, magnitude=magnitude, invariants=checks, work_factor=8.0 * s.shape[-1],
        structure=_STRUCTURE, arrays={"logit_gradient": g_z}, step_sizes={"tau": abs(float(tau_fixed))},
        analytic_rounding={t: INVARIANT_ULPS * eps * np.broadcast_to(terms[t], grads[t].shape) for t in grads
                           if t in terms})


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

#: The space ``attn-gradcheck hunt`` searches: the batch (the in-batch negatives), the width, the hard negatives and
#: temperature where the scenario sets them, and dtype; the similarity is the code's.
SPACE = (Axis("dtype", "choice", choices=("float64", "float32")),
         Axis("batch", low=1, high=64, edges=(1, 2, 3, 8, 16, 17)),
         Axis("dim", low=1, high=256, edges=(1, 2, 3, 8, 16, 17, 64, 128, 256)),
         Axis("hard_negatives", low=1, high=4, when_set=True),
         Axis("temperature", "choice", choices=(0.1, 0.05, 0.01, 1.0), when_set=True))

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
        example=EXAMPLE, space=SPACE)

