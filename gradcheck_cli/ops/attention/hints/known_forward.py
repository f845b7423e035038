"""Attention's known forward mistakes as fingerprints: when the implementation's O (or a pass's mask) is exactly
attention with one of them on the scenario's own inputs: a stage's (``Registration.forward_mistakes``), a stage left
out, a mask part lost or off by one (``mask_variants``, also the backward's and the projections' and the block's),
the mask applied after the softmax, the softmax over the queries, the scores transposed, a sink's column sliced at
the wrong end or its exp unshifted, dropout applied as a mask."""
from __future__ import annotations

import numpy as np

from .... import masks
from .. import stages as score_stages
from ..formulas import _exp_scores, attention_weights, raw_scores, repeat_kv, sink_weight


def mask_variants(sc, which: str = "backward") -> list[tuple[str, str, np.ndarray]]:
    """(name, what it gets wrong, the visible set) of a ``which`` pass ("backward" or "forward") whose mask loses one
    of its parts, whose window is off by one, or whose packed documents' boundaries are off by one, where the
    scenario's mask is built from its keys (and every query row still sees a key)."""
    if sc.visible_source is not None or sc.visible.all():
        return []
    docs = None if sc.documents is None else sc.documents.pair
    keys = {"causal": sc.causal, "window": sc.window, "key_lengths": sc.key_lengths, "documents": docs}

    def visible(**changed):
        return masks.build_visible(sc.batch, sc.heads_q, sc.n_q, sc.n_k, **{**keys, **changed})

    out = []
    parts = sum(x is not None for x in (sc.window, sc.key_lengths, docs)) + (sc.causal != "none")
    if sc.key_lengths is not None and parts > 1:
        out.append((f"mask-{which}-no-padding", f"the {which}'s mask drops the key padding (key_lengths): it keeps "
                                                "the causal or window part alone", visible(key_lengths=None)))
    if sc.window is not None and parts > 1:
        out.append((f"mask-{which}-no-window", f"the {which}'s mask drops the sliding window", visible(window=None)))
    if sc.causal != "none" and parts > 1:
        out.append((f"mask-{which}-no-causal", f"the {which}'s mask drops the causal part (padding or window kept)",
                    visible(causal="none")))
    if sc.causal != "none" and sc.window is None and docs is None:  # the diagonal: < where <= belongs, or the reverse
        i, j = np.arange(sc.n_q)[:, None], np.arange(sc.n_k)[None, :]
        shift = sc.n_k - sc.n_q if sc.causal == "lower-right" else 0
        for step, how in ((-1, "excludes the diagonal (j < i where j <= i belongs)"),
                          (1, "reaches one key past the diagonal (j <= i + 1)")):
            out.append((f"mask-{which}-causal{step:+d}", f"the {which}'s causal mask {how}",
                        masks.build_visible(sc.batch, sc.heads_q, sc.n_q, sc.n_k, key_lengths=sc.key_lengths,
                                            explicit=j - i <= shift + step)))
    if docs is not None:
        out.append((f"mask-{which}-no-documents", f"the {which} lets the documents of the packed batch see each "
                                                  f"other (cu_seqlens not applied in the {which})",
                    visible(documents=None)))
        for step in (-1, 1):  # every boundary moved by one (searchsorted's side, an off-by-one in cu_seqlens)
            moved = tuple(tuple(n + (step if d == 0 else (-step if d == len(ns) - 1 else 0)) for d, n in enumerate(ns))
                          for ns in docs)
            if len(docs[0]) > 1 and all(n >= 1 for ns in moved for n in ns):
                early = "one token early" if step < 0 else "one token late"
                out.append((f"mask-{which}-documents{step:+d}", f"the {which}'s document boundaries are off by one "
                                                                f"({early}: cu_seqlens or searchsorted's side)",
                            visible(documents=moved)))
    if sc.window is not None:
        left, right = sc.window
        for side in ("left", "right"):
            for step in (-1, 1):
                moved = (left + step, right) if side == "left" and left is not None else (
                    (left, right + step) if side == "right" and right is not None else None)
                if moved is None or min(m for m in moved if m is not None) < 0:
                    continue
                out.append((f"mask-{which}-window-{side}{step:+d}",
                            f"the {which}'s sliding window is off by one: {list(moved)} where the scenario's is "
                            f"{list(sc.window)} (its {side} edge, < where <= belongs or the reverse)",
                            visible(window=moved)))
    return [(n, says, v) for n, says, v in out if v.any(axis=-1).all() and (v != sc.visible).any()]


def forward_named(sc, context, kv_map) -> str | None:
    """What the implementation's forward computes instead, when its O is exactly attention with one of the forward's
    known mistakes: a stage's (``Registration.forward_mistakes``), a stage left out, a mask part lost or off by one,
    the mask applied after the softmax without renormalising, a sink's exp not shifted by the row max."""
    from .context import _matches
    ref = context.reference()
    stages = tuple(context.stages)
    found = []
    for name, says, output in _forward_candidates(sc, context, kv_map, stages):
        try:
            other = output()
        except (ValueError, ArithmeticError):
            continue
        if other is not None and other.shape == context.output.shape and _matches(context.output, other, ref):
            found.append(f"{says} (`{name}`)")
    if not found:
        return None
    if len(found) == 1:
        return f"the forward has a known mistake: {found[0]}; its O equals that forward's"
    return f"the forward has one of these known mistakes (they give the same O here): {'; or '.join(found)}"


