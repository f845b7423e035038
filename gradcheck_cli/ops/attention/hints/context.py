"""What the hints may consult about an implementation beyond the checks (``Context``: its output and
gradients, the float64 reference of any visible set or KV map, its forward), and the hints that test
its forward with it: what it computes instead of attention, whether it mixes batch elements, which key
rows it never reads, and whether its backward ignores the mask."""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .... import masks
from ....indices import ranges
from ....numeric import SeedStream
from ....tolerance import machine_epsilon
from ..formulas import attention_weights, backward, log_sum_exp, raw_scores, repeat_kv, sum_groups

#: An alternative explains the implementation's output when it is this many times closer to it than
#: the reference is.
CLOSER = 100.0
#: A fitted pattern explains an error when what it leaves is below this fraction of the error.
EXPLAINED = 0.1
#: An output moves, or a reference gradient row is live, above this fraction of the largest value: above
#: the rounding of float32 (eps 1.2e-7), the loosest dtype finite differences run in, below any real effect.
SIGNIFICANT = 1e-6
#: A gradient row is zero at or below this fraction of the reference's largest: float64 rounding, no more.
ZERO = 1e-12


@dataclass
class Context:
    """What the hints may consult beyond the checks: the implementation's output and gradients on the
    scenario's inputs, the float64 reference of any visible set / KV map on the same inputs, and the
    implementation's forward (for the batch-mixing test). None for the built-in engines."""
    output: np.ndarray                               # O of the implementation, float64
    reference: Callable[..., np.ndarray]             # reference(visible=, kv_map=, scale=) -> O, float64
    reference_gradients: dict[str, np.ndarray]       # the float64 reference's dq, dk, dv
    gradients: dict[str, np.ndarray]                 # the implementation's, float64
    forward: Callable[..., np.ndarray] | None        # forward(q, k, v, visible[, convention]) -> O of the
    #                                                  implementation (called in another ``convention``)
    inputs: dict[str, np.ndarray]
    g: np.ndarray | None = None                      # the upstream gradient, float64
    stages: tuple = ()                               # the score stages in force (reference(stages=...) replaces them)
    lse: tuple | None = None                         # (the implementation's LSE, the reference's, G_L), float64


def _matches(o: np.ndarray, alternative: np.ndarray, reference: np.ndarray) -> bool:
    """o is CLOSER times closer to the alternative than to the reference (and the two differ)."""
    to_alt = float(np.abs(o - alternative).max(initial=0.0))
    to_ref = float(np.abs(o - reference).max(initial=0.0))
    return to_ref > 0 and to_alt * CLOSER < to_ref


#: The hint of a forward that reads the visible set as a drop mask (the other boolean mask convention).
DROP_MASK = ("the forward reads visible as a drop mask (True = hidden, the convention of boolean masks in "
             "torch.nn.MultiheadAttention), while the scenario's visible set is a keep mask (True = key visible, "
             "as SDPA's boolean attn_mask): invert the mask where your code receives it, or set "
             "convention: {mask: drop}")


def _convention(sc, call: Callable, reference: np.ndarray, output: np.ndarray | None = None) -> str | None:
    """The hint of an implementation written for another calling convention (``convention:`` keys): called
    with one key changed (``call(convention) -> O`` in the tool's layout), its forward agrees with the
    reference. With ``output`` (its O as called), agreeing is being CLOSER times closer to the reference;
    without (its call failed), being within sqrt(eps) of the dtype of the reference's largest value."""
    from ...convention import MEANING, applies, setting
    current = sc.convention
    for key, value, alt in current.alternatives():
        if not applies(alt, sc):
            continue
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):  # a wrong way may well warn
                warnings.simplefilter("ignore")
                o = np.asarray(call(alt), dtype=np.float64)
        except Exception:  # noqa: BLE001 -- the implementation fails that way too: not its convention
            continue
        if o.shape != reference.shape or not np.isfinite(o).all():
            continue
        if output is not None:
            agrees = _matches(reference, o, output)
        else:
            size = max(float(np.abs(reference).max(initial=0.0)), 1e-300)
            agrees = float(np.abs(o - reference).max(initial=0.0)) <= np.sqrt(machine_epsilon(sc.dtype)) * size
        if not agrees:
            continue
        what = _written_for(key, value)
        mine = getattr(current, key)
        return (f"{what}: called with {setting(key, value)} it agrees with the reference, while the scenario's "
                f"convention is {key}: {mine} ({MEANING[(key, mine)]}); set {setting(key, value)} in the scenario "
                "(docs/your-code.md \"Checking your own implementation\")")
    return None


