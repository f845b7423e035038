"""The log-sum-exp as a second output of attention (``outputs: [o, lse]``): kernels return it for their backward
(FlashAttention's ``softmax_lse``, ``return_lse=True``), ring attention merges partial outputs by it, and a
model may train through it. LSE_i = log(sum_j exp(S_ij) (+ exp(s_h) with sinks)) in natural log, [B, Hq, n_q].

The loss becomes L = sum(O * G) + sum(LSE * G_L), G_L seeded (its own stream; zero outside ``loss_rows`` as G
is), and the gradient at the softmax's input gains P_ij G_L_i: dS = P (dP - D + G_L). With sinks the sinks'
gradient gains the term p_i G_L_i (flash-attention #2706): ds_h = sum_{b,i} p_i (G_L_i - D_i).

Your code is called with ``return_lse=True`` and returns ``(o, lse)``, lse [B, Hq, n_q] in o's dtype (a kernel
that keeps it in float32 is checked with dtype: float32); a NumPy backward is passed ``grad_lse=`` beside grad_o.
Faults: ``lse-grad-ignored`` (the backward drops G_L, as FlashAttention 2/3's Python interface does) and ``lse-log2``
(the LSE returned in log2 units, pytorch #181645's kind: LSE / ln 2)."""
from __future__ import annotations

import math

import numpy as np

from ...numeric import SeedStream
from ..registry import Fault, Param

KEY = "outputs"
#: The reference check of a user's LSE.
CHECK = "lse agrees with the reference"
LN2 = math.log(2.0)
#: What the LSE output does not cover yet (``attn-gradcheck ops``; ``validate`` refuses it with the key).
LIMIT = ("outputs: [o, lse] is checked in float64 and float32 along the VJP on the NumPy engines and your NumPy, "
         "torch and JAX code (either layout; convention.lse_layout bhn or bnh): not yet in half precision, on the "
         "torch closed forms, or along check.mode jvp / hvp")

PARAM = Param("choice-list", None, "the outputs of attention: [o] (the default) or [o, lse], the log-sum-exp of "
                                   "each row's scores (natural log, [B, Hq, n_q]) as a second output: its upstream "
                                   "gradient is seeded and the backward must take it (your code is called with "
                                   "return_lse=True and returns (o, lse))", choices=("o", "lse"))

_ADDED = "adds to the implementation's gradients the change this bug makes to the float64 reference's"

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("lse-grad-ignored", "LSE: the backward ignores the log-sum-exp's upstream gradient (dS without P G_L, as "
                              "FlashAttention 2/3's Python interface)",
          ("gradient q", "gradient k", "backward agrees with the reference", "score-gradient rows sum to 0",
           "gradient bias", "gradient relative_bias", "gradient alibi_slopes", "gradient sinks"),
          user=_ADDED, scenario=((KEY, ["o", "lse"]),), backends=("numpy",)),
    Fault("lse-log2", "LSE: the log-sum-exp returned in log2 units (LSE / ln 2; pytorch #181645), the backward "
                      "taking it as natural",
          ("gradient q", "gradient k", "gradient bias", "gradient relative_bias", "gradient alibi_slopes",
           "gradient sinks", "lse agrees with the reference"), forward=True, engine=False,
          user="divides the implementation's lse by ln 2", scenario=((KEY, ["o", "lse"]),)),
)}


def wanted(sc) -> bool:
    """Whether the scenario's outputs include the log-sum-exp."""
    given = dict(sc.params).get(KEY)
    return given is not None and "lse" in given


def upstream(sc, dtype=None) -> np.ndarray:
    """G_L [B, Hq, n_q]: the seeded upstream gradient of the LSE (zero outside ``loss_rows``)."""
    g = np.random.default_rng([sc.seed, SeedStream.LSE]).standard_normal((sc.batch, sc.heads_q, sc.n_q))
    if sc.loss_rows is not None:
        keep = np.zeros(sc.n_q, dtype=bool)
        keep[list(sc.loss_rows)] = True
        g[..., ~keep] = 0
    return g.astype(dtype or sc.dtype)


def returned(lse, faults) -> np.ndarray:
    """The LSE a computation returns as the faults make it (``lse-log2``: in log2 units)."""
    return lse / LN2 if "lse-log2" in faults else lse


def validate(params: dict, attention: dict) -> list:
    """(key, message, hint) where the LSE output is not built yet."""
    given = params.get(KEY)
    if given is None:
        return []
    if "o" not in given or given[0] != "o":
        return [(KEY, f"lists {', '.join(given)}: o comes first (your code returns (o, lse))", "[o] or [o, lse]")]
    if "lse" not in given:
        return []
    fix = "set outputs: [o] for this scenario"
    if attention["mode"] in ("jvp", "hvp"):
        return [(KEY, f"the log-sum-exp as an output is checked along the VJP, not check.mode {attention['mode']} yet",
                 fix)]
    if attention["backend"] == "torch" and not attention["implementation"]:
        return [(KEY, "the log-sum-exp as an output runs on the NumPy engines (naive, tiled) and NumPy, torch and JAX "
                      "implementations, not the torch closed forms yet", f"{fix}, or backend: numpy")]
    if attention["dtype"] in ("float16", "bfloat16"):
        return [(KEY, f"the log-sum-exp as an output is checked in float64 and float32, not {attention['dtype']} yet",
                 f"{fix}, or dtype: float32")]
    return []


