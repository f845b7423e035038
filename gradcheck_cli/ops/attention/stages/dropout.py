"""Attention dropout with a keep mask (``dropout: {p: 0.1}``): the weights after the softmax are multiplied by
W = M / (1 - p), M a boolean keep mask the tool draws from the scenario's seed (its own stream), so

    O = (A * W) V,    dV = (A * W)^T dO,    dA = (dO V^T) * W,    dS = A (dA - D),  D = rowsum(A * dA) = rowsum(dO * O)

is a fixed function of q, k and v and finite differences are well defined. The stage is the identity on the scores
and gives the engines its weights instead (:meth:`Dropout.weights`, a block of W for a block of rows and keys); A
itself (what the softmax gives, its rows summing to 1) is unchanged. Your code is passed ``keep_mask=`` (bool
[B, Hq, n_q, n_k], True = kept) and ``dropout_p=``.

A mask your code draws (``dropout: {p, drawn_by: code}``): the stage holds a :class:`CodeMask` (the seed, and the
mask once the code's first call returned it; ``drawn_mask`` wraps the code and checks its masks). The code is passed
``dropout_p=`` and ``dropout_seed=`` (an int) and returns ``(o, keep_mask)`` (``(o, lse, keep_mask)``); the
gradients are checked against the mask it returned.

Faults: ``dropout-scale-p`` (the kept weights scaled by p instead of 1 / (1 - p), in forward and backward),
``dropout-ds-dropped`` (the backward's dS built from the dropped weights A * W instead of A), ``dropout-dv-unmasked``
(dV = A^T dO, the mask missing from dV)."""
from __future__ import annotations

import numpy as np

from ....numeric import SeedStream
from ...registry import Fault, Param
from .base import ALL, Registration, Stage

KEY = "dropout"
#: Bytes of weight blocks kept for reuse.
CACHE_BYTES = 32 * 2**20
#: Who draws the keep mask: the tool (from the scenario's seed, passed as keep_mask=) or the code (from dropout_seed=).
DRAWN_BY = ("tool", "code")
#: What dropout does not cover yet (``attn-gradcheck ops``; ``validate`` refuses it with the key).
LIMIT = ("dropout: {p} is checked in float64 and float32 along the VJP, with the keep mask the tool draws: not yet in "
         "half precision, on the torch closed forms, or along check.mode jvp / hvp")


class Dropout(Stage):
    name = KEY
    batched_kwargs = ("keep_mask",)  # [B, ...]: stacked with the inputs' copies along the batch axis
    post_softmax = True

    def __init__(self, keep: np.ndarray | None, p: float, drawn: CodeMask | None = None):
        self._keep, self.p, self.drawn = keep, float(p), drawn
        self._cache: dict = {}  # blocks of W by (rows, cols, dtype), asked for again and again
        self._cached = 0
        if drawn is not None:
            self.batched_kwargs = ()  # the code draws its mask: nothing to stack with the copies

    @property
    def keep(self) -> np.ndarray:
        """The keep mask [B, Hq, n_q, n_k]: the tool's, or the one the code returned on its first call."""
        if self._keep is None:
            if self.drawn is None or self.drawn.mask is None:
                raise RuntimeError("the keep mask of dropout: {drawn_by: code} is asked for before the code's "
                                   "first call")
            return self.drawn.mask
        return self._keep

    def _same(self, cls=None):
        return (cls or Dropout)(self._keep, self.p, self.drawn)

    def factor(self) -> float:
        """The weight of a kept entry: 1 / (1 - p)."""
        return 1.0 / (1.0 - self.p)

    def weights(self, rows=ALL, cols=ALL, dtype=np.float64):
        """W on a block of rows and keys [B, Hq, len(rows), len(cols)] in ``dtype``: the kept entries' factor, 0 for
        the dropped (kept for reuse up to ``CACHE_BYTES``: the fast forward asks for the same blocks every call)."""
        key = (rows.start, rows.stop, cols.start, cols.stop, np.dtype(dtype).str)
        if key in self._cache:
            return self._cache[key]
        w = (self.keep[..., rows, cols] * self.factor()).astype(dtype, copy=False)
        if self._cached + w.nbytes <= CACHE_BYTES:
            self._cache[key] = w
            self._cached += w.nbytes
        return w

    def backward_weights(self, rows=ALL, cols=ALL):
        """The weights the backward applies to dV and dA (the same W; a fault's differ)."""
        return self.weights(rows, cols)

    def score_weights(self, rows=ALL, cols=ALL):
        """The weights the backward's dS takes A with: None for A itself (a fault's: W)."""
        return None

    @property
    def kwargs(self) -> dict:
        if self.drawn is not None:
            return {"dropout_p": self.p, "dropout_seed": self.drawn.seed}
        return {"keep_mask": self.keep, "dropout_p": self.p}

    @property
    def key(self) -> tuple:
        if self.drawn is not None:
            return (type(self).__name__, self.p, "code", self.drawn.seed)
        return (type(self).__name__, self.p, self.keep.shape, np.packbits(self.keep).tobytes())

    @property
    def label(self) -> str:
        return f"dropout {self.p:g}"


