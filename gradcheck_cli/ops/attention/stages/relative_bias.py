"""T5's relative position bias: S -> S + W[bucket(j - i'), h], a learned table W [buckets, Hq] (the weight of
T5's ``relative_attention_bias`` embedding): ``relative_bias: {buckets: 32, max_distance: 128, bidirectional:
true, grad: true}``.

The bucket of a relative position is T5's ``_relative_position_bucket`` (transformers' T5Attention): exact for
small distances, logarithmic up to ``max_distance``, the last bucket beyond; bidirectional tables give keys
after the query the upper half. The relative position of query row i and key j is ``j - (i + n_k - n_q)``: the
queries aligned with the last keys (lower-right, as a decoder with a cache sees them; T5's own when n_q = n_k).
The table's values are seeded (standard normal, the stages' own stream). With ``grad: true`` (the default) the
table is an input like q, k and v: dW[b, h] = the sum of dS[.., h, i, j] over every (batch, i, j) whose pair
falls in bucket b (a scatter-add, the embedding's backward), checked by finite differences. f' = 1, f'' = 0.
Its faults: ``relative-bias-scatter`` (the table's gradient written with ``dW[bucket] += dS``, NumPy's buffered
fancy indexing: a bucket met by many pairs keeps one pair's gradient, not their sum) and
``relative-bias-offset-backward`` (the backward recomputes the buckets without the offset n_k - n_q, the queries
aligned with the first keys)."""
from __future__ import annotations

import hashlib
import math

import numpy as np

from ...registry import Fault, Param
from .base import ALL, Registration, Stage, added, gradient_limits, positions

KEY = "relative_bias"
KWARG = "relative_attention_bias"


