"""ALiBi (BLOOM, MPT; FlashAttention's ``alibi_slopes``): a linear bias per head, S -> S + m_h d(i, j).

The distance form (FlashAttention's) adds ``-m_h |i + n_k - n_q - j|``, the distance to the lower-right aligned
diagonal; the column form (BLOOM's ``build_alibi_tensor``) adds ``m_h j``. Under a lower-right causal mask they
give the same output: per row they differ by ``m_h (i + n_k - n_q)``, a constant the softmax removes (the
log-sum-exp keeps it). ``slopes: geometric`` are the ALiBi paper's, for any head count (a power of two 2^k:
``2^(-8 i / 2^k)``; otherwise the closest power of two's, then every other slope of twice that many), as
transformers and FlashAttention's tests compute them; or a list, one slope per query head. f' = 1, f'' = 0: the
stage changes no derivative; it never builds an n_q x n_k array of its own beyond the block it is asked for
(the tiled engine stays O(n) in memory). With ``grad: true`` the slopes are an input like q, k and v (learned
slopes): dm_h = the sum over the batch and every (i, j) of dS[., h, i, j] d(i, j), checked by finite differences.
Its faults: ``alibi-slopes-pow2`` (a user's code is given the slopes
of the powers-of-two formula for a head count that is not one, transformers #28380) and
``alibi-offset-backward`` (the backward recomputes the bias without the lower-right offset n_k - n_q), and for
learned slopes ``alibi-slope-grad-sign`` (dm sums dS |i' - j|: the distance form's sign dropped) and
``alibi-slope-grad-batch`` (dm from the first batch element alone)."""
from __future__ import annotations

import math

import numpy as np

from ...registry import Fault, Param
from .base import ALL, Registration, Stage, added, gradient_limits, positions

KEY = "alibi"
PARAM = "alibi_slopes"  # the input name of the slopes when their gradient is checked
FORMS = ("distance", "column")
#: Bytes of bias blocks kept for reuse (the finite differences ask for the same blocks thousands of times).
CACHE_BYTES = 32 * 2**20


