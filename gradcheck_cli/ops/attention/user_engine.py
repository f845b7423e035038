"""A user's attention, in any flavour, as an engine (docs/your-code.md "Checking your own implementation"): a
NumPy object's forward and backward as they are, a torch callable or a JAX function through its flavour
(``flavours.torch``, ``flavours.jax``: autograd or jax.vjp, presented on NumPy arrays), every call through
``implementation.call`` (the one guard contract: fresh copies in, copies out, in-place changes named, results
checked), its determinism and its isolation (each scenario in a fresh worker) as for every op's code."""
from __future__ import annotations

import functools
from collections.abc import Collection

import numpy as np

from ... import flavours, implementation, precision
from ...errors import ScenarioError
from ...numeric import SeedStream
from ..registry import Problem
from . import formulas, varlen
from . import lse as lse_output
from . import stages as score_stages
from .args import Args
from .distributed import keys as distributed_keys
from .drawn_mask import Drawn, own_mask
from .inputs import seeded_inputs
from .invariants import output_invariants
from .reference import (
    LOW_PRECISION,
    LOW_PRECISION_CHECKS,
    REFERENCE_CHECKS,
    Interface,
    called_as,
    diagnosis_fields,
    hint_context,
    implementation_second,
    implementation_tangents,
    plain,
    reference,
    results64,
    varies,
)
from .rounding import Blocks, output_terms


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None) -> Problem:
    """The same problem for the user's implementation (docs/your-code.md "Checking your own implementation"):
    its forward and backward are called through ``implementation.call`` (fresh copies in, copies out;
    misbehaviour is a failed check), perturbed copies are stacked along the batch axis, and the built-in
    engine in float64 is the reference its output and gradients must agree with (``precision``), judged
    against a plain computation in the flavour's own framework (``_peer``).
    In float16/bfloat16 (torch and JAX: the loader refuses a NumPy implementation there) that agreement
    replaces the finite differences (``_low``)."""
    stages = score_stages.from_scenario(sc)
    # per-rank code (or the built-in ring) on its ranks: presented as a NumPy implementation on the global arrays
    ranks = distributed_keys.settings(sc) is not None
    backend = "numpy" if ranks else sc.backend  # the flavour the engine calls it through
    if backend == "jax":  # JAX imported first: its ml_dtypes gives NumPy a bfloat16
        from ...flavours import jax as _  # noqa: F401
    elif sc.dtype == "bfloat16":
        _bfloat16(sc)
    # softcap=, alibi_slopes=, ... passed when the scenario has them (arrays in the precision computed in; a
    # torch implementation's as tensors on the scenario's device)
    given = np.float64 if sc.dtype == "float64" else np.float32
    # (a boolean array, dropout's keep mask, passes as it is)
    convert = lambda a, same: a if a.dtype == bool else a.astype(sc.dtype if same else given)  # noqa: E731
    # a packed batch's cu_seqlens_q=, cu_seqlens_k= (int32), max_seqlen_q=, max_seqlen_k= (ints)
    documents = {} if sc.documents is None else sc.documents.kwargs()
    if backend == "torch":
        from ...flavours import torch as torch_flavour
        convert = lambda a, same: torch_flavour.tensor(a if a.dtype == bool else a.astype(sc.dtype if same else given),  # noqa: E731
                                                       sc.device)
        documents = {kw: torch_flavour.tensor(a, sc.device) for kw, a in documents.items()}
    code = sc.implementation_object
    if ranks:
        from .distributed.proxy import Proxy
        kwarg = score_stages.param_kwargs(stages)
        code = Proxy(sc, tuple(kwarg[t] for t in score_stages.params(stages)),
                     tuple(f for f in faults if f in distributed_keys.FAULTS))
    impl = score_stages.bind(code, score_stages.shown(stages, sc.visible, faults), convert,
                             f"{backend}/{sc.device}/{np.dtype(given)}/{sc.dtype}", documents)
    if sc.mode == "jvp" and backend == "numpy" and not callable(getattr(impl, "jvp", None)):
        raise ScenarioError(f"{sc.implementation} has no callable jvp: mode jvp needs jvp(q, k, v, visible, scale, "
                            "kv_map, dq, dk, dv) -> do beside forward and backward (docs/jvp-and-hvp.md "
                            "\"JVP of your own code\")", file=sc.file, line=sc.implementation_line or sc.line,
                            key=f"scenarios[{sc.index}].implementation")
    drop = score_stages.post(stages)
    # dropout: {drawn_by: code}: the code's mask taken from each call
    drawn = None if drop is None or drop.drawn is None else Drawn(drop.drawn)
    if drawn is not None:
        impl = own_mask(impl, backend, drawn)
    lse_on = lse_output.wanted(sc)  # the log-sum-exp a second output: the code's (o, lse) joined as one
    if lse_on:
        impl = lse_output.joined(impl, backend, sc.convention)
    if backend in ("torch", "jax"):  # one function, differentiated by autograd or jax.vjp (and along a bias)
        kwarg = score_stages.param_kwargs(stages)
        impl = flavours.wrap(impl, 3, sc.backend, sc.dtype, sc.device, output="o",
                             grad_kw={kwarg[t]: x.astype(sc.dtype) for t, x in score_stages.params(stages).items()})
    low = sc.dtype in LOW_PRECISION
    dt = np.dtype(sc.dtype)
    if low:  # the same draws as float64, rounded to the dtype (as the torch engine does)
        inputs64, g64 = seeded_inputs(sc, dtype=np.float64)
        inputs, g = {t: x.astype(dt) for t, x in inputs64.items()}, g64.astype(dt)
    else:
        inputs, g = seeded_inputs(sc)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    args = Args.of(sc, stages)
    kv_map, visible, scale, batch = args.kv_map, sc.visible, sc.scale, sc.batch
    extra = score_stages.params(stages)  # a bias whose gradient is checked: an input, returned by backward as dbias
    batched = score_stages.batched(score_stages.shown(stages, sc.visible, faults))
    carried = {name for name, _ in batched.values()}  # the parameters whose copies go along the batch axis
    blocks = Blocks(sc, kv_map, score_stages.owners(stages))
    interface = Interface(faults, sizes, args, varlen.shown(sc, visible, faults))
    grad_lse = lse_output.upstream(sc, dt) if lse_on else None
    d_out = sc.d_value + (1 if lse_on else 0)  # O's columns, and the LSE's beside them
    g_out = g if not lse_on else np.concatenate([g, grad_lse[..., None]], axis=-1)

    def fold(terms):
        """Terms of L per element of the joined output -> per element of O (the LSE's spread over its row)."""
        return terms if not lse_on else terms[..., :-1] + terms[..., -1:] / sc.d_value

    def called(q, k, v, visible=None, conv=sc.convention) -> tuple:
        """The implementation's leading arguments (q, k, v, visible, scale, kv_map) in convention ``conv``; the
        visible set it is shown (``interface.visible``: a mask fault's) unless another is given."""
        return conv.arguments(q, k, v, interface.visible if visible is None else visible, args.scale, args.kv_map, dt)

    def user_joined(q, k, v, visible, conv=sc.convention, **given):
        """The implementation's O (and with the LSE an output, its lse as one more column), called in convention
        ``conv`` (its layout, mask and scale), in the tool's; ``given``: stage arguments for this call (a bias's
        perturbed copies, ``attn_bias=``)."""
        shape = conv.shape((q.shape[0], sc.heads_q, sc.n_q, d_out))
        fn = functools.partial(impl.forward, **given) if given else impl.forward
        y = conv.tensor(implementation.call(fn, "forward", called(q, k, v, visible, conv), {"o": (shape, dt)},
                                            conv.names())["o"])
        if not lse_on:
            return interface.output(q, k, v, y)
        o_part = interface.output(q, k, v, np.ascontiguousarray(y[..., :-1]))
        return np.concatenate([o_part, interface.lse(y[..., -1:])], axis=-1)

    def user_forward(q, k, v, visible, conv=sc.convention, **given):
        """The implementation's O (``user_joined`` without the LSE)."""
        y = user_joined(q, k, v, visible, conv, **given)
        return y if not lse_on else np.ascontiguousarray(y[..., :-1])

    def user_backward(q, k, v, grad_o, with_lse: bool = False):
        """(dq, dk, dv), and the gradient of each checked stage parameter after them (dbias); ``with_lse``: the LSE's
        upstream gradient G_L too (the scenario's loss; other losses have none)."""
        conv = sc.convention
        grad = grad_o
        if lse_on:
            grad = np.concatenate([grad_o, (grad_lse if with_lse else np.zeros_like(grad_lse))[..., None]], axis=-1)
        out = implementation.call(impl.backward, "backward",
                                  called(q, k, v) + (conv.tensor(grad),),
                                  {**{f"d{t}": (conv.shape(x.shape), dt) for t, x in zip("qkv", (q, k, v))},
                                   **{f"d{t}": (x.shape, dt) for t, x in extra.items()}},
                                  conv.names() + ("grad_o",))
        return interface.gradients(q, k, v, grad_o, *(conv.tensor(out[f"d{t}"]) for t in "qkv"),
                                   *(out[f"d{t}"] for t in extra), grad_lse=grad_lse if with_lse else None)

    stacked_bytes = sum(x.nbytes for x in inputs.values()) + visible.size + g_out.nbytes  # a copy's arguments, O
    stack = impl.stack if backend == "jax" else None  # the flavour's own object; a NumPy one is the user's

    def moved_forward(**moved) -> np.ndarray:
        """O of C copies of the inputs, the ``moved`` ones replaced ([C, B, ...] each), stacked along the batch
        axis for one call: [C, B, Hq, n_q, d_value]. A compiled flavour (JAX) pads a small stack with unmoved
        copies to one fixed size (``stack``), so that one compiled program serves every small stack."""
        c = next(iter(moved.values())).shape[0]
        alone = [t for t in moved if t in extra and t not in carried]
        if alone or drawn is not None:  # a parameter without a batch axis (a relative-bias table), or a keep mask
            # the code draws (for a stack it would draw one per copy): one call per copy
            kwarg = score_stages.param_kwargs(stages)
            try:
                return np.stack([user_joined(*(moved[t][i] if t in moved else inputs[t] for t in "qkv"),
                                              interface.visible,
                                              **{kwarg[t]: moved[t][i].astype(sc.dtype) for t in alone})
                                 for i in range(c)])
            except implementation.ImplementationFailure as exc:
                raise implementation.in_copies(exc, batch, " and ".join(moved)) from None
        total = stack(c, stacked_bytes) if stack else c
        if total > c:
            moved = {t: np.concatenate([m, np.broadcast_to(inputs[t], (total - c,) + inputs[t].shape)])
                     if t in inputs else m for t, m in moved.items()}  # a stage's parameter: padded below
        args = {t: (moved[t] if t in moved else np.broadcast_to(val, (total,) + val.shape)).reshape(
            (total * batch,) + val.shape[1:]) for t, val in inputs.items()}
        vis = np.broadcast_to(interface.visible, (total,) + visible.shape).reshape((total * batch,) + visible.shape[1:])
        given = {}
        # a stage parameter moved, or one per batch element (a bias [B, H|1, n_q, n_k]), goes with the copies
        # along the batch axis: [C * B, H|1, n_q, n_k]
        for kwarg, (name, value) in batched.items():
            if name in moved or value.shape[0] > 1:
                x = moved.get(name, np.broadcast_to(value, (c,) + value.shape))
                if total > c:
                    x = np.concatenate([x, np.broadcast_to(value, (total - c,) + x.shape[1:])])
                x = np.broadcast_to(x, (total, batch) + x.shape[2:])
                x = x.copy() if x.dtype == bool else x.astype(sc.dtype)  # dropout's keep mask stays boolean
                given[kwarg] = x.reshape((total * batch,) + x.shape[2:])
        try:
            return user_joined(args["q"], args["k"], args["v"], vis, **given).reshape((total,) + g_out.shape)[:c]
        except implementation.ImplementationFailure as exc:
            raise implementation.in_copies(exc, batch, " and ".join(moved)) from None

    def copies_forward(name: str, x: np.ndarray) -> np.ndarray:
        """x [C, B, ...]: C perturbed copies of input ``name``, stacked along the batch axis."""
        return moved_forward(**{name: x})

    def moved_gradients(**moved) -> dict:
        """The implementation's gradients with the ``moved`` inputs replaced (one point; mode hvp)."""
        at = {**inputs, **moved}
        return dict(zip("qkv", user_backward(at["q"], at["k"], at["v"], g, with_lse=True)))

    def user_hvp(dq, dk, dv) -> tuple:
        """The implementation's Hessian-vector product along (dq, dk, dv) (JAX: jax.grad over jax.vjp)."""
        conv = sc.convention
        out = implementation.call(
            impl.hvp, "double backward", called(q, k, v)
            + (conv.tensor(g),) + tuple(conv.tensor(t) for t in (dq, dk, dv)),
            {f"h{t}": (conv.shape(x.shape), dt) for t, x in zip("qkv", (q, k, v))},
            conv.names() + ("grad_o", "dq", "dk", "dv"))
        return tuple(conv.tensor(out[f"h{t}"]) for t in "qkv")

    def user_jvp(dq, dk, dv) -> np.ndarray:
        """The implementation's output tangent along (dq, dk, dv), in the tool's layout."""
        conv = sc.convention
        shape = conv.shape(g.shape)
        return conv.tensor(implementation.call(
            impl.jvp, "jvp", called(q, k, v)
            + tuple(conv.tensor(t) for t in (dq, dk, dv)), {"o_dot": (shape, dt)},
            conv.names() + ("dq", "dk", "dv"))["o_dot"])

    y = called_as(sc, lambda conv: user_joined(q, k, v, interface.visible, conv), inputs)
    if drawn is not None and (drawn.failure() or drawn.mask is None):
        raise drawn.failure() or implementation.ImplementationFailure(
            "the code's keep mask never reached the tool (dropout: {drawn_by: code})", "keep_mask")
    o = y if not lse_on else np.ascontiguousarray(y[..., :-1])
    dq, dk, dv, *dparams = user_backward(q, k, v, g, with_lse=True)
    names = ("q", "k", "v", *extra)
    again_y = user_joined(q, k, v, interface.visible)
    again = {"o": again_y[..., :sc.d_value], **dict(zip(names, user_backward(q, k, v, g, with_lse=True))),
             **({"lse": again_y[..., -1]} if lse_on else {})}
    results = {"o": o, "q": dq, "k": dk, "v": dv, **dict(zip(extra, dparams)),
               **({"lse": y[..., -1]} if lse_on else {})}
    deterministic = implementation.determinism("forward and backward", results, again, sc.nondet_tol)
    if low:
        return _low(sc, impl, inputs, g, interface, results, deterministic, user_forward, user_backward)
    ref, terms, a64 = reference(inputs, g, args, grad_lse)
    # dropout: O = (A * W) V, its terms A * W's
    dropout = None if drop is None else (drop.weights(), (a64 * drop.weights()).sum(axis=-1))

    def results_at(xs: dict) -> dict | None:
        try:
            grads = user_backward(xs["q"], xs["k"], xs["v"], g, with_lse=True)
            return {"o": user_forward(xs["q"], xs["k"], xs["v"], interface.visible), **dict(zip("qkv", grads))}
        except implementation.ImplementationFailure:
            return None

    nearby = precision.nearby(inputs, results_at, lambda xs: results64(xs, g, args, grad_lse),
                              [sc.seed, SeedStream.PRECISION])
    agree, computes_in = precision.judge(results, ref, terms, sc.dtype,
                                         lambda p: _peer(sc, {**inputs, **extra}, g, args, p, grad_lse),
                                         {**REFERENCE_CHECKS, **dict.fromkeys(extra, REFERENCE_CHECKS["q"]),
                                          **({"lse": lse_output.CHECK} if lse_on else {})},
                                         sc.factor, sc.slack, nearby_difference=nearby)
    rounding, rounding_total = blocks.rounding({**inputs, **extra}, g, a64, scale, kv_map, stages=stages,
                                               lse=None if not lse_on else (grad_lse, ref["lse"]))
    rule = precision.Policy.for_dtype(computes_in)
    rng_inv = np.random.default_rng([sc.seed, SeedStream.INVARIANTS])

    def checks() -> list:
        try:
            out = [deterministic] + agree + output_invariants(
                lambda q, k, v: user_forward(q, k, v, interface.visible),
                lambda q, k, v, go: user_backward(q, k, v, go)[1:3],
                inputs, visible, kv_map, o, rng_inv, output_terms(inputs, a64, scale, kv_map, stages), computes_in,
                (g, dk, dv), sc.documents, _sink_weight(inputs, args), dropout)
        except implementation.ImplementationFailure as exc:
            out = [deterministic] + agree + [implementation.failure_check("invariants", exc)]
        if ranks:  # the gathered result against the same code's on one rank
            from .distributed.invariants import one_rank_checks
            out += one_rank_checks(sc, faults, results, ref, {t: rule.ulps * rule.eps * terms[t] for t in results},
                                   rule.ulps * rule.eps, build)
        return out + ([] if drawn is None else drawn.checks(visible)) + flavours.compiled_rows(impl)

    copy_bytes = (o.size + k.size + v.size + q.size) * dt.itemsize  # a copy's inputs and output
    if not ranks:  # its scores and weights too, here (on ranks they live there, a tile at a time)
        copy_bytes += 3 * a64.size * dt.itemsize
    return Problem(
        inputs={**inputs, **extra},
        loss=lambda name, x: np.sum(np.asarray(copies_forward(name, x), dtype=np.float64) * g_out,
                                    axis=(-4, -3, -2, -1)),  # in float64: the LSE's terms dwarf O's
        gradients={"q": dq, "k": dk, "v": dv, **dict(zip(extra, dparams))},
        rounding=rounding,
        rounding_total=rounding_total,
        copy_bytes=copy_bytes + visible.size,
        invariants=checks,
        arrays={"q": q, "k": k, "v": v, "visible": visible, "grad_output": g,
                "scale": np.asarray(scale), "kv_map": kv_map, "output": o,
                "analytic_q": dq, "analytic_k": dk, "analytic_v": dv, "reference_output": ref["o"],
                **extra, **{f"analytic_{t}": x for t, x in zip(extra, dparams)},
                **({"lse": results["lse"], "reference_lse": ref["lse"], "grad_lse": grad_lse} if lse_on else {})},
        output=o if not lse_on else y,  # with the LSE an output, O and the LSE side by side
        parts=blocks.parts,
        loss_parts=lambda name, x: blocks.sums(name, fold(np.asarray(copies_forward(name, x), dtype=np.float64)
                                                          * g_out)),
        compute_dtype=None if computes_in == sc.dtype else computes_in,
        analytic_rounding={t: rule.ulps * rule.eps * terms[t] for t in names},
        nondeterministic=varies(o, again["o"], sc.nondet_tol),
        serial=ranks,
        compile_s=flavours.compile_time(impl),
        tangents=None if sc.mode != "jvp" else implementation_tangents(
            inputs, g, a64, moved_forward, user_jvp, interface, [sc.seed, SeedStream.TANGENT_HINTS],
            precision.Policy.for_dtype(computes_in, sc.factor, sc.slack)),
        second=None if sc.mode != "hvp" else implementation_second(
            inputs, g, moved_gradients, user_hvp, interface, precision.Policy.for_dtype(computes_in, sc.factor,
                                                                                        sc.slack)),
        **diagnosis_fields(sc, hint_context(inputs, g, args, results, ref, user_forward, grad_lse)),
    )


