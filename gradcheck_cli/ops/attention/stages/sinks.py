"""Learnable attention sinks (gpt-oss's ``sinks``, passed to its kernels as ``s_aux``; FlashAttention 4's
``learnable_sink``): one logit s_h per query head that joins each row's normaliser and has no value row,

    L_i = log(sum_j exp(S_ij) + exp(s_h)),   A_ij = exp(S_ij - L_i),   O_i = sum_j A_ij V_j,

so a row's weights sum to 1 - p_i with p_i = exp(s_h - L_i), the weight the sink takes. The sink is not scaled by
the softmax scale and not capped (gpt-oss concatenates it to the scaled, masked scores). It is no elementwise map
of the scores: the stage is the identity on them and gives the engines its logits instead (:meth:`Sinks.logits`);
every engine adds exp(s_h - m) to a row's sum (the tiled engine starts its online softmax from m = s_h, l = 1: the
sink enters once per row). It is always the last stage, at the softmax's input.

The gradient is that of a key column whose value row is 0: dS_i,sink = p_i (0 - D_i) with D_i = sum_j A_ij dA_ij,
and the softmax's input gradient then sums to 0 over each row, sink included, so
ds_h = -sum over the batch and rows of sum_j dS_ij (:meth:`Sinks.param_grad`, block by block). With ``grad: true``
the logits are an input like q, k and v, checked by finite differences. A row that sees no key would be defined
with a sink (its output 0, its weights all on the sink) but is still refused at load as without one: there is
nothing of it to check but zeros.

Faults: ``sink-grad-dropped`` (the backward returns no sink gradient: 0), ``sink-grad-batch`` (from the first
batch element only), ``sink-grad-sign`` (ds_h = +sum p_i D_i), ``sink-scaled`` (the sink logit multiplied by the
softmax scale, as the scores are, in forward and backward)."""
from __future__ import annotations

import math

import numpy as np

from ....numeric import SeedStream
from ...registry import Fault, Param
from .base import ALL, Registration, Stage, gradient_limits

KEY = "sinks"
#: The largest |sink logit| accepted: beyond it the sink takes all or none of every row's weight (exp(100) ~ 1e43).
MAX_LOGIT = 100.0


class Sinks(Stage):
    name = KEY
    param_kwarg = "sinks"
    normaliser = True
    input_dtype_kwargs = ("sinks",)  # in the inputs' dtype, as a model's sinks parameter is (gpt-oss: bf16)

    def __init__(self, values, grad: bool, scale: float = 1.0):
        self.sinks = values if hasattr(values, "requires_grad") else np.asarray(values)
        self.grad, self.scale = grad, scale  # the scale: for the fault that applies it
        self.param = KEY if grad else None

    def _same(self, values, cls=None):
        return (cls or Sinks)(values, self.grad, self.scale)

    def values(self):
        return self.sinks

    def moved(self, x):
        return self._same(x, type(self))

    def lead(self) -> tuple:
        return tuple(np.shape(self.sinks)[:-1]) + (1, 1)  # perturbed copies' axes, then the batch and heads

    def logits(self):
        """The logit each row's normaliser gets, [..., Hq] (perturbed copies [C, Hq])."""
        return self.sinks

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        """ds_h = -sum over the batch, the block's rows and keys of dS[., h, i, j]: [Hq]."""
        g = np.asarray(g_out)
        return -g.reshape((-1,) + g.shape[-3:]).sum(axis=(0, 2, 3))

    def lse_grad(self, grad_lse, p):
        """The log-sum-exp's share of ds_h when it is an output: -sum dS misses sum_{b,i} G_L_i (the full softmax's
        input gradient sums to G_L_i over a row, the sink's column included), [Hq]."""
        g = np.asarray(grad_lse)
        return g.reshape((-1,) + g.shape[-2:]).sum(axis=(0, 2))

    def param_terms(self, t, rows=ALL, cols=ALL, power: int = 1):
        t = np.asarray(t)
        return t.reshape((-1,) + t.shape[-3:]).sum(axis=(0, 2, 3))

    def param_add(self, total, block, rows=ALL, cols=ALL):
        total += block

    def block_index(self) -> np.ndarray:
        return np.arange(np.shape(self.sinks)[-1])  # a sink moves every row of its head

    def block_sums(self, rows: np.ndarray) -> np.ndarray:
        return rows.sum(axis=(-3, -1))  # [..., B, Hq, n_q] -> [..., Hq]

    def bound(self, b: float) -> float:
        return max(b, float(np.abs(np.asarray(self.logits(), dtype=np.float64)).max(initial=0.0)))

    @property
    def kwargs(self) -> dict:
        return {"sinks": self.logits()}

    @property
    def key(self) -> tuple:
        return (type(self).__name__, self.grad, float(self.scale), np.asarray(self.sinks).tobytes())

    @property
    def label(self) -> str:
        return f"sinks{' +grad' if self.grad else ''}"