def _forward_candidates(sc, context, kv_map, stages) -> list:
    out = []
    by_key = {r.key: r for r in score_stages.REGISTERED}
    for i, st in enumerate(stages):
        reg = by_key.get(st.name)
        for name, (says, make) in (reg.forward_mistakes.items() if reg else ()):
            wrong = make(st, sc)
            if wrong is not None:
                out.append((name, says, lambda i=i, wrong=wrong: context.reference(
                    stages=stages[:i] + (wrong,) + stages[i + 1:])))
        if st.name not in ("sinks", "dropout"):
            stage = st.name.replace("_", " ")
            out.append((f"{st.name.replace('_', '-')}-left-out", f"the forward leaves out the {stage} stage (its "
                        "scores never get it)",
                        lambda i=i: context.reference(stages=stages[:i] + stages[i + 1:])))
    out += [(name, says, lambda v=v: context.reference(visible=v)) for name, says, v in mask_variants(sc, "forward")]
    x = [np.asarray(context.inputs[t], dtype=np.float64) for t in "qkv"]
    plain = all(st.name not in ("sinks", "dropout") for st in stages)
    if plain:
        def over_queries():
            s = raw_scores(x[0], x[1], sc.scale, np.asarray(kv_map))
            s = score_stages.apply(stages, s) if stages else s
            s = np.where(sc.visible, s, -np.inf)
            top = np.max(s, axis=-2, keepdims=True, initial=-np.inf, where=sc.visible)
            e = np.where(sc.visible, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
            total = e.sum(axis=-2, keepdims=True)
            # a key no query sees: uniform over the queries, as a finite fill (-1e9) makes it
            a = np.where(total > 0, e / np.where(total > 0, total, 1.0), 1.0 / sc.n_q)
            return a @ repeat_kv(x[2], np.asarray(kv_map))
        out.append(("softmax-over-queries", "the softmax is normalised over the query axis (axis -2), not over the "
                                            "keys", over_queries))
        if sc.n_q == sc.n_k and sc.heads_q == sc.heads_kv:
            def transposed_scores():
                s = np.swapaxes(raw_scores(x[0], x[1], sc.scale, np.asarray(kv_map)), -1, -2)
                s = score_stages.apply(stages, s) if stages else s
                s = np.where(sc.visible, s, -np.inf)
                e = np.exp(s - s.max(axis=-1, keepdims=True))
                return e / e.sum(axis=-1, keepdims=True) @ x[2]
            out.append(("scores-transposed", "the scores are K Q^T, not Q K^T (q and k swapped; n_q = n_k hides it)",
                        transposed_scores))
    drop = next((st for st in stages if st.name == "dropout"), None)
    if drop is not None:
        rest = tuple(st for st in stages if st.name != "dropout")
        def kept_only(rescale):
            return context.reference(visible=sc.visible & np.broadcast_to(drop.keep, sc.visible.shape),
                                     stages=rest) * rescale
        for name, rescale, how in (("dropout-as-mask", 1.0, ""), ("dropout-as-mask-rescaled", 1 / (1 - drop.p),
                                                                 ", then divided by 1 - p")):
            out.append((name, f"dropout: the dropped entries are masked to -inf before the softmax (the row "
                              f"renormalised over the kept keys{how}), not zeroed after it",
                        lambda rescale=rescale: kept_only(rescale)))
    if plain and not sc.visible.all():
        def unrenormalised():
            a = attention_weights(x[0], x[1], None, sc.scale, np.asarray(kv_map), stages=stages)
            return (a * sc.visible) @ repeat_kv(x[2], np.asarray(kv_map))
        out.append(("mask-after-softmax", "the mask is applied after the softmax (weights of hidden keys zeroed) "
                                          "without renormalising each row", unrenormalised))
    sinks = next((st for st in stages if st.name == "sinks"), None)
    if sinks is not None and all(st.name != "dropout" for st in stages):
        def unshifted():
            rest = tuple(st for st in stages if st.name != "sinks")
            e, l = _exp_scores(x[0], x[1], sc.scale, np.asarray(kv_map), sc.visible, stages=rest)
            sink = np.asarray(score_stages.sink_logits(stages), dtype=np.float64)
            return (e @ repeat_kv(x[2], np.asarray(kv_map))) / (l + np.exp(sink))
        def misaligned(first: bool):
            a = attention_weights(x[0], x[1], sc.visible, sc.scale, np.asarray(kv_map), stages=stages)
            p = sink_weight(x[0], x[1], sc.visible, sc.scale, np.asarray(kv_map), stages=stages)[..., None]
            v = repeat_kv(x[2], np.asarray(kv_map))
            if first:  # [sink, keys] sliced [..., :-1]: the sink's weight on V_0, key j's on V_{j+1}
                return p * v[..., :1, :] + a[..., :-1] @ v[..., 1:, :]
            return a[..., 1:] @ v[..., :-1, :] + p * v[..., -1:, :]  # [keys, sink] sliced [..., 1:]
        out += [("sinks-column-sliced-wrong-end", "sinks: the sink's column is concatenated first but the slice after "
                                                  "the softmax drops the last column (probs[..., :-1]): every weight "
                                                  "lands on the next V row", lambda: misaligned(True)),
                ("sinks-column-sliced-wrong-end-last", "sinks: the sink's column is concatenated last but the slice "
                                                       "after the softmax drops the first column (probs[..., 1:]): "
                                                       "every weight lands on the previous V row",
                 lambda: misaligned(False))]
        out.append(("sinks-unshifted", "sinks: the sink's exp(s_h) joins the normaliser without the row max's shift "
                                       "(exp(s_h), where the other terms are exp(S - m): exp(s_h - m) belongs)",
                    unshifted))
    return out