def bucket(relative_position, buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
    """T5's ``_relative_position_bucket`` in NumPy: the bucket [0, buckets) of each relative position
    (key position minus query position)."""
    rel = np.asarray(relative_position, dtype=np.int64)
    out = np.zeros(rel.shape, dtype=np.int64)
    if bidirectional:
        buckets //= 2
        out += (rel > 0).astype(np.int64) * buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    exact = buckets // 2
    with np.errstate(divide="ignore"):
        large = exact + (np.log(np.maximum(rel, 1).astype(np.float32) / exact) / math.log(max_distance / exact)
                         * (buckets - exact)).astype(np.int64)
    large = np.minimum(large, buckets - 1)
    return out + np.where(rel < exact, rel, large)


class RelativeBias(Stage):
    name = KEY
    input_dtype_kwargs = (KWARG,)
    param_kwarg = KWARG

    def __init__(self, table, grad: bool, n_q: int, n_k: int, max_distance: int, bidirectional: bool,
                 offset: bool = True, documents=None):
        self.table, self.grad = table, grad
        self.n_q, self.n_k, self.max_distance, self.bidirectional, self.offset = (n_q, n_k, max_distance,
                                                                                  bidirectional, offset)
        self.param = KEY if grad else None
        self.documents = documents  # a packed batch's (query lengths, key lengths): each document's positions
        i, j = positions(n_q, n_k, offset, documents)
        self.buckets = bucket(j[None, :] - i[:, None], self.size, max_distance, bidirectional)

    @property
    def size(self) -> int:
        """The number of buckets (the table's rows)."""
        return self.table.shape[-2]

    def _same(self, table, cls=None, **changes):
        """This stage with its table replaced (and ``changes`` to its settings), as a ``cls`` (a fault's)."""
        given = dict(grad=self.grad, n_q=self.n_q, n_k=self.n_k, max_distance=self.max_distance,
                     bidirectional=self.bidirectional, offset=self.offset, documents=self.documents)
        return (cls or type(self))(table, **{**given, **changes})

    def values(self):
        return self.table

    def moved(self, x):
        return self._same(x)

    def lead(self) -> tuple:
        return self.table.shape[:-2] + (1, 1)  # perturbed copies' axes, then the batch and heads (broadcast)

    def _block(self, rows, cols, xp=np):
        """W[bucket(i, j), h] for the block, [..., 1, Hq, len(rows), len(cols)]."""
        idx = self.buckets[rows, cols]
        t = self.table
        if xp is not np and xp.__name__ == "torch" and isinstance(t, xp.Tensor):  # a leaf of autograd
            g = t[..., xp.as_tensor(idx, device=t.device), :]
            return g.movedim(-1, -3).unsqueeze(-4)
        g = np.asarray(t)[..., idx, :]
        return np.expand_dims(np.moveaxis(g, -1, -3), -4)

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return added(s, self._block(rows, cols, xp), xp)

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        """The embedding's backward: dS summed into the bucket of each (i, j), per head: [buckets, Hq]."""
        heads = g_out.shape[-3]
        per_head = np.asarray(g_out).reshape((-1, heads) + g_out.shape[-2:]).sum(axis=0).reshape(heads, -1)
        idx = (self.buckets[rows, cols].ravel()[None, :] + self.size * np.arange(heads)[:, None]).ravel()
        summed = np.bincount(idx, weights=per_head.ravel(), minlength=heads * self.size)
        return summed.reshape(heads, self.size).T

    def param_add(self, total, block, rows=ALL, cols=ALL):
        total += block

    def block_index(self) -> np.ndarray:
        # an entry W[b, h] moves every row of head h (in every batch element): its block is the head
        return np.broadcast_to(np.arange(self.table.shape[-1]), self.table.shape[-2:])

    def block_sums(self, rows: np.ndarray) -> np.ndarray:
        return rows.sum(axis=(-3, -1))  # [..., B, Hq, n_q] -> [..., Hq]

    def error(self, size, s, rows=ALL, cols=ALL):
        return size + np.abs(s) + np.abs(self._block(rows, cols))

    def bound(self, b: float) -> float:
        return b + float(np.abs(self.table).max(initial=0.0))

    @property
    def kwargs(self) -> dict:
        return {KWARG: self.table}

    @property
    def key(self) -> tuple:
        t = np.asarray(self.table)
        return (type(self).__name__, t.shape, str(t.dtype), hashlib.sha256(t.tobytes()).hexdigest(),
                self.n_q, self.n_k, self.max_distance, self.bidirectional, self.offset, self.documents)

    @property
    def label(self) -> str:
        return (f"relative bias {self.size} buckets{'' if self.bidirectional else ' causal'}"
                f"{' +grad' if self.grad else ''}")


class _Scatter(RelativeBias):
    """relative-bias-scatter: ``dW[bucket, h] += dS`` with NumPy's buffered fancy indexing (one pair per bucket)."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        heads = g_out.shape[-3]
        per_head = np.asarray(g_out).reshape((-1, heads) + g_out.shape[-2:]).sum(axis=0)
        out = np.zeros((self.size, heads))
        for h in range(heads):
            out[self.buckets[rows, cols], h] += per_head[h]  # the bug: repeated buckets are written, not summed
        return out


def make(sc) -> RelativeBias | None:
    given = sc.p(KEY)
    if given is None:
        return None
    params = dict(given)
    from ....numeric import SeedStream
    table = np.random.default_rng([sc.seed, SeedStream.STAGES, 1]).standard_normal((params["buckets"], sc.heads_q))
    if sc.dtype in ("float64", "float32"):  # half precision: the engines round it with the other inputs
        table = table.astype(sc.dtype)
    return RelativeBias(table, params["grad"], sc.n_q, sc.n_k, params["max_distance"], params["bidirectional"],
                        documents=None if sc.documents is None else sc.documents.pair)


def validate(sc_params: dict, attention: dict) -> list:
    given = sc_params.get(KEY)
    if given is None:
        return []
    params = dict(given)
    buckets, distance = params["buckets"], params["max_distance"]
    half = buckets // 2 if params["bidirectional"] else buckets
    if half < 2 or (params["bidirectional"] and buckets % 2):
        need = "an even number of at least 4" if params["bidirectional"] else "at least 2"
        return [(f"{KEY}.buckets", f"is {buckets}: a {'bidirectional ' if params['bidirectional'] else ''}table "
                                   f"needs {need}", "T5 uses 32")]
    if distance <= half // 2:
        return [(f"{KEY}.max_distance", f"is {distance}; it must exceed the exact buckets ({half // 2})",
                 "T5 uses 128")]
    return gradient_limits(KEY, "the table", attention) if params["grad"] else []


def _applies(sc, fault: str) -> str | None:
    params = dict(sc.p(KEY))
    if not params["grad"] and fault == "relative-bias-scatter":
        return f"the table's gradient is not checked ({KEY}.grad: false)"
    stage = make(sc)
    if fault == "relative-bias-scatter" and not np.any(np.bincount(stage.buckets.ravel()) > 1):
        return "no bucket is met by two pairs (i, j): the scatter has no repeated index"
    if fault == "relative-bias-offset-backward" and sc.documents is not None:
        if sc.documents.seqlens_q == sc.documents.seqlens_k:
            return "every document has as many queries as keys: each offset L_k - L_q is 0"
    elif fault == "relative-bias-offset-backward" and sc.n_q == sc.n_k:
        return "n_q = n_k: the offset n_k - n_q is 0"
    return None


_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"

class _Flipped(RelativeBias):
    """The relative position taken as i - j (context minus memory): the buckets of the opposite direction."""

    def __init__(self, table, **kw):
        super().__init__(table, **kw)
        i, j = positions(self.n_q, self.n_k, self.offset, self.documents)
        self.buckets = bucket(i[:, None] - j[None, :], self.size, self.max_distance, self.bidirectional)


class _FlippedGrad(RelativeBias):
    """The table's gradient summed into the buckets of i - j (the forward's j - i right)."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        right = self.buckets
        i, j = positions(self.n_q, self.n_k, self.offset, self.documents)
        self.buckets = bucket(i[:, None] - j[None, :], self.size, self.max_distance, self.bidirectional)
        try:
            return super().param_grad(g_out, s, rows, cols)
        finally:
            self.buckets = right


