"""The keys every op shares: precision and check (dtype, epsilon, tolerance, mode, ...), the policy for an
implementation of yours (check.factor, slack, nondet_tol, timeout), backend and device."""
from __future__ import annotations

from ..ops import OPS
from ..tolerance import DEFAULT_FACTOR, defaults_for, machine_epsilon
from .fields import (
    DEFAULT_DIRECTIONS,
    DEFAULT_SAMPLES,
    DEVICES,
    LOW_PRECISION,
    MAX_DIRECTIONS,
    MAX_EPSILON,
    MAX_FACTOR,
    MAX_SLACK,
    MAX_TOLERANCE,
    MIN_STEP_ULPS,
    MODES,
    _Fields,
)
from .yaml_lines import _show


def _user_code_policy(f: _Fields) -> tuple[float, float | None, float, float]:
    """The ``check`` keys of an op that accepts an implementation: (factor, slack, nondet_tol, timeout)."""
    factor = f.float("check.factor", DEFAULT_FACTOR)
    if factor > MAX_FACTOR:
        raise f.error("check.factor", f"{factor:g} would accept an implementation {factor:g} times as wrong as a plain "
                      f"computation in the same precision: a check that blind passes real bugs; at most {MAX_FACTOR:g}",
                      hint=f"omit it for the default ({DEFAULT_FACTOR:g}, FlashAttention's)")
    slack = f.float("check.slack", None, positive=False)
    if slack is not None and slack < 0:
        raise f.error("check.slack", f"must be >= 0, got {slack}")
    if slack is not None and slack > MAX_SLACK:
        raise f.error("check.slack", f"{slack:g} would accept any error of that absolute size in results of order 1; "
                      f"at most {MAX_SLACK:g}", hint="omit it for the default (1e-5 in half precision, else 0)")
    nondet_tol = f.float("check.nondet_tol", 0.0, positive=False)
    if f.has("check.nondet_tol") and not f.has("implementation") and f.where("check.nondet_tol")[0] != "defaults":
        raise f.error("check.nondet_tol", "applies to a scenario with an implementation: the built-in engines are "
                      "deterministic and are not run twice",
                      hint="remove it, or add 'implementation: module:attribute'")
    if nondet_tol < 0:
        raise f.error("check.nondet_tol", f"must be >= 0, got {nondet_tol}",
                      hint="0 (the default) requires two calls on the same inputs to agree bit for bit")
    if nondet_tol > MAX_TOLERANCE:
        raise f.error("check.nondet_tol", f"{nondet_tol:g} would accept two calls on the same inputs that differ by "
                      f"{nondet_tol:.0%} of their size; at most {MAX_TOLERANCE:g}",
                      hint="0 (the default) requires two calls on the same inputs to agree bit for bit")
    timeout = f.float("check.timeout", 900.0)
    if (f.has("check.timeout") and not f.has("implementation") and not f.has("distributed")
            and f.where("check.timeout")[0] != "defaults"):
        raise f.error("check.timeout", "applies to a scenario with an implementation (run in a process of its own, "
                      "stopped after this many seconds) or distributed ranks", hint="remove it, or add "
                      "'implementation: module:attribute'")
    return factor, slack, nondet_tol, timeout


