"""Score stages: what happens to the scores between ``S = scale * Q K^T`` and the softmax.

A scenario's stages are an ordered list (:func:`from_scenario`; the order of ``REGISTERED`` is the default,
FlashAttention 2's and Gemma 2's: soft-capping first). Each stage is one module owning an elementwise map
``f(s; its parameters, the query row i and key column j)`` with

- ``value(s, rows, cols, xp)``: f on a block of scores [..., B, Hq, len(rows), len(cols)] (any extra leading
  axes broadcast: perturbed copies), ``rows``/``cols`` the block's slices of the full n_q x n_k grid
  (FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` is the model), ``xp`` the array namespace
  (NumPy, torch or jax.numpy: the torch and JAX peers compute the same map, autograd-differentiable);
- ``slope``/``bend``: f' and f'' at the stage's input, None for 1 and 0 (the chain rule of every derivative:
  dS_in = f' dS_out for the VJP, S_dot_out = f' S_dot_in for the JVP, and the HVP's
  G_in_dot = f'' S_dot_in G_out + f' G_out_dot);
- ``error(size, s, ...)``: the rounding of f(s) when s carries an error of ``size`` (units of eps), and
  ``slope_size``: the size of the terms of f'(s) with its rounding; ``bound(b)``: a bound on |f(s)| given |s| <= b;
- ``kwargs``: what a user's implementation is passed (FlashAttention's keyword names), and its ``label``;
- a parameter whose gradient is checked (an additive bias's, ``param``): an input beside q, k and v, its
  gradient from the gradient at the stage's output (``param_grad``, gathered by :func:`pull_back`).

The generic machinery here composes them (:func:`apply`, :func:`with_slope`, :func:`jet`, :func:`pull_back`,
:func:`error`, :func:`slope_size`); the engines call it only when a scenario has stages, so plain attention's
numbers and speed are untouched. A stage's faults are registered wrong stages (:func:`inject`), not flags in formulas.
The mask is applied after every stage, by the engines (hidden scores never reach a stage).
"""
from __future__ import annotations

import types
from collections.abc import Collection

import numpy as np

from ...registry import Fault, Param
from . import alibi, bias, dropout, relative_bias, sinks, softcap
from .base import ALL, LIMITS, Registration, Stage

__all__ = ["ALL", "FAULTS", "KEYS", "LIMITS", "MISTAKES", "REGISTERED", "Stage", "apply", "from_scenario", "inject",
           "jet", "with_slope"]


#: The stage modules, in the default order of the score path.
REGISTERED: tuple[Registration, ...] = (softcap.REGISTRATION, bias.REGISTRATION, relative_bias.REGISTRATION,
                                        alibi.REGISTRATION, sinks.REGISTRATION, dropout.REGISTRATION)
#: The elementwise stages, whose order a scenario may set (a normaliser, the sinks, comes after them all).
ORDERED = tuple(r for r in REGISTERED if not r.normaliser)

#: The key that orders the stages where a library differs from the default order (``stages: [bias, softcap]``).
ORDER_KEY = "stages"

#: The scenario keys of the stages (``Op.keys`` of attention), and the order key.
KEYS: dict[str, Param] = {**{r.key: r.param for r in REGISTERED},
                          ORDER_KEY: Param("choice-list", None, "the order of the score stages where it is not the "
                                           "default (" + ", ".join(r.key for r in ORDERED) + "), e.g. "
                                           "[bias, softcap] to cap a biased score; every stage used, once (sinks "
                                           "join the softmax's normaliser, after them all)",
                                           choices=tuple(r.key for r in ORDERED))}

#: Every stage fault, by name.
FAULTS: dict[str, Fault] = {name: f for r in REGISTERED for name, f in r.faults.items()}
#: Each stage's known mistakes (``Registration.mistakes``), by stage name.
MISTAKES: dict[str, dict] = {r.key: dict(r.mistakes) for r in REGISTERED}