class CodeMask:
    """The keep mask the code draws from ``seed`` (``drawn_by: code``): None until its first call returns it
    (``drawn_mask.Drawn`` sets it), shared by the stage and its faults' copies."""

    def __init__(self, seed: int, p: float, shape: tuple):
        self.seed, self.p, self.shape = seed, p, tuple(shape)
        self.mask: np.ndarray | None = None


class _ScaledByP(Dropout):
    """dropout-scale-p: kept entries weighted p instead of 1 / (1 - p), forward and backward."""

    def factor(self) -> float:
        return self.p


class _OverP(Dropout):
    """A mistake the hints know (no fault): kept weights divided by p instead of 1 - p."""

    def factor(self) -> float:
        return 1.0 / self.p


class _DsDropped(Dropout):
    """dropout-ds-dropped: the backward's dS = (A * W) (dA - D), built from the dropped weights."""

    def score_weights(self, rows=ALL, cols=ALL):
        return self.weights(rows, cols)


class _DvUnmasked(Dropout):
    """dropout-dv-unmasked: dV = A^T dO, the mask and its factor missing from dV."""

    def backward_weights(self, rows=ALL, cols=ALL):
        return None


def make(sc) -> Dropout | None:
    given = sc.p(KEY)
    if given is None:
        return None
    given = dict(given)
    p = float(given["p"])
    rng = np.random.default_rng([sc.seed, SeedStream.DROPOUT])
    shape = (sc.batch, sc.heads_q, sc.n_q, sc.n_k)
    if given.get("drawn_by", "tool") == "code":
        return Dropout(None, p, CodeMask(int(rng.integers(2**31 - 1)), p, shape))
    return Dropout(rng.random(shape) >= p, p)


def validate(sc_params: dict, attention: dict) -> list:
    """(key, message, hint) for a p out of range, and where dropout is not built yet."""
    given = sc_params.get(KEY)
    if given is None:
        return []
    p = dict(given)["p"]
    if not 0.0 < p < 1.0:
        return [(f"{KEY}.p", f"is {p:g}; a dropout probability is in (0, 1)", "e.g. p: 0.1")]
    fix = "remove dropout for this scenario"
    if dict(given).get("drawn_by", "tool") == "code" and not attention["implementation"]:
        return [(f"{KEY}.drawn_by", "is code, but the scenario checks no code of yours: the engines use the mask the "
                                    "tool draws", "remove drawn_by, or set implementation:")]
    if attention["mode"] in ("jvp", "hvp"):
        return [(KEY, f"dropout is checked along the VJP, not check.mode {attention['mode']} yet", fix)]
    if attention["backend"] == "torch" and not attention["implementation"]:
        return [(KEY, "dropout runs on the NumPy engines (naive, tiled) and NumPy, torch and JAX implementations, not "
                      "the torch closed forms yet", f"{fix}, or backend: numpy")]
    if attention["dtype"] in ("float16", "bfloat16"):
        return [(KEY, f"dropout is checked in float64 and float32, not {attention['dtype']} yet", f"{fix}, or dtype: "
                                                                                                   "float32")]
    return []


_SCENARIO = ((KEY, {"p": 0.3}),)

REGISTRATION = Registration(
    key=KEY,
    param=Param("mapping", None, "attention dropout with a keep mask the tool draws from the scenario's seed: the "
                                 "weights after the softmax times M / (1 - p)",
                fields=(("p", Param("float", 0.1, "the dropout probability, in (0, 1)")),
                        ("drawn_by", Param("choice", "tool", "tool (the keep mask drawn from the scenario's seed, "
                                                             "passed as keep_mask=) or code (your code draws it from "
                                                             "dropout_seed= and returns (o, keep_mask))",
                                           choices=DRAWN_BY)))),
    make=make,
    faults={f.name: f for f in (
        Fault("dropout-scale-p", "dropout: the kept weights scaled by p instead of 1 / (1 - p) (forward and "
                                 "backward)",
              ("shifting every V row shifts O by as much", "O rows in the range of visible V rows"), forward=True,
              scenario=_SCENARIO, backends=("numpy",)),
        Fault("dropout-ds-dropped", "dropout: the backward's dS built from the dropped weights A * W instead of A",
              ("gradient q", "gradient k", "score-gradient rows sum to 0", "backward agrees with the reference",
               "gradient bias", "gradient relative_bias", "gradient alibi_slopes", "gradient sinks"),
              user="adds to the implementation's gradients the change this bug makes to the float64 reference's",
              scenario=_SCENARIO, backends=("numpy",)),
        Fault("dropout-dv-unmasked", "dropout: dV = A^T dO, the keep mask and its factor missing from dV",
              ("gradient v", "backward agrees with the reference"),
              user="adds to the implementation's gradients the change this bug makes to the float64 reference's",
              scenario=_SCENARIO, backends=("numpy",)),
    )},
    wrong={"dropout-scale-p": lambda st, visible: (st._same(_ScaledByP), visible),
           "dropout-ds-dropped": lambda st, visible: (st._same(_DsDropped), visible),
           "dropout-dv-unmasked": lambda st, visible: (st._same(_DvUnmasked), visible)},
    backward_only=("dropout-ds-dropped", "dropout-dv-unmasked"),
    validate=validate,
    normaliser=True,
    passes="keep_mask= (bool [B, Hq, n_q, n_k], True = kept) and dropout_p= (drawn_by: code: dropout_p= and "
           "dropout_seed=, and the code returns (o, keep_mask))",
)
