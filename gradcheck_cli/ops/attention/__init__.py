"""Scaled dot-product attention with visible sets and grouped KV heads, as one self-contained op.

Modules, imported one way (each only from those above it in this list, and none from outside the
package but the shared machinery below ``ops``):
  stages     the score stages between scale * Q K^T and the softmax (soft-capping), each with its faults (a leaf)
  varlen     a packed batch's documents (FlashAttention's varlen): its key, faults and check (a leaf)
  formulas   forward, backward, ``repeat_kv``/``sum_groups``, the faults
  directional  the JVP and the HVP in closed form
  rounding   the size of the terms of O and the gradients (noise floors, agreement)
  reference  seeded inputs, the float64 reference, the faults' interface variants
  invariants semantic checks of attention       hints  likely causes of a failure
  copies     the fast forward of the finite differences
  distributed  context-parallel code on real ranks (``distributed:``): keys, ranks, sharding, the built-in ring
  user_engine  a user's implementation (NumPy, torch or JAX, through ``flavours``, or per-rank code through
             ``distributed.proxy``), above the engines
  naive, tiled_engine (over tiled), torch_engine   the built-in engines, resolved by name from ``OP.engines``
"""
from __future__ import annotations

from ..registry import Engine, Interface, Op
from . import lse, scenario_keys, space, varlen
from . import stages as score_stages
from .directional import hvp, jvp
from .distributed import keys as distributed
from .formulas import (
    ENGINE_FAULTS,
    FAULTS,
    HVP_FAULTS,
    JVP_FAULTS,
    Gradients,
    attention_weights,
    backward,
    forward,
    repeat_kv,
    sum_groups,
)
from .inputs import seeded_inputs
from .memory import need as memory_need
from .overflow import non_finite
from .rounding import output_term_sizes, output_terms, term_sizes

__all__ = ["ENGINE_FAULTS", "FAULTS", "HVP_FAULTS", "JVP_FAULTS", "Gradients", "OP", "attention_weights", "backward",
           "forward", "hvp", "jvp", "repeat_kv", "seeded_inputs", "sum_groups", "output_term_sizes", "output_terms",
           "term_sizes"]


def shapes(sc) -> dict:
    return {"q": (sc.batch, sc.heads_q, sc.n_q, sc.d_head), "k": (sc.batch, sc.heads_kv, sc.n_k, sc.d_head),
            "v": (sc.batch, sc.heads_kv, sc.n_k, sc.d_value)}


def why_not(sc, fault: str) -> str | None:
    """Why a fault cannot apply to a scenario, where its structure says so (what the ranks of a distributed scenario
    are never given first, whichever family the fault is of)."""
    why = distributed.why_not(sc, fault)
    if why:
        return why
    if fault in score_stages.FAULTS:
        return score_stages.why_not(sc, fault)
    if fault in varlen.FAULTS:
        return varlen.why_not(sc, fault)
    if fault in lse.FAULTS:
        return lse.why_not(sc, fault)
    if (distributed.settings(sc) is not None and sc.implementation is None and OP.faults[fault].user is None
            and fault not in distributed.FAULTS):
        return "the built-in ring hosts the context-parallel faults and the interface faults, not this engine's"
    if fault == "swap-dk-dv" and sc.d_head != sc.d_value:
        return f"dK and dV differ in shape (d_head {sc.d_head}, d_value {sc.d_value}): they cannot be swapped"
    if fault in ("mask", "mask-backward", "leak-hidden-key") and sc.visible.all():
        return "every key is visible to every query: there is no mask to ignore"
    if fault == "gqa-sum" and sc.heads_kv == sc.heads_q:
        return "no KV head is shared by several query heads"
    if fault in JVP_FAULTS and sc.mode != "jvp":
        return "the scenario does not check the JVP (check: {mode: jvp})"
    if fault in HVP_FAULTS and sc.mode != "hvp":
        return "the scenario does not check the double backward (check: {mode: hvp})"
    if fault == "jvp-mask" and sc.visible.all():
        return "every key is visible to every query: there is no mask for the tangent to ignore"
    if fault in ("scale", "jvp-scale") and sc.scale == 1.0:
        return "scale is 1: dropping it changes nothing"
    return None

