"""Diagnosis of attention's failed checks: what the axes of q, k, v mean, which rows the mask touches,
and the hints that name a likely cause. Each hint fires only on its own evidence (docs/verdicts.md
"Diagnosing a failure"; tests/test_hints.py holds a table of distinct bugs, each hint tested to fire on its cause and
on no other):

- the implementation computes in a lower precision than its dtype (the reference checks say so);
- the forward lets hidden keys reach O (``attention is 0 off the visible set`` or ``hidden K/V rows do
  not change O`` fails, or O is exactly attention without the mask);
- the forward uses the other causal alignment, or the other KV-head layout (O is exactly that);
- the implementation is written for another calling convention (``convention:`` keys: layout, mask
  convention, shared mask, no scale argument): called that way, its forward agrees with the reference
  (also when, called the scenario's way, it fails);
- the forward mixes batch elements (moving one batch element's inputs changes another's output);
- the forward never reads some key rows (they get zero gradient where the reference's is not, and O is
  attention with them hidden);
- O leaves the range of its visible V rows without a mask leak: the weights do not sum to 1;
- the backward's mask handling (errors confined to the rows the mask touches);
- the softmax row-sum term (G_S rows, or the analytic G_K over the keys, do not sum to 0);
- one common factor on G_Q and G_K (the scale), or on one gradient alone;
- the GQA reduction (the error of a shared KV head is a mix of its query heads' shares with unequal
  weights, while G_Q passes);
- G_K and G_V swapped.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from .... import fingerprints, masks
from ....fingerprints import SAME_FACTOR, factor
from ...registry import Structure
from ..distributed.hints import rank_hints
from . import known, known_forward
from .context import (
    DROP_MASK,
    Context,
    _alternative,
    _convention,
    _lse_hints,
    _mask_backward,
    _missing_keys,
    _mixing,
    _sink_backward,
    _stage_faults,
)
from .patterns import _gqa, _reference_factor, _scale, _shift_violation, _swapped

__all__ = ["Context", "diagnosis"]


def _skipped_documents(sc, context: Context) -> list[int]:
    """The documents of a packed batch whose output rows the implementation left exactly 0 (every head) where
    the reference's are not."""
    if sc.documents is None:
        return []
    doc_q = masks.document_of(sc.n_q, sc.documents.pair)
    ref = context.reference()
    return [d for d in range(len(sc.documents.seqlens_q)) if (doc_q == d).any()
            and not context.output[..., doc_q == d, :].any() and ref[..., doc_q == d, :].any()]


#: A packed batch's documents named as classes of rows in the localisation (the first ones).
DOCUMENT_CLASSES = 8


def _factor_hints(sc, factors: dict, against: dict) -> list[str]:
    """The hints of gradients that are a constant factor c times their finite differences (or the reference's):
    one per factor, naming every tensor that shares it; -1 is a sign, 1/g on dK and dV the GQA group averaged."""
    group = sc.heads_q // sc.heads_kv
    out = []
    for c, ts in fingerprints.grouped(factors):
        names = [t.upper() if len(t) == 1 else t for t in ts]  # q -> G_Q; a stage's parameter keeps its name
        grads = " and ".join(f"G_{n}" for n in names)
        each = "are both" if len(ts) > 1 else "is"
        seen = " and ".join(sorted({against[t] for t in ts}))
        if len(ts) > 1:
            seen = seen.replace("its finite", "their finite")
        if set(ts) == {"k", "v"} and group > 1 and abs(c * group - 1) <= SAME_FACTOR:
            out.append(f"{grads} are both 1/{group} x {seen} everywhere, 1 over the GQA group size: the {group} query "
                       "heads of each KV group averaged into their KV head's gradient instead of summed, or another "
                       f"reduction into dK and dV averaged over {group} parts (query blocks) instead of summed")
        elif abs(c + 1) <= SAME_FACTOR:
            out.append(f"{grads} {each} -1 x {seen} everywhere: the sign of d{' and d'.join(names)} is flipped (a "
                       "difference taken the other way round, or a distance whose sign was lost)")
        else:
            alone = " alone" if len(ts) == 1 else ""
            out.append(f"{grads} {each} {c:.6g} x {seen} everywhere{_what_factor(sc, c, ts)}: a constant factor on "
                       f"d{' and d'.join(names)}{alone} (a scale applied once too often or too rarely, a wrong "
                       "divisor, or an averaged instead of summed reduction)")
    return out