def _written_for(key: str, value: str) -> str:
    """What an implementation written for ``convention: {key: value}`` does."""
    from ...convention import MEANING
    if key == "layout":
        return "the forward takes q, k, v and returns o as " + ("[B, n, H, d]" if value == "bnhd" else "[B, H, n, d]")
    if key == "mask":
        return f"the forward reads visible as {'an' if value[0] == 'a' else 'a'} {value} mask ({MEANING[key, value]})"
    if key == "mask_heads":
        return f"the forward takes {MEANING[key, value]}"
    return "the forward " + ("takes no scale argument (it uses 1/sqrt(d_head) itself)" if value == "omitted"
                             else "takes a scale argument after the mask")


def _sinks_alternative(sc, context: Context, kv_map, ref) -> str | None:
    """With sinks: what the forward computes instead, when it is attention with the sinks left out, multiplied by the
    softmax scale, negated, or read per KV head (sinks[kv_map[h]]: a sink per KV head indexed like K and V)."""
    from ..stages import sinks as sink_stage
    stages = context.stages
    at = next((i for i, st in enumerate(stages) if st.normaliser), None)
    if at is None:
        return None
    st = stages[at]
    logits = np.asarray(st.logits(), dtype=np.float64)
    hq, hkv = sc.heads_q, sc.heads_kv
    candidates = [(stages[:at] + stages[at + 1:],
                   "the forward leaves the sinks out of the softmax: each row's normaliser needs exp(s_h) beside "
                   "sum_j exp(S_ij) (gpt-oss concatenates the sink logit as one more score column and drops that "
                   "column after the softmax)")]
    if sc.scale != 1:
        candidates.append((stages[:at] + (sink_stage.Sinks(logits * sc.scale, st.grad),) + stages[at + 1:],
                           f"the forward multiplies the sink logits by the softmax scale ({sc.scale:g}), as it does "
                           "the scores: the sinks join the normaliser unscaled (gpt-oss adds them after the scaling)"))
    candidates.append((stages[:at] + (sink_stage.Sinks(-logits, st.grad),) + stages[at + 1:],
                       "the forward uses -s_h for the sink logits: exp(s_h) joins each row's normaliser"))
    if hkv < hq:
        candidates.append((stages[:at] + (sink_stage.Sinks(logits[np.asarray(kv_map) % len(logits)], st.grad),)
                           + stages[at + 1:],
                           "the forward reads the sinks per KV head (sinks[kv_map[h]], indexed like K and V): there is "
                           "one sink per query head, sinks[h]"))
    for wrong, says in candidates:
        if _matches(context.output, context.reference(stages=wrong), ref):
            return says
    return None


def other_alignment(sc) -> tuple[str, np.ndarray] | None:
    """(the other causal alignment, the scenario's visible set under it) where the two differ and every query row
    still sees a key (a packed batch: each document aligned on its own); None otherwise."""
    docs = sc.documents
    differ = sc.n_q != sc.n_k if docs is None else any(a != b for a, b in zip(*docs.pair))
    if sc.causal == "none" or sc.visible_source is not None or not differ:
        return None
    other = "upper-left" if sc.causal == "lower-right" else "lower-right"
    alt = masks.build_visible(sc.batch, sc.heads_q, sc.n_q, sc.n_k, causal=other, window=sc.window,
                              key_lengths=sc.key_lengths, documents=None if docs is None else docs.pair)
    return (other, alt) if alt.any(axis=-1).all() else None


