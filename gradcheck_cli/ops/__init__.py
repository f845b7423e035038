"""Ops the checker knows, registered in one place: ``OPS`` (name -> Op) and ``FAULTS`` (name -> Fault)."""
from __future__ import annotations

from . import attention, block, infonce, layernorm, logit_scale, projections, rmsnorm, rope, swiglu
from .registry import Fault, Op, Problem

OPS: dict[str, Op] = {op.name: op for op in (attention.OP, projections.OP, rope.OP, rmsnorm.OP, swiglu.OP, block.OP,
                                             infonce.OP, logit_scale.OP, layernorm.OP)}

#: The op of a scenario without ``op:``.
DEFAULT_OP = attention.OP.name

FAULTS: dict[str, Fault] = {name: fault for op in OPS.values() for name, fault in op.faults.items()}

__all__ = ["DEFAULT_OP", "OPS", "FAULTS", "Fault", "Op", "Problem"]
