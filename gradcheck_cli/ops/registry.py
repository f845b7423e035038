"""The op record and the one registry of ops. Each op module builds its ``Op``; ``OPS`` lists them."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def named_value(faults, prefix: str) -> str | None:
    """The value a parametrised fault or known mistake carries in its name (``prefix`` + value, e.g.
    ``rmsnorm-rstd-float16`` -> ``float16``), or None when none of ``faults`` has the prefix."""
    return next((f[len(prefix):] for f in faults if f.startswith(prefix)), None)

@dataclass(frozen=True)
class Fault:
    """A deliberately wrong variant of an op's forward and/or backward (a negative control).

    ``engine``: it applies to the op's built-in engines. ``user``: what it does to a user's
    implementation (it needs no access to its internals: it changes what the implementation is
    shown or what it returns), None when it does not apply to one. ``sized``: its size is set from the
    clean run (e.g. 10x the smallest error the clean run detects). ``scenario``: the keys (and a value of each)
    a scenario must have for the fault to apply, beyond the op's example (a score stage's: ``softcap``)."""
    name: str
    breaks: str                 # what the fault changes, in one line
    caught_by: tuple[str, ...]  # names of the checks expected to catch it
    forward: bool = False       # True when the fault changes the forward (finite differences change too)
    engine: bool = True
    user: str | None = None
    sized: bool = False
    derivative: str = "vjp"     # what it breaks: vjp (the gradients), jvp (the output's tangent), hvp (Hessian x vec)
    scenario: tuple = ()        # (key, value) pairs a scenario needs for it to apply (a score stage's key)
    backends: tuple[str, ...] = ()  # the backends its built-in engines apply it on (empty: every one the op has)


@dataclass(frozen=True)
class Tangents:
    """What the JVP checks (``check: {mode: jvp}``) need of an engine that computes a forward-mode derivative.

    forward(q=..., k=..., v=...): the op's output with inputs replaced (they may carry extra leading axes of
      perturbed copies). jvp(tangents): the analytic output tangent for tangents by input name (a missing input
      has tangent 0). jvp_terms(tangents): per output element, the size of the terms the analytic tangent is
      made of (its rounding). output_terms: per output element, the size of the terms of one forward (the
      rounding of the differences). upstream: the G of L = sum(O * G), paired with ``Problem.gradients`` in
      the adjoint identity. explain(checks): hints for a failed JVP, given every check of the run (None: the op
      has none).
      agreement(tangent, o_dot): a reference check of the JVP ``o_dot`` along ``tangent`` (an implementation's,
      against the float64 closed form; None: no such check).
    """
    forward: Callable[..., np.ndarray]
    jvp: Callable[[dict], np.ndarray]
    jvp_terms: Callable[[dict], np.ndarray]
    output_terms: np.ndarray
    upstream: np.ndarray
    explain: Callable[[list], list[str]] | None = None
    agreement: Callable[[dict, np.ndarray], Any] | None = None


@dataclass(frozen=True)
class SecondOrder:
    """What the double-backward checks (``check: {mode: hvp}``) need of an engine: the Hessian of L = sum(O * G)
    times a direction, against central differences of its own first-order gradients along that direction.

    gradients(**moved): the engine's gradients (by input name) with the ``moved`` inputs replaced. hvp(u): the
      analytic Hessian-vector product H u by input name, for a direction u by input name (missing: zero).
      hvp_terms(u): per element of H u, the size of the terms it is made of (its rounding). gradient_terms: per
      element of each gradient, the size of its terms (the rounding of the differences). agreement(u, hu): reference
      checks of H u (an implementation's, against the float64 closed form). explain(checks): hints for a failed
      double backward, given every check of the run.
    """
    gradients: Callable[..., dict]
    hvp: Callable[[dict], dict]
    hvp_terms: Callable[[dict], dict]
    gradient_terms: dict
    agreement: Callable[[dict, dict], list] | None = None
    explain: Callable[[list], list[str]] | None = None


@dataclass(frozen=True)
class Structure:
    """What the axes of one input mean, for the diagnosis of a failed check.

    axes: a name per axis, e.g. ``("batch", "query head", "query row", "feature")``.
    classes: label -> bool mask over the leading axes (broadcast over the rest), e.g. query rows that
      see every key versus rows with hidden keys; the diagnosis counts failures in each.
    heat: the two axes of the heat map (rows, columns), or None.
    """
    axes: tuple[str, ...]
    classes: Mapping[str, np.ndarray] = field(default_factory=dict)
    heat: tuple[str, str] | None = None


@dataclass
class Problem:
    """Everything the checker needs for one scenario of one op, with faults already applied.

    inputs: the differentiable tensors, in report order.
    loss: ``loss(name, x)`` is L evaluated with input ``name`` replaced by ``x``, where ``x`` may
      carry extra leading axes of perturbed copies; returns L per copy (shape ``x.shape[:-ndim]``).
    gradients: the analytic dL/d(input) of the implementation under test.
    rounding: per input, for each element, the size of the terms of L that move when it moves,
      weighted by how much rounding one forward puts in them: eps * rounding / step bounds the
      rounding error of that element's difference quotient (the other terms of L are computed
      identically in both evaluations, and L is accumulated in float64).
    rounding_total: the same over every term of L (a direction moves every element).
    copy_bytes: bytes of work memory one perturbed copy needs in ``loss`` (for chunking).
    serial: its ``loss`` calls run one at a time whatever calls them (the ranks of a distributed check answer
      one call after another): the finite differences then run one chunk at a time, of the whole budget.
    invariants: computes the semantic checks (list of ``result.Check``).
    arrays: what ``--save-arrays`` writes.
    output: the op's output (for the applicability of faults).
    parts / loss_parts: optional, for colouring. ``parts[name]`` (shape of the input) is the id of the
      independent block of the output each element feeds; ``loss_parts(name, x)`` is L split by those
      blocks, shape ``[..., P]``, summing to L. Elements of different blocks can be perturbed at once.
    compute_dtype: the precision the forward really computes in, when measured lower than the
      scenario's dtype (a float64 scenario whose implementation computes internally in float32): the
      noise floor of the finite differences is that precision's.
    analytic_rounding: optional, per input, the rounding allowed in each element of the analytic
      gradient (an implementation's backward in its own precision), added to the noise floor.
    structure / hints: optional, for the diagnosis of failures. ``structure[name]`` names the axes of
      input ``name``; ``hints(evidence, checks)`` returns one-line likely causes, given
      ``diagnose.Evidence`` of every gradient check (by input) and all checks of the run.
    """
    inputs: dict[str, np.ndarray]
    loss: Callable[[str, np.ndarray], np.ndarray]
    gradients: dict[str, np.ndarray]
    rounding: dict[str, np.ndarray]
    rounding_total: float
    copy_bytes: int
    invariants: Callable[[], list]
    arrays: dict[str, Any] = field(default_factory=dict)
    output: np.ndarray | None = None
    parts: dict[str, np.ndarray] | None = None
    loss_parts: Callable[[str, np.ndarray], np.ndarray] | None = None
    structure: dict[str, Structure] | None = None
    hints: Callable[[dict, list], list[str]] | None = None
    step_sizes: dict[str, float] | None = None  # natural scale of an input for the step policy (default 1)
    compute_dtype: str | None = None  # the precision the forward was measured to compute in (default: its dtype)
    analytic_rounding: dict[str, np.ndarray] | None = None  # allowed rounding of each analytic gradient element
    nondeterministic: bool = False  # the implementation's forward changes from call to call
    serial: bool = False  # its calls run one at a time (ranks): one worker, the whole budget to each call
    compile_s: Callable[[], float] | None = None  # seconds a compiled flavour (JAX) has spent compiling so far
    second: SecondOrder | None = None  # the engine's Hessian-vector product (mode hvp); None: it has none
    tangents: Tangents | None = None  # the engine's forward-mode derivative (mode jvp); None: it has none


@dataclass(frozen=True)
class Interface:
    """What a user's implementation of an op provides (the ``implementation:`` key): ``flavours`` are the
    backends it may be written for; ``signature`` says what each callable takes and returns (messages and
    ``attn-gradcheck faults``); ``args``, the names of the arguments after the tensors (what the module form's
    ``call`` may pass: ``implementation.modules``); ``modules``, whether it accepts that form (an op with
    weights); ``conventions``, the ``convention:`` keys that apply to it (layout, mask, mask_heads, scale)."""
    flavours: tuple[str, ...]
    signature: str
    args: tuple[str, ...] = ()
    modules: bool = True
    conventions: tuple[str, ...] = ()


@dataclass(frozen=True)
class NonFinite:
    """What an op says of NaN or inf in a scenario: ``hint``, its own diagnosis (replacing the generic
    one) or None; ``cause``, how its values leave the dtype's range (ends the generic hint); ``unstable``,
    what brings perturbed copies near that range."""
    hint: str | None = None
    cause: str = "; use a wider dtype or smaller values"
    unstable: str = "large values"


def user_code_engines(module: str) -> dict:
    """``engines`` and ``engine_for`` of an op with one built-in engine (``module:build``) that also checks a
    user's implementation (``module:build_user``, in every flavour its ``Interface`` names)."""
    return {"engines": {e.name: e for e in (
                Engine("naive", f"{module}:build", "the closed forms in NumPy"),
                Engine("implementation", f"{module}:build_user", "a user's implementation (NumPy, torch or JAX)",
                       choice=False))},
            "engine_for": _built_in_or_user}


def _built_in_or_user(sc) -> str:
    return "implementation" if sc.implementation is not None else "naive"


#: ``check`` keys of the agreement policy and of the isolation of user code: they apply to ops that accept
#: an implementation.
IMPLEMENTATION_CHECK_KEYS = ("check.factor", "check.slack", "check.nondet_tol", "check.timeout")


#: Marks a Param without a default: the key is required.
REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One op-specific scenario key, read by the loader with its file and line.

    kind: ``int`` (>= minimum), ``float`` (> 0 unless ``minimum`` allows 0 or negatives), ``choice``
    (one of ``choices``), ``bool``, ``floats`` (non-empty list of floats > 0), ``ints`` (non-empty
    list of ints >= minimum), ``sizes`` (a non-empty list of ints >= minimum, repeats allowed),
    ``choice-or-floats`` (one of ``choices`` or a list of floats > 0; any finite floats where ``minimum``
    is set), ``path`` (a file, relative to the YAML;
    the op's ``validate`` reads it), ``choice-list`` (a non-empty list of
    distinct ``choices``) or ``mapping`` (a mapping of the keys
    ``fields``, (name, Param) pairs; read as a tuple of (name, value) pairs, a list as a tuple; the whole mapping
    None when absent and ``default`` is None).
    """
    kind: str
    default: Any = REQUIRED
    help: str = ""
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    fields: tuple[tuple[str, Any], ...] = ()


#: Sizes a hunt draws as often as all the others together (``Axis.edges``): the smallest, each side of the block
#: sizes kernels tile by (16 .. 256), and primes between (the seqlens of FlashAttention's test grids).
SIZE_EDGES = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 113, 127, 128, 129, 217, 255, 256, 257)
#: Head dimensions kernels special-case (FlashAttention's 40, 80, 96, 160, 192, 256) and each side of the powers of 2.
HEAD_EDGES = (1, 2, 3, 4, 8, 15, 16, 17, 31, 32, 33, 40, 63, 64, 65, 80, 96, 127, 128, 129, 160, 192, 255, 256)
#: Model and hidden widths: the head dimensions' edges, and each side of 512 and 1024.
WIDTHS = HEAD_EDGES + (257, 511, 512, 513, 1023, 1024)


@dataclass(frozen=True)
class Axis:
    """One key of the space ``attn-gradcheck hunt`` draws scenarios from (``Op.space``), as data.

    ``key``: a scenario key, dotted for a nested one (``mask.causal``), or ``group`` (attention's query heads per KV
    head: ``heads_q`` = ``heads_kv`` x group). Its values are an integer range ``low`` .. ``high``, whose ``edges``
    (block edges, primes, the sizes kernels special-case) are drawn as often as the rest, or ``choices`` (None: the
    key left out, its default). The simplest value comes first: a failure shrinks towards it.
    ``kind``: ``int``, ``choice``, ``lengths`` (a padding length per batch element, each in 1 .. ``of``, or none) or
    ``window`` (a sliding window (left, right), each side in 0 .. ``of`` or None, or none).
    ``when_set``: the axis varies only where the starting scenario sets the key (a variant, or an input the code
    may not take), or where ``--space`` names it. ``fixed_by``: keys of the starting scenario that fix this one's
    value (a mask file fixes the sizes): with one of them set, it keeps the starting value; a key ending in '[]'
    fixes it only when set to a list (``alibi.slopes[]``: a list of slopes, not a named rule)."""
    key: str
    kind: str = "int"
    low: int = 1
    high: int = 1
    edges: tuple[int, ...] = ()
    choices: tuple = ()
    of: str = ""
    when_set: bool = False
    fixed_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class Engine:
    """One way of computing an op, imported only when a scenario uses it (as einops resolves its
    backends lazily): ``target`` names ``module:function``, a ``build(scenario, faults, sizes) -> Problem``.
    Nothing imports an engine's module but :meth:`load`, so an engine may import its framework (torch)
    at the top and the op's package never reaches up to it."""
    name: str
    target: str
    summary: str = ""
    choice: bool = True               # chosen with ``engine:`` / ``--engine``; False: implied (backend, implementation)
    keys: tuple[str, ...] = ()        # scenario keys that apply to this engine only (e.g. block sizes)

    def load(self) -> Callable[..., Problem]:
        module, attr = self.target.split(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class KeyGroup:
    """Keys an op shares with the ops of its structure, parsed by the op's own code (attention's: heads, sizes,
    masks and the calling convention, ``ops.attention.scenario_keys``). ``read(fields, batch)`` reads their values
    before anything of their size exists; ``build(fields, read, batch, base_dir, op)`` makes what they describe
    once the memory check passed. Both return Scenario fields. ``sizes(read, batch)``: what the memory estimate
    counts and the keys that reduce it, for the loader's error. ``takes(op)``: the keys that apply to an op (``keys``
    lists every one); ``nested``: the mappings among them and their keys (merged over ``defaults`` key by key, but
    those in ``whole``, whose keys belong together, replaced as a whole); ``schema()``: their JSON Schema."""
    name: str
    keys: tuple[str, ...]
    nested: Mapping[str, tuple[str, ...]]
    read: Callable[..., dict]
    build: Callable[..., dict]
    sizes: Callable[[dict, int], tuple[str, str]]
    takes: Callable[[Any], tuple[str, ...]]
    schema: Callable[[], dict]
    summary: str
    whole: tuple[str, ...] = ()


@dataclass(frozen=True)
class Op:
    """An op: its gradients, faults and scenario keys.

    ``shared_keys``: the keys it shares with the ops of its structure (attention's heads, n_q, n_k, d_head,
    masks, ...), which it parses itself (``KeyGroup``).
    ``keys``: its own keys. ``validate(params, attention)`` returns (key, message, hint) for values
    that are wrong together (the loader reports the first with its line); ``attention`` holds the
    parsed attention keys or is empty. ``shapes(sc)``: the shapes of its inputs (for progress and the
    memory estimate). ``describe(sc)``: one line of the scenario's shapes. ``common_keys``: the shared
    keys (batch, dtype, epsilon, tolerance, check, seed) it uses, when not all. ``memory(sc)``: bytes
    beyond its inputs, for the load-time estimate. An op is computed by ``build`` or, when it has
    several engines, by ``engines[engine_for(sc)]`` (see :meth:`problem`).
    """
    name: str
    summary: str
    tensors: tuple[str, ...]
    faults: Mapping[str, Fault]
    build: Callable[..., Problem] | None = None  # build(scenario, faults) -> Problem, for an op of one engine
    engines: Mapping[str, Engine] = field(default_factory=dict)  # or its engines, by name
    engine_for: Callable[[Any], str] | None = None  # the name of the engine that checks a scenario
    keys: Mapping[str, Param] = field(default_factory=dict)
    shared_keys: KeyGroup | None = None
    validate: Callable[[dict, dict], list] | None = None
    shapes: Callable[[Any], dict] | None = None
    describe: Callable[[Any], str] | None = None
    common_keys: tuple[str, ...] | None = None  # the shared keys it takes (default: all of them)
    memory: Callable[[Any], int] | None = None  # bytes a scenario needs (load-time estimate; default: its tensors')
    why_not: Callable[[Any, str], str | None] | None = None  # why a fault cannot apply to a scenario, if known
    # Capabilities, as data: they drive the loader, the CLI's choices, the schema and the fault contract.
    backends: tuple[str, ...] = ("numpy",)       # values of ``backend:`` (more than one: ``backend``/``device`` apply)
    built_in_backends: tuple[str, ...] = ("numpy",)  # those its built-in engines run on (the others: user code)
    dtypes: tuple[str, ...] = ("float64", "float32")  # values of ``dtype:``
    low_precision_backends: tuple[str, ...] = ("torch",)  # the backends its float16/bfloat16 (if any) run on
    implementation: Interface | None = None     # the ``implementation:`` it accepts, if any
    colouring: bool = False                     # its output splits into independent blocks (``Problem.parts``)
    example: Mapping[str, Any] = field(default_factory=dict)  # scenario keys on which every engine fault applies
    non_finite: Callable[[Any], NonFinite] | None = None  # what NaN or inf in a scenario means for this op
    tangent_engines: tuple[str, ...] = ()       # the engines that compute a JVP (``check: {mode: jvp}``)
    tangent_flavours: tuple[str, ...] = ()      # the flavours of ``implementation:`` whose JVP it checks
    second_engines: tuple[str, ...] = ()        # the engines that compute a Hessian-vector product (mode hvp)
    second_flavours: tuple[str, ...] = ()       # the flavours of ``implementation:`` whose double backward it checks
    variants: tuple[tuple[str, str], ...] = ()  # (key, what it does) of each variant it checks (attention's stages)
    limits: tuple[str, ...] = ()  # what it does not check yet (``attn-gradcheck ops`` lists them)
    variant_labels: Callable[[Any], tuple[str, ...]] | None = None  # the variants a scenario uses, for its reports
    #: whether a scenario sets a shared key a fault needs (``Fault.scenario``: ``varlen``), where it is no key of the
    #: op's own (those are set when their value is not None)
    sets: Callable[[Any, str], bool] | None = None
    #: the space ``attn-gradcheck hunt`` searches (``Axis`` records, drawn in this order); empty: the op has none
    space: tuple[Axis, ...] = ()

    def directional_derivative(self, mode: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """(engines, implementation flavours) that compute the derivative ``mode`` checks, for modes jvp and hvp;
        None for the other modes (every engine computes gradients)."""
        return {"jvp": (self.tangent_engines, self.tangent_flavours),
                "hvp": (self.second_engines, self.second_flavours)}.get(mode)

    def problem(self, sc, faults=(), sizes: dict[str, float] | None = None) -> Problem:
        """The problem of scenario ``sc`` with ``faults`` injected (``sizes``: of the sized faults), from the
        engine that checks it."""
        if self.engines:
            return self.engines[self.engine_for(sc)].load()(sc, faults, sizes)
        return self.build(sc, faults, sizes) if sizes else self.build(sc, faults)

    @property
    def engine_choices(self) -> tuple[str, ...]:
        """The engines ``engine:`` chooses between (the first is the default)."""
        return tuple(name for name, e in self.engines.items() if e.choice)

    def takes(self, key: str) -> bool:
        """Whether scenario key ``key`` (top-level, or ``check.<key>``) applies to this op, beyond the shared
        and attention keys: backends, engines and implementations bring keys of their own."""
        if key == "implementation":
            return self.implementation is not None
        if key in ("backend", "device"):
            return len(self.backends) > 1
        if key == "engine":
            return len(self.engine_choices) > 1
        if key in IMPLEMENTATION_CHECK_KEYS:
            return self.implementation is not None
        return any(key in e.keys for e in self.engines.values() if e.choice)