def _what_factor(sc, c: float, tensors) -> str:
    """What a factor c on one or more gradients is: the scale (or 1/scale), dropout's 1 - p; for a stage's parameter
    (shared by the batch, the rows, the heads: its gradient a sum over them), else among attention's sizes."""
    p = dict(sc.p("dropout") or {}).get("p")
    named = [(sc.scale, f"the scale {sc.scale:.6g}: applied once too often"),
             (1 / sc.scale, f"1/scale: the scale {sc.scale:.6g} missing")] if abs(sc.scale - 1) > 1e-9 else []
    if p:
        named += [(1 - p, f"1 - p (p = {p:g}): the dropout's 1/(1 - p) rescale missing"),
                  (1 / (1 - p), f"1/(1 - p) (p = {p:g}): the dropout's rescale applied once too often")]
    for value, said in named:
        if abs(c - value) <= fingerprints.SIZE_FACTOR * abs(value):
            return f" (it is {said})"
    if any(t in "qkv" for t in tensors):  # q, k, v are not reductions over the batch or the rows
        return ""
    return fingerprints.sized(c, {"batch elements": sc.batch, "query heads": sc.heads_q, "KV heads": sc.heads_kv,
                                  "query rows (n_q)": sc.n_q, "key rows (n_k)": sc.n_k, "head features (d_head)":
                                  sc.d_head, "query heads of a KV group": sc.heads_q // sc.heads_kv})


def diagnosis(sc, context: Context | None = None) -> tuple[dict[str, Structure], Callable]:
    """(structure, hints(evidence, checks))."""
    kv_map = np.asarray(sc.kv_map, dtype=np.intp)
    visible = sc.visible
    sees_all = visible.all(axis=-1)                                        # [B, Hq, n_q]
    group = np.eye(sc.heads_kv, dtype=np.int64)[kv_map]                     # [Hq, Hkv]
    seen = np.einsum("bhij,hg->bgj", visible.astype(np.int64), group)        # [B, Hkv, n_k]
    every = seen == (sc.n_q * group.sum(axis=0))[None, :, None]
    kv_classes = {"key rows every query sees": every, "key rows hidden from some queries": ~every & (seen > 0),
                  "key rows no query sees": seen == 0}
    n_k = visible.shape[-1]
    first = np.where(visible.any(axis=-1), visible.argmax(axis=-1), 0)
    last = np.where(visible.any(axis=-1), n_k - 1 - visible[..., ::-1].argmax(axis=-1), n_k - 1)
    q_classes = {"query rows that see every key": sees_all, "query rows with hidden keys": ~sees_all,
                 "query rows cut on the left (window edge)": first > 0,
                 "query rows cut on the right (causal diagonal, padding)": last < n_k - 1}
    if sc.documents is not None:  # a packed batch: where the errors sit, by document (the first ones)
        doc_q = masks.document_of(sc.n_q, sc.documents.pair)
        doc_k = masks.document_of(sc.n_k, sc.documents.pair, keys=True)
        for d in range(min(len(sc.documents.seqlens_q), DOCUMENT_CLASSES)):
            q_classes[f"document {d}'s queries"] = np.broadcast_to((doc_q == d)[None, None], sees_all.shape)
            kv_classes[f"document {d}'s keys"] = np.broadcast_to((doc_k == d)[None, None], every.shape)
        single = np.isin(doc_q, [d for d, n in enumerate(sc.documents.seqlens_q) if n == 1])
        if single.any():
            q_classes["queries of one-query documents"] = np.broadcast_to(single[None, None], sees_all.shape)
    if sc.heads_kv < sc.heads_q:
        for g in range(sc.heads_kv):
            heads = kv_map == g
            q_classes[f"query heads of KV head {g} ({', '.join(map(str, np.flatnonzero(heads)))})"] = \
                np.broadcast_to(heads[None, :, None], sees_all.shape)
    structure = {
        "q": Structure(("batch", "query head", "query row", "feature"), q_classes, ("query head", "query row")),
        "k": Structure(("batch", "KV head", "key row", "feature"), kv_classes, ("KV head", "key row")),
        "v": Structure(("batch", "KV head", "key row", "feature"), kv_classes, ("KV head", "key row")),
    }

    def hints(evidence: dict, checks: list) -> list[str]:
        verdicts = {c.tensor: c.verdict for c in checks if c.kind == "gradient"}
        failed = {t for t, v in verdicts.items() if v == "fail"}
        broken = {c.name for c in checks if c.verdict == "fail"}
        out = []
        lower = [c for c in checks if c.verdict == "inconclusive" and c.facts.get("computes_in")]
        if lower:
            precision = lower[0].facts["computes_in"]
            out.append(f"the implementation computes internally in about {precision}: it agrees with the float64 "
                       f"reference to {precision} rounding only (or its forward differs from attention by no more "
                       f"than that), so a {sc.dtype} scenario cannot check it to {sc.tolerance:g}; run it with "
                       f"dtype: {precision} to check it at that precision")
        nondeterministic = [c for c in checks if c.name == "deterministic" and c.verdict == "fail"]
        if any(c.name == "keep mask the same on every call" and c.verdict == "fail" for c in checks):
            out.append("the keep mask your code draws changes from call to call: draw it from dropout_seed= (a "
                       "torch.Generator or np.random.default_rng seeded with it, jax.random.key(dropout_seed); "
                       "torch's and NumPy's global generators are seeded with it for each call), the same for any "
                       "batch size; every other failure may reflect only that")
            return out
        if nondeterministic:  # every other test compares separate calls: their failures may be this alone
            differing = nondeterministic[0].facts.get("differing") or ()
            which = ", ".join("O" if t == "o" else "d" + t.upper() for t in differing) or "results"
            out.append(f"the implementation is not deterministic: its {which} differ between two calls on the same "
                       "inputs (dropout or other randomness left on, or a reduction whose order changes, e.g. "
                       "atomics); finite differences, the reference and the invariants compare separate calls, so "
                       "their failures may reflect only that: make it deterministic, or set check: {nondet_tol: ...} "
                       "when small differences are intended")
            return out
        forward_wrong = "forward agrees with the reference" in broken
        convention = None
        if context is not None and forward_wrong and context.forward is not None:
            x = context.inputs
            convention = _convention(sc, lambda conv: context.forward(x["q"], x["k"], x["v"], sc.visible, conv),
                                     context.reference(), context.output)
        alternative = convention or (_alternative(sc, context, kv_map) if context is not None and forward_wrong
                                     else None)
        # a forward's known mistake, named before what it breaks (hidden keys reaching O through the normaliser,
        # documents seeing each other across a misplaced boundary)
        named_forward = known_forward.forward_named(sc, context, kv_map) if (
            context is not None and forward_wrong and alternative is None) else None
        leak = [name for name in ("attention is 0 off the visible set", "hidden K/V rows do not change O")
                if name in broken]
        documents = next((c.facts["leaks"] for c in checks if c.name == "documents do not see each other"
                          and c.verdict == "fail" and c.facts.get("leaks")), None)
        if named_forward:  # said after the facts it explains (documents seeing each other), in place of the advice;
            # hidden keys reaching O said too only where the named mistake is the mask's own
            alternative = named_forward
            leak = leak if "`mask-" in named_forward else []
        if documents:  # a packed batch: say which documents see which (varlen)
            pairs = "; ".join(f"document {d}'s keys reach document {e}'s queries" for d, e in documents[:3])
            out.append(f"the forward lets the documents of the packed batch see each other ({pairs})" + (
                "" if named_forward else ": each document's queries may see only its own keys, cu_seqlens_k[d] to "
                "cu_seqlens_k[d + 1]; check how the code maps a token to its document (an off-by-one at the "
                "boundaries, searchsorted's side, offsets from the other cu_seqlens) and any path that ignores "
                "cu_seqlens"))
        skipped = _skipped_documents(sc, context) if context is not None and forward_wrong else []
        if skipped:  # whole documents' rows left at 0: the loop over the documents misses them
            out.append(f"the forward leaves every output row of document{'s' if len(skipped) > 1 else ''} "
                       f"{', '.join(map(str, skipped[:6]))}{' ...' if len(skipped) > 6 else ''} at 0, where the "
                       "reference's are not: each document of cu_seqlens needs its own attention (a loop over the "
                       "documents that stops early, or sizes every document by the first one's length?)")
        if convention:
            out.append(convention)
        elif documents or skipped:
            pass
        elif alternative == DROP_MASK:
            out.append(alternative)
        elif leak or alternative == "no mask":
            out.append("the forward lets hidden keys reach O (" + ("; ".join(leak) if leak else
                       "its output is exactly attention without the mask") + ")"
                       + (", while finite differences agree with the backward"
                          if verdicts and all(v == "pass" for v in verdicts.values()) else "")
                       + ": hidden keys must get weight exactly 0: the visible set applied to the scores before a "
                         "softmax over the keys")
        elif alternative is not None and alternative != named_forward:
            out.append(alternative)
        if named_forward:
            out.append(named_forward)
        mixing = _mixing(sc, context, checks) if context is not None else None
        if mixing:
            out.append(mixing)
        missing = _missing_keys(sc, context, evidence, kv_map) if context is not None and (
            forward_wrong or failed) else None
        if missing:
            out.append(missing)
        shifted = "shifting every V row shifts O by as much" in broken
        outside = "O rows in the range of visible V rows" in broken
        quiet = not leak and not documents and not skipped and alternative is None and not mixing and not missing
        partial = quiet and outside and not shifted
        if partial:  # the weights sum to 1, yet O leaves the range of the V rows its query may see
            out.append("the forward lets hidden keys reach O (O rows in the range of visible V rows, while the weights "
                       "of each row sum to 1): weight reaches keys hidden from that query row though other rows may "
                       "see them; a window, a causal offset or a mask tile misaligned by some keys?")
        elif quiet and shifted and sc.p("sinks") is not None:  # the weights sum to 1 - p: the sinks' share
            out.append("the attention weights of a row and the sink's do not sum to 1 (shifting every V row shifts O "
                       "by (1 - p_i) c" + ("; O rows in the range of visible V rows" if outside else "") + "): the "
                       "sinks' share of the rows is wrong (a sink applied to some rows or heads only, read for the "
                       "wrong head, or rounded to another precision), or the softmax's normalisation is")
        elif quiet and shifted and sc.p("dropout") is not None:  # the weights sum to sum_j A_ij W_ij
            out.append("the dropped weights of a row do not sum to what the keep mask gives (shifting every V row "
                       "shifts O by sum_j A_ij W_ij c" + ("; O rows in the range of visible V rows" if outside else "")
                       + "): the forward applies another mask than " + ("the one it returns" if
                                                                        dict(sc.p("dropout")).get("drawn_by") == "code"
                                                                        else "keep_mask")
                       + ", applies it before the softmax, or rescales the kept weights otherwise than by 1 / (1 - p)")
        elif quiet and shifted:
            out.append("the attention weights of a row do not sum to 1 over the keys given (shifting every V row does "
                       "not shift O by as much" + ("; O rows in the range of visible V rows" if outside else "") + "): "
                       "the softmax's normaliser counts something else than the row's visible keys (keys padded with "
                       "zeros or taken from elsewhere, an online softmax that does not rescale its running sum or "
                       "accumulator when the row maximum grows, a denominator with an epsilon added)")
        if (not leak and alternative != "no mask" and not partial
                and _mask_backward(sc, context, evidence, failed, broken, sees_all, kv_map)):
            # for code, the evidence is the fingerprint, not where the errors sit (A recomputed without the mask
            # moves every gradient of a row with hidden keys, key rows every query sees among them)
            out.append("the gradients are exactly the reference's with A recomputed without the mask: the backward "
                       "ignores or misapplies the visible set" if context is not None else
                       "the errors sit only where the mask matters (query rows with hidden keys, key rows hidden "
                       "from some queries) while rows the mask does not touch are right: the backward ignores or "
                       "misapplies the visible set (e.g. recomputes A without it)")
        lse_hints = _lse_hints(sc, context, kv_map, failed, broken) if context is not None else []
        out.extend(lse_hints)
        out.extend(rank_hints(sc, context, failed, forward_wrong, checks))
        sink_backward = _sink_backward(sc, context, kv_map, failed) if context is not None else None
        if not sink_backward and context is not None:
            sink_backward = _stage_faults(sc, context, kv_map, failed)
        if sink_backward:
            out.append(sink_backward)
        # a known mistake that gives exactly these gradients outranks what their symptoms suggest (a row sum that
        # is not 0, a factor): said in its place
        fingerprint = known.named(sc, context, evidence, failed, kv_map) if not sink_backward else []
        # the faults attention's own hints name by their patterns: their fingerprint is said only where none does
        patterned = fingerprint and set(re.findall(r"`([^`]+)`", " ".join(fingerprint))) <= known.PATTERNED
        weak, fingerprint = (fingerprint, []) if patterned else ([], fingerprint)
        swapped = _swapped(evidence, failed)
        if swapped:
            out.append(swapped)
        elif (not lse_hints and not fingerprint and not sink_backward and not forward_wrong
              and "lse" not in (sc.p("outputs") or ())):  # a wrong forward's weights need not sum to 1 either
            shift = _shift_violation(evidence, failed, verdicts, broken, sc.tolerance)
            if shift:
                out.append(shift)
        factors = {t: factor(evidence.get(t)) for t in failed if not (sink_backward and t == "sinks")}
        against = dict.fromkeys(factors, "its finite differences")
        # a constant factor the float64 reference sees (below the finite differences' tolerance)
        if context is not None:
            for c in checks:
                if (c.kind == "reference" and c.verdict == "fail" and c.tensor in "qkv"
                        and factors.get(c.tensor) is None):
                    factors[c.tensor] = _reference_factor(context, c.tensor)
                    against[c.tensor] = "the float64 reference's"
        if alternative is not None and sc.p("dropout") is not None:  # the factors follow from the forward's
            factors = {}
        scale_hint = _scale(sc, factors, verdicts)
        if scale_hint:
            out.append(scale_hint)
        generic = []  # constant factors: said only where no known mistake explains the gradients exactly
        for t in sorted(factors):
            c = factors.get(t)
            if c is not None and abs(c) < 1e-12:
                out.append(f"the gradient of {t} is 0 everywhere while its finite differences are not: {t} gets no "
                           "gradient at all (detached, computed under no_grad or stop_gradient, or not the tensor "
                           "the code was given)")
        shared = {t: c for t, c in factors.items() if c is not None and abs(c) >= 1e-12
                  and not (scale_hint and t in "qk")}
        generic += _factor_hints(sc, shared, against)
        gqa = _gqa(sc, evidence, verdicts, kv_map, factors) if not fingerprint else None
        if gqa:
            out.append(gqa)
        if failed == {"sinks"} and not sink_backward and factors.get("sinks") is None and not out and not fingerprint:
            lse_on = "lse" in (sc.p("outputs") or ())
            out.append("the sinks' gradient alone is wrong while dQ, dK and dV pass: ds_h = "
                       + ("sum over every batch element and every query row (every block of a tiled backward) of "
                          "p_i (G_L_i - D_i), G_L the LSE's upstream gradient" if lse_on else
                          "-sum over every batch element and every query row (every block of a tiled backward) of "
                          "p_i D_i")
                       + ", with p_i = exp(s_h - LSE_i) the sink's weight and D_i = rowsum(dO * O) (not rowsum(dP))")
        # a known mistake that gives exactly these gradients; else the factors
        out.extend(fingerprint or (weak if not out else []) or generic)
        return out

    return structure, hints