def _alternative(sc, context: Context, kv_map) -> str | None:
    """What the implementation's forward computes instead, when it is exactly one of: attention with the
    mask inverted (a drop mask), without the mask, with the other causal alignment, or with the other
    KV-head layout."""
    ref = context.reference()
    o = context.output
    sinks = _sinks_alternative(sc, context, kv_map, ref) or _dropout_alternative(sc, context, ref)
    if sinks:
        return sinks
    dropped = ~sc.visible
    if not sc.visible.all() and dropped.any(axis=-1).all() and _matches(o, context.reference(visible=dropped), ref):
        return DROP_MASK
    if not sc.visible.all() and _matches(o, context.reference(visible=np.ones_like(sc.visible)), ref):
        return "no mask"
    docs = sc.documents
    aligned = other_alignment(sc)
    if aligned is not None:
        other, alt = aligned
        if _matches(o, context.reference(visible=alt), ref) and docs is not None:
            return (f"the forward aligns each document's causal mask {other}, while the scenario's (FlashAttention's "
                    f"varlen convention) is {sc.causal}: in a document with L_q queries and L_k keys query i' sees "
                    f"keys j' <= i' + L_k - L_q; the two differ where L_q != L_k (torch.tril needs the offset "
                    "L_k - L_q)" if sc.causal == "lower-right" else
                    f"the forward aligns each document's causal mask {other}, while the scenario's is {sc.causal}")
        if _matches(o, context.reference(visible=alt), ref):
            rule = {"upper-left": "key j visible to query i when j <= i, as SDPA's is_causal=True and "
                                  "torch.tril do",
                    "lower-right": "key j visible to query i when j <= i + n_k - n_q, the last query seeing every "
                                   "key"}
            return (f"the forward applies the causal mask aligned {other} ({rule[other]}), while the scenario's is "
                    f"{sc.causal} ({rule[sc.causal]}); with n_q = {sc.n_q} and n_k = {sc.n_k} they differ"
                    + (" (a KV-cache block needs lower-right)" if sc.causal == "lower-right" else ""))
    scale = _scale_alternative(sc, context, ref)
    if scale:
        return scale
    hq, hkv = sc.heads_q, sc.heads_kv
    if 1 < hkv < hq and hq % hkv == 0:
        contiguous = np.arange(hq) // (hq // hkv)
        interleaved = np.arange(hq) % hkv
        if (kv_map == contiguous).all():
            other, name, mine = interleaved, "interleaved (query head r reads KV head r % heads_kv)", "contiguous"
        elif (kv_map == interleaved).all():
            other, name, mine = contiguous, "contiguous (query head r reads KV head r // (heads_q / heads_kv))", \
                "interleaved"
        else:
            return None
        if _matches(o, context.reference(kv_map=other), ref):
            other_name = name.split()[0]
            return (f"the forward maps query heads to KV heads {name}, while the scenario's kv_map is {mine} "
                    f"({list(map(int, kv_map))}): if that is your model's layout, set kv_map: {other_name} in the "
                    "scenario; otherwise repeat_kv and its reduction must follow the model's layout")
    return None


def _scale_alternative(sc, context: Context, ref) -> str | None:
    """The forward uses 1/sqrt(d_head), no scale, or the scale twice, where the scenario's scale is another."""
    ignored = "the scale argument ignored, or a default taken in its place"
    for value, said, why in ((sc.d_head ** -0.5, f"1/sqrt(d_head) = {sc.d_head ** -0.5:.6g}", ignored),
                             (1.0, "1 (no scale)", ignored),
                             (sc.d_value ** -0.5, f"1/sqrt(d_value) = {sc.d_value ** -0.5:.6g}", "the scale taken "
                                                                                               "from V's width"),
                             (sc.scale ** 2, f"the scale twice ({sc.scale ** 2:.6g})", "q pre-scaled, and the scores "
                                                                                     "scaled again"),
                             (1 / sc.scale, f"1/scale = {1 / sc.scale:.6g}", "the scores divided by the scale where "
                                                                           "they are multiplied by it")):
        if abs(value - sc.scale) > 1e-12 * abs(sc.scale) and _matches(context.output, context.reference(scale=value),
                                                                       ref):
            return f"the forward scales the scores by {said}, not by the scenario's scale {sc.scale:.6g}: {why}"
    return None


