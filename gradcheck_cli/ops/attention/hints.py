"""Diagnosis of attention's failed checks: what the axes of q, k, v mean, which rows the mask touches,
and the hints that name a likely cause. Each hint fires only on its own evidence (README "Diagnosing a
failure"; tests/test_hints.py holds a table of distinct bugs, each hint tested to fire on its cause and
on no other):

- the implementation computes in a lower precision than its dtype (the reference checks say so);
- the forward lets hidden keys reach O (``attention is 0 off the visible set`` or ``hidden K/V rows do
  not change O`` fails, or O is exactly attention without the mask);
- the forward uses the other causal alignment, or the other KV-head layout (O is exactly that);
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

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ... import masks
from ..registry import Structure
from ...indices import ranges
from .formulas import backward, repeat_kv
from .inputs import seeded_inputs

#: An alternative explains the implementation's output when it is this many times closer to it than
#: the reference is.
CLOSER = 100.0
#: A fitted pattern explains an error when what it leaves is below this fraction of the error.
EXPLAINED = 0.1


@dataclass
class Context:
    """What the hints may consult beyond the checks: the implementation's output and gradients on the
    scenario's inputs, the float64 reference of any visible set / KV map on the same inputs, and the
    implementation's forward (for the batch-mixing test). None for the built-in engines."""
    output: np.ndarray                               # O of the implementation, float64
    reference: Callable[..., np.ndarray]             # reference(visible=..., kv_map=...) -> O, float64
    reference_gradients: dict[str, np.ndarray]       # the float64 reference's dq, dk, dv
    gradients: dict[str, np.ndarray]                 # the implementation's, float64
    forward: Callable[..., np.ndarray] | None        # forward(q, k, v, visible) -> O of the implementation
    inputs: dict[str, np.ndarray]
    g: np.ndarray | None = None                      # the upstream gradient, float64


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
        lower = [c for c in checks if c.verdict == "inconclusive" and c.detail.startswith("computes in about")]
        if lower:
            precision = lower[0].detail.split()[3].rstrip(",")
            out.append(f"the implementation computes internally in about {precision}: it agrees with the float64 "
                       f"reference to {precision} rounding only (or its forward differs from attention by no more "
                       f"than that), so a {sc.dtype} scenario cannot check it to {sc.tolerance:g}; run it with "
                       f"dtype: {precision} to check it at that precision")
        nondeterministic = [c for c in checks if c.name == "deterministic" and c.verdict == "fail"]
        if nondeterministic:  # every other test compares separate calls: their failures may be this alone
            detail = nondeterministic[0].detail
            which = detail.split("; ")[1].split(" differ")[0] if " differ;" in detail else "results"
            out.append(f"the implementation is not deterministic: its {which} differ between two calls on the same "
                       "inputs (dropout or other randomness left on, or a reduction whose order changes, e.g. "
                       "atomics); finite differences, the reference and the invariants compare separate calls, so "
                       "their failures may reflect only that: make it deterministic, or set check: {nondet_tol: ...} "
                       "when small differences are intended")
            return out
        forward_wrong = "forward agrees with the reference" in broken
        alternative = _alternative(sc, context, kv_map) if context is not None and forward_wrong else None
        leak = [name for name in ("attention is 0 off the visible set", "hidden K/V rows do not change O")
                if name in broken]
        if leak or alternative == "no mask":
            out.append("the forward lets hidden keys reach O (" + ("; ".join(leak) if leak else
                       "its output is exactly attention without the mask") + ")"
                       + (", while finite differences agree with the backward"
                          if verdicts and all(v == "pass" for v in verdicts.values()) else "")
                       + ": apply the visible set in the forward (hidden keys get weight exactly 0)")
        elif alternative is not None:
            out.append(alternative)
        mixing = _mixing(sc, context, checks) if context is not None else None
        if mixing:
            out.append(mixing)
        missing = _missing_keys(sc, context, evidence, kv_map) if context is not None and (
            forward_wrong or failed) else None
        if missing:
            out.append(missing)
        shifted = "shifting every V row shifts O by as much" in broken
        outside = "O rows in the range of visible V rows" in broken
        quiet = not leak and alternative is None and not mixing and not missing
        partial = quiet and outside and not shifted
        if partial:  # the weights sum to 1, yet O leaves the range of the V rows its query may see
            out.append("the forward lets hidden keys reach O (O rows in the range of visible V rows, while the weights "
                       "of each row sum to 1): weight reaches keys hidden from that query row though other rows may "
                       "see them; a window, a causal offset or a mask tile misaligned by some keys?")
        elif quiet and shifted:
            out.append("the attention weights of a row do not sum to 1 (shifting every V row shifts O by as much"
                       + ("; O rows in the range of visible V rows" if outside else "") + "): the softmax's "
                       "normalisation is wrong (e.g. an online softmax that does not rescale its running sum and "
                       "accumulator when the row maximum grows, or a denominator with an epsilon added)")
        if (not leak and alternative != "no mask" and not partial
                and _mask_backward(sc, context, evidence, failed, broken, sees_all, kv_map)):
            out.append("the errors sit only where the mask matters (query rows with hidden keys, key rows hidden "
                       "from some queries) while rows the mask does not touch are right: the backward ignores or "
                       "misapplies the visible set (e.g. recomputes A without it)")
        swapped = _swapped(evidence, failed)
        if swapped:
            out.append(swapped)
        else:
            shift = _shift_violation(evidence, failed, verdicts, broken, sc.tolerance)
            if shift:
                out.append(shift)
        factors = {t: _factor(evidence.get(t)) for t in failed}
        against = dict.fromkeys(factors, "its finite differences")
        if context is not None:  # a constant factor the float64 reference sees (below the finite differences' tolerance)
            for c in checks:
                if c.kind == "reference" and c.verdict == "fail" and c.tensor in "qkv" and factors.get(c.tensor) is None:
                    factors[c.tensor] = _reference_factor(context, c.tensor)
                    against[c.tensor] = "the float64 reference's"
        scale_hint = _scale(sc, factors, verdicts)
        if scale_hint:
            out.append(scale_hint)
        for t in sorted(factors):
            c = factors.get(t)
            if c is not None and not (scale_hint and t in "qk"):
                out.append(f"G_{t.upper()} is {c:.6g} x {against[t]} everywhere: a constant factor on "
                           f"d{t.upper()} alone (a scale applied {'too often' if c > 1 else 'too rarely'}, a wrong "
                           "divisor, or an averaged instead of summed reduction)")
        gqa = _gqa(sc, evidence, verdicts, kv_map, factors)
        if gqa:
            out.append(gqa)
        return out

    return structure, hints


