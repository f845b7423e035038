"""Attention's known mistakes as fingerprints (``gradcheck_cli.fingerprints``): the backward faults whose change the
float64 reference's gradients show (``DIFFERENCE_FAULTS``, the LSE's gradient ignored) and every backward fault of
the score stages in force (softcap, bias, ALiBi, sinks, dropout, ...), each evaluated on the scenario's own inputs.
Named only where attention's own hints name no cause: they read patterns of the same mistakes, and one cause is
said once."""
from __future__ import annotations

import numpy as np

from .... import fingerprints, numeric
from ...convention import default_kv_map, interleaved_kv_map
from .. import lse as lse_output
from .. import stages as score_stages
from ..args import Args
from ..formulas import (
    DIFFERENCE_FAULTS,
    FAULTS,
    _exp_scores,
    attention_weights,
    backward,
    forward,
    raw_scores,
    repeat_kv,
    sum_groups,
)
from .context import other_alignment
from .known_forward import mask_variants


def _as_dict(grads) -> dict:
    return {"q": grads.q, "k": grads.k, "v": grads.v, **dict(grads.params)}


def candidates(sc, context, kv_map) -> tuple[list, dict]:
    """(the candidate wrong backwards, the correct gradients), both as dicts by tensor (float64)."""
    x = [np.asarray(context.inputs[t], dtype=np.float64) for t in "qkv"]
    g = np.asarray(context.g, dtype=np.float64)
    grad_lse = None if context.lse is None else np.asarray(context.lse[2], dtype=np.float64)
    args = Args(sc.visible, sc.scale, np.asarray(kv_map, dtype=np.intp), tuple(context.stages))

    def computed(faults=(), stages=None, visible=None):
        kw = args.but(**{k: v for k, v in (("stages", stages), ("visible", visible)) if v is not None}).kw
        return _as_dict(backward(*x, grad_o=g, faults=faults, grad_lse=grad_lse, **kw))

    out = [fingerprints.Candidate(f, FAULTS[f].breaks, lambda f=f: computed((f,))) for f in DIFFERENCE_FAULTS]
    if grad_lse is not None:
        out.append(fingerprints.Candidate("lse-grad-ignored", lse_output.FAULTS["lse-grad-ignored"].breaks,
                                          lambda: computed(("lse-grad-ignored",))))
        out += [fingerprints.Candidate(name, says, lambda name=name: computed((name,)))
                for name, says in LSE_MISTAKES.items()]
    # a kernel saves its log-sum-exp for the backward whether or not it returns it
    out += [fingerprints.Candidate(f"lse-saved-{p}{d}", f"the log-sum-exp is saved for the backward in {p}: A = "
                                   f"exp(S - LSE) rebuilt from it{said}",
                                   lambda p=p, d=d: computed((f"lse-saved-{p}{d}",)))
            for p in numeric.SAVED_PRECISIONS
            for d, said in (("", " (D from dO O)"), ("-rowsum-of-p", " (D = rowsum(P dP) from it too)"))]
    out += [fingerprints.Candidate(f"lse-saved-{kind}{d}", f"{says}{said}",
                                   lambda kind=kind, d=d: computed((f"lse-saved-{kind}{d}",)))
            for kind, says in (("without-max", "the saved log-sum-exp leaves out the row max (log sum exp(S - m), "
                                               "not m + log sum exp(S - m)): A = exp(S - LSE) rebuilt from it is "
                                               "exp(m) times too large"),
                               ("unmasked", "the backward rebuilds A = exp(S - LSE) from the scores without the mask "
                                            "(hidden keys get exp(S - LSE) > 0)"),
                               ("row-max", "the row max m is saved for the backward where the log-sum-exp belongs: A "
                                           "= exp(S - m) rebuilt from it is unnormalised"))
            for d, said in (("", " (D from dO O)"), ("-rowsum-of-p", " (D = rowsum(P dP) from it too)"))]
    out += [fingerprints.Candidate("backward-softmax-unscaled", "the backward recomputes A = softmax(q k^T) without "
                                   "the scale (dQ and dK still multiplied by it)",
                                   lambda: computed(("backward-softmax-unscaled",))),
            fingerprints.Candidate("backward-softmax-scaled-twice", "the backward recomputes A with the scale applied "
                                   "twice (q pre-scaled, then the scores scaled again)",
                                   lambda: computed(("backward-softmax-scaled-twice",)))]
    if score_stages.post(args.stages) is not None:
        out.append(fingerprints.Candidate("dropout-dp-unmasked", DROPOUT_DP_UNMASKED,
                                          lambda: computed(("dropout-dp-unmasked",))))
        out.append(fingerprints.Candidate("dropout-dp-unmasked-d-right", DROPOUT_DP_UNMASKED + ", while D = rowsum(dO "
                                          "O) is right", lambda: computed(("dropout-dp-unmasked-d-right",))))
    full = backward(*x, grad_o=g, grad_lse=grad_lse, **args.kw)  # the correct backward, once for every candidate
    right = _as_dict(full)
    if "bias" in right and right["bias"].shape[-3] > 1:
        out.append(fingerprints.Candidate(
            "bias-grad-summed-over-heads", "bias: the per-head bias's gradient is summed over the heads too (every "
            "head gets the sum)", lambda: {**right, "bias": np.broadcast_to(
                right["bias"].sum(axis=-3, keepdims=True), right["bias"].shape)}))
    out += _skipped_blocks(sc, args, x, g, grad_lse, right, full)
    out += _params_from_dp(args, x, g, grad_lse, right, full)
    out += _reused(sc, args, x, g, grad_lse, right, full)
    out += _stage_params(args, x, g, grad_lse, right, full)
    out += _mistakes(sc, args, x, g, grad_lse, computed, full)
    for name, fault in score_stages.FAULTS.items():
        if fault.forward:
            continue
        wrong = score_stages.inject(args.stages, args.visible, [name])[1]
        if wrong == args.stages:
            continue
        out.append(fingerprints.Candidate(name, fault.breaks, lambda wrong=wrong: computed(stages=wrong)))
    for i, st in enumerate(args.stages):  # the stages' own known mistakes, each in the backward alone
        for name, (says, wrong) in score_stages.MISTAKES.get(st.name, {}).items():
            out.append(fingerprints.Candidate(name, says, lambda i=i, wrong=wrong, st=st: computed(
                stages=args.stages[:i] + (wrong(st),) + args.stages[i + 1:])))
    return out, right


