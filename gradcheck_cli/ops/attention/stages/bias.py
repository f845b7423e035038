"""An additive bias, S -> S + B (T5's relative position bias, a learned float ``attn_mask`` of PyTorch SDPA,
FlashAttention's ``attn_bias``): ``bias: {shape: [B|1, H|1, n_q, n_k], grad: true}``.

The values are seeded (standard normal, their own random stream) in the shape given, or read from a .npy file
(``values: bias.npy``, relative to the YAML: the user's own bias), broadcast over the batch and query heads where
it says 1. With ``grad: true`` (the default) the bias is an input like q, k and v: its
gradient dBias = dS (the gradient at the bias's output, the softmax's input) summed over the broadcast axes
(``sum_broadcast``, the one reduction, as ``sum_groups`` is GQA's) is checked by finite differences. Hidden
entries get dS = 0: the mask comes after the bias. f' = 1, f'' = 0. Its faults: ``bias-broadcast-sum`` (the
gradient takes the first batch element / head of a broadcast axis instead of their sum),
``bias-hidden-gradient`` (hidden entries keep what the gradient buffer held, here the bias, instead of 0) and
``bias-scaled`` (dBias = scale dS, the chain rule taken as if the bias were inside the scale)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ....text import visible
from ...registry import Fault, Param
from .base import ALL, Registration, Stage, added, block, gradient_limits

KEY = "bias"


def sum_broadcast(g, lead: tuple[int, int]):
    """[..., B, H, r, c] -> [B|1, H|1, r, c] (``lead`` the bias's first two sizes): the sum over the axes the bias
    is broadcast along (and any extra leading axes)."""
    first = g.ndim - 4
    axes = tuple(range(first)) + tuple(first + i for i in range(2) if lead[i] == 1 and g.shape[first + i] != 1)
    return g.sum(axis=axes).reshape(tuple(lead) + g.shape[-2:]) if axes else g


class Bias(Stage):
    name = KEY
    input_dtype_kwargs = ("attn_bias",)
    param_kwarg = "attn_bias"
    batched_kwargs = ("attn_bias",)

    def __init__(self, values: np.ndarray, grad: bool, scale: float = 1.0):
        self.bias, self.grad, self.scale = values, grad, scale  # the scale: for the fault that applies it
        self.param = KEY if grad else None

    def values(self):
        return self.bias

    def moved(self, x):
        return type(self)(x, self.grad, self.scale)

    def _block(self, rows, cols):
        return self.bias[..., rows, cols]

    def value(self, s, rows=ALL, cols=ALL, xp=np):
        return added(s, self._block(rows, cols), xp)

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return sum_broadcast(g_out, self.bias.shape[-4:-2])

    def error(self, size, s, rows=ALL, cols=ALL):
        return size + np.abs(s) + np.abs(self._block(rows, cols))

    def bound(self, b: float) -> float:
        return b + float(np.abs(self.bias).max(initial=0.0))

    @property
    def kwargs(self) -> dict:
        return {"attn_bias": self.bias}

    @property
    def key(self) -> tuple:
        b = np.asarray(self.bias)
        return (type(self).__name__, b.shape, str(b.dtype), hashlib.sha256(b.tobytes()).hexdigest())

    @property
    def label(self) -> str:
        return f"bias {'x'.join(map(str, self.bias.shape[-4:]))}{' +grad' if self.grad else ''}"


class _FirstOfBroadcast(Bias):
    """bias-broadcast-sum: the gradient of a broadcast axis is its first element's, not the sum."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        shape = self.bias.shape[-4:-2]
        return g_out[..., :shape[0], :shape[1], :, :] if g_out.ndim == 4 else super().param_grad(g_out, s, rows, cols)


class _HiddenNotZeroed(Bias):
    """bias-hidden-gradient: hidden entries keep what the buffer held (the bias) instead of 0."""

    def __init__(self, values, grad, scale, visible):
        super().__init__(values, grad, scale)
        self.visible = visible

    def moved(self, x):
        return type(self)(x, self.grad, self.scale, self.visible)

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        right = super().param_grad(g_out, s, rows, cols)
        seen = sum_broadcast(block(self.visible, rows, cols, g_out).astype(np.float64), right.shape[:2]) > 0
        return np.where(seen, right, self._block(rows, cols))


class _Scaled(Bias):
    """bias-scaled: dBias = scale dS."""

    def param_grad(self, g_out, s, rows=ALL, cols=ALL):
        return self.scale * super().param_grad(g_out, s, rows, cols)


#: The bias files read, by (path, size, modification time): a scenario makes its stages many times.
_LOADED: dict[tuple, np.ndarray] = {}


def _load(path, attention: dict) -> np.ndarray:
    """The values of ``bias.values`` (a .npy file relative to the YAML), float64, read-only; FileProblem says why
    not."""
    from .... import files
    full = Path(attention["base_dir"]) / path
    try:
        st = full.stat()
        key = (str(full.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        key = None
    if key in _LOADED:
        return _LOADED[key]
    limit = attention["batch"] * attention["heads_q"] * attention["n_q"] * attention["n_k"]
    values = files.load_npy(full, max_elements=limit, numbers=True).astype(np.float64)
    if values.ndim != 4 or not np.isfinite(values).all():
        raise files.FileProblem(f"holds shape {list(values.shape)}; expected [B|1, H|1, n_q, n_k]"
                                if values.ndim != 4 else "holds NaN or inf")
    values.setflags(write=False)
    if key is not None:
        _LOADED[key] = values
    return values


def make(sc) -> Bias | None:
    given = sc.p(KEY)
    if given is None:
        return None
    params = dict(given)
    shape = tuple(params["shape"] or (1, sc.heads_q, sc.n_q, sc.n_k))
    from ....numeric import SeedStream
    if params["values"] is not None:  # the user's own values (checked by validate when the file was loaded)
        values = _load(params["values"], {"base_dir": sc.base_dir, "batch": sc.batch, "heads_q": sc.heads_q,
                                          "n_q": sc.n_q, "n_k": sc.n_k})
    else:
        values = np.random.default_rng([sc.seed, SeedStream.STAGES]).standard_normal(shape)
    if sc.dtype in ("float64", "float32"):  # half precision: the engines round it with the other inputs
        values = values.astype(sc.dtype)
    return Bias(values, params["grad"], sc.scale)


def validate(sc_params: dict, attention: dict) -> list:
    given = sc_params.get(KEY)
    if given is None:
        return []
    params = dict(given)
    shape = params["shape"]
    if params["values"] is not None:
        from .... import files
        try:
            loaded = _load(params["values"], attention).shape
        except files.FileProblem as exc:
            return [(f"{KEY}.values", f"{visible(repr(params['values'])[:200])} {exc}",
                     "give a .npy file of the bias, relative to the YAML file, written with numpy.save(path, bias)")]
        if shape is not None and tuple(shape) != loaded:
            return [(f"{KEY}.shape", f"is {list(shape)} but {visible(repr(params['values'])[:200])} holds "
                                     f"{list(loaded)}",
                     "remove shape: the file's shape is used")]
        shape = loaded
    where = f"{KEY}.values" if params["values"] is not None else f"{KEY}.shape"
    if shape is not None:
        want = (attention["batch"], attention["heads_q"], attention["n_q"], attention["n_k"])
        if len(shape) != 4 or shape[2:] != want[2:] or shape[0] not in (1, want[0]) or shape[1] not in (1, want[1]):
            verb = "holds shape" if params["values"] is not None else "is"
            return [(where, f"{verb} {list(shape)}; expected [B|1, H|1, n_q, n_k] = "
                            f"[{want[0]}|1, {want[1]}|1, {want[2]}, {want[3]}]",
                     "one bias per (batch, query head), or 1 where it is shared")]
    return gradient_limits(KEY, "a bias", attention) if params["grad"] else []


def _applies(sc, fault: str) -> str | None:
    params = dict(sc.p(KEY))
    if not params["grad"]:
        return "the bias's gradient is not checked (bias.grad: false)"
    stage = make(sc)
    if fault == "bias-broadcast-sum" and stage.bias.shape[:2] == (sc.batch, sc.heads_q):
        return "the bias is not broadcast over the batch or the query heads"
    if fault == "bias-hidden-gradient" and sc.visible.all():
        return "every key is visible to every query: no entry is hidden"
    return None


_CAUGHT = ("gradient bias", "backward agrees with the reference")
_ADDED = "adds to the implementation's dbias the change this bug makes to the float64 reference's"
_SCENARIO = ((KEY, {"grad": True}),)

#: Known mistakes of the bias's forward: name -> (what it gets wrong, (stage, scenario) -> the wrong stage or None).
FORWARD_MISTAKES = {
    "bias-inside-scale": ("bias: added inside the scaled product, scale (q k + b), not scale q k + b",
                          lambda st, sc: None if sc.scale == 1 else Bias(np.asarray(st.bias) * sc.scale, st.grad)),
    "bias-first-batch": ("bias: a per-batch bias [B, ...] read as bias[:1] (assumed shared by the batch)",
                         lambda st, sc: None if np.shape(st.bias)[-4] == 1 else Bias(
                             np.asarray(st.bias)[..., :1, :, :, :], st.grad)),
    "bias-transposed": ("bias: added transposed (bias[..., j, i] at score (i, j); n_q = n_k hides it)",
                        lambda st, sc: Bias(np.swapaxes(np.asarray(st.bias), -1, -2), st.grad)
                        if np.shape(st.bias)[-1] == np.shape(st.bias)[-2] else None),
    "bias-by-kv-head": ("bias: a per-query-head bias indexed by KV head (bias[:, kv_map]), as if it were per KV "
                        "head", lambda st, sc: Bias(np.asarray(st.bias)[..., np.asarray(sc.kv_map), :, :], st.grad)
                        if np.shape(st.bias)[-3] == sc.heads_q > sc.heads_kv else None),
    "bias-first-head": ("bias: a per-head bias [.., H, ...] read as bias[:, :1] (assumed shared by the heads)",
                        lambda st, sc: None if np.shape(st.bias)[-3] == 1 else Bias(
                            np.asarray(st.bias)[..., :1, :, :], st.grad)),
}


REGISTRATION = Registration(
    key=KEY,
    param=Param("mapping", None, "an additive bias on the scores (after soft-capping, before the mask): shape "
                                 "[B|1, H|1, n_q, n_k] (default [1, heads_q, n_q, n_k]), seeded values, grad: true "
                                 "checks its gradient",
                fields=(("shape", Param("sizes", None, "[B|1, H|1, n_q, n_k]")),
                        ("values", Param("path", None, "a .npy file of the bias's values [B|1, H|1, n_q, n_k], "
                                                       "relative to the YAML (default: seeded)")),
                        ("grad", Param("bool", True, "check the bias's gradient (default true)")))),
    make=make,
    faults={f.name: f for f in (
        Fault("bias-broadcast-sum", "bias: the gradient of a broadcast axis is its first element's, not the sum over "
                                    "it", _CAUGHT, scenario=((KEY, {"shape": [1, 1, 3, 10]}),), backends=("numpy",),
              user=_ADDED),
        Fault("bias-hidden-gradient", "bias: hidden entries' gradient keeps what the buffer held (the bias), not 0",
              _CAUGHT, scenario=_SCENARIO, backends=("numpy",), user=_ADDED),
        Fault("bias-scaled", "bias: dBias = scale dS, as if the bias were inside the softmax scale", _CAUGHT,
              scenario=_SCENARIO, backends=("numpy",), user=_ADDED),
    )},
    wrong={"bias-broadcast-sum": lambda st, visible: (_FirstOfBroadcast(st.bias, st.grad, st.scale), visible),
           "bias-hidden-gradient": lambda st, visible: (_HiddenNotZeroed(st.bias, st.grad, st.scale, visible),
                                                        visible),
           "bias-scaled": lambda st, visible: (_Scaled(st.bias, st.grad, st.scale), visible)},
    backward_only=("bias-broadcast-sum", "bias-hidden-gradient", "bias-scaled"),
    applies=_applies,
    validate=validate,
    passes="attn_bias= [B|1, H|1, n_q, n_k]; a NumPy backward returns dbias last",
    forward_mistakes=FORWARD_MISTAKES,
)