ENGINES = {e.name: e for e in (
    Engine("naive", "gradcheck_cli.ops.attention.naive:build", "the closed forms in NumPy, dense n_q x n_k"),
    Engine("tiled", "gradcheck_cli.ops.attention.tiled_engine:build",
           "FlashAttention-style blocks with an online softmax; no n_q x n_k array", keys=("block_q", "block_k")),
    Engine("implementation", "gradcheck_cli.ops.attention.user_engine:build",
           "a user's implementation: NumPy forward and backward, or a torch or JAX function through its flavour",
           choice=False),
    Engine("torch", "gradcheck_cli.ops.attention.torch_engine:build",
           "the closed forms in torch, with autograd and SDPA as second opinions (torch imported only here)",
           choice=False),
)}


def engine_for(sc) -> str:
    """The engine that checks scenario ``sc``."""
    if sc.implementation is not None or distributed.settings(sc) is not None:
        return "implementation"  # per-rank code, or the built-in ring, on its ranks
    if sc.backend == "torch":
        return "torch"
    return sc.engine


#: What a user's implementation provides (docs/your-code.md "Checking your own implementation").
INTERFACE = Interface(
    flavours=("numpy", "torch", "jax"),
    signature="numpy: an object with forward(q, k, v, visible, scale, kv_map) -> o and backward(q, k, v, visible, "
              "scale, kv_map, grad_o) -> (dq, dk, dv) (for mode jvp also jvp(q, k, v, visible, scale, kv_map, dq, dk, "
              "dv) -> do); torch: a callable (q, k, v, visible, scale, kv_map) -> o, "
              "differentiated by autograd; jax: the same function on JAX arrays, differentiated by jax.vjp",
    args=("visible", "scale", "kv_map"), modules=False,
    conventions=("layout", "mask", "mask_heads", "scale", "lse_layout"))

#: A small scenario on which every fault of the built-in engines applies (the fault contract's).
EXAMPLE = {"batch": 2, "heads_q": 4, "heads_kv": 2, "n_q": 3, "n_k": 10, "d_head": 8,
           "mask": {"causal": "lower-right", "key_lengths": [10, 8]}}

OP = Op(name="attention", summary="scaled dot-product attention (A.10): gradients of q, k, v",
        tensors=("q", "k", "v"),
        faults={**FAULTS, **score_stages.FAULTS, **varlen.FAULTS, **lse.FAULTS, **distributed.FAULTS},
        keys={**score_stages.KEYS, lse.KEY: lse.PARAM, distributed.KEY: distributed.PARAM},
        engines=ENGINES,
        engine_for=engine_for, shared_keys=scenario_keys.KEY_GROUP,
        shapes=shapes, why_not=why_not, non_finite=non_finite, memory=memory_need,
        backends=("numpy", "torch", "jax"), built_in_backends=("numpy", "torch"),
        dtypes=("float64", "float32", "float16", "bfloat16"), low_precision_backends=("torch", "jax"),
        implementation=INTERFACE, colouring=True, example=EXAMPLE, space=space.AXES, tangent_engines=("naive", "tiled"),
        tangent_flavours=("numpy", "torch", "jax"), second_engines=("naive",), second_flavours=("torch", "jax"),
        variants=tuple((r.key, f"{r.param.help} (your code is passed {r.passes})") for r in score_stages.REGISTERED)
        + ((varlen.KEY, f"{varlen.schema()['description'].split('. Your code')[0]} (your code is passed "
                        f"{varlen.PASSES})"),
           (lse.KEY, "[o, lse]: the log-sum-exp of each row a second output with a seeded upstream gradient (your "
                     "code is passed return_lse=True and returns (o, lse); a NumPy backward gets grad_lse=)")),
        validate=lambda params, attention: (score_stages.validate(params, attention) + lse.validate(params, attention)
                                            + distributed.validate(params, attention)),
        limits=score_stages.LIMITS + (lse.LIMIT, score_stages.dropout.LIMIT, distributed.LIMIT),
        variant_labels=lambda sc: score_stages.labels(score_stages.from_scenario(sc))
        + ((sc.documents.label,) if sc.documents is not None else ()) + (("lse output",) if lse.wanted(sc) else ())
        + ((distributed.label(sc),) if distributed.settings(sc) is not None else ()),
        sets=lambda sc, key: key != varlen.KEY or sc.documents is not None)