def _reused(sc, args, x, g, grad_lse, right, full) -> list:
    """Candidates of a plain backward that takes one tensor for another: dQ from P instead of dS, dV from dS (P
    overwritten in place), dQ from K read by the other head map, the LSE's gradient indexed by key."""
    if args.stages:
        return []
    grads = full
    k_rep = repeat_kv(x[1], args.kv_map)
    out = [fingerprints.Candidate("dq-from-p", "dQ = scale P K: the weights where the score gradient dS belongs",
                                  lambda: {**right, "q": grads.a @ k_rep * args.scale}),
           fingerprints.Candidate("dv-from-ds", "dV = dS^T dO: P overwritten in place by dS (p.mul_) before dV reads "
                                                "it", lambda: {**right, "v": sum_groups(
                                                    np.swapaxes(grads.s, -1, -2) @ g, args.kv_map, x[2].shape[-3])})]
    heads_q, heads_kv = x[0].shape[-3], x[1].shape[-3]
    if 1 < heads_kv < heads_q:
        for other in (default_kv_map(heads_q, heads_kv), interleaved_kv_map(heads_q, heads_kv)):
            if tuple(other) != tuple(args.kv_map):
                out.append(fingerprints.Candidate(
                    "dq-other-head-map", "dQ = scale dS K with K expanded to the query heads by the other head map "
                    "(tile for repeat, or the reverse) while the forward's is the scenario's",
                    lambda other=other: {**right, "q": grads.s @ repeat_kv(x[1], np.asarray(other, dtype=np.intp))
                                         * args.scale}))
    if grad_lse is not None and sc.n_q == sc.n_k:
        def along_keys():
            g_s = grads.s - grads.a * grad_lse[..., :, None] + grads.a * grad_lse[..., None, :]
            return {**right, "q": g_s @ k_rep * args.scale, "k": sum_groups(
                np.swapaxes(g_s, -1, -2) @ x[0] * args.scale, args.kv_map, heads_kv)}
        out.append(fingerprints.Candidate("lse-grad-along-keys", "the LSE's upstream gradient G_L [B, H, n_q] is "
                                          "broadcast along the keys (G_L[..., None, :], indexed by key) where each "
                                          "query row's belongs (G_L[..., :, None]); n_q = n_k hides it", along_keys))
    return out