def _precision_and_check(f: _Fields, dtype: str, colouring_default: bool = True):
    """The keys every op shares: (dtype, epsilon, tolerance, seed, mode, samples, directions, colouring)."""
    dflt = defaults_for(dtype)
    epsilon = f.float("epsilon", dflt["epsilon"])
    if epsilon > MAX_EPSILON:
        raise f.error("epsilon", f"{epsilon:g} is too large a step: central differences converge only as the step "
                      f"shrinks (error ~ step^2), and beyond {MAX_EPSILON:g} x the inputs' scale they estimate nothing "
                      "a verdict could rest on", hint=f"omit it for the {dtype} default ({dflt['epsilon']:g}); "
                      "'attn-gradcheck sweep-eps' shows the error against the step")
    resolution = machine_epsilon(dtype)
    if epsilon < MIN_STEP_ULPS * resolution and dtype not in LOW_PRECISION:  # no finite differences in half precision
        raise f.error("epsilon", f"{epsilon:g} is below what {dtype} can resolve ({resolution:.2g}): the "
                      "perturbed values would round back", hint=f"use at least {MIN_STEP_ULPS * resolution:.2g}")
    tolerance = f.float("tolerance", dflt["tolerance"])
    if tolerance > MAX_TOLERANCE:
        raise f.error("tolerance", f"{tolerance:g} would accept gradients wrong by {tolerance:.0%} of their size (a "
                      f"zero gradient at 1): a check that blind cannot pass anything; at most {MAX_TOLERANCE:g}",
                      hint=f"omit it for the {dtype} default ({dflt['tolerance']:g}); for float16/bfloat16 the "
                           "check.factor / check.slack policy applies")
    seed = f.int("seed", 0, minimum=0)
    mode = f.choice("check.mode", MODES, "full")
    samples = f.int("check.samples", DEFAULT_SAMPLES)
    directions = f.int("check.directions", DEFAULT_DIRECTIONS)
    if directions > MAX_DIRECTIONS:
        raise f.error("check.directions", f"at most {MAX_DIRECTIONS:,} directions, got {directions:,}",
                      hint="use mode: full to check every element")
    for key, applies in (("check.samples", "sample"), ("check.directions", "directional")):
        if mode in ("jvp", "hvp") and f.has(key):  # their directions are fixed: a random one, then per input
            raise f.error(key, f"{key.split('.')[1]} applies to mode {applies}; mode {mode} checks a random "
                          "direction of every input" + (" and then each input's alone" if mode == "jvp" else ""),
                          hint=f"remove {key.split('.')[1]}")
    colouring = f.raw("check.colouring", mode == "full" and colouring_default)
    if not isinstance(colouring, bool):
        raise f.error("check.colouring", f"expected true or false, got {_show(colouring)}")
    if colouring and mode != "full" and f.has("check.colouring"):
        raise f.error("check.colouring", f"colouring applies to mode full only (mode is {mode})",
                      hint="remove colouring, or use mode: full")
    if colouring and not colouring_default:
        raise f.error("check.colouring", "this op has no independent output blocks to colour",
                      hint="remove colouring (it applies to op "
                           + ", ".join(o.name for o in OPS.values() if o.colouring) + ")")
    return dtype, epsilon, tolerance, seed, mode, samples, directions, colouring and mode == "full"


#: What each mode of a directional derivative checks, for messages.
_DERIVATIVE = {"jvp": "a forward-mode derivative (JVP)", "hvp": "a double backward (Hessian-vector product)"}


def _mode_applies(f: _Fields, spec, mode: str, engine: str | None, flavour: str | None = None,
                  dtype: str = "float64") -> None:
    """``check: {mode: jvp}`` and ``{mode: hvp}`` need an engine that computes that derivative or an implementation
    of a flavour whose derivative the op can take (``Op.directional_derivative``), in float64 or float32;
    ``engine`` is the built-in engine that would check the scenario, None for a backend or an implementation of
    the user's (``flavour``: its backend)."""
    computes = spec.directional_derivative(mode)
    if computes is None:
        return
    engines, flavours = computes
    if flavour is not None and flavour in flavours:
        if dtype not in ("float64", "float32"):
            differenced = "forward" if mode == "jvp" else "gradients"
            raise f.error("check.mode", f"mode {mode} differences the {differenced}: it needs dtype float64 or "
                          f"float32, not {dtype}", hint="use dtype: float32 (or float64)")
        return
    if engine is not None and engine in engines:
        return
    places = [f"engine: {e}" for e in engines] + [f"a {fl} implementation" for fl in flavours]
    which = f"has one on: {', '.join(places)}" if places else "has none"
    if flavour is not None:
        runs = f" (this scenario's implementation is {flavour})"
        hint = (f"write it for backend: {' or '.join(flavours)}, or use another check.mode" if flavours else
                "use another check.mode")
    elif engine is not None:
        runs, hint = f" (this scenario runs engine: {engine})", "use another check.mode" + (
            f", or engine: {engines[0]}" if engines else "")
    else:
        runs = " (this scenario runs a backend's own closed forms)"
        hint = ("remove backend (the built-in engines compute it: " + ", ".join(engines) + "), or use another "
                "check.mode") if engines else "use another check.mode"
    raise f.error("check.mode", f"mode {mode} checks {_DERIVATIVE[mode]}; op {spec.name} {which}{runs}", hint=hint)