def _low(sc, impl, inputs: dict, g, interface: Interface, results: dict, deterministic, user_forward,
         user_backward) -> Problem:
    """The problem in float16/bfloat16 (as the torch engine's there): no finite differences; the output and
    gradients against the float64 reference on the same (rounded) inputs, each element within factor x the
    error of the plain computation in the same precision in the flavour's framework (``_peer``), + slack + ulps
    of its terms; then the determinism check and the output invariants."""
    dt = np.dtype(sc.dtype)
    args = interface.args
    rounded = {t: x.astype(np.float64) for t, x in inputs.items()}  # the inputs as the dtype holds them
    g64 = g.astype(np.float64)
    r64 = {t: x.astype(np.float64) for t, x in results.items()}
    ref, terms, a64 = reference(rounded, g64, args)
    agree, computes_in = precision.judge(
        r64, ref, terms, sc.dtype, lambda p: _peer(sc, rounded, g64, args, p),
        LOW_PRECISION_CHECKS, sc.factor, sc.slack)

    def forward64(q, k, v, vis=interface.visible, conv=sc.convention):
        """The implementation's O on float64 arrays (rounded to the dtype first), as float64."""
        return user_forward(q.astype(dt), k.astype(dt), v.astype(dt), vis, conv).astype(np.float64)

    def backward_kv64(q, k, v, grad_o):
        return [x.astype(np.float64) for x in user_backward(*(x.astype(dt) for x in (q, k, v, grad_o)))[1:]]

    def checks() -> list:
        try:
            out = [deterministic] + agree + output_invariants(
                forward64, backward_kv64, rounded, args.visible, args.kv_map, r64["o"],
                np.random.default_rng([sc.seed, SeedStream.INVARIANTS]),
                output_terms(rounded, a64, args.scale, args.kv_map, args.stages),
                computes_in, (g64, r64["k"], r64["v"]), sc.documents, _sink_weight(rounded, args))
        except implementation.ImplementationFailure as exc:
            out = [deterministic] + agree + [implementation.failure_check("invariants", exc)]
        return out + flavours.compiled_rows(impl)

    context = hint_context(rounded, g64, args, r64, ref,
                           lambda q, k, v, vis, conv=sc.convention: forward64(q, k, v, vis, conv))
    return Problem(
        inputs={}, loss=None, gradients={t: r64[t] for t in "qkv"}, rounding={}, rounding_total=0.0, copy_bytes=0,
        invariants=checks, output=r64["o"],
        arrays={**rounded, "visible": args.visible, "grad_output": g64, "scale": np.asarray(args.scale),
                "kv_map": args.kv_map,
                "output": r64["o"], "reference_output": ref["o"], **{f"analytic_{t}": r64[t] for t in "qkv"}},
        **diagnosis_fields(sc, context),
    )


