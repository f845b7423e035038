"""The ``distributed:`` scenario key (attention): ``{world_size, sharding, backend}``, what it may be combined with
(:func:`validate`, each refusal naming its key), and the mask as FlashAttention's arguments (:func:`band`)."""
from __future__ import annotations

import importlib.util

import numpy as np

from ...registry import Fault, Param
from . import sharding
from .sharding import SHARDINGS

KEY = "distributed"
BACKENDS = ("gloo", "nccl")

PARAM = Param("mapping", None, "context-parallel attention on real ranks: your per-rank function runs on world_size "
                               "processes joined by torch.distributed (torch code, or the built-in ring), or your "
                               "per-shard JAX code under jax.shard_map over world_size devices, each holding its "
                               "shard of the sequence (docs/distributed.md)",
              fields=(("world_size", Param("int", 2, "the number of ranks (processes)")),
                      ("sharding", Param("choice", "contiguous",
                                         "how the sequence is split: contiguous, zigzag (rank r holds chunks r and "
                                         "2 ws - 1 - r), ulysses (contiguous; heads_q divisible by world_size, and "
                                         "heads_kv for the built-in Ulysses) or per-document (a packed batch, varlen: "
                                         "each document zigzagged over the ranks)",
                                         choices=SHARDINGS)),
                      ("backend", Param("choice", "gloo", "gloo (CPU) or nccl (device: cuda)", choices=BACKENDS))))

#: What distributed checks do not cover yet (``attn-gradcheck ops``; ``validate`` refuses it with the key).
LIMIT = ("distributed: torch per-rank code (or the built-in ring) and JAX per-shard code under shard_map (equal "
         "shards) in float64 and float32 along the VJP, self-attention (n_q = n_k) with a causal mask, a window, "
         "both or neither, packed batches per document: not yet half precision, JVP/HVP, padding (key_lengths), a "
         "bias, T5's bias or dropout")


def settings(sc_or_params) -> dict | None:
    """The scenario's distributed settings with their defaults, or None."""
    params = dict(sc_or_params.params) if hasattr(sc_or_params, "params") else sc_or_params
    given = params.get(KEY)
    if given is None:
        return None
    given = dict(given)
    return {"world_size": int(given.get("world_size", 2)), "sharding": given.get("sharding", "contiguous"),
            "backend": given.get("backend", "gloo")}


def label(sc) -> str:
    """How reports name the scenario's distribution: ``ring x4 zigzag``."""
    given = settings(sc)
    algorithm = "ulysses" if given["sharding"] == "ulysses" else "ring" if sc.implementation is None else "ranks"
    return f"{algorithm} x{given['world_size']}" + (f" {given['sharding']}" if given["sharding"] != "ulysses" else "")


def rows_of(sc) -> list[np.ndarray]:
    """The global rows each rank of the scenario holds."""
    given = settings(sc)
    cu = None if sc.documents is None else sc.documents.cu_q
    return sharding.rows(sc.n_q, given["world_size"], given["sharding"], cu)


def band_of(sc) -> tuple[int, int] | None:
    """The scenario's mask as FlashAttention's ``window_size``: within each document for a packed batch."""
    return band(sc.visible, None if sc.documents is None else sc.documents.cu_q)


def band(visible: np.ndarray, cu_seqlens=None) -> tuple[int, int] | None:
    """FlashAttention's ``window_size`` (left, right) of the visible set: query i sees key j exactly when
    -left <= j - i <= right (-1: unbounded; right 0 is causal), the same for every batch element and head; None
    when the visible set is not such a band."""
    n = visible.shape[-1]
    if visible.shape[-2] != n or not (visible == visible[:1, :1]).all():
        return None
    offsets = np.arange(n)[None, :] - np.arange(n)[:, None]  # j - i
    same = np.ones((n, n), dtype=bool)
    if cu_seqlens is not None:  # a packed batch: the band within each document, nothing across
        doc = np.searchsorted(np.asarray(cu_seqlens)[1:], np.arange(n), side="right")
        same = doc[:, None] == doc[None, :]
    seen = offsets[visible[0, 0]]
    if seen.size == 0:
        return None
    lo, hi = int(seen.min()), int(seen.max())
    if not np.array_equal(visible[0, 0], (offsets >= lo) & (offsets <= hi) & same):
        return None
    left = -1 if lo <= -(n - 1) else -lo
    right = -1 if hi >= n - 1 else hi
    return left, right