def geometric(heads: int) -> list[float]:
    """The ALiBi paper's slopes for ``heads`` heads (``get_slopes`` of its code, and transformers')."""
    if math.log2(heads).is_integer():
        return powers_of_two(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return powers_of_two(closest) + geometric(2 * closest)[0::2][:heads - closest]


def powers_of_two(heads: int) -> list[float]:
    """The formula for a power of two, 2^(-8 (i + 1) / heads): wrong for other head counts (alibi-slopes-pow2)."""
    start = 2.0 ** (-(2.0 ** -(math.log2(heads) - 3)))
    return [start * start ** i for i in range(heads)]


class Alibi(Stage):
    name = KEY
    param_kwarg = "alibi_slopes"

    def __init__(self, slopes, form: str, n_q: int, n_k: int, offset: bool = True, grad: bool = False,
                 documents=None):
        self.slopes = np.asarray(slopes, dtype=np.float64) if not hasattr(slopes, "requires_grad") else slopes
        self.form, self.n_q, self.n_k, self.offset, self.grad = form, n_q, n_k, offset, grad
        self.documents = documents  # a packed batch's (query lengths, key lengths): each document's positions
        self._i, self._j = positions(n_q, n_k, offset, documents)
        self.param = PARAM if grad else None
        self._cache: dict = {}
        self._cached = 0

    def _same(self, slopes, cls=None, **changes):
        """This stage with its slopes replaced (and ``changes`` to its settings), as a ``cls`` (a fault's)."""
        given = dict(form=self.form, n_q=self.n_q, n_k=self.n_k, offset=self.offset, grad=self.grad,
                     documents=self.documents)
        return (cls or Alibi)(slopes, **{**given, **changes})

    def values(self):
        return self.slopes

    def moved(self, x):
        return self._same(x)

    def lead(self) -> tuple:
        return tuple(self.slopes.shape[:-1]) + (1, 1)  # perturbed copies' axes, then the batch and heads

    def distance(self, rows=ALL, cols=ALL) -> np.ndarray:
        """d(i, j) for the block's rows and keys, [len(rows), len(cols)] in float64."""
        i, j = self._i[rows][:, None], self._j[cols][None, :]  # each document's own in a packed batch
        if self.form == "distance":
            return -np.abs(i - j).astype(np.float64)
        return np.broadcast_to(j.astype(np.float64), (i.shape[0], j.shape[1]))

    def bias(self, rows=ALL, cols=ALL):
        """m_h d(i, j) for the block's rows and keys, [..., Hq, len(rows), len(cols)] in float64 (perturbed slopes
        [C, Hq]: [C, 1, Hq, ...], broadcast over the batch)."""
        if self.slopes.ndim > 1 or not isinstance(self.slopes, np.ndarray):  # copies, or a leaf of autograd
            d = self.distance(rows, cols)
            if isinstance(self.slopes, np.ndarray):
                return self.slopes[..., None, :, None, None] * d
            return self.slopes[..., :, None, None] * self.slopes.new_tensor(d)
        key = (rows.start, rows.stop, cols.start, cols.stop)
        if key in self._cache:
            return self._cache[key]
        b = self.slopes[:, None, None] * self.distance(rows, cols)
        if self._cached + b.nbytes <= CACHE_BYTES:
            self._cache[key] = b
            self._cached += b.nbytes
        return b

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return added(s, self.bias(rows, cols), xp)

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        """dm_h = sum over the batch and the block of dS[., h, i, j] d(i, j): [Hq]."""
        return _weighted(g_out, self.distance(rows, cols))

    def param_terms(self, t, rows=ALL, cols=ALL, power: int = 1):
        return _weighted(t, np.abs(self.distance(rows, cols)) ** power)

    def param_add(self, total, block, rows=ALL, cols=ALL):
        total += block

    def block_index(self) -> np.ndarray:
        return np.arange(self.slopes.shape[-1])  # a slope moves every row of its head

    def block_sums(self, rows: np.ndarray) -> np.ndarray:
        return rows.sum(axis=(-3, -1))  # [..., B, Hq, n_q] -> [..., Hq]

    def error(self, size, s, rows=ALL, cols=ALL):
        # the product m d and the sum round: |m d| and |s + m d| <= |s| + |m d|
        return size + np.abs(s) + 2 * np.abs(self.bias(rows, cols))

    def bound(self, b: float) -> float:
        return b + float(np.abs(self.slopes).max(initial=0.0)) * max(self.n_q, self.n_k)

    @property
    def kwargs(self) -> dict:
        return {"alibi_slopes": self.slopes, **({"alibi_form": self.form} if self.form != "distance" else {})}

    @property
    def key(self) -> tuple:
        return (type(self).__name__, self.form, self.n_q, self.n_k, self.offset, self.grad,
                np.asarray(self.slopes).tobytes(), self.documents)

    @property
    def label(self) -> str:
        return f"alibi {self.form}{' +grad' if self.grad else ''}"


def _weighted(g, d):
    """sum over every axis but the heads of g [..., Hq, r, c] d [r, c] -> [Hq]."""
    g = np.asarray(g)
    return np.einsum("bhij,ij->h", g.reshape((-1,) + g.shape[-3:]), d)


class _SignDropped(Alibi):
    """alibi-slope-grad-sign: dm = sum dS |i' - j|, the distance's sign dropped (the forward adds -m |i' - j|)."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return _weighted(g_out, np.abs(self.distance(rows, cols)))


class _FirstBatch(Alibi):
    """alibi-slope-grad-batch: dm from the first batch element alone, not summed over the batch."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        g = np.asarray(g_out)
        return super().param_grad(g[..., :1, :, :, :], s, rows, cols)


def make(sc) -> Alibi | None:
    given = sc.p(KEY)
    if given is None:
        return None
    params = dict(given)
    slopes = params["slopes"]
    values = np.asarray(geometric(sc.heads_q) if slopes == "geometric" else slopes, dtype=np.float64)
    if params["grad"] and sc.dtype == "float32":  # an input like q, k and v: in their dtype
        values = values.astype(np.float32)
    return Alibi(values, params["form"], sc.n_q, sc.n_k, grad=params["grad"],
                 documents=None if sc.documents is None else sc.documents.pair)


def validate(sc_params: dict, attention: dict) -> list:
    """(key, message, hint) for slopes that do not match the query heads."""
    given = sc_params.get(KEY)
    if given is None:
        return []
    slopes, heads = dict(given)["slopes"], attention.get("heads_q")
    if slopes != "geometric" and heads is not None and len(slopes) != heads:
        return [(f"{KEY}.slopes", f"has {len(slopes)} slopes but heads_q is {heads}",
                 "give one slope per query head, or slopes: geometric")]
    return gradient_limits(KEY, "the slopes", attention) if dict(given)["grad"] else []


def _applies(sc, fault: str) -> str | None:
    params = dict(sc.p(KEY))
    if fault in ("alibi-slope-grad-sign", "alibi-slope-grad-batch") and not params["grad"]:
        return f"the slopes' gradient is not checked ({KEY}.grad: false)"
    if fault == "alibi-slope-grad-sign" and params["form"] != "distance":
        return "the column form's d = j is never negative: no sign to drop"
    if fault == "alibi-slope-grad-batch" and sc.batch == 1:
        return "batch 1: the first batch element is the whole batch"
    if fault == "alibi-slopes-pow2":
        if params["slopes"] != "geometric":
            return "the slopes are given, not the geometric ones"
        if math.log2(sc.heads_q).is_integer():
            return f"{sc.heads_q} query heads is a power of two: both formulas agree"
    if fault == "alibi-offset-backward":
        if params["form"] != "distance":
            return "the column form has no offset"
        if sc.documents is not None and sc.documents.seqlens_q == sc.documents.seqlens_k:
            return "every document has as many queries as keys: each offset L_k - L_q is 0"
        if sc.documents is None and sc.n_q == sc.n_k:
            return "n_q = n_k: the offset n_k - n_q is 0"
    return None


_SLOPE_CAUGHT = ("gradient alibi_slopes", "backward agrees with the reference")
_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"

class _Signed(Alibi):
    """The distance without its absolute value: -(i - j), as if every key were at or before its query."""

    def distance(self, rows=ALL, cols=ALL) -> np.ndarray:
        i, j = self._i[rows][:, None], self._j[cols][None, :]
        return -(i - j).astype(np.float64)


class _GradColumn(Alibi):
    """The slopes' gradient from dS times the column index j (BLOOM's form) while the forward uses the distance."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        j = self._j[cols][None, :]
        return _weighted(g_out, np.broadcast_to(j.astype(np.float64), (self._i[rows].shape[0], j.shape[1])))


class _GradNoOffset(Alibi):
    """The slopes' gradient from the distance without the query offset n_k - n_q (the forward's has it)."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        i, j = positions(self.n_q, self.n_k, False, self.documents)
        i, j = i[rows][:, None], j[cols][None, :]
        d = -np.abs(i - j).astype(np.float64) if self.form == "distance" else np.broadcast_to(
            j.astype(np.float64), (i.shape[0], j.shape[1]))
        return _weighted(g_out, d)