class _Reshaped(RelativeBias):
    """The gathered bias [n_q, n_k, H] turned into [H, n_q, n_k] by a reshape, not a transpose (the whole block)."""

    def _block(self, rows=ALL, cols=ALL, xp=np):
        if rows != ALL or cols != ALL:
            raise ValueError("the reshape scrambles the whole block")
        g = np.asarray(self.table)[..., self.buckets, :]  # [..., n_q, n_k, H]
        return np.expand_dims(g.reshape(g.shape[:-3] + (g.shape[-1], g.shape[-3], g.shape[-2])), -4)


#: Known mistakes of the relative bias's forward: name -> (what it gets wrong, (stage, scenario) -> the wrong stage or
#: None).
FORWARD_MISTAKES = {
    "relative-bias-direction-flipped": ("relative bias: the relative position is taken as i - j (query minus key), "
                                        "not j - i: every bucket of the opposite direction",
                                        lambda st, sc: st._same(st.table, cls=_Flipped)),
    "relative-bias-other-direction-mode": ("relative bias: the buckets of the other mode (bidirectional: an "
                                           "encoder's, or one-way: a decoder's) from the scenario's",
                                           lambda st, sc: st._same(st.table, bidirectional=not st.bidirectional)),
    "relative-bias-reshaped": ("relative bias: the gathered bias [n_q, n_k, H] is made [H, n_q, n_k] by a reshape "
                               "where a transpose belongs (heads and positions scrambled)",
                               lambda st, sc: st._same(st.table, cls=_Reshaped) if sc.heads_q > 1 else None),
    "relative-bias-no-offset": ("relative bias: the query positions are 0 .. n_q-1, without the offset n_k - n_q "
                                "of queries that follow a KV cache",
                                lambda st, sc: st._same(st.table, offset=False) if st.offset and st.n_q != st.n_k
                                else None),
}


REGISTRATION = Registration(
    key=KEY,
    param=Param("mapping", None, "T5's relative position bias: the scores get W[bucket(j - i - (n_k - n_q)), h] "
                                 "(the queries aligned with the last keys, as a KV cache's), a seeded table "
                                 "W [buckets, heads_q] (passed as relative_attention_bias=), T5's buckets; grad: true "
                                 "checks the table's gradient",
                fields=(("buckets", Param("int", 32, "the table's rows (T5: 32)", minimum=2)),
                        ("max_distance", Param("int", 128, "the distance the last bucket starts at (T5: 128)",
                                               minimum=2)),
                        ("bidirectional", Param("bool", True, "keys after the query get their own buckets (T5's "
                                                              "encoder: true; its decoder: false)")),
                        ("grad", Param("bool", True, "check the table's gradient (default true)")))),
    make=make,
    faults={f.name: f for f in (
        Fault("relative-bias-scatter", "relative bias: the table's gradient written dW[bucket] += dS with buffered "
                                       "fancy indexing (a bucket keeps one pair's gradient, not their sum)",
              ("gradient relative_bias", "backward agrees with the reference"), backends=("numpy",), user=_ADDED,
              scenario=((KEY, {"grad": True}),)),
        Fault("relative-bias-offset-backward", "relative bias: the backward recomputes the buckets without the "
                                               "lower-right offset n_k - n_q",
              ("gradient q", "gradient k", "gradient v", "backward agrees with the reference",
               "score-gradient rows sum to 0", "gradient relative_bias",
               "gradient bias", "gradient alibi_slopes"),  # they come from dS too, where checked
              backends=("numpy",), user=_ADDED,
              scenario=((KEY, {"grad": True}),)),
    )},
    wrong={"relative-bias-scatter": lambda st, visible: (st._same(st.table, cls=_Scatter), visible),
           "relative-bias-offset-backward": lambda st, visible: (st._same(st.table, offset=False), visible)},
    backward_only=("relative-bias-scatter", "relative-bias-offset-backward"),
    applies=_applies,
    validate=validate,
    passes=f"{KWARG}= [buckets, Hq] (T5's embedding weight); a NumPy backward returns its gradient last",
    forward_mistakes=FORWARD_MISTAKES,
    mistakes={"relative-bias-backward-direction-flipped": (
        "relative bias: the backward recomputes the buckets of i - j, the opposite direction of the forward's j - i",
        lambda st: st._same(st.table, cls=_Flipped)),
              "relative-bias-grad-direction-flipped": (
        "relative bias: the table's gradient is summed into the buckets of i - j, the opposite direction of the "
        "forward's j - i", lambda st: st._same(st.table, cls=_FlippedGrad))},
)