def _mixing(sc, context: Context, checks) -> str | None:
    """Batch elements that are not independent: the implementation's output for one batch element moves
    when only another's inputs move. Tested directly by stacking a moved copy after the inputs."""
    suspicious = any(c.verdict == "fail" and c.name in ("perturbations stay in their block",
                                                          "forward agrees with the reference") for c in checks)
    if context.forward is None or not suspicious:
        return None
    x = context.inputs
    rng = np.random.default_rng([sc.seed, SeedStream.BATCH_MIXING])
    moved = {t: val + rng.standard_normal(val.shape).astype(val.dtype) for t, val in x.items()}
    try:
        alone = np.asarray(context.forward(x["q"], x["k"], x["v"], sc.visible), dtype=np.float64)
        both = np.asarray(context.forward(*(np.concatenate([x[t], moved[t]]) for t in "qkv"),
                                          np.concatenate([sc.visible, sc.visible])), dtype=np.float64)
    except Exception:  # the implementation failing here is reported by the checks themselves
        return None
    change = np.abs(both[:sc.batch] - alone)
    if not change.max(initial=0.0) > SIGNIFICANT * max(float(np.abs(alone).max(initial=0.0)), 1e-300):
        return None
    return (f"the forward mixes batch elements: the output of batch element(s) 0-{sc.batch - 1} changed (by up to "
            f"{change.max():.3g}) when only other batch elements, stacked after them, changed; attention is "
            "independent per batch element (reduce over the key axis only, never over the batch), and "
            "attn-gradcheck stacks perturbed copies along the batch axis")


def _missing_keys(sc, context: Context, evidence, kv_map) -> str | None:
    """Key rows the implementation never reads: its dK and dV are zero there (and so are the finite
    differences, where taken) while the reference's are not, and its O is attention with those keys
    hidden."""
    ref_k, ref_v = context.reference_gradients["k"], context.reference_gradients["v"]
    mine_k, mine_v = context.gradients["k"], context.gradients["v"]
    size = max(float(np.abs(ref_k).max(initial=0.0)), float(np.abs(ref_v).max(initial=0.0)), 1e-300)
    zero = (np.abs(mine_k).max(axis=(0, 1, 3)) <= ZERO * size) & (np.abs(mine_v).max(axis=(0, 1, 3)) <= ZERO * size)
    live = ((np.abs(ref_k).max(axis=(0, 1, 3)) > SIGNIFICANT * size)
            | (np.abs(ref_v).max(axis=(0, 1, 3)) > SIGNIFICANT * size))
    rows = np.flatnonzero(zero & live)
    if not len(rows) or len(rows) == sc.n_k:
        return None
    for name in ("k", "v"):
        ev = evidence.get(name)
        if ev is not None:
            taken = ev.checked[..., rows, :]
            if (np.abs(np.where(taken, ev.numeric[..., rows, :], 0)) > np.nan_to_num(
                    np.where(taken, ev.allowed[..., rows, :], 0))).any():
                return None  # the forward does read them
    hidden = sc.visible.copy()
    hidden[..., rows] = False
    if not hidden.any(axis=-1).all() or not _matches(context.output, context.reference(visible=hidden),
                                                    context.reference()):
        return None
    return (f"the forward never reads key row(s) {ranges(rows.tolist())} of {sc.n_k}: their gradients are zero and "
            "O is attention with them hidden; a block of keys is skipped (e.g. the last, partial block when "
            "n_k is not a multiple of the block size)")


