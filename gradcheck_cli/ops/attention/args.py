"""Attention's arguments besides q, k and v, as one record: the visible set, the softmax scale, the
query-to-KV head map and the score stages (softcap, bias, ALiBi). The engines, the reference, the hints
and the user-code paths pass one :class:`Args`; the closed forms keep the textbook signature
``forward(q, k, v, visible, scale, kv_map, ..., stages=)`` (A.10), called with ``**args.kw``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Args:
    """visible: bool [B, Hq, n_q, n_k] (True: query i sees key j); scale: the factor of Q K^T; kv_map: int
    [Hq], the KV head each query head reads; stages: the score stages in force (``stages.Stage``); documents: a
    packed batch's, or None (the visible set already keeps them apart)."""
    visible: np.ndarray
    scale: float
    kv_map: np.ndarray
    stages: tuple = ()
    documents: object = None  # a packed batch's (``varlen.Documents``): what a user's code is passed as cu_seqlens

    @classmethod
    def of(cls, sc, stages=()) -> Args:
        """A scenario's arguments, with the stages given (``stages.from_scenario(sc)``, or a fault's)."""
        return cls(sc.visible, sc.scale, np.asarray(sc.kv_map, dtype=np.intp), tuple(stages), sc.documents)

    @property
    def kw(self) -> dict:
        """The keyword arguments of the closed forms: visible, scale, kv_map, stages."""
        return {"visible": self.visible, "scale": self.scale, "kv_map": self.kv_map, "stages": self.stages}

    def but(self, **changes) -> Args:
        """These arguments with some replaced (another visible set, other stages)."""
        return dataclasses.replace(self, **changes)