def _peer(sc, inputs: dict, g, args: Args, precision: str, grad_lse=None):
    """The plain computation in ``precision`` that the implementation's rounding is judged against, in its own
    framework: torch autograd (in half precision also the torch closed forms and SDPA) for torch code, the
    plain forward in jax.numpy differentiated by jax.vjp for JAX code in half precision, the built-in closed
    forms in NumPy otherwise."""
    if grad_lse is not None:  # the LSE an output: the closed forms with G_L (float64 and float32 only)
        return plain(inputs, g, args, precision, grad_lse)
    if sc.backend == "torch":
        from .torch_engine import peers
        return peers.plain(inputs, g, args, sc.heads_q, sc.device, precision)
    if precision in LOW_PRECISION:
        from . import jax_plain
        return jax_plain.plain(inputs, g, args, precision)
    return plain(inputs, g, args, precision)


def _sink_weight(inputs: dict, args: Args):
    """The reference's sinks' weight per row (float64), or None without sinks."""
    q, k = (np.asarray(inputs[t], dtype=np.float64) for t in "qk")
    return formulas.sink_weight(q, k, **args.kw) if args.stages else None


def _bfloat16(sc) -> None:
    """NumPy's bfloat16 (ml_dtypes', which JAX brings and the torch extra installs), or a one-line refusal."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        raise ScenarioError("dtype bfloat16 with a torch implementation needs the ml_dtypes package: "
                            "pip install ml_dtypes (or pip install 'attn-gradcheck[torch]')", file=sc.file,
                            line=sc.line, key=f"scenarios[{sc.index}].dtype") from None
