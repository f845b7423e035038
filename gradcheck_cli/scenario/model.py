"""The frozen ``Scenario`` record the loader builds, and the default mapping of query heads to KV heads."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import implementation
from ..errors import ScenarioError
from ..implementation.modules import ModuleSpec
from ..ops import OPS
from ..ops.attention.formulas import DEFAULT_BLOCK
from ..ops.convention import Convention, default_kv_map  # noqa: F401 (the package exports it)
from ..tolerance import DEFAULT_FACTOR
from .fields import LOW_PRECISION


@dataclass(frozen=True)
class Scenario:
    name: str
    op: str
    batch: int
    mode: str
    samples: int
    directions: int
    colouring: bool
    dtype: str
    epsilon: float
    tolerance: float
    seed: int
    # The fields of attention's keys (``ops.attention.scenario_keys``: the op reads and builds them); the
    # defaults are an op's without them.
    heads_q: int = 1
    heads_kv: int = 1
    kv_map: tuple[int, ...] = (0,)
    n_q: int = 0
    n_k: int = 0
    d_head: int = 0
    d_value: int = 0
    scale: float = 1.0
    causal: str = "none"
    window: tuple[int | None, int | None] | None = None
    key_lengths: tuple[int, ...] | None = None
    documents: Any = None  # a packed batch's documents (``ops.attention.varlen.Documents``, ``varlen:``)
    visible_source: str | None = None
    loss_rows: tuple[int, ...] | None = None
    file: str = ""
    line: int = 0
    index: int = 0  # position in the file's list of scenarios, after sweeps expand
    params: tuple = ()  # the op's own keys (``Op.keys``) as (key, value) pairs
    engine: str = "naive"
    block_q: int = DEFAULT_BLOCK
    block_k: int = DEFAULT_BLOCK
    implementation: str | None = None
    backend: str = "numpy"
    device: str = "cpu"
    factor: float = DEFAULT_FACTOR
    slack: float | None = None  # None: the dtype's default (tolerance.DEFAULT_SLACK)
    nondet_tol: float = 0.0
    visible: np.ndarray = field(default=None, repr=False, compare=False)
    base_dir: str = "."          # the YAML's folder: where ``implementation`` and mask files are found
    implementation_line: int = 0  # the line of the ``implementation`` key
    timeout: float = 900.0       # seconds an isolated run of an implementation may take (``check.timeout``)
    module: ModuleSpec | None = None  # the mapping form of ``implementation`` (factory, weights, call)
    convention: Convention = Convention()  # how an attention implementation is called (``convention:``)
    # ``visible`` (above) is attention's too: the visible set [B, Hq, n_q, n_k] its mask keys make.

    @property
    def derivatives(self) -> tuple[str, ...]:
        """The derivatives the scenario checks: ``jvp`` (forward mode, ``check: {mode: jvp}``), ``hvp`` (double
        backward, ``check: {mode: hvp}``) or ``vjp`` (the gradients, every other mode). A fault of a derivative
        not checked does not apply."""
        return (self.mode,) if self.mode in ("jvp", "hvp") else ("vjp",)

    def p(self, key: str):
        """The value of the op-specific key ``key``."""
        return dict(self.params)[key]

    @property
    def implementation_object(self):
        """The user's implementation, imported on first use (in the process that checks it: the loader
        never runs user code). Raises ScenarioError, placed at the ``implementation`` key, when it
        cannot be imported or used."""
        if self.implementation is None:
            return None
        try:
            return implementation.load(self.implementation, Path(self.base_dir), flavour=self.backend)
        except implementation.LoadError as exc:
            raise ScenarioError(str(exc), file=self.file, line=self.implementation_line or self.line,
                                key=f"scenarios[{self.index}].implementation") from None

    def describe(self) -> str:
        spec = OPS[self.op]
        if spec.describe:
            return spec.describe(self)
        contiguous = self.heads_q % self.heads_kv == 0 and self.kv_map == default_kv_map(self.heads_q, self.heads_kv)
        kv = f"{self.heads_kv}" + ("" if contiguous else f" map={list(self.kv_map)}")
        if self.dtype in LOW_PRECISION:
            how = f"factor {self.factor:g} policy"
        else:
            how = f"{self.mode}{' coloured' if self.colouring else ''}"
        where = f" torch/{self.device}" if self.backend == "torch" else ""
        if self.engine == "tiled":
            where += f" tiled {self.block_q}x{self.block_k}"
        variants = ", ".join(spec.variant_labels(self)) if spec.variant_labels and self.params else ""
        return (f"B={self.batch} Hq={self.heads_q} Hkv={kv} n_q={self.n_q} n_k={self.n_k} "
                f"d={self.d_head}/{self.d_value} {self.dtype}{where} {how}" + (f", {variants}" if variants else ""))