def _matches(o: np.ndarray, alternative: np.ndarray, reference: np.ndarray) -> bool:
    """o is CLOSER times closer to the alternative than to the reference (and the two differ)."""
    to_alt = float(np.abs(o - alternative).max(initial=0.0))
    to_ref = float(np.abs(o - reference).max(initial=0.0))
    return to_ref > 0 and to_alt * CLOSER < to_ref


def _alternative(sc, context: Context, kv_map) -> str | None:
    """What the implementation's forward computes instead, when it is exactly one of: attention without
    the mask, with the other causal alignment, or with the other KV-head layout."""
    ref = context.reference()
    o = context.output
    if not sc.visible.all() and _matches(o, context.reference(visible=np.ones_like(sc.visible)), ref):
        return "no mask"
    if sc.causal != "none" and sc.visible_source is None and sc.n_q != sc.n_k:
        other = "upper-left" if sc.causal == "lower-right" else "lower-right"
        alt = masks.build_visible(sc.batch, sc.heads_q, sc.n_q, sc.n_k, causal=other, window=sc.window,
                                  key_lengths=sc.key_lengths)
        if alt.any(axis=-1).all() and _matches(o, context.reference(visible=alt), ref):
            rule = {"upper-left": "key j visible to query i when j <= i, as SDPA's is_causal=True and "
                                  "torch.tril do",
                    "lower-right": "key j visible to query i when j <= i + n_k - n_q, the last query seeing every "
                                   "key"}
            return (f"the forward applies the causal mask aligned {other} ({rule[other]}), while the scenario's is "
                    f"{sc.causal} ({rule[sc.causal]}); with n_q = {sc.n_q} and n_k = {sc.n_k} they differ"
                    + (" (a KV-cache block needs lower-right)" if sc.causal == "lower-right" else ""))
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
            return (f"the forward maps query heads to KV heads {name}, while the scenario's kv_map is {mine} "
                    f"({list(map(int, kv_map))}): repeat_kv and its reduction must follow the model's layout")
    return None