def _sink_backward(sc, context: Context, kv_map, failed) -> str | None:
    """With sinks: what the backward computes instead, when every failed gradient is exactly the reference's of a
    known mistake: P recomputed without the sinks (a log-sum-exp over the keys alone), the sinks' gradient from the
    first batch element, or with its sign flipped."""
    from .. import stages as score_stages
    stages = context.stages
    at = next((i for i, st in enumerate(stages) if st.normaliser), None)
    if at is None or not failed or context.g is None:
        return None
    x = {t: val.astype(np.float64) for t, val in context.inputs.items()}

    def gradients(back):
        g = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g, stages=back)
        return {"q": g.q, "k": g.k, "v": g.v, **g.params}
    ref = gradients(stages)
    candidates = [(stages[:at] + stages[at + 1:], "qkv",
                   "the backward recomputes P without the sinks (dQ, dK and dV are those of attention without "
                   "sinks while the forward has them): P_ij = exp(S_ij - LSE_i) needs the log-sum-exp with exp(s_h) "
                   "in it, as the forward's (save that LSE, sink included); the sinks' gradient, -sum_i p_i D_i, "
                   "then vanishes too")]
    for fault, says in (("sink-grad-batch", "the sinks' gradient is the first batch element's alone: ds_h sums "
                                            "-p_i D_i over the batch as well as the rows"),
                        ("sink-grad-sign", "the sinks' gradient has the wrong sign: ds_h = -sum_{b,i} p_i D_i (the "
                                           "sink's column has dS = p_i (0 - D_i), D_i = rowsum(dO * O))")):
        candidates.append((score_stages.inject(stages, sc.visible, (fault,))[1], stages[at].param or "", says))
    without = stages[:at] + stages[at + 1:]
    candidates.insert(1, (lambda: _p_without_sink(x, sc, kv_map, context.g, stages, without, d_right=False),
                          "qkv",
                          "the backward's D_i = rowsum(P~ * dP) takes P~ normalised without the sink "
                          "(D_i / (1 - p_i)), while its P has the sink: D_i = sum_j A_ij dP_ij with the sink's "
                          "weights, or rowsum(dO * O)"))
    candidates.insert(1, (lambda: _p_without_sink(x, sc, kv_map, context.g, stages, without), "qkv",
                          "the backward recomputes P from a log-sum-exp without the sinks while D = rowsum(dO * O) "
                          "comes from the forward's O, which has them (a FlashAttention-style backward whose saved LSE "
                          "left the sink out): P_ij = exp(S_ij - LSE_i) needs exp(s_h) in the LSE"))
    for back, tensors, says in candidates:
        wrong = back() if callable(back) else gradients(back)
        named = [t for t in failed if t in tensors]
        if named and all(t in wrong and t in context.gradients and t in ref
                         and _matches(context.gradients[t], wrong[t], ref[t]) for t in named):
            return says
    return None


def _p_without_sink(x, sc, kv_map, g, stages, without, d_right: bool = True) -> dict:
    """The gradients of a backward whose P leaves the sinks out (P from the keys' log-sum-exp alone) while its
    D = rowsum(dO * O) comes from the right O; with ``d_right`` False the other way round: P right, D from P
    normalised without the sinks."""
    q, k, v = x["q"], x["k"], x["v"]
    a_right = attention_weights(q, k, sc.visible, sc.scale, kv_map, stages=stages)
    a = attention_weights(q, k, sc.visible, sc.scale, kv_map, stages=without)
    if not d_right:
        a_right, a = a, a_right
    v_rep, k_rep = repeat_kv(v, kv_map), repeat_kv(k, kv_map)
    g_a = g @ np.swapaxes(v_rep, -1, -2)
    g_s = a * (g_a - (a_right * g_a).sum(axis=-1, keepdims=True))
    if without:
        from .. import stages as score_stages
        g_s = score_stages.pull_back(without, raw_scores(q, k, sc.scale, kv_map), g_s)[0]
    heads_kv = k.shape[-3]
    return {"q": (g_s @ k_rep) * sc.scale,
            "k": sum_groups((np.swapaxes(g_s, -1, -2) @ q) * sc.scale, kv_map, heads_kv),
            "v": sum_groups(np.swapaxes(a, -1, -2) @ g, kv_map, heads_kv)}


