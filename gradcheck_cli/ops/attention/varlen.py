"""Packed variable-length batches (FlashAttention's varlen): ``varlen: {seqlens_q: [...], seqlens_k: [...]}``.

Documents lie side by side along one packed sequence axis, in a batch of 1 (q [1, Hq, total_q, d_head], k and v
[1, Hkv, total_k, ...]); no document sees another, and the mask keys hold within each document: ``causal:
lower-right`` aligns each document bottom-right on its own keys (FlashAttention's convention: query i' of a
document with L_q queries and L_k keys sees its keys 0 .. i' + L_k - L_q), a window is taken about that
diagonal, ``key_lengths`` and an explicit ``mask.visible`` are ANDed in on the packed axes. The visible set is
built once, at load (``masks.build_visible(documents=)``): every engine and every invariant reads it as they read
any mask, so a document's attention is exactly a masked attention.

A user's code is passed ``cu_seqlens_q``, ``cu_seqlens_k`` (int32, documents + 1 offsets), ``max_seqlen_q`` and
``max_seqlen_k`` (ints) beside the packed ``visible``; perturbed copies are stacked along the batch axis, every
batch element the same packed layout. The check ``documents do not see each other`` replaces one document's K/V
rows at a time and requires the other documents' outputs not to move. Faults: ``varlen-packed-causal`` (the
mask over the packed axis, documents see each other), ``varlen-top-left`` (each document aligned top-left),
``varlen-single-query`` (a document of one query reads every key before it, flash-attention #1537's kind of
length-1 path).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ... import masks
from ...invariants import bounded_each
from ...keys import Fields
from ...tolerance import machine_epsilon
from ..registry import Fault

KEY = "varlen"
#: The keys of ``varlen:``.
NESTED = ("seqlens_q", "seqlens_k")
#: The keyword arguments a user's code is passed (FlashAttention's names).
PASSES = "cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k="


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch: query and key counts, one of each per document."""
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]

    @property
    def pair(self) -> masks.Documents:
        return self.seqlens_q, self.seqlens_k

    @property
    def cu_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seqlens_q)]).astype(np.int32)

    @property
    def cu_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.seqlens_k)]).astype(np.int32)

    def kwargs(self) -> dict:
        """What a user's code is passed (fresh arrays each time)."""
        return {"cu_seqlens_q": self.cu_q, "cu_seqlens_k": self.cu_k,
                "max_seqlen_q": int(max(self.seqlens_q)), "max_seqlen_k": int(max(self.seqlens_k))}

    @property
    def label(self) -> str:
        return f"varlen {len(self.seqlens_q)} doc{'' if len(self.seqlens_q) == 1 else 's'}"

    def query(self, i: int) -> tuple[int, int]:
        """(document, query within it) of packed query row i."""
        d = int(masks.document_of(sum(self.seqlens_q), self.pair)[i])
        return d, i - int(self.cu_q[d])

    def describe(self, d: int) -> str:
        q0, k0 = int(self.cu_q[d]), int(self.cu_k[d])
        lq, lk = self.seqlens_q[d], self.seqlens_k[d]
        span = lambda a, n: f"{a}-{a + n - 1}" if n > 1 else (f"{a}" if n else "none")  # noqa: E731
        return (f"document {d} ({lq} quer{'y' if lq == 1 else 'ies'}: rows {span(q0, lq)}; "
                f"{lk} key{'' if lk == 1 else 's'}: {span(k0, lk)})")