def _mixing(sc, context: Context, checks) -> str | None:
    """Batch elements that are not independent: the implementation's output for one batch element moves
    when only another's inputs move. Tested directly by stacking a moved copy after the inputs."""
    suspicious = any(c.verdict == "fail" and c.name in ("perturbations stay in their block",
                                                          "forward agrees with the reference") for c in checks)
    if context.forward is None or not suspicious:
        return None
    x = context.inputs
    rng = np.random.default_rng([sc.seed, 11])
    moved = {t: val + rng.standard_normal(val.shape).astype(val.dtype) for t, val in x.items()}
    try:
        alone = np.asarray(context.forward(x["q"], x["k"], x["v"], sc.visible), dtype=np.float64)
        both = np.asarray(context.forward(*(np.concatenate([x[t], moved[t]]) for t in "qkv"),
                                          np.concatenate([sc.visible, sc.visible])), dtype=np.float64)
    except Exception:  # the implementation failing here is reported by the checks themselves
        return None
    change = np.abs(both[:sc.batch] - alone)
    if not change.max(initial=0.0) > 1e-6 * max(float(np.abs(alone).max(initial=0.0)), 1e-300):
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
    zero = (np.abs(mine_k).max(axis=(0, 1, 3)) <= 1e-12 * size) & (np.abs(mine_v).max(axis=(0, 1, 3)) <= 1e-12 * size)
    live = (np.abs(ref_k).max(axis=(0, 1, 3)) > 1e-6 * size) | (np.abs(ref_v).max(axis=(0, 1, 3)) > 1e-6 * size)
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


def _mask_backward(sc, context, evidence, failed, broken, sees_all, kv_map) -> bool:
    """The backward ignores the visible set. For an implementation: every failed gradient is exactly the
    reference's with A recomputed without the mask (the ``mask-backward`` bug), tensor by tensor. For
    the built-in engines: the errors of G_Q confined to query rows with hidden keys while rows that see
    every key are right, or the unseen-rows invariant failing with G_Q right where it was checked."""
    if context is not None:
        wrong = [t for t in "qkv" if t in failed or ("unseen K/V rows get zero gradient" in broken and t in "kv")]
        if not wrong or context.g is None:
            return False
        x = {t: val.astype(np.float64) for t, val in context.inputs.items()}
        unmasked = backward(x["q"], x["k"], x["v"], sc.visible, sc.scale, kv_map, context.g, ("mask-backward",))
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
    return "unseen K/V rows get zero gradient" in broken


def _swapped(evidence, failed) -> str | None:
    """The analytic G_K matches the finite differences of V and the analytic G_V those of K."""
    ek, ev = evidence.get("k"), evidence.get("v")
    if ek is None or ev is None or not ({"k", "v"} & failed) or ek.analytic.shape != ev.analytic.shape:
        return None
    both = ek.checked & ev.checked
    if not both.any():
        return None
    fits_k = np.abs(ek.analytic - ev.numeric)[both] <= ev.allowed[both]
    fits_v = np.abs(ev.analytic - ek.numeric)[both] <= ek.allowed[both]
    if fits_k.all() and fits_v.all():
        return ("G_K and G_V are swapped: the analytic G_K matches the finite differences of V, and G_V those of K "
                "(check the order the backward returns them in)")
    return None


def _shift_violation(evidence, failed, verdicts, broken, tolerance) -> str | None:
    """Softmax is shift invariant: moving every key by the same vector moves each score row by a
    constant, so the K gradients of a (batch, KV head) sum to zero over the keys. Evidence: the G_S
    invariant, or the analytic G_K not summing to 0 while the finite differences do and G_V is right."""
    message = ("softmax is shift invariant, so the row-sum term of its backward is missing or wrong: "
               "G_S = A * (G_A - rowsum(A * G_A))")
    if "score-gradient rows sum to 0" in broken:
        return "G_S rows do not sum to 0: " + message
    ev = evidence.get("k")
    if ev is None or not ({"q", "k"} & failed) or verdicts.get("v") != "pass" or not ev.checked.all():
        return None
    total_a = float(np.abs(ev.analytic.sum(axis=-2)).max(initial=0.0))
    total_n = float(np.abs(ev.numeric.sum(axis=-2)).max(initial=0.0))
    size = float(np.abs(ev.analytic).max(initial=0.0))
    if total_a > 10 * tolerance * size and total_a > 10 * total_n:
        return (f"the analytic G_K does not sum to 0 over the keys (worst {total_a:.3g}; the finite differences "
                f"sum to {total_n:.1g}): " + message)
    return None