def validate(params: dict, attention: dict) -> list:
    """(key, message, hint) for settings out of range and what distributed checks do not cover yet."""
    given = settings(params)
    if given is None:
        return []
    ws, sharding = given["world_size"], given["sharding"]
    fix = "remove distributed for this scenario"
    jax = bool(attention.get("implementation")) and attention["backend"] == "jax"
    if not jax and importlib.util.find_spec("torch") is None:  # the ranks run torch.distributed
        return [(KEY, "the ranks run torch.distributed, and torch is not installed",
                 "pip install 'attn-gradcheck[torch]'")]
    if ws < 1 or ws > 16:
        return [(f"{KEY}.world_size", f"is {ws}; between 1 and 16 ranks", "e.g. world_size: 2")]
    if attention.get("implementation") and attention["backend"] not in ("torch", "jax"):
        return [(KEY, f"checks per-rank torch code or per-shard JAX code, not backend {attention['backend']}",
                 "backend: torch or jax, or remove implementation to check the built-in ring")]
    if jax:
        refused = _jax_refusal(given, attention)
        if refused:
            return [refused]
    if attention["mode"] in ("jvp", "hvp"):
        return [(KEY, f"distributed attention is checked along the VJP, not check.mode {attention['mode']} yet", fix)]
    if attention["dtype"] in ("float16", "bfloat16"):
        return [(KEY, f"distributed attention is checked in float64 and float32, not {attention['dtype']} yet",
                 f"{fix}, or dtype: float32")]
    if given["backend"] == "nccl" and attention.get("device", "cpu") != "cuda":
        return [(f"{KEY}.backend", "is nccl, which needs device: cuda", "backend: gloo on the CPU")]
    n_q, n_k = attention.get("n_q"), attention.get("n_k")
    if n_q != n_k:
        return [(KEY, f"context parallelism splits one sequence: n_q must equal n_k (here {n_q} and {n_k})",
                 "set n_k equal to n_q")]
    least = 2 * ws if sharding == "zigzag" else ws
    if n_q is not None and n_q < least and sharding != "per-document":
        return [(KEY, f"n_q = {n_q} leaves a rank without rows: {sharding} sharding over {ws} ranks needs at least "
                      f"{least}", f"n_q >= {least}")]
    if sharding == "ulysses":  # the built-in Ulysses splits both; code of one's own may repeat K/V first (MQA)
        for key in ("heads_q", "heads_kv") if not attention.get("implementation") else ("heads_q",):
            if attention.get(key) is not None and attention[key] % ws:
                return [(f"{KEY}.sharding", f"is ulysses, which splits the heads over the ranks: {key} = "
                                            f"{attention[key]} is not divisible by world_size {ws}",
                         f"a {key} divisible by {ws}")]
    if params.get("stages") is not None and not attention.get("implementation"):
        return [("stages", "the built-in ring applies the stages in their default order (the cap before ALiBi, the "
                           "sinks in the normaliser)", "remove stages, or check your own per-rank code")]
    built = attention.get("built") or {}
    documents = built.get("documents")
    if sharding == "per-document" or documents is not None:
        refused = _per_document_refusal(sharding, documents) or _empty_rank(sharding, ws, n_q, documents)
        if refused:
            return [refused]
    for key in ("bias", "relative_bias", "dropout"):
        if params.get(key) is not None:
            return [(KEY, f"{key} is not split over ranks yet", f"{fix}, or remove {key}")]
    visible = built.get("visible")
    if visible is not None and band(visible, None if documents is None else documents.cu_q) is None:
        return [(KEY, "the mask must be causal and/or a window, the same for every batch element and head (the ranks "
                      "are passed causal= and window_size=): key_lengths and mask files are not split over ranks yet",
                 "mask: {causal: lower-right, window: [left, right]} only")]
    kv_map = built.get("kv_map")
    if kv_map is not None and attention.get("heads_kv"):
        group = attention["heads_q"] // attention["heads_kv"]
        if tuple(kv_map) != tuple(r // group for r in range(attention["heads_q"])):
            return [(KEY, "GQA across ranks takes contiguous groups (query head r reads KV head r // group, "
                          "FlashAttention's), not this kv_map", "remove kv_map")]
    convention = built.get("convention")
    if convention is not None and (convention.mask, convention.mask_heads, convention.scale) != ("keep", "per-head",
                                                                                              "passed"):
        return [("convention", "with distributed the ranks get causal= and window_size=, not a mask, and "
                               "softmax_scale= always: only convention.layout and lse_layout apply",
                 "remove convention.mask, mask_heads and scale")]
    return []


def _per_document_refusal(sharding_kind: str, documents) -> tuple | None:
    """A packed batch goes over the ranks document by document, and only so."""
    if documents is None:
        return (f"{KEY}.sharding", "is per-document, which splits the documents of a packed batch: the scenario has "
                                   "none", "varlen: {seqlens_q: [...]}, or another sharding")
    if sharding_kind != "per-document":
        return (KEY, f"a packed batch (varlen) is split over the ranks document by document, not {sharding_kind}",
                "distributed: {sharding: per-document}")
    if documents.seqlens_q != documents.seqlens_k:
        return ("varlen.seqlens_k", "differs from seqlens_q: context parallelism splits one sequence per document "
                                    "(self-attention)", "remove seqlens_k")
    return None


def _empty_rank(sharding_kind: str, ws: int, n: int, documents) -> tuple | None:
    """A rank the sharding leaves without rows (short documents)."""
    held = sharding.rows(n, ws, sharding_kind, documents.cu_q)
    empty = [r for r, idx in enumerate(held) if idx.size == 0]
    if empty:
        return (KEY, f"per-document sharding over {ws} ranks leaves rank{'s' if len(empty) > 1 else ''} "
                     f"{', '.join(map(str, empty))} without rows: the documents are too short",
                "longer documents or fewer ranks")
    return None


def _jax_refusal(given: dict, attention: dict) -> tuple | None:
    """What JAX code under shard_map cannot be given: shards of different lengths, a torch backend, a GPU."""
    ws, n = given["world_size"], attention.get("n_q")
    if given["backend"] == "nccl":
        return (f"{KEY}.backend", "nccl applies to torch ranks; JAX code runs under jax.shard_map over XLA devices",
                "remove distributed.backend")
    if attention.get("device", "cpu") != "cpu":
        return (KEY, "JAX code is checked on emulated CPU devices here, not on GPUs yet", "device: cpu")
    chunks = 2 * ws if given["sharding"] == "zigzag" else ws
    if n is not None and n % chunks:
        return (KEY, f"jax.shard_map splits the sequence into equal shards: n_q = {n} is not divisible by {chunks}"
                     + (" (2 x world_size zigzag chunks)" if given["sharding"] == "zigzag" else ""),
                f"n_q = {n - n % chunks or chunks}")
    return None


def _on(n: int = 9, **given) -> tuple:
    """A fault's scenario keys (the fault contract's example: one sequence of 9 rows, causal, over the ranks)."""
    return (("n_q", n), ("n_k", n), ("mask", {"causal": "lower-right"}), (KEY, {"world_size": 3, **given}))


_SCENARIO = _on()
#: The invariant every context-parallel fault fails: the same code on one rank is right (``invariants.py``).
ONE_RANK = "same result on one rank"
#: With learned sinks or ALiBi slopes, a wrong backward is wrong in their gradients too.
_PARAMS = ("gradient sinks", "gradient alibi_slopes")
_GRADS = ("gradient q", "gradient k", "gradient v", "backward agrees with the reference",
          "row 0's unseen K/V rows get zero gradient", "unseen K/V rows get zero gradient",
          "shifting every V row shifts O by as much", ONE_RANK) + _PARAMS

#: The context-parallel faults, hosted by the built-in ring and Ulysses (``distributed/ring.py``): each leaves the
#: forward exact (but the zigzag one) and breaks the gradients.
FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("cp-stale-kv", "ring: the backward computes every step with the rank's own K/V, not the rotated block's "
                         "(diffusers #14265)", _GRADS, scenario=_SCENARIO, backends=("numpy",)),
    Fault("cp-local-lse", "ring: the backward recomputes each block's P from that block's own LSE instead of the "
                          "merged one", _GRADS, scenario=_SCENARIO, backends=("numpy",)),
    Fault("cp-lse-grad-dropped", "ring: the backward drops the merged LSE's upstream gradient",
          ("gradient q", "gradient k", "backward agrees with the reference", ONE_RANK) + _PARAMS,
          scenario=_SCENARIO + (("outputs", ["o", "lse"]),), backends=("numpy",)),
    Fault("cp-dkv-not-returned", "ring: dK/dV are not sent back to their owner after the last step",
          ("gradient k", "gradient v", "backward agrees with the reference",
           "row 0's unseen K/V rows get zero gradient", "unseen K/V rows get zero gradient", ONE_RANK),
          scenario=_SCENARIO,
          backends=("numpy",)),
    Fault("cp-zigzag-chunk", "zigzag ring: a rotated block's positions recomputed with its second chunk off by one "
                             "(EasyContext #47's kind)",
          ("forward agrees with the reference", "backward agrees with the reference", "gradient q", "gradient k",
           "gradient v", "O rows in the range of visible V rows", "hidden K/V rows do not change O",
           "lse agrees with the reference", "shifting every V row shifts O by as much", ONE_RANK) + _PARAMS,
          forward=True,
          scenario=_on(sharding="zigzag"), backends=("numpy",)),
    Fault("cp-param-not-summed", "a replicated parameter's gradient (the sinks, learned ALiBi slopes) taken from "
                                 "rank 0 as it holds it, not summed over the ranks (the context-parallel group left "
                                 "out of the gradient all-reduce)",
          ("gradient sinks", "gradient alibi_slopes", "backward agrees with the reference", ONE_RANK),
          scenario=_SCENARIO + (("sinks", {"grad": True}),), backends=("numpy",)),
    Fault("cp-ulysses-order", "Ulysses: the backward all-to-all gathers its chunks in reversed rank order",
          _GRADS, scenario=_on(8, sharding="ulysses", world_size=2), backends=("numpy",)),
)}