def _stage_params(args, x, g, grad_lse, right, full) -> list:
    """Candidates of a stage parameter's gradient: a bias after softcap's cap whose gradient also takes the cap's
    derivative (as if it came before the cap), a sink's gradient from exp(s_h - m_i) without the row's normaliser."""
    out = []
    names = [st.name for st in args.stages]
    raw = raw_scores(x[0], x[1], args.scale, args.kv_map)
    if "softcap" in names and grad_lse is None:
        at = names.index("softcap")
        cap = args.stages[at]
        after = score_stages.apply(args.stages[:at], raw) if at else raw
        grads = full
        for st in args.stages[at + 1:]:
            if st.param is not None and st.param in right and st.name in ("bias", "alibi", "relative_bias"):
                out.append(fingerprints.Candidate(
                    f"{st.name.replace('_', '-')}-grad-through-cap", f"{st.name.replace('_', ' ')}: its gradient is "
                    "taken after the cap's derivative (1 - t^2), though it is added after the cap (dS at the softmax's "
                    "input belongs)", lambda st=st: {**right, st.param: st.param_grad(grads.s * cap.slope(after),
                                                                                       None)}))
    sinks = next((st for st in args.stages if st.name == "sinks"), None)
    if sinks is not None and sinks.param in right and np.size(right[sinks.param]) > 1:
        out.append(fingerprints.Candidate(
            "sinks-grad-summed-over-heads", "sinks: the sinks' gradient is summed over the heads too (every head gets "
            "the sum) where each head's sink has its own", lambda: {**right, sinks.param: np.broadcast_to(
                np.sum(right[sinks.param], axis=-1, keepdims=True), np.shape(right[sinks.param]))}))
    if sinks is not None and sinks.param in right and "dropout" not in names:
        rest = tuple(st for st in args.stages if st.name != "sinks")
        s = score_stages.apply(rest, raw) if rest else raw
        sink = np.asarray(score_stages.sink_logits(args.stages), dtype=np.float64)[..., 0]  # [Hq, 1]
        top = np.maximum(np.max(s, axis=-1, initial=-np.inf, where=args.visible), sink)
        o = forward(*x, **args.kw)
        d = (g * o).sum(axis=-1)
        out.append(fingerprints.Candidate(
            "sinks-grad-unnormalised", "sinks: the sink's gradient takes exp(s_h - m_i), the running max only, as its "
            "weight: ds_h = -sum exp(s_h - m_i) D_i, missing the division by the row's normaliser l_i",
            lambda: {**right, sinks.param: -(np.exp(sink - top) * d).reshape((-1,) + d.shape[-2:]).sum(axis=(0, 2))}))
    return out


def _params_from_dp(args, x, g, grad_lse, right, full) -> list:
    """Candidates of an additive stage's parameter (bias, ALiBi slopes, relative bias table) whose gradient is taken
    from dP = dO V^T, the gradient of the weights, instead of dS, the gradient at the softmax's input."""
    out = []
    grads = full
    for st in args.stages:
        if st.param is None or st.param not in right or st.name in ("sinks", "softcap", "dropout"):
            continue
        if any(other.name in ("softcap", "dropout") for other in args.stages):
            break
        out.append(fingerprints.Candidate(
            f"{st.name.replace('_', '-')}-grad-from-dp", f"{st.name.replace('_', ' ')}: its parameter's gradient is "
            "taken from dP = dO V^T (the weights' gradient) where dS, the gradient at the softmax's input, belongs",
            lambda st=st: {**right, st.param: st.param_grad(grads.ga * args.visible, None)}))
    return out