#: Known mistakes of ALiBi's forward: name -> (what it gets wrong, (stage, scenario) -> the wrong stage or None).
FORWARD_MISTAKES = {
    "alibi-slopes-exponent-off-by-one": ("ALiBi: the slopes are 2^(-8 h / H) for h = 0 .. H-1, not 2^(-8 (h + 1) / H) "
                                         "(the exponent off by one)",
                                         lambda st, sc: st._same(np.asarray(st.slopes) * 2.0 ** (8.0 / sc.heads_q))),
    "alibi-sign-flipped": ("ALiBi: the bias is added with the wrong sign (+m |i - j|: far keys favoured)",
                           lambda st, sc: st._same(-np.asarray(st.slopes))),
    "alibi-signed-distance": ("ALiBi: the distance is -(i - j) without its absolute value (right only where no "
                              "key comes after its query, as under a causal mask)",
                              lambda st, sc: st._same(st.slopes, cls=_Signed) if st.form == "distance" else None),
    "alibi-inside-scale": ("ALiBi: added before the softmax scale, scale (q k + m d), not scale q k + m d",
                           lambda st, sc: st._same(np.asarray(st.slopes) * sc.scale) if sc.scale != 1 else None),
    "alibi-slopes-by-kv-head": ("ALiBi: the slopes indexed by KV head (slopes[kv_map]): the query heads of a group "
                                "share one slope",
                                lambda st, sc: st._same(np.asarray(st.slopes)[np.asarray(sc.kv_map)])
                                if sc.heads_kv < sc.heads_q else None),
    "alibi-no-offset": ("ALiBi: the distance is taken without the query offset n_k - n_q (queries aligned with the "
                        "first keys, not the last)",
                        lambda st, sc: st._same(st.slopes, offset=False) if st.offset and st.n_q != st.n_k else None),
}