def from_scenario(sc) -> tuple[Stage, ...]:
    """The scenario's stages, in the order in force (``stages:``, else the default; empty for plain attention)."""
    params = dict(sc.params)
    if not any(params.get(r.key) is not None for r in REGISTERED):
        return ()
    made = {st.name: st for st in (r.make(sc) for r in REGISTERED) if st is not None}
    order = params.get(ORDER_KEY) or tuple(name for name, st in made.items()
                                           if not st.normaliser and not st.post_softmax)
    return (tuple(made[name] for name in order) + tuple(st for st in made.values() if st.normaliser)
            + tuple(st for st in made.values() if st.post_softmax))


def post(stages):
    """The stage that weights the softmax's output (dropout), or None."""
    return next((st for st in stages if st.post_softmax), None)


def sink_logits(stages):
    """The logit each row's normaliser gets from a normaliser stage (the sinks), shaped to broadcast against a
    row statistic [..., B, Hq, n_q, 1] ([Hq] -> [1, Hq, 1, 1]; perturbed copies [C, Hq] -> [C, 1, Hq, 1, 1]);
    None without one."""
    for st in stages:
        logits = st.logits()
        if logits is not None:
            return logits[..., None, :, None, None]
    return None


def owner(fault: str) -> Registration | None:
    return next((r for r in REGISTERED if fault in r.faults), None)


def why_not(sc, fault: str) -> str | None:
    """Why a stage fault cannot apply to scenario ``sc`` (None: it applies, or it is no stage fault)."""
    reg = owner(fault)
    if reg is None:
        return None
    if dict(sc.params).get(reg.key) is None:
        return f"the scenario has no {reg.key} (key {reg.key}:)"
    return reg.applies(sc, fault) if reg.applies else None


def inject(stages: tuple[Stage, ...], visible, faults: Collection[str]):
    """(the forward's stages, the backward's, visible) with the active stage faults' wrong stages in place of the
    right ones (a fault of ``Registration.backward_only`` in the backward's alone: the backward recomputes the
    scores), and the visible set the softmax then uses (a fault that applies the mask before its stage hands the
    softmax every key)."""
    forward, backward = stages, stages
    for name in faults:
        reg = owner(name)
        if reg is None:
            continue
        for i, st in enumerate(stages):
            if st.name == reg.key:
                wrong, visible = reg.wrong[name](st, visible)
                backward = backward[:i] + (wrong,) + backward[i + 1:]
                if name not in reg.backward_only:
                    forward = forward[:i] + (wrong,) + forward[i + 1:]
    return forward, backward, visible


def shown(stages: tuple[Stage, ...], visible, faults: Collection[str]) -> tuple[Stage, ...]:
    """The stages whose arguments a user's implementation is passed: with the active stage faults that change the
    forward in place (``alibi-slopes-pow2`` passes the wrong slopes); the others act on its gradients."""
    return inject(stages, visible, [f for f in faults if f in FAULTS and FAULTS[f].forward])[0]


def apply(stages, s, rows=ALL, cols=ALL, xp=np):
    """The scores after every stage."""
    for st in stages:
        s = st.value(s, rows, cols, xp)
    return s


def with_slope(stages, s, rows=ALL, cols=ALL, xp=np):
    """(the scores after every stage, the derivative of the whole chain at ``s``, None for 1)."""
    d1 = None
    for st in stages:
        slope = st.slope(s, rows, cols, xp)
        if slope is not None:
            d1 = slope if d1 is None else d1 * slope
        s = st.value(s, rows, cols, xp)
    return s, d1