def _skipped_blocks(sc, args, x, g, grad_lse, right, full) -> list:
    """Candidates of a backward whose loops skip rows or keys (plain attention): the tail block of the keys or of the
    queries (a loop range(0, n - B + 1, B)), or the last document of a packed batch."""
    if args.stages:
        return []
    grads = full
    k_rep = repeat_kv(x[1], args.kv_map)

    def kept(keep_q, keep_k):
        keep = keep_q[:, None] & keep_k[None, :]
        g_s = grads.s * keep
        return {**right, "q": g_s @ k_rep * args.scale,
                "k": sum_groups(np.swapaxes(g_s, -1, -2) @ x[0] * args.scale, args.kv_map, x[1].shape[-3]),
                "v": sum_groups(np.swapaxes(grads.a * keep, -1, -2) @ g, args.kv_map, x[2].shape[-3])}

    every_q, every_k = np.ones(sc.n_q, dtype=bool), np.ones(sc.n_k, dtype=bool)
    out = []
    for n, axis in ((sc.n_k, "key"), (sc.n_q, "query")):
        for cut in sorted({n // b * b for b in (2, 4, 8, 16, 32, 64, 128) if 0 < n // b * b < n}):
            keep = np.arange(n) < cut
            out.append(fingerprints.Candidate(
                f"backward-skips-{axis}-tail-{cut}", f"the backward's loop over {axis} blocks skips the tail: "
                f"{axis}s {cut}..{n - 1} left out (a loop range(0, n - B + 1, B), or n // B blocks, with n = {n} not a "
                "multiple of the block size B)",
                lambda keep=keep, axis=axis: kept(keep, every_k) if axis == "query" else kept(every_q, keep)))
    if sc.documents is not None and len(sc.documents.pair[0]) > 1:
        lens_q, lens_k = sc.documents.pair
        keep_q, keep_k = np.arange(sc.n_q) < sum(lens_q[:-1]), np.arange(sc.n_k) < sum(lens_k[:-1])
        out.append(fingerprints.Candidate("backward-skips-last-document", "the backward's loop over the packed "
                                          "documents skips the last one (range(n_docs - 1)): its rows and keys get no "
                                          "gradient", lambda: kept(keep_q, keep_k)))
    return out


#: The candidates attention's own hints name by their patterns (hints.__init__): a fingerprint naming only these is
#: said where no pattern hint names a cause.
PATTERNED = frozenset((*DIFFERENCE_FAULTS, "lse-grad-ignored"))

#: Known mistakes of the LSE output's gradient (``formulas.backward`` computes each on request).
LSE_MISTAKES = {
    "lse-grad-no-weights": "the log-sum-exp's upstream gradient is added to G_S without the weights A (dS = P (dP - "
                           "D) + G_L on every visible score, not + A G_L: dLSE_i / dS_ij = A_ij)",
    "lse-grad-no-weights-all": "the log-sum-exp's upstream gradient is added to every score of G_S, hidden ones "
                               "included, without the weights A (dLSE_i / dS_ij = A_ij)",
}
DROPOUT_DP_UNMASKED = ("dropout: dP = dO V^T without the keep mask and its 1/(1 - p) (the forward drops weights, the "
                       "backward's dP forgets it)")


def _mistakes(sc, args, x, g, grad_lse, computed, full) -> list:
    """Known mistakes of an attention backward without a CLI switch."""
    out = []
    aligned = other_alignment(sc)
    if aligned is not None:
        other, alt = aligned
        out.append(fingerprints.Candidate(
            "mask-backward-alignment", f"the backward's causal mask is aligned {other} while the forward's is "
            f"{sc.causal} (torch.tril, or SDPA's is_causal, in one pass and not the other)",
            lambda: computed(visible=alt)))
    out += [fingerprints.Candidate(name, says, lambda v=v: computed(visible=v)) for name, says, v in mask_variants(sc)]
    heads_q, heads_kv = x[0].shape[-3], x[1].shape[-3]
    if 1 < heads_kv < heads_q:
        for layout, other_map in (("contiguous groups (h // group)", default_kv_map(heads_q, heads_kv)),
                                  ("interleaved (h % Hkv)", interleaved_kv_map(heads_q, heads_kv))):
            if tuple(other_map) == tuple(args.kv_map):
                continue

            def regrouped(other_map=other_map):
                per_head = _as_dict(backward(x[0], repeat_kv(x[1], args.kv_map), repeat_kv(x[2], args.kv_map),
                                             grad_o=g, **args.but(kv_map=np.arange(heads_q)).kw,
                                             grad_lse=grad_lse))
                by = np.asarray(other_map, dtype=np.intp)
                return {**computed(), "k": sum_groups(per_head["k"], by, heads_kv),
                        "v": sum_groups(per_head["v"], by, heads_kv)}
            out.append(fingerprints.Candidate(
                "gqa-backward-head-map", f"the backward sums the query heads' dK, dV into KV heads by the other "
                f"head map, {layout}, while the forward reads them by the scenario's", regrouped))
            out.append(fingerprints.Candidate(
                "gqa-backward-other-map", f"the backward reads K, V and sums dK, dV by the other head map, {layout}, "
                "while the forward reads them by the scenario's",
                lambda other_map=other_map: _as_dict(backward(*x, grad_o=g, grad_lse=grad_lse, **args.but(
                    kv_map=np.asarray(other_map, dtype=np.intp)).kw))))
    plain = not args.stages
    if sc.n_q == sc.n_k:
        def untransposed():
            a = attention_weights(*x[:2], **args.kw)
            return {**_as_dict(full), "v": sum_groups(a @ g, args.kv_map, x[2].shape[-3])}
        out.append(fingerprints.Candidate("dv-untransposed", "dV = A G_O without the transpose of A (A^T G_O; the "
                                          "shapes agree when n_q = n_k)", untransposed))
        if plain:
            def dq_transposed():
                grads = full
                return {**_as_dict(grads), "q": np.swapaxes(grads.s, -1, -2) @ repeat_kv(x[1], args.kv_map)
                        * args.scale}
            out.append(fingerprints.Candidate("dq-transposed-scores", "dQ = dS^T K: the score gradient transposed "
                                              "(dS K belongs; the shapes agree when n_q = n_k)", dq_transposed))

            def dk_untransposed():
                grads = full
                return {**_as_dict(grads), "k": sum_groups(grads.s @ x[0] * args.scale, args.kv_map,
                                                           x[1].shape[-3])}
            out.append(fingerprints.Candidate("dk-untransposed-scores", "dK = dS Q: the score gradient without its "
                                              "transpose (dS^T Q belongs; the shapes agree when n_q = n_k)",
                                              dk_untransposed))
    if all(st.name not in ("sinks", "dropout") for st in args.stages):
        def unnormalised():
            e, _ = _exp_scores(*x[:2], args.scale, args.kv_map, args.visible, stages=args.stages)
            return {**computed(), "v": sum_groups(np.swapaxes(e, -1, -2) @ g, args.kv_map, x[2].shape[-3])}
        out.append(fingerprints.Candidate("dv-unnormalised", "dV = E^T G_O from the unnormalised exponentials E = "
                                          "exp(S - rowmax), not the weights A = E / rowsum(E)", unnormalised))
    return out


def named(sc, context, evidence, failed: set, kv_map) -> list[str]:
    """The fingerprint hint of a user's attention, or [] (built-in engines: no context)."""
    if context is None or context.g is None or not failed:
        return []
    found, right = candidates(sc, context, kv_map)
    return fingerprints.named(evidence, failed, found, right)