class _Dropped(Sinks):
    """sink-grad-dropped: the backward returns no gradient for the sinks (a zero buffer)."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return np.zeros(np.shape(g_out)[-3])

    def lse_grad(self, grad_lse, p):
        return np.zeros(np.shape(grad_lse)[-2])


class _FirstBatch(Sinks):
    """sink-grad-batch: the gradient from the first batch element alone."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return super().param_grad(np.asarray(g_out)[..., :1, :, :, :], s, rows, cols)

    def lse_grad(self, grad_lse, p):
        return super().lse_grad(np.asarray(grad_lse)[..., :1, :, :], p)


class _SignFlipped(Sinks):
    """sink-grad-sign: ds_h = +sum p_i D_i (the row sum of dS taken for the sink's own gradient)."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return -super().param_grad(g_out, s, rows, cols)

    def lse_grad(self, grad_lse, p):
        return -super().lse_grad(grad_lse, p)


class _NoLseTerm(Sinks):
    """sink-grad-lse: ds_h = -sum p_i D_i, the log-sum-exp's term p_i G_L_i dropped (flash-attention #2706)."""

    def lse_grad(self, grad_lse, p):
        g = np.asarray(grad_lse) * (1.0 - np.asarray(p))
        return g.reshape((-1,) + g.shape[-2:]).sum(axis=(0, 2))


class _Scaled(Sinks):
    """sink-scaled: the logit multiplied by the softmax scale, as the scores are (forward and backward)."""

    def logits(self):
        return self.sinks * self.scale


def make(sc) -> Sinks | None:
    given = sc.p(KEY)
    if given is None:
        return None
    params = dict(given)
    values = params["values"]
    if values == "seeded":
        values = np.random.default_rng([sc.seed, SeedStream.STAGES, 2]).standard_normal(sc.heads_q)
    values = np.asarray(values, dtype=np.float64)
    if params["grad"] and sc.dtype == "float32":  # an input like q, k and v: in their dtype
        values = values.astype(np.float32)
    return Sinks(values, params["grad"], sc.scale)


def validate(sc_params: dict, attention: dict) -> list:
    """(key, message, hint) for sinks that do not match the query heads, and what is not built for them yet."""
    given = sc_params.get(KEY)
    if given is None:
        return []
    params, heads = dict(given), attention.get("heads_q")
    values = params["values"]
    if values != "seeded" and heads is not None and len(values) != heads:
        return [(f"{KEY}.values", f"has {len(values)} logits but heads_q is {heads}",
                 "give one sink logit per query head, or values: seeded")]
    if values != "seeded" and max(abs(x) for x in values) > MAX_LOGIT:
        return [(f"{KEY}.values", f"has a logit of {max(values, key=abs):g}: a sink that large takes all of a row's "
                                  "weight (O = 0, nothing to check but zeros) or none of it",
                 f"keep the sink logits within +-{MAX_LOGIT:g}, the scale of the scores they compete with")]
    return gradient_limits(KEY, "the sinks", attention) if params["grad"] else []