def _factor(ev) -> float | None:
    """c when analytic = c x numeric explains the whole check (what is left is within what it allows) and
    c is not 1; else None."""
    if ev is None:
        return None
    a, n, allowed = ev.analytic[ev.checked], ev.numeric[ev.checked], ev.allowed[ev.checked]
    nn = float(n @ n)
    if not np.isfinite(nn) or nn == 0 or not np.isfinite(a).all():
        return None
    c = float(a @ n) / nn
    if not (np.abs(a - c * n) <= allowed).all() or abs(c - 1) <= 1e-9:
        return None
    return c


def _reference_factor(context: Context, t: str) -> float | None:
    """c when the implementation's gradient is c x the reference's, up to EXPLAINED of their difference."""
    a, r = context.gradients[t], context.reference_gradients[t]
    rr = float(np.sum(r * r))
    if not rr > 0:
        return None
    c = float(np.sum(a * r)) / rr
    gap = float(np.abs(a - r).max(initial=0.0))
    if abs(c - 1) <= 1e-12 or not float(np.abs(a - c * r).max(initial=0.0)) <= EXPLAINED * gap:
        return None
    return c


def _scale(sc, factors, verdicts) -> str | None:
    """G_Q and G_K share one factor while G_V is right: the scale of the score gradient."""
    c_q, c_k = factors.get("q"), factors.get("k")
    if c_q is None or c_k is None or verdicts.get("v") != "pass" or abs(c_q - c_k) > 1e-2 * abs(c_q):
        return None
    ratio = (c_q + c_k) / 2
    why = ""
    if abs(ratio * sc.scale - 1) < 1e-2:
        why = f"; it is 1/scale ({1 / sc.scale:.4g}): the backward drops the scale"
    elif abs(ratio / sc.scale - 1) < 1e-2:
        why = f"; it is the scale ({sc.scale:.4g}): the backward applies it twice"
    return (f"G_Q and G_K are both {ratio:.4g} x their finite differences while G_V is right: the scale factor in "
            f"the backward (G_Q = scale * G_S K, G_K = scale * G_S^T Q){why}")


def _gqa(sc, evidence, verdicts, kv_map, factors) -> str | None:
    """The error of a shared KV head's gradient is a mix of its query heads' shares with unequal weights
    (some heads missing, doubled or overwritten), while G_Q passes: the GQA reduction."""
    if verdicts.get("q") != "pass" or sc.heads_kv == sc.heads_q:
        return None
    shares = _head_shares(sc, kv_map)
    found = {}
    for t in ("k", "v"):
        ev = evidence.get(t)
        if ev is None or verdicts.get(t) != "fail" or factors.get(t) is not None or not ev.checked.all():
            continue
        error = ev.analytic - ev.numeric
        for g in range(sc.heads_kv):
            heads = np.flatnonzero(kv_map == g)
            e = error[:, g].ravel()
            if len(heads) < 2 or not np.abs(e).max(initial=0.0) > 0:
                continue
            basis = np.stack([shares[t][:, r].ravel() for r in heads], axis=1)
            w, *_ = np.linalg.lstsq(basis, e, rcond=None)
            left = float(np.linalg.norm(e - basis @ w))
            if left <= EXPLAINED * float(np.linalg.norm(e)) and np.ptp(w) > 0.5 * float(np.abs(w).max()):
                found.setdefault(g, {})[t] = [int(h) for h, x in zip(heads, w) if abs(x) > 0.5]
    if not found:
        return None
    parts = "; ".join(f"KV head {g}: query head(s) {', '.join(map(str, sorted(set(sum(v.values(), [])))))} "
                      f"missing or counted extra in d{'/d'.join(t.upper() for t in v)}" for g, v in sorted(found.items()))
    return (f"errors only in K/V gradients of KV heads shared by several query heads ({parts}), and G_Q is right: "
            "the GQA reduction must sum the gradients of every query head in a group (sum_groups)")


def _head_shares(sc, kv_map) -> dict[str, np.ndarray]:
    """Each query head's share of the float64 reference's dK and dV: [B, Hq, n_k, d]."""
    inputs, g = seeded_inputs(sc, dtype=np.float64)
    identity = np.arange(sc.heads_q)
    grads = backward(inputs["q"], repeat_kv(inputs["k"], kv_map), repeat_kv(inputs["v"], kv_map), sc.visible,
                     sc.scale, identity, g)
    return {"k": grads.k, "v": grads.v}
