"""Logit soft-capping (Gemma 2's ``attn_logit_softcapping``, FlashAttention's ``softcap``): S -> c tanh(S / c).

f' = 1 - t^2 and f'' = -2 t (1 - t^2) / c with t = tanh(S / c); |f(S)| < c. The cap applies to the scores
before any bias or ALiBi and before the mask (a hidden score is never capped: it stays -inf). Its faults:
``softcap-derivative`` (the backward drops the tanh' factor, dS_raw = dS), ``softcap-masked`` (the cap
applied after masking: a hidden score, -inf, becomes -c and the key gets weight), ``softcap-tanh-s`` (the
forward computes S tanh(S), FlashAttention 4's bug, flash-attention #2396; the backward keeps the right
derivative). The invariants all hold: the softmax sees capped scores, and the score-gradient rows (the
gradient at the softmax's input, before the tanh' factor) still sum to 0."""
from __future__ import annotations

import numpy as np

from ...registry import Fault, Param
from .base import ALL, Registration, Stage, block

KEY = "softcap"


class Softcap(Stage):
    name = KEY

    def __init__(self, cap: float):
        self.cap = float(cap)

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return self.cap * xp.tanh(s / self.cap)

    def _t(self, s):
        return np.tanh(s / self.cap)

    def slope(self, s, rows=ALL, cols=ALL, xp=np):
        t = xp.tanh(s / self.cap)
        return 1 - t * t

    def bend(self, s, rows=ALL, cols=ALL, xp=np):
        t = xp.tanh(s / self.cap)
        return (-2.0 / self.cap) * t * (1 - t * t)

    def error(self, size, s, rows=ALL, cols=ALL):
        # the input's error passed on by f', the division's (|s| relative, times f') and tanh's and the product's
        # own (|f(s)| each)
        t = self._t(s)
        return (1 - t * t) * (size + np.abs(s)) + 2 * self.cap * np.abs(t)

    def slope_size(self, s, size, rows=ALL, cols=ALL):
        # |f'| and the rounding of 1 - t^2 (1 + t^2), plus f' moved by the input's error: |f''| (size + |s|)
        t = self._t(s)
        return 2.0 + (2.0 / self.cap) * np.abs(t) * (1 - t * t) * (size + np.abs(s))

    def bound(self, b: float) -> float:
        return min(b, self.cap)

    @property
    def kwargs(self) -> dict:
        return {"softcap": self.cap}

    @property
    def label(self) -> str:
        return f"softcap {self.cap:g}"

    @property
    def key(self) -> tuple:
        return (type(self).__name__, self.cap)


class _DroppedSlope(Softcap):
    """softcap-derivative: the backward's tanh' factor dropped (dS_raw = dS)."""

    def slope(self, s, rows=ALL, cols=ALL, xp=np):
        return None

    def bend(self, s, rows=ALL, cols=ALL, xp=np):
        return None


class _AfterMask(Softcap):
    """softcap-masked: the mask applied first (hidden scores -inf), then the cap, which turns -inf into -c: every
    hidden key gets the weight of a score -c (the softmax is then handed every key)."""

    def __init__(self, cap: float, visible):
        super().__init__(cap)
        self.visible = visible

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return xp.where(block(self.visible, rows, cols, s, xp), super().value(s, rows, cols, xp), -self.cap)

    def slope(self, s, rows=ALL, cols=ALL, xp=np):
        return xp.where(block(self.visible, rows, cols, s, xp), super().slope(s, rows, cols, xp), 0.0)

    def bend(self, s, rows=ALL, cols=ALL, xp=np):
        return xp.where(block(self.visible, rows, cols, s, xp), super().bend(s, rows, cols, xp), 0.0)


class _TanhTimesS(Softcap):
    """softcap-tanh-s: the forward computes S tanh(S) (flash-attention #2396); the backward's factor is right."""

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return s * xp.tanh(s)


class _WrongSlope(Softcap):
    """A known mistake of the backward's tanh' factor (``MISTAKES``): ``slope(t, s, cap)`` in its place."""

    def __init__(self, cap: float, slope):
        super().__init__(cap)
        self._wrong = slope

    def slope(self, s, rows=ALL, cols=ALL, xp=np):
        return self._wrong(xp.tanh(s / self.cap), s, self.cap, xp)

    def bend(self, s, rows=ALL, cols=ALL, xp=np):
        return None


