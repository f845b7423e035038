"""ALiBi (BLOOM, MPT; FlashAttention's ``alibi_slopes``): a linear bias per head, S -> S + m_h d(i, j).

The distance form (FlashAttention's) adds ``-m_h |i + n_k - n_q - j|``, the distance to the lower-right aligned
diagonal; the column form (BLOOM's ``build_alibi_tensor``) adds ``m_h j``. Under a lower-right causal mask they
give the same output: per row they differ by ``m_h (i + n_k - n_q)``, a constant the softmax removes (the
log-sum-exp keeps it). ``slopes: geometric`` are the ALiBi paper's, for any head count (a power of two 2^k:
``2^(-8 i / 2^k)``; otherwise the closest power of two's, then every other slope of twice that many), as
transformers and FlashAttention's tests compute them; or a list, one slope per query head. f' = 1, f'' = 0: the
stage changes no derivative; it never builds an n_q x n_k array of its own beyond the block it is asked for
(the tiled engine stays O(n) in memory). Its faults: ``alibi-slopes-pow2`` (a user's code is given the slopes
of the powers-of-two formula for a head count that is not one, transformers #28380) and
``alibi-offset-backward`` (the backward recomputes the bias without the lower-right offset n_k - n_q)."""
from __future__ import annotations

import math

import numpy as np

from ...registry import Fault, Param
from .base import ALL, Registration, Stage, added

KEY = "alibi"
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

    def __init__(self, slopes, form: str, n_q: int, n_k: int, offset: bool = True):
        self.slopes = np.asarray(slopes, dtype=np.float64)
        self.form, self.n_q, self.n_k, self.offset = form, n_q, n_k, offset
        self._cache: dict = {}
        self._cached = 0

    def bias(self, rows=ALL, cols=ALL) -> np.ndarray:
        """m_h d(i, j) for the block's rows and keys, [Hq, len(rows), len(cols)] in float64."""
        key = (rows.start, rows.stop, cols.start, cols.stop)
        if key in self._cache:
            return self._cache[key]
        i = np.arange(self.n_q)[rows][:, None]
        j = np.arange(self.n_k)[cols][None, :]
        if self.form == "distance":
            d = -np.abs(i + (self.n_k - self.n_q if self.offset else 0) - j).astype(np.float64)
        else:
            d = np.broadcast_to(j.astype(np.float64), (i.shape[0], j.shape[1]))
        b = self.slopes[:, None, None] * d
        if self._cached + b.nbytes <= CACHE_BYTES:
            self._cache[key] = b
            self._cached += b.nbytes
        return b

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return added(s, self.bias(rows, cols), xp)

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
        return (type(self).__name__, self.form, self.n_q, self.n_k, self.offset, self.slopes.tobytes())

    @property
    def label(self) -> str:
        return f"alibi {self.form}"


def make(sc) -> Alibi | None:
    given = sc.p(KEY)
    if given is None:
        return None
    params = dict(given)
    slopes = params["slopes"]
    return Alibi(geometric(sc.heads_q) if slopes == "geometric" else slopes, params["form"], sc.n_q, sc.n_k)


def validate(sc_params: dict, attention: dict) -> list:
    """(key, message, hint) for slopes that do not match the query heads."""
    given = sc_params.get(KEY)
    if given is None:
        return []
    slopes, heads = dict(given)["slopes"], attention.get("heads_q")
    if slopes != "geometric" and heads is not None and len(slopes) != heads:
        return [(f"{KEY}.slopes", f"has {len(slopes)} slopes but heads_q is {heads}",
                 "give one slope per query head, or slopes: geometric")]
    return []


def _applies(sc, fault: str) -> str | None:
    params = dict(sc.p(KEY))
    if fault == "alibi-slopes-pow2":
        if params["slopes"] != "geometric":
            return "the slopes are given, not the geometric ones"
        if math.log2(sc.heads_q).is_integer():
            return f"{sc.heads_q} query heads is a power of two: both formulas agree"
    if fault == "alibi-offset-backward":
        if params["form"] != "distance":
            return "the column form has no offset"
        if sc.n_q == sc.n_k:
            return "n_q = n_k: the offset n_k - n_q is 0"
    return None


REGISTRATION = Registration(
    key=KEY,
    param=Param("mapping", None, "ALiBi: the scores get m_h d(i, j), slopes m per query head (geometric: the "
                                 "paper's for any head count, or a list), form distance (-m |i + n_k - n_q - j|, "
                                 "FlashAttention's) or column (m j, BLOOM's)",
                fields=(("slopes", Param("choice-or-floats", "geometric", "geometric, or one slope > 0 per query "
                                                                          "head", choices=("geometric",))),
                        ("form", Param("choice", "distance", "distance or column", choices=FORMS)))),
    make=make,
    faults={f.name: f for f in (
        Fault("alibi-slopes-pow2", "ALiBi: the slopes of the powers-of-two formula 2^(-8 (i + 1) / H) for a head "
                                   "count that is not a power of two (transformers #28380)",
              ("forward agrees with the reference", "backward agrees with the reference"), forward=True,
              engine=False, user="passes the implementation those slopes (alibi_slopes=)",
              scenario=((KEY, {"slopes": "geometric"}),)),
        Fault("alibi-offset-backward", "ALiBi: the backward recomputes the bias without the lower-right offset "
                                       "(-m |i - j| where n_q != n_k)",
              ("gradient q", "gradient k", "gradient v", "backward agrees with the reference",
               "score-gradient rows sum to 0",  # the tiled backward's P from the forward's log-sum-exp
               "gradient bias"),  # a bias's gradient (dS) where one is checked
              user="adds to the implementation's gradients the change this bug makes to the float64 reference's",
              scenario=((KEY, {"slopes": "geometric"}),)),
    )},
    wrong={"alibi-slopes-pow2": lambda st, visible: (Alibi(powers_of_two(len(st.slopes)), st.form, st.n_q, st.n_k),
                                                     visible),
           "alibi-offset-backward": lambda st, visible: (Alibi(st.slopes, st.form, st.n_q, st.n_k, offset=False),
                                                         visible)},
    backward_only=("alibi-offset-backward",),
    applies=_applies,
    validate=validate,
    passes="alibi_slopes= [Hq], and alibi_form=column for the column form",
)