def jet(stages, s, rows=ALL, cols=ALL):
    """(f(s), f'(s), f''(s)) of the whole chain (f' None for 1, f'' None for 0): (g o f)'' = g'' f'^2 + g' f''."""
    d1 = d2 = None
    for st in stages:
        slope, bend = st.slope(s, rows, cols), st.bend(s, rows, cols)
        if bend is not None:
            bend = bend if d1 is None else bend * d1 * d1
        if slope is not None:
            d2 = None if d2 is None else d2 * slope
            d1 = slope if d1 is None else d1 * slope
        if bend is not None:
            d2 = bend if d2 is None else d2 + bend
        s = st.value(s, rows, cols)
    return s, d1, d2


def params(stages) -> dict:
    """The stages' parameters whose gradients are checked, by input name (none for plain attention)."""
    return {st.param: st.values() for st in stages if st.param is not None}


def owners(stages) -> dict:
    """{parameter: its stage} of the parameters whose gradients are checked."""
    return {st.param: st for st in stages if st.param is not None}


def param_kwargs(stages) -> dict:
    """{parameter: the keyword a user's code is passed it as} of the parameters whose gradients are checked."""
    return {st.param: st.param_kwarg for st in stages if st.param is not None}


def batched(stages) -> dict:
    """{keyword: (the parameter it carries or None, its values)} of the arguments whose first axis is the batch's
    (a bias): a user's code called on copies stacked along the batch axis gets them stacked likewise."""
    return {kw: (st.param, st.kwargs[kw]) for st in stages for kw in st.batched_kwargs}


def lead(stages) -> tuple:
    """The leading axes the stages' parameters broadcast the scores to ([C, B|1, H|1] for perturbed copies of a
    bias), for the shape of the output."""
    shapes = [st.lead() for st in stages if st.param is not None]
    return np.broadcast_shapes(*shapes) if shapes else ()


def moved(stages, name: str, x):
    """The stages with parameter ``name`` replaced by ``x`` (perturbed copies: extra leading axes)."""
    return tuple(st.moved(x) if st.param == name else st for st in stages)


def pull_back(stages, s, g_out, rows=ALL, cols=ALL, xp=np):
    """(the gradient at the raw scores ``s``, {parameter: the gradient of its block}) from ``g_out``, the gradient
    at the last stage's output (the softmax's input): back through each stage, its parameter's gradient taken
    from the gradient at its own output."""
    inputs = []
    for st in stages:
        inputs.append(s)
        s = st.value(s, rows, cols, xp)
    grads, g = {}, g_out
    for st, s_in in zip(reversed(stages), reversed(inputs)):
        if st.param is not None:
            grads[st.param] = st.param_grad(g, s_in, rows, cols)
        slope = st.slope(s_in, rows, cols, xp)
        if slope is not None:
            g = g * slope
    return g, grads


def lse_terms(stages, params: dict, grad_lse, sink) -> dict:
    """``params`` (the stages' parameters' gradients) with the log-sum-exp's share of a normaliser stage's (the
    sinks': its column of the softmax's input gradient gains p_i G_L_i, and the others' row sums G_L_i (1 - p_i):
    -sum dS misses G_L_i), when the LSE is an output; ``sink``: p [..., B, Hq, n_q]."""
    out = dict(params)
    for st in stages:
        if st.normaliser and st.param is not None and st.param in out:
            out[st.param] = out[st.param] + st.lse_grad(np.asarray(grad_lse), np.asarray(sink))
    return out


def error(stages, size, s, rows=ALL, cols=ALL):
    """The error of the final scores (units of eps) when the first stage's input ``s`` carries ``size``."""
    for st in stages:
        size = st.error(size, s, rows, cols)
        s = st.value(s, rows, cols)
    return size


def slope_size(stages, s, size, rows=ALL, cols=ALL):
    """The size of the terms of the chain's derivative with its rounding (None: exactly 1), the input ``s``
    carrying an error of ``size``: the product of each stage's, each at its own input and error."""
    out = None
    for st in stages:
        part = st.slope_size(s, size, rows, cols)
        if part is not None:
            out = part if out is None else out * part
        size = st.error(size, s, rows, cols)
        s = st.value(s, rows, cols)
    return out