def _lse_hints(sc, context: Context, kv_map, failed, broken) -> list[str]:
    """With the log-sum-exp an output: its value exactly another convention's (log2 units, the row maximum left
    out), or gradients exactly those of a backward that ignores its upstream gradient G_L."""
    if context.lse is None:
        return []
    mine, ref, g_l = context.lse
    out = []
    if "lse agrees with the reference" in broken and mine is not None:
        from .. import lse as lse_output
        s = raw_scores(*(np.asarray(context.inputs[t], dtype=np.float64) for t in "qk"), sc.scale, kv_map)
        if context.stages:
            from .. import stages as score_stages
            s = score_stages.apply(context.stages, s)
        top = np.max(s, axis=-1, initial=-np.inf, where=sc.visible)
        if _matches(mine, ref / lse_output.LN2, ref):
            out.append("the implementation returns the log-sum-exp in log2 units (LSE / ln 2, as kernels that use "
                       "exp2 keep it; pytorch #181645): return it in natural log (multiply by ln 2)")
        elif _matches(mine, ref - top, ref):
            out.append("the implementation returns the log-sum-exp without the row maximum: log(sum_j exp(S_ij - m_i)) "
                       "where LSE_i = m_i + log(sum_j exp(S_ij - m_i)) (add m back)")
        else:
            x = {t: np.asarray(context.inputs[t], dtype=np.float64) for t in "qk"}
            others = [(np.ones_like(sc.visible), context.stages, sc.scale,
                       "the implementation's log-sum-exp runs over every key: the mask is missing from it (hidden keys "
                       "must not enter the LSE, as they do not enter the softmax)"),
                      (sc.visible, tuple(st for st in context.stages if not st.normaliser), sc.scale,
                       "the implementation's log-sum-exp leaves out the sinks: LSE_i = log(sum_j exp(S_ij) + "
                       "exp(s_h)), the softmax's normaliser"),
                      (sc.visible, context.stages, sc.scale * sc.scale,
                       "the implementation's log-sum-exp takes the scores scaled twice (the softmax scale applied to "
                       "already scaled scores)"),
                      (sc.visible, context.stages, 1.0,
                       "the implementation's log-sum-exp is that of the unscaled scores q k^T, while its softmax's are "
                       "scaled (the scale left out of the returned statistic)")]
            with np.errstate(over="ignore"):
                zeros = np.log(np.sum(np.where(sc.visible, np.exp(s), 0.0), axis=-1) + np.sum(~sc.visible, axis=-1))
            if not sc.visible.all() and _matches(mine, zeros, ref):
                out.append("the implementation's log-sum-exp takes every hidden score as 0 (where(visible, S, 0)): "
                           "each hidden key adds exp(0) = 1 to it; hidden scores must be -inf there")
                others = []
            for visible, stages, scale, says in others:
                same = visible is sc.visible and stages == context.stages and scale == sc.scale
                if not same and _matches(mine, log_sum_exp(x["q"], x["k"], visible, scale, kv_map, stages=stages),
                                         ref):
                    out.append(says)
                    break
    qkv = [t for t in "qkv" if t in failed]
    if qkv and context.g is not None:
        x = {t: np.asarray(context.inputs[t], dtype=np.float64) for t in "qkv"}
        without = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g, stages=context.stages)
        if all(_matches(context.gradients[t], getattr(without, t), context.reference_gradients[t]) for t in qkv):
            out.append("the backward ignores the log-sum-exp's upstream gradient (its dQ, dK are those of the loss on "
                       "O alone, as FlashAttention 2/3's Python interface computes them): dS = P (dP - D + G_L), "
                       "G_L the gradient of the returned LSE"
                       + ("; with code differentiated by autograd: the LSE is returned detached (lax.stop_gradient, as "
                          "jax.nn.dot_product_attention's return_residual does, or .detach())"
                          if sc.implementation and sc.backend in ("torch", "jax") else ""))
        elif g_l is not None:
            flipped = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g, stages=context.stages,
                               grad_lse=-g_l)
            if all(_matches(context.gradients[t], getattr(flipped, t), context.reference_gradients[t]) for t in qkv):
                out.append("the log-sum-exp's upstream gradient enters the backward with the wrong sign: "
                           "dS = P (dP - D + G_L), not P (dP - D - G_L)")
    return out


