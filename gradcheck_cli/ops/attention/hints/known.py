"""Attention's known mistakes as fingerprints (``gradcheck_cli.fingerprints``): the backward faults whose change the
float64 reference's gradients show (``DIFFERENCE_FAULTS``, the LSE's gradient ignored) and every backward fault of
the score stages in force (softcap, bias, ALiBi, sinks, dropout, ...), each evaluated on the scenario's own inputs.
Named only where attention's own hints name no cause: they read patterns of the same mistakes, and one cause is
said once."""
from __future__ import annotations

import numpy as np

from .... import fingerprints, masks
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
    repeat_kv,
    sum_groups,
)
from .context import other_alignment


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
    if score_stages.post(args.stages) is not None:
        out.append(fingerprints.Candidate("dropout-dp-unmasked", DROPOUT_DP_UNMASKED,
                                          lambda: computed(("dropout-dp-unmasked",))))
    out += _mistakes(sc, args, x, g, grad_lse, computed)
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
    return out, computed()


#: Known mistakes of the LSE output's gradient (``formulas.backward`` computes each on request).
LSE_MISTAKES = {
    "lse-grad-no-weights": "the log-sum-exp's upstream gradient is added to G_S without the weights A (dS = P (dP - "
                           "D) + G_L on every visible score, not + A G_L: dLSE_i / dS_ij = A_ij)",
    "lse-grad-no-weights-all": "the log-sum-exp's upstream gradient is added to every score of G_S, hidden ones "
                               "included, without the weights A (dLSE_i / dS_ij = A_ij)",
}
DROPOUT_DP_UNMASKED = ("dropout: dP = dO V^T without the keep mask and its 1/(1 - p) (the forward drops weights, the "
                       "backward's dP forgets it)")


def _mask_variants(sc) -> list[tuple[str, str, np.ndarray]]:
    """(name, what it gets wrong, the visible set) of a backward whose mask loses one of its parts, or whose window
    is off by one, where the scenario's mask is built from its keys (and every query row still sees a key)."""
    if sc.visible_source is not None or sc.visible.all():
        return []
    docs = None if sc.documents is None else sc.documents.pair
    keys = {"causal": sc.causal, "window": sc.window, "key_lengths": sc.key_lengths, "documents": docs}

    def visible(**changed):
        return masks.build_visible(sc.batch, sc.heads_q, sc.n_q, sc.n_k, **{**keys, **changed})

    out = []
    parts = sum(x is not None for x in (sc.window, sc.key_lengths, docs)) + (sc.causal != "none")
    if sc.key_lengths is not None and parts > 1:
        out.append(("mask-backward-no-padding", "the backward's mask drops the key padding (key_lengths): it keeps "
                                                "the causal or window part alone", visible(key_lengths=None)))
    if sc.window is not None and parts > 1:
        out.append(("mask-backward-no-window", "the backward's mask drops the sliding window", visible(window=None)))
    if sc.causal != "none" and parts > 1:
        out.append(("mask-backward-no-causal", "the backward's mask drops the causal part (padding or window kept)",
                    visible(causal="none")))
    if docs is not None:
        out.append(("mask-backward-no-documents", "the backward lets the documents of the packed batch see each "
                                                  "other (cu_seqlens not applied in the backward)",
                    visible(documents=None)))
    if sc.window is not None:
        left, right = sc.window
        for side, (lo, hi) in (("left", (left, right)), ("right", (left, right))):
            for step in (-1, 1):
                moved = (lo + step, hi) if side == "left" and lo is not None else (
                    (lo, hi + step) if side == "right" and hi is not None else None)
                if moved is None or min(m for m in moved if m is not None) < 0:
                    continue
                out.append((f"mask-backward-window-{side}{step:+d}",
                            f"the backward's sliding window is off by one: {list(moved)} where the forward's is "
                            f"{list(sc.window)} (its {side} edge, < where <= belongs or the reverse)",
                            visible(window=moved)))
    return [(n, says, v) for n, says, v in out if v.any(axis=-1).all() and (v != sc.visible).any()]


def _mistakes(sc, args, x, g, grad_lse, computed) -> list:
    """Known mistakes of an attention backward without a CLI switch."""
    out = []
    aligned = other_alignment(sc)
    if aligned is not None:
        other, alt = aligned
        out.append(fingerprints.Candidate(
            "mask-backward-alignment", f"the backward's causal mask is aligned {other} while the forward's is "
            f"{sc.causal} (torch.tril, or SDPA's is_causal, in one pass and not the other)",
            lambda: computed(visible=alt)))
    out += [fingerprints.Candidate(name, says, lambda v=v: computed(visible=v)) for name, says, v in _mask_variants(sc)]
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
    plain = not args.stages
    if sc.n_q == sc.n_k:
        def untransposed():
            right = computed()
            a = attention_weights(*x[:2], **args.kw)
            return {**right, "v": sum_groups(a @ g, args.kv_map, x[2].shape[-3])}
        out.append(fingerprints.Candidate("dv-untransposed", "dV = A G_O without the transpose of A (A^T G_O; the "
                                          "shapes agree when n_q = n_k)", untransposed))
        if plain:
            def dq_transposed():
                grads = backward(*x, grad_o=g, grad_lse=grad_lse, **args.kw)
                return {**_as_dict(grads), "q": np.swapaxes(grads.s, -1, -2) @ repeat_kv(x[1], args.kv_map)
                        * args.scale}
            out.append(fingerprints.Candidate("dq-transposed-scores", "dQ = dS^T K: the score gradient transposed "
                                              "(dS K belongs; the shapes agree when n_q = n_k)", dq_transposed))

            def dk_untransposed():
                grads = backward(*x, grad_o=g, grad_lse=grad_lse, **args.kw)
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