def bound(stages, b: float) -> float:
    for st in stages:
        b = st.bound(b)
    return b


def validate(params: dict, attention: dict) -> list:
    """(key, message, hint) of the stages' values wrong together with the attention keys (``Op.validate``), and of
    an order that does not list exactly the stages used."""
    order = params.get(ORDER_KEY)
    if order is not None:
        used = [r.key for r in ORDERED if params.get(r.key) is not None]
        if set(order) != set(used):
            return [(ORDER_KEY, f"lists {', '.join(order)} but the scenario sets "
                                + (", ".join(used) if used else "no stage"),
                     "list every stage the scenario sets, once, in the order to apply them")]
    return [problem for r in REGISTERED if r.validate for problem in r.validate(params, attention)]


def kwargs(stages, to=None) -> dict:
    """What a user's implementation is passed for the stages (none for plain attention); ``to(array, same)``
    converts each array (slopes, biases) to the flavour's own (a torch tensor on the inputs' device), ``same``
    when it goes in the inputs' dtype (``Stage.input_dtype_kwargs``)."""
    out: dict = {}
    for st in stages:
        given = st.kwargs
        if to is not None:
            given = {k: to(v, k in st.input_dtype_kwargs) if isinstance(v, np.ndarray) else v for k, v in given.items()}
        out.update(given)
    return out


def keys(stages) -> tuple:
    """The stages' exact keys (``Stage.key``), for caches of compiled programs."""
    return tuple(st.key for st in stages)


def labels(stages) -> tuple[str, ...]:
    """The stages' labels, in order (``softcap 2``, ``alibi distance``): what reports name them by."""
    return tuple(st.label for st in stages)


class _Fresh:
    """``fn`` with keyword arguments bound, each array among them handed over as a fresh copy on every call (an
    implementation that changes one in place cannot change the next call's); a call's own keywords (a bias's
    perturbed copies) replace the bound ones."""

    def __init__(self, fn, given: dict):
        self.fn, self.given = fn, given

    def __call__(self, *args, **kw):
        fresh = {k: (v.copy() if isinstance(v, np.ndarray) else v.clone() if hasattr(v, "clone") else v)
                 for k, v in self.given.items() if k not in kw}
        return self.fn(*args, **fresh, **kw)


#: The implementations bound to stage arguments, by (id of the implementation, its arguments): one object per
#: pair for the life of the process, so that a compiled flavour (JAX) compiles it once, not once per scenario.
_BOUND: dict[tuple, tuple] = {}


def bind(impl, stages, to=None, tag: str = "", extra: dict | None = None):
    """A user's implementation with the stages' keyword arguments (``softcap=``, ...) bound: a callable (torch,
    JAX) as ``functools.partial``, a NumPy object's forward/backward/jvp/hvp likewise. Unchanged without stages:
    an implementation is passed a variant's argument only when the scenario uses the variant. ``to`` converts the
    arrays (``kwargs``); ``tag`` names that conversion (device, dtype) in the cache key. ``extra``: other keyword
    arguments of the scenario's, bound likewise (a packed batch's ``cu_seqlens_q=``, ...; already converted)."""
    given = {**kwargs(stages, to), **(extra or {})}
    if impl is None or not given:
        return impl
    key = (id(impl), keys(stages), tag,
           tuple((k, tuple(np.asarray(v).ravel().tolist()) if hasattr(v, "shape") else v)
                 for k, v in (extra or {}).items()))
    if key not in _BOUND:
        if callable(impl) and not hasattr(impl, "backward"):
            bound = _Fresh(impl, given)
        else:
            bound = types.SimpleNamespace(**{name: _Fresh(getattr(impl, name), given)
                                             for name in ("forward", "backward", "jvp", "hvp")
                                             if callable(getattr(impl, name, None))})
        _BOUND[key] = (impl, bound)  # the implementation kept: its id stays its own
    return _BOUND[key][1]