def _stage_faults(sc, context: Context, kv_map, failed) -> str | None:
    """The registered mistakes of the backward of the scenario's stages (``Registration.backward_only``: dropout's
    dS from the dropped weights, its dV without the mask, ...) as candidates: when every failed gradient is
    exactly the one a mistake gives, the hint names it."""
    from .. import stages as score_stages
    if not context.stages or not failed or context.g is None:
        return None
    x = {t: np.asarray(context.inputs[t], dtype=np.float64) for t in "qkv"}
    right = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g, stages=context.stages)
    named = [t for t in failed if t in "qkv"]
    if not named:
        return None
    for r in score_stages.REGISTERED:
        if not any(st.name == r.key for st in context.stages):
            continue
        for fault in r.backward_only:
            wrong = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g,
                             stages=score_stages.inject(context.stages, sc.visible, (fault,))[1])
            if all(_matches(context.gradients[t], getattr(wrong, t), getattr(right, t)) for t in named):
                return f"the gradients are exactly those of a known mistake: {r.faults[fault].breaks}"
    return None


def _dropout_alternative(sc, context: Context, ref) -> str | None:
    """With dropout: what the forward computes instead, when it is attention with the kept weights scaled by p,
    without the 1 / (1 - p) rescale, with the mask inverted, or without dropout."""
    from .. import stages as score_stages
    from ..stages import dropout as dropout_stage
    drop = score_stages.post(context.stages)
    if drop is None:
        return None
    at = context.stages.index(drop)

    def reference_with(stage):
        return context.reference(stages=context.stages[:at] + ((stage,) if stage is not None else ())
                                 + context.stages[at + 1:])
    p = drop.p
    candidates = (
        (dropout_stage._ScaledByP(drop.keep, p), f"the forward scales the kept weights by p = {p:g} instead of "
                                                 f"1 / (1 - p) = {1 / (1 - p):.4g}"),
        (dropout_stage._OverP(drop.keep, p), f"the forward divides the kept weights by p = {p:g} instead of "
                                             f"1 - p = {1 - p:g}"),
        (dropout_stage.Dropout(drop.keep, 0.0), "the forward applies the keep mask without the 1 / (1 - p) rescale "
                                                "of the kept weights (inverted dropout)"),
        (dropout_stage.Dropout(~drop.keep, p), "the forward keeps the entries " + ("the keep_mask it returns drops"
                                                                                 if drop.drawn else "keep_mask drops")
         + " (True = kept)"),
        (None, "the forward applies no dropout at all" + (" (though it returns a keep mask)" if drop.drawn else
                                                          ": it ignores keep_mask") + " (a module left in eval mode?)"))
    for stage, says in candidates:
        if _matches(context.output, reference_with(stage), ref):
            return says
    return None


def _mask_backward(sc, context, evidence, failed, broken, sees_all, kv_map) -> bool:
    """The backward ignores the visible set. For an implementation: every failed gradient is exactly the
    reference's with A recomputed without the mask (the ``mask-backward`` bug), tensor by tensor. For
    the built-in engines: the errors of G_Q confined to query rows with hidden keys while rows that see
    every key are right, or the unseen-rows invariant failing with G_Q right where it was checked."""
    if context is not None:
        wrong = [t for t in "qkv" if t in failed or (_unseen_failed(broken) and t in "kv")]
        if not wrong or context.g is None or sc.visible.all():  # no mask to ignore
            return False
        x = {t: val.astype(np.float64) for t, val in context.inputs.items()}
        unmasked = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g, ("mask-backward",),
                            stages=tuple(context.stages))
        matched = [t for t in wrong if _matches(context.gradients[t], getattr(unmasked, t),
                                                context.reference_gradients[t])]
        return bool(matched) and all(t in matched for t in failed)
    ev = evidence.get("q")
    confined = None  # no evidence either way: no query row that sees every key was checked
    if ev is not None and "q" in failed:
        rows = np.broadcast_to(sees_all[..., None], ev.bad.shape) & ev.checked
        if rows.any():
            confined = bool(ev.bad.any() and not (ev.bad & rows).any())
    if confined is not None:
        return confined
    return _unseen_failed(broken)


def _unseen_failed(broken) -> bool:
    """An invariant that K/V rows some loss cannot see get zero gradient failed (every row's loss, or row 0's)."""
    return bool({"unseen K/V rows get zero gradient", "row 0's unseen K/V rows get zero gradient"}
                & set(broken))