def read(f: Fields, batch: int) -> Documents | None:
    """``varlen.seqlens_q`` and ``varlen.seqlens_k`` (the key counts default to the query counts), in a batch of 1;
    ``n_q`` and ``n_k``, where given, must be their totals."""
    if not (f.has("varlen.seqlens_q") or f.has("varlen.seqlens_k")):
        return None
    if not f.has("varlen.seqlens_q"):
        raise f.error("varlen.seqlens_k", "is given without varlen.seqlens_q",
                      hint="give seqlens_q, the query count of each document (seqlens_k defaults to it)")
    lq = f.int_list("varlen.seqlens_q", 0, None, "a document's query count")
    lk = f.int_list("varlen.seqlens_k", 0, None, "a document's key count") or lq
    if len(lk) != len(lq):
        raise f.error("varlen.seqlens_k", f"has {len(lk)} documents but seqlens_q has {len(lq)}",
                      hint="give one key count per document, in the same order")
    if sum(lq) == 0 or sum(lk) == 0:
        raise f.error("varlen.seqlens_q" if sum(lq) == 0 else "varlen.seqlens_k",
                      "adds up to 0: the packed batch would be empty")
    empty = next((d for d in range(len(lq)) if lq[d] > 0 and lk[d] == 0), None)
    if empty is not None:
        raise f.error("varlen.seqlens_k", f"document {empty} has {lq[empty]} quer{'y' if lq[empty] == 1 else 'ies'} "
                      "and no key: its queries see nothing", hint="give every document with queries at least one key")
    if batch != 1:
        raise f.error("batch", f"is {batch}, but a packed batch (varlen) has batch 1: its documents lie side by side "
                      "along the sequence axis", hint="remove batch, or list the sequences as documents of varlen")
    for key, total, what in (("n_q", sum(lq), "seqlens_q"), ("n_k", sum(lk), "seqlens_k")):
        if f.has(key) and f.raw(key) != total:
            raise f.error(key, f"is {f.raw(key)}, but varlen.{what} adds up to {total}",
                          hint=f"remove {key}: with varlen it is the documents' total")
    return Documents(tuple(lq), tuple(lk))


def schema() -> dict:
    counts = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    return {"type": "object", "additionalProperties": False, "required": ["seqlens_q"],
            "description": "a packed variable-length batch (FlashAttention's varlen): documents side by side in a "
                           "batch of 1, none seeing another, the mask keys holding within each; n_q and n_k are the "
                           "totals. Your code is passed " + PASSES,
            "properties": {"seqlens_q": {**counts, "description": "each document's query count"},
                           "seqlens_k": {**counts, "description": "each document's key count (default: seqlens_q)"}}}


# --- faults: the visible set a bug makes ---------------------------------------------------------------------

_LEAK_CHECKS = ("attention is 0 off the visible set", "documents do not see each other",
                "forward agrees with the reference", "lse agrees with the reference",
                "backward agrees with the reference",
                "hidden K/V rows do not change O", "unseen K/V rows get zero gradient",
                "row 0's unseen K/V rows get zero gradient", "O rows in the range of visible V rows")
_ADDED = ("adds to the implementation's output and gradients the change this bug makes to the float64 reference's "
          "(whether your code reads visible or cu_seqlens)")

#: The keys a scenario needs for the faults to apply, on top of attention's example (n_q 3, n_k 10): two documents,
#: the second of one query, each with more keys than queries, in a batch of 1.
_EXAMPLE = ((KEY, {"seqlens_q": [2, 1], "seqlens_k": [5, 5]}), ("batch", 1), ("mask", {"causal": "lower-right"}))

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("varlen-packed-causal", "varlen: the mask is taken over the packed axis (causal and window across "
                                  "documents): a document sees the documents before it",
          _LEAK_CHECKS, forward=True, user=_ADDED, scenario=_EXAMPLE),
    # hiding keys that should be seen is consistent (finite differences agree) and breaks no invariant: only a
    # reference sees it, so it applies to your code (against the float64 reference), not to the built-in engines
    Fault("varlen-top-left", "varlen: each document aligned top-left (query i' sees its keys 0..i'), not "
                             "bottom-right, where a document has more keys than queries",
          ("forward agrees with the reference", "lse agrees with the reference", "backward agrees with the reference",
           # your code's O plus the change of the reference's is no attention output: its invariants may break too
           "O rows in the range of visible V rows", "hidden K/V rows do not change O",
           "unseen K/V rows get zero gradient", "row 0's unseen K/V rows get zero gradient"),
          forward=True, engine=False, user=_ADDED, scenario=_EXAMPLE),
    Fault("varlen-single-query", "varlen: a document of one query (max_seqlen 1 paths, flash-attention #1537) "
                                 "reads every key up to its own, across document boundaries",
          _LEAK_CHECKS, forward=True, user=_ADDED, scenario=_EXAMPLE),
)}


def wrong_visible(sc, fault: str) -> np.ndarray:
    """The visible set the fault's forward and backward use instead of the scenario's."""
    docs = sc.documents
    shape = (sc.batch, sc.heads_q, sc.n_q, sc.n_k)
    if fault == "varlen-top-left":
        return masks.build_visible(*shape, causal="upper-left" if sc.causal == "lower-right" else sc.causal,
                                   window=sc.window, key_lengths=sc.key_lengths, documents=docs.pair,
                                   explicit=None) & _aligned_explicit(sc)
    packed = masks.build_visible(*shape, causal=sc.causal, window=sc.window, key_lengths=sc.key_lengths)
    if fault == "varlen-packed-causal":
        return sc.visible | packed
    single = np.isin(masks.document_of(sc.n_q, docs.pair), [d for d, n in enumerate(docs.seqlens_q) if n == 1])
    return sc.visible | (packed & single[:, None])


