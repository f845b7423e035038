"""The built-in NumPy engine: the closed forms of ``formulas`` with faults injected; finite differences
evaluate the same forward through ``copies.Forward``, checked against ``formulas.forward`` in every run."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from ...numeric import SeedStream
from ..registry import Problem, SecondOrder, Tangents
from . import copies, formulas, varlen
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

    def fwd(q, k, v):
        return forward(q, k, v, faults=faults, **seen.kw), attention_weights(q, k, faults=faults, **seen.kw)

    def bwd(q, k, v, grad_o):
        return backward(q, k, v, grad_o=grad_o, faults=faults, **back.kw)

    def reference(q, k, v):
        return forward(q, k, v, faults=faults, **seen.kw)

    # Finite differences evaluate the same forward by blocks of query rows (copies.py), checked
    # against the reference in every run.
    fast = copies.Forward(None if "mask" in faults else shown, scale, kv_map, sc.n_q, sc.n_k, stages=stages)

    def copies_forward(name: str, x: np.ndarray) -> np.ndarray:
        if name in extra:  # a stage's parameter moved: its perturbed copies in the stages
            return fast(**qkv, stages=score_stages.moved(stages, name, x))
        return fast(**{**qkv, name: x})

    o, a = fwd(q, k, v)
    grads = bwd(q, k, v, g)
    rounding, rounding_total = blocks.rounding(inputs, g, a, scale, kv_map, stages=right)
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
        loss=lambda name, x: np.sum(copies_forward(name, x) * g, axis=(-4, -3, -2, -1), dtype=np.float64),
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
                            if stages else None),
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": grads.q, "analytic_k": grads.k, "analytic_v": grads.v,
                **extra, **{f"analytic_{t}": grads.params[t] for t in extra}},
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
        loss_parts=lambda name, x: blocks.sums(name, copies_forward(name, x) * g),
        **diagnosis_fields(sc),
    )