REGISTRATION = Registration(
    key=KEY,
    param=Param("mapping", None, "ALiBi: the scores get m_h d(i, j), slopes m per query head (geometric: the "
                                 "paper's for any head count, or a list), form distance (-m |i + n_k - n_q - j|, "
                                 "FlashAttention's) or column (m j, BLOOM's)",
                fields=(("slopes", Param("choice-or-floats", "geometric", "geometric, or one slope > 0 per query "
                                                                          "head", choices=("geometric",))),
                        ("form", Param("choice", "distance", "distance or column", choices=FORMS)),
                        ("grad", Param("bool", False, "check the slopes' gradient (learned slopes; default "
                                                      "false)")))),
    make=make,
    faults={f.name: f for f in (
        Fault("alibi-slopes-pow2", "ALiBi: the slopes of the powers-of-two formula 2^(-8 (i + 1) / H) for a head "
                                   "count that is not a power of two (transformers #28380)",
              ("forward agrees with the reference", "lse agrees with the reference",
               "backward agrees with the reference"), forward=True,
              engine=False, user="passes the implementation those slopes (alibi_slopes=)",
              scenario=((KEY, {"slopes": "geometric"}),)),
        Fault("alibi-offset-backward", "ALiBi: the backward recomputes the bias without the lower-right offset "
                                       "(-m |i - j| where n_q != n_k)",
              ("gradient q", "gradient k", "gradient v", "backward agrees with the reference",
               "score-gradient rows sum to 0",  # the tiled backward's P from the forward's log-sum-exp
               # a bias's, the slopes' or T5's table's gradient where checked: they come from dS
               "gradient bias", "gradient alibi_slopes", "gradient relative_bias", "gradient sinks"),
              user="adds to the implementation's gradients the change this bug makes to the float64 reference's",
              scenario=((KEY, {"slopes": "geometric"}),)),
        Fault("alibi-slope-grad-sign", "ALiBi: the slopes' gradient sums dS |i' - j|, the sign of the distance "
                                       "form's -|i' - j| dropped", _SLOPE_CAUGHT, user=_ADDED,
              scenario=((KEY, {"grad": True}),), backends=("numpy",)),
        Fault("alibi-slope-grad-batch", "ALiBi: the slopes' gradient from the first batch element alone, not "
                                        "summed over the batch", _SLOPE_CAUGHT, user=_ADDED,
              scenario=((KEY, {"grad": True}),), backends=("numpy",)),
    )},
    wrong={"alibi-slopes-pow2": lambda st, visible: (st._same(np.asarray(powers_of_two(st.slopes.shape[-1]),
                                                                         dtype=np.asarray(st.slopes).dtype)), visible),
           "alibi-offset-backward": lambda st, visible: (st._same(st.slopes, offset=False), visible),
           "alibi-slope-grad-sign": lambda st, visible: (st._same(st.slopes, cls=_SignDropped), visible),
           "alibi-slope-grad-batch": lambda st, visible: (st._same(st.slopes, cls=_FirstBatch), visible)},
    backward_only=("alibi-offset-backward", "alibi-slope-grad-sign", "alibi-slope-grad-batch"),
    applies=_applies,
    validate=validate,
    passes="alibi_slopes= [Hq] (with grad: true a NumPy backward returns their gradient last), and "
           "alibi_form=column for the column form",
    forward_mistakes=FORWARD_MISTAKES,
    mistakes={"alibi-grad-column-form": ("ALiBi: the slopes' gradient multiplies dS by the column index j (BLOOM's "
                                         "form) while the forward uses the distance -|i - j| (they agree only under "
                                         "a causal mask, up to a constant per row)",
                                         lambda st: st._same(st.slopes, cls=_GradColumn)),
              "alibi-grad-no-offset": ("ALiBi: the slopes' gradient takes the distance without the query offset n_k - "
                                       "n_q while the forward's has it",
                                       lambda st: st._same(st.slopes, cls=_GradNoOffset)
                                       if st.offset and st.n_q != st.n_k else st)},
)