def _aligned_explicit(sc) -> np.ndarray:
    """What the scenario's explicit mask (if any) hides, on top of the structured keys: kept by the top-left fault."""
    structured = masks.build_visible(sc.batch, sc.heads_q, sc.n_q, sc.n_k, causal=sc.causal, window=sc.window,
                                     key_lengths=sc.key_lengths, documents=sc.documents.pair)
    return sc.visible | ~structured


def shown(sc, visible: np.ndarray, faults) -> np.ndarray:
    """``visible`` with an active varlen fault's wrong visible set in its place (the engines')."""
    for name in faults:
        if name in FAULTS and sc.documents is not None:
            return wrong_visible(sc, name)
    return visible


def why_not(sc, fault: str) -> str | None:
    if sc.documents is None:
        return f"the scenario has no varlen (key {KEY}:)"
    if not (wrong_visible(sc, fault) != sc.visible).any():
        return {"varlen-packed-causal": "no document could see another under these masks (one document, or "
                                        "causal: upper-left with nothing before)",
                "varlen-top-left": "no document has more keys than queries under causal: lower-right or a window: "
                                   "the alignments agree",
                "varlen-single-query": "no document of one query has keys before it to read"}[fault]
    return None


# --- the invariant ------------------------------------------------------------------------------------------

#: Documents whose K/V rows are replaced, one at a time (the first ones with keys).
CHECKED_DOCUMENTS = 4


def document_invariant(forward, inputs: dict, documents: Documents, o, rng, o_convex, precision: str, ulps: float):
    """``documents do not see each other``: for each of the first CHECKED_DOCUMENTS documents with keys, its K/V
    rows replaced by random values must leave every other document's O rows where they were (to ``ulps`` of
    ``precision`` of sum_j A_ij |V_jc|). ``forward(q, k, v) -> o``. The detail names the documents that leak."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    doc_q = masks.document_of(q.shape[-2], documents.pair)
    doc_k = masks.document_of(k.shape[-2], documents.pair, keys=True)
    eps = machine_epsilon(precision)
    gaps = np.zeros(o.shape)
    worst, pairs = 0.0, []
    for d in [d for d, n in enumerate(documents.seqlens_k) if n][:CHECKED_DOCUMENTS]:
        rows = (doc_k == d)[:, None]
        k2 = np.where(rows, rng.standard_normal(k.shape).astype(k.dtype) * 10, k)
        v2 = np.where(rows, rng.standard_normal(v.shape).astype(v.dtype) * 10, v)
        gap = np.abs(np.asarray(forward(q, k2, v2), dtype=np.float64) - o)
        gap[..., doc_q == d, :] = 0.0  # its own queries may move
        ratio = gap / np.maximum(ulps * eps * o_convex, np.finfo(np.float64).tiny)
        moved = ratio.max(axis=(0, 1, 3)) > 1.0  # [n_q]: the rows of other documents that moved
        for e in sorted(set(doc_q[moved].tolist())):
            pairs.append((float(ratio[..., doc_q == e, :].max()), d, e))
        worst = max(worst, float(ratio.max(initial=0.0)))
        gaps = np.maximum(gaps, gap)
    detail = (f"the K/V rows of each of the first {min(CHECKED_DOCUMENTS, len(documents.seqlens_k))} documents "
              "replaced by random values, one document at a time: the other documents' O rows must not move; "
              f"allowed {ulps:g} ulps of {precision} of sum_j A_ij |V_jc|")
    if pairs:
        pairs.sort(reverse=True)
        leaks = "; ".join(f"document {d}'s keys leak into document {e}" for _, d, e in pairs[:3])
        detail = f"{leaks}{' (and more)' if len(pairs) > 3 else ''}: " + detail
    check = bounded_each("documents do not see each other", "o", gaps, ulps * eps * o_convex, detail,
                         guarded=float(np.abs(o).max(initial=0.0)))
    # the documents whose keys reach another's queries, worst first, for the hints: ((keys' document, queries'), ...)
    return dataclasses.replace(check, facts={**check.facts, "leaks": tuple((d, e) for _, d, e in pairs)})