#: Known mistakes of the softcap's backward: name -> (what it gets wrong, the wrong stage).
MISTAKES = {
    "softcap-slope-raw-score": ("softcap: the backward's tanh' factor is taken at the raw score, 1 - tanh(S)^2, "
                                "not at S / c",
                                lambda st: _WrongSlope(st.cap, lambda t, s, c, xp: 1 - xp.tanh(s) ** 2)),
    "softcap-slope-not-squared": ("softcap: the backward's tanh' factor written 1 - t, not 1 - t^2 (t = tanh(S / c))",
                                  lambda st: _WrongSlope(st.cap, lambda t, s, c, xp: 1 - t)),
    "softcap-slope-of-capped": ("softcap: the backward's tanh' factor is computed from the capped scores (1 - "
                                "tanh(c tanh(S / c) / c)^2: the saved scores are the capped ones), not the raw",
                                lambda st: _WrongSlope(st.cap, lambda t, s, c, xp: 1 - xp.tanh(t) ** 2)),
    "softcap-slope-over-cap": ("softcap: the backward's factor is (1 - t^2) / c: the 1 / c of the inner S / c kept, "
                               "though the outer c cancels it",
                               lambda st: _WrongSlope(st.cap, lambda t, s, c, xp: (1 - t * t) / c)),
    "softcap-slope-capped-value": ("softcap: the backward's factor is 1 - (c t)^2, the capped score squared where "
                                   "tanh(S / c)^2 belongs", lambda st: _WrongSlope(
                                       st.cap, lambda t, s, c, xp: 1 - (c * t) ** 2)),
}


class _ScaleAfterCap(Softcap):
    """The cap applied to the unscaled scores, the scale after it: scale c tanh(q k / c)."""

    def __init__(self, cap: float, scale: float):
        super().__init__(cap)
        self.scale = scale

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return self.scale * self.cap * xp.tanh(s / (self.scale * self.cap))


#: Known mistakes of the softcap's forward: name -> (what it gets wrong, (stage, scenario) -> the wrong stage).
FORWARD_MISTAKES = {
    "softcap-scale-after-cap": ("softcap: the cap is applied to the unscaled scores and the scale after it (scale c "
                                "tanh(q k / c)), not c tanh(scale q k / c)",
                                lambda st, sc: None if sc.scale == 1 else _ScaleAfterCap(st.cap, sc.scale)),
}


def _every_key(visible):
    if callable(visible):
        return lambda rows, cols: np.ones_like(visible(rows, cols))
    return np.ones_like(visible)


_GRADIENTS = ("gradient q", "gradient k", "backward agrees with the reference")
_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"

REGISTRATION = Registration(
    key=KEY,
    param=Param("float", None, "soft-capping c > 0: the scores S become c tanh(S / c) before the mask "
                               "(Gemma 2 uses 50, FlashAttention's softcap=)"),
    make=lambda sc: None if sc.p(KEY) is None else Softcap(sc.p(KEY)),
    faults={f.name: f for f in (
        Fault("softcap-derivative", "softcap: the backward drops the tanh' factor (dS_raw = dS, not dS (1 - t^2))",
              _GRADIENTS, user=_ADDED, scenario=((KEY, 1.5),)),
        Fault("softcap-masked", "softcap applied after the mask: a hidden score (-inf) is capped to -c and its key "
                                "gets weight, in forward and backward",
              ("attention is 0 off the visible set", "unseen K/V rows get zero gradient",
               "row 0's unseen K/V rows get zero gradient", "hidden K/V rows do not change O",
               "O rows in the range of visible V rows", "forward agrees with the reference",
               "lse agrees with the reference", "shifting every V row shifts O by as much",
               "documents do not see each other"),
              forward=True, scenario=((KEY, 1.5),)),
        Fault("softcap-tanh-s", "softcap: the forward computes S tanh(S) (flash-attention #2396), the backward "
                                "the right tanh' factor",
              ("gradient q", "gradient k", "gradient v", "forward agrees with the reference",
               "lse agrees with the reference", "shifting every V row shifts O by as much",
               "backward agrees with the reference",
               # in modes jvp and hvp the derivatives of the wrong forward are not the right stage's
               "jvp (random tangent)", "jvp q", "jvp k", "hvp q", "hvp k", "hvp v"),
              forward=True, scenario=((KEY, 1.5),)),
    )},
    wrong={"softcap-derivative": lambda st, visible: (_DroppedSlope(st.cap), visible),
           "softcap-masked": lambda st, visible: (_AfterMask(st.cap, visible), _every_key(visible)),
           "softcap-tanh-s": lambda st, visible: (_TanhTimesS(st.cap), visible)},
    applies=lambda sc, fault: ("every key is visible to every query: there is no mask for the cap to follow"
                               if fault == "softcap-masked" and sc.visible.all() else None),
    passes="softcap=c",
    mistakes=MISTAKES,
    forward_mistakes=FORWARD_MISTAKES,
)