def _backend_and_device(f: _Fields, spec, dtype: str) -> tuple[str, str]:
    """``backend`` and ``device``: a backend none of the op's built-in engines runs on applies to an
    implementation of yours; JAX runs on its default device (in float16/bfloat16 where the op's
    ``low_precision_backends`` name it); a NumPy implementation never runs in half precision; torch (and a
    GPU for cuda) must be there."""
    backend = f.choice("backend", spec.backends, spec.backends[0])
    device = f.choice("device", DEVICES, "cpu")
    if backend not in spec.built_in_backends and not f.has("implementation"):
        raise f.error("backend", f"backend: {backend} applies to an implementation of yours (op {spec.name}'s "
                      f"built-in engines run on {' and '.join(spec.built_in_backends)})",
                      hint="add 'implementation: module:attribute' or remove it")
    low = dtype in LOW_PRECISION
    if backend == "jax":
        if low and backend not in spec.low_precision_backends:
            raise f.error("dtype", f"dtype {dtype} with backend: jax is not supported for op {spec.name} (it runs "
                          f"on {' and '.join(spec.low_precision_backends)})", hint="use float64 or float32 with JAX")
        _require_jax(f, device)
    elif backend == "numpy" and low and f.has("implementation") and "jax" in spec.low_precision_backends:
        raise f.error("dtype", f"dtype {dtype} needs backend: torch or backend: jax: a NumPy implementation is "
                      "checked by finite differences, which mean nothing in half precision",
                      hint="write it in torch or JAX (backend: torch / backend: jax), or use float64 or float32")
    elif backend == "torch" or device != "cpu" or low:
        _require_torch(f, backend, device, dtype)
    return backend, device


def _missing(error, library: str):
    """``error``, marked as the want of an optional library (a scenario left out by --deselect is not refused for
    it: ``loader.loads(wanted=)``)."""
    error.missing = library
    return error


def _require_jax(f: _Fields, device: str) -> None:
    """JAX scenarios need JAX, on its default device."""
    if device != "cpu":
        raise f.error("device", "device applies to backend: torch (JAX runs on its default device)",
                      hint="remove device")
    try:
        import jax  # noqa: F401
    except ImportError:
        raise _missing(f.error("backend", "this scenario needs JAX, which is not installed",
                               hint="pip install 'attn-gradcheck[jax]', or pip install 'jax[cpu]'"), "jax") from None


def _require_torch(f: _Fields, backend: str, device: str, dtype: str) -> None:
    """Torch scenarios need torch (and cuda a GPU): say how to get it before anything runs."""
    key = "backend" if f.has("backend") else ("device" if f.has("device") else "dtype")
    if backend != "torch":
        what = f"device {device}" if device != "cpu" else f"dtype {dtype}"
        raise f.error(key, f"{what} needs backend: torch", hint="add 'backend: torch'")
    try:
        import torch
    except ImportError:
        raise _missing(f.error(key, "this scenario needs torch, which is not installed",
                               hint="pip install 'attn-gradcheck[torch]', or pin a build, e.g. pip install "
                                    "torch==2.13.0; an unpinned torch may pull a large CUDA build"), "torch") from None
    if dtype == "bfloat16" and f.has("implementation"):
        try:  # your code's bfloat16 tensors come back as NumPy arrays of ml_dtypes' bfloat16
            import ml_dtypes  # noqa: F401
        except ImportError:
            raise _missing(f.error("dtype", "dtype bfloat16 with a torch implementation needs the ml_dtypes "
                                   "package, which is not installed",
                                   hint="pip install ml_dtypes (or pip install 'attn-gradcheck[torch]')"),
                           "ml_dtypes") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise _missing(f.error("device", "device cuda was asked for but torch sees no CUDA device",
                               hint="use device: cpu, or run on a machine with a GPU and a CUDA build of torch; "
                                    "--deselect leaves such scenarios out here"), "CUDA")