def why_not(sc, fault: str) -> str | None:
    if not wanted(sc):
        return f"the scenario's outputs have no lse (key {KEY}: [o, lse])"
    return None


#: The joined implementations, by (id of the implementation, backend): one object per implementation for the life of
#: the process (a compiled flavour compiles it once, not once per scenario).
_JOINED: dict[tuple, tuple] = {}


def joined(impl, backend: str, convention=None):
    """(see :func:`_joined`; ``convention``: the code's, its ``lse_layout``)."""
    lse_layout = "bhn" if convention is None else convention.lse_layout
    swapped = convention is not None and convention.lse_swapped()
    key = (id(impl), backend, lse_layout, swapped)
    if key not in _JOINED:
        _JOINED[key] = (impl, _joined(impl, backend, swapped, lse_layout))  # the implementation kept: its id too
    return _JOINED[key][1]


def _joined(impl, backend: str, swapped: bool, lse_layout: str):
    """The user's implementation as one with a single output, O and the LSE side by side: [B, Hq, n_q, d_value + 1]
    in the code's layout (the LSE the last column), so that every path of the engine (the flavours' autograd and
    jax.vjp, stacked copies, finite differences) carries both; its upstream gradient is [G, G_L] likewise. A NumPy
    object's backward is passed ``grad_lse=`` (the last column of the joined gradient). ``swapped``: the code's LSE
    has its head and row axes the other way round from its O's (``convention.lse_layout``: FlashAttention's
    [B, H, n_q] beside an O of [B, n_q, H, d]); it is swapped to O's order before joining, its gradient back."""
    def turned(x):
        return x.swapaxes(1, 2) if swapped else x

    if backend in ("torch", "jax"):
        def both(*args, **kw):
            out = impl(*args, return_lse=True, **kw)
            o, values = _pair(out, swapped, lse_layout)
            from ... import flavours
            if swapped:
                values = values.swapaxes(1, 2) if backend == "torch" else _jax_swap(values)
            return flavours.side_by_side(backend, o, values)
        return both

    class Joined:
        def forward(self, *args, **kw):
            o, values = _pair(impl.forward(*args, return_lse=True, **kw), swapped, lse_layout)
            o = np.asarray(o)
            return np.concatenate([o, turned(np.asarray(values, dtype=o.dtype))[..., None]], axis=-1)

        def backward(self, *args, **kw):
            *given, grad = args
            grad = np.asarray(grad)
            try:
                return impl.backward(*given, np.ascontiguousarray(grad[..., :-1]),
                                     grad_lse=np.ascontiguousarray(turned(grad[..., -1])), **kw)
            except TypeError as exc:
                if "grad_lse" not in str(exc):
                    raise
                raise TypeError(f"{exc}: with outputs: [o, lse] the backward is passed grad_lse= ([B, Hq, n_q], the "
                                "LSE's upstream gradient) beside grad_o") from None
    return Joined()


def _jax_swap(x):
    import jax.numpy as jnp
    return jnp.swapaxes(x, 1, 2)


_AXES = {"bhn": "[B, Hq, n_q]", "bnh": "[B, n_q, Hq]"}


def _pair(out, swapped: bool = False, lse_layout: str = "bhn"):
    """(o, lse) of what the code returned with return_lse=True, or a failure saying what it returned instead (the
    implementation's, not an exception of the tool's own: no location in the tool). ``swapped``: lse's head and row
    axes the other way round from o's."""
    from ...implementation import ImplementationFailure as Failure
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Failure("with outputs: [o, lse] the code is called with return_lse=True and must return (o, lse), "
                      f"got {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
    o, values = out
    if len(values.shape) == len(o.shape) + 1 and tuple(o.shape) == tuple(values.shape[:-1]):
        raise Failure(f"returned (lse, o)? the first is {list(o.shape)} and the second {list(values.shape)}: return "
                      "(o, lse), lse [B, Hq, n_q]")
    want = tuple(o.shape[:-1])
    if swapped:
        want = (want[0], want[2], want[1]) + want[3:]
    if tuple(values.shape) != want:
        other = (want[0], want[2], want[1]) + want[3:]
        hint = ""
        if tuple(values.shape) == other and want != other:
            hint = ("; the other order: set convention: {lse_layout: " + ("bhn" if lse_layout == "bnh" else "bnh")
                    + "} if your code returns it so")
        raise Failure(f"with return_lse=True, lse must be {_AXES[lse_layout]} = {list(want)} beside o "
                      f"{list(o.shape)}, got {list(values.shape)}{hint}")
    if str(values.dtype) != str(o.dtype):  # a rounded LSE makes its finite differences blind to its gradient
        raise Failure(f"with return_lse=True, lse must be in o's dtype ({o.dtype}), got {values.dtype}: return it "
                      "in the inputs' dtype (a kernel that keeps it in float32 is checked with dtype: float32)")
    return o, values