def _applies(sc, fault: str) -> str | None:
    params = dict(sc.p(KEY))
    if fault in ("sink-grad-dropped", "sink-grad-batch", "sink-grad-sign") and not params["grad"]:
        return f"the sinks' gradient is not checked ({KEY}.grad: false)"
    if fault == "sink-grad-lse" and not params["grad"]:
        return f"the sinks' gradient is not checked ({KEY}.grad: false)"
    if fault == "sink-grad-lse" and "lse" not in (dict(sc.params).get("outputs") or ()):
        return "the log-sum-exp is no output (outputs: [o, lse]): its term of the sinks' gradient is 0"
    if fault == "sink-grad-batch" and sc.batch == 1:
        return "batch 1: the first batch element is the whole batch"
    if fault == "sink-scaled" and sc.scale == 1:
        return "scale 1: the scaled sink is the sink"
    if fault == "sink-scaled" and not params["grad"] and sc.implementation is None:
        return ("the sinks' gradient is not checked: a built-in engine with the scaled sink in forward and backward "
                "is another function, differentiated consistently (grad: true catches it)")
    return None


_CAUGHT = ("gradient sinks", "backward agrees with the reference")
_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"
_LEARNED = ((KEY, {"grad": True}),)

REGISTRATION = Registration(
    key=KEY,
    param=Param("mapping", None, "learnable attention sinks (gpt-oss's sinks, FlashAttention 4's learnable_sink): "
                                 "one logit per query head joins each row's softmax normaliser, with no value row; "
                                 "values seeded or a list, grad: true checks their gradient",
                fields=(("values", Param("choice-or-floats", "seeded", "seeded (standard normal, from the "
                                                                      "scenario's seed), or one logit per query head",
                                         choices=("seeded",), minimum=-math.inf)),
                        ("grad", Param("bool", False, "check the sinks' gradient (learned sinks; default false)")))),
    make=make,
    faults={f.name: f for f in (
        Fault("sink-grad-dropped", "sinks: the backward returns no gradient for the sink logits (0)", _CAUGHT,
              user=_ADDED, scenario=_LEARNED, backends=("numpy",)),
        Fault("sink-grad-batch", "sinks: the sinks' gradient from the first batch element alone, not summed over "
                                 "the batch", _CAUGHT, user=_ADDED, scenario=_LEARNED, backends=("numpy",)),
        Fault("sink-grad-sign", "sinks: ds_h = +sum_i p_i D_i, the sign of the sink column's dS dropped", _CAUGHT,
              user=_ADDED, scenario=_LEARNED, backends=("numpy",)),
        Fault("sink-grad-lse", "sinks: ds_h = -sum_{b,i} p_i D_i, the log-sum-exp's term p_i G_L_i dropped "
                               "(flash-attention #2706)", _CAUGHT, user=_ADDED,
              scenario=((KEY, {"grad": True}), ("outputs", ["o", "lse"])), backends=("numpy",)),
        Fault("sink-scaled", "sinks: the sink logit multiplied by the softmax scale, as the scores are (forward "
                             "and backward)",
              ("forward agrees with the reference", "lse agrees with the reference",
               "shifting every V row shifts O by as much",
               "backward agrees with the reference", "gradient sinks"),
              forward=True, user="passes the implementation scale * sinks (sinks=)", scenario=_LEARNED,
              backends=("numpy",)),
    )},
    wrong={"sink-grad-dropped": lambda st, visible: (st._same(st.sinks, _Dropped), visible),
           "sink-grad-batch": lambda st, visible: (st._same(st.sinks, _FirstBatch), visible),
           "sink-grad-sign": lambda st, visible: (st._same(st.sinks, _SignFlipped), visible),
           "sink-grad-lse": lambda st, visible: (st._same(st.sinks, _NoLseTerm), visible),
           "sink-scaled": lambda st, visible: (st._same(st.sinks, _Scaled), visible)},
    backward_only=("sink-grad-dropped", "sink-grad-batch", "sink-grad-sign", "sink-grad-lse"),
    applies=_applies,
    validate=validate,
    normaliser=True,
    passes="sinks= [Hq] (with grad: true a NumPy backward returns their gradient last)",
)
