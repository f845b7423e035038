"""The built-in NumPy engine: the closed forms of ``formulas`` with faults injected; finite differences
evaluate the same forward through ``copies.Forward``, checked against ``formulas.forward`` in every run."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ...numeric import SeedStream
from ..registry import Problem, SecondOrder, Tangents
from . import copies, formulas, lse, varlen
from . import stages as score_stages
from .args import Args
from .directional import hvp, hvp_terms, jvp, jvp_terms
from .formulas import attention_weights, backward, forward
from .hints.tangent import jvp_hints
from .inputs import seeded_inputs
from .invariants import engine_invariants
from .reference import diagnosis_fields
from .rounding import Blocks, output_term_sizes, output_terms, term_sizes


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """Inputs for scenario ``sc``, the loss L = sum(O * G), analytic gradients and invariants of the
    built-in engine with ``faults`` injected (``sizes`` is unused: no built-in fault is sized)."""
    qkv, g = seeded_inputs(sc)
    q, k, v = qkv["q"], qkv["k"], qkv["v"]
    dt = np.dtype(sc.dtype)
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible, scale = sc.visible, sc.scale
    # the score stages, a stage fault's wrong one in place of the right one (with the visible set the softmax
    # then sees: ``shown``); the invariants keep the scenario's visible set. A stage's parameter whose gradient
    # is checked (an additive bias) is an input beside q, k, v.
    right = score_stages.from_scenario(sc)
    stages, back, shown = score_stages.inject(right, visible, faults)  # the forward's and the backward's
    shown = varlen.shown(sc, shown, faults)  # a packed batch's fault: the visible set it makes
    extra = score_stages.params(right)
    inputs = {**qkv, **extra}
    seen, true = Args(shown, scale, kv_map, stages), Args(visible, scale, kv_map, right)
    back = seen.but(stages=back)
    blocks = Blocks(sc, kv_map, score_stages.owners(right))
    grad_lse = lse.upstream(sc) if lse.wanted(sc) else None  # the log-sum-exp as a second output: its G_L

    def fwd(q, k, v):
        return forward(q, k, v, faults=faults, **seen.kw), attention_weights(q, k, faults=faults, **seen.kw)

    def bwd(q, k, v, grad_o, grad_lse=None):
        return backward(q, k, v, grad_o=grad_o, faults=faults, grad_lse=grad_lse, **back.kw)

    def reference(q, k, v):
        return forward(q, k, v, faults=faults, **seen.kw)

    # Finite differences evaluate the same forward by blocks of query rows (copies.py), checked
    # against the reference in every run.
    fast = copies.Forward(None if "mask" in faults else shown, scale, kv_map, sc.n_q, sc.n_k, stages=stages)

    def copies_forward(name: str, x: np.ndarray, with_lse: bool = False):
        if name in extra:  # a stage's parameter moved: its perturbed copies in the stages
            return fast(**qkv, stages=score_stages.moved(stages, name, x), with_lse=with_lse)
        return fast(**{**qkv, name: x}, with_lse=with_lse)

    def loss_terms(name: str, x: np.ndarray) -> np.ndarray:
        """The terms of L per element of O for perturbed copies: O G, and with the LSE an output its share
        LSE_i G_L_i spread over row i's elements (the row's block)."""
        if grad_lse is None:
            return copies_forward(name, x) * g
        o, values = copies_forward(name, x, with_lse=True)  # in float64: the LSE's terms dwarf O's
        return (o.astype(np.float64) * g + (lse.returned(values.astype(np.float64), faults) * grad_lse)[..., None]
                / o.shape[-1])

    o, a = fwd(q, k, v)
    drop = score_stages.post(right)  # dropout: O = (A * W) V (the term sizes take W from the stages)
    dropout = None
    if drop is not None:
        w = drop.weights()
        a64 = formulas.attention_weights(q.astype(np.float64), k.astype(np.float64), **true.kw)
        dropout = (w, (a64 * w).sum(axis=-1))
    grads = bwd(q, k, v, g, grad_lse)
    lse_values = None if grad_lse is None else formulas.log_sum_exp(q, k, **seen.kw)
    rounding, rounding_total = blocks.rounding(inputs, g, a, scale, kv_map, stages=right,
                                               lse=None if grad_lse is None else (grad_lse, lse_values))
    rng_inv = np.random.default_rng([sc.seed, SeedStream.INVARIANTS])
    second = None
    if sc.mode == "hvp":  # the double backward: H u against differences of these very gradients
        def moved_gradients(**moved) -> dict:
            at = {**qkv, **moved}
            grads = bwd(at["q"], at["k"], at["v"], g)
            return {"q": grads.q, "k": grads.k, "v": grads.v}

        second = SecondOrder(
            gradients=moved_gradients,
            hvp=lambda u: dict(zip("qkv", hvp(q, k, v, grad_o=g, dq=u.get("q"), dk=u.get("k"), dv=u.get("v"),
                                              faults=faults, **back.kw))),
            hvp_terms=lambda u: dict(zip("qkv", hvp_terms(q, k, v, grad_o=g, dq=u.get("q"), dk=u.get("k"),
                                                          dv=u.get("v"), **true.kw))),
            gradient_terms=term_sizes(qkv, g, lambda span: a[..., span, :], scale, kv_map, stages=right))

    def o_dot(t: dict) -> np.ndarray:
        """The engine's JVP along tangents t (by input name; missing: zero)."""
        return jvp(q, k, v, dq=t.get("q"), dk=t.get("k"), dv=t.get("v"), faults=faults, **seen.kw)

    return Problem(
        inputs=inputs,
        loss=lambda name, x: np.sum(loss_terms(name, x), axis=(-4, -3, -2, -1), dtype=np.float64),
        gradients={"q": grads.q, "k": grads.k, "v": grads.v, **{t: grads.params[t] for t in extra}},
        rounding=rounding,
        rounding_total=rounding_total,
        copy_bytes=3 * a.size * dt.itemsize + o.size * dt.itemsize,
        invariants=lambda: [copies.agreement(fast, reference, qkv, seen, faults,
                                             np.random.default_rng([sc.seed, SeedStream.FAST_FORWARD]))]
        + engine_invariants(fwd, bwd, qkv, visible, kv_map, grads, rng_inv,
                            output_terms(qkv, a, scale, kv_map, right), g, sc.documents,
                            formulas.sink_weight(q.astype(np.float64), k.astype(np.float64),
                                                 **seen.but(visible=None if "mask" in faults else shown).kw)
                            if stages else None, dropout),
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": grads.q, "analytic_k": grads.k, "analytic_v": grads.v,
                **extra, **{f"analytic_{t}": grads.params[t] for t in extra},
                **({} if grad_lse is None else {"lse": lse_values, "grad_lse": grad_lse})},
        output=o,
        tangents=Tangents(
            forward=lambda **moved: fast(**{**qkv, **moved}),
            jvp=o_dot,
            jvp_terms=lambda t: jvp_terms(q, k, v, dq=t.get("q"), dk=t.get("k"), dv=t.get("v"), **true.kw),
            output_terms=output_term_sizes(qkv, lambda span: a[..., span, :], scale, kv_map, stages=right),
            upstream=g,
            explain=jvp_hints(o_dot, qkv, true, [sc.seed, SeedStream.TANGENT_HINTS])),
        second=second,
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, loss_terms(name, x)),
        **diagnosis_fields(sc),
    )