_SHARDING_OF = {"cp-zigzag-chunk": "zigzag", "cp-ulysses-order": "ulysses"}


def why_not(sc, fault: str) -> str | None:
    """Why a fault does not apply to a distributed scenario (or a context-parallel fault to another), or None."""
    given = settings(sc)
    if fault in FAULTS:
        if given is None:
            return "the scenario is not distributed (key distributed)"
        if sc.implementation is not None:
            return "the context-parallel faults are the built-in ring's; your code is checked as it is"
        if given["world_size"] < 2:
            return "one rank: nothing is sent between ranks"
        want = _SHARDING_OF.get(fault)
        if want and given["sharding"] != want:
            return f"the scenario's sharding is {given['sharding']}, not {want}"
        if fault == "cp-param-not-summed":
            params = dict(sc.params)
            learned = any(dict(params.get(key) or ()).get("grad") for key in ("sinks", "alibi"))
            return None if learned else "no replicated parameter: the scenario learns no sinks or ALiBi slopes"
        if fault != "cp-ulysses-order" and given["sharding"] == "ulysses":
            return "Ulysses has no ring"
        return None
    if given is not None and fault in VISIBLE_FAULTS:
        return ("the ranks are passed causal=, window_size= (and a packed batch's cu_seqlens), not the visible set "
                "this fault changes")
    return None


#: Faults of a user's interface that change the visible set it is shown (the ranks never see it: they are passed
#: causal=, window_size= and a packed batch's cu_seqlens).
VISIBLE_FAULTS = ("mask", "leak-hidden-key", "varlen-packed-causal", "varlen-top-left", "varlen-single-query")
