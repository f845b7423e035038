"""A random grid of CORRECT scenarios: no run may FAIL, and every inconclusive verdict must name a true
cause. Draws scenarios over every op, both engines, the torch backend, float64/float32/float16/bfloat16
and correct user implementations (NumPy, torch, and ones that compute internally in float32: see
benchmarks/correct_impls.py), runs each through the Python API and counts verdicts.

    python benchmarks/correct_grid.py [--count 1000] [--seed 0] [--jobs 2] [--json out.json] [--only PREFIX]
    python benchmarks/correct_grid.py --derivatives [...]   # modes jvp and hvp instead (their own categories)
    python benchmarks/correct_grid.py --variants [...]      # the score stages (softcap, bias, T5's, ALiBi) everywhere
    python benchmarks/correct_grid.py --distributed [...]   # context-parallel attention on real ranks (needs torch)

Exit 1 when any scenario FAILs. Without torch the torch categories are skipped. The counts of a full run
are in docs/verdicts.md ("How verdicts, power and precision work").
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import math
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent


def _has_jax() -> bool:
    return importlib.util.find_spec("jax") is not None


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _mask(rng, n_q: int, n_k: int, batch: int) -> dict | None:
    kind = rng.choice(["none", "causal", "upper", "window", "padding", "causal+padding"],
                      p=[0.25, 0.2, 0.15, 0.15, 0.15, 0.1])
    if kind == "none":
        return None
    mask: dict = {}
    if kind in ("causal", "causal+padding") and n_q <= n_k:
        mask["causal"] = "lower-right"
    if kind == "upper":
        mask["causal"] = "upper-left"
    if kind == "window":
        mask["causal"] = "lower-right" if n_q <= n_k else "upper-left"
        if n_q <= n_k:  # upper-left with more queries than keys leaves rows past the window empty
            mask["window"] = [int(rng.integers(0, 6)), 0]
    if kind in ("padding", "causal+padding"):
        lo = n_k if mask.get("causal") == "lower-right" else 1
        mask["key_lengths"] = [int(rng.integers(max(lo - 2, 1), n_k + 1)) if lo < n_k else n_k for _ in range(batch)]
        if mask.get("causal") == "lower-right":  # lower-right with fewer keys than queries empties rows
            mask["key_lengths"] = [n_k] * batch
    return mask or None


def _attention(rng, dtype: str, small: bool = False) -> dict:
    batch = int(rng.integers(1, 3))
    heads_q = int(rng.choice([1, 2, 4]))
    heads_kv = int(rng.choice([h for h in (1, 2, 4) if heads_q % h == 0]))
    n_q = int(rng.integers(1, 12 if small else 20))
    n_k = int(rng.integers(max(1, n_q // 2), 24))
    d_head = int(rng.choice([1, 2, 4, 8, 16, 32, 64] if not small else [2, 4, 8, 16]))
    sc = {"op": "attention", "batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "n_q": n_q, "n_k": n_k,
          "d_head": d_head, "dtype": dtype, "seed": int(rng.integers(2**31))}
    if rng.random() < 0.3:
        sc["d_value"] = int(rng.choice([1, 4, 8, 16]))
    if rng.random() < 0.15 and heads_q > heads_kv:
        sc["kv_map"] = [r % heads_kv for r in range(heads_q)]
    if rng.random() < 0.3:  # a tenth of these far out, where softmax rows saturate
        top = 100.0 if rng.random() < 0.1 else 8.0
        sc["scale"] = float(np.round(math.exp(rng.uniform(math.log(0.1), math.log(top))), 4))
    mask = _mask(rng, n_q, n_k, batch)
    if mask:
        sc["mask"] = mask
    if dtype in ("float64", "float32"):
        mode = str(rng.choice(["full", "sample", "directional"], p=[0.6, 0.25, 0.15]))
        if mode != "full":
            sc["check"] = {"mode": mode}
    return sc


def _plain_op(rng, op: str, dtype: str) -> dict:
    sc = {"op": op, "dtype": dtype, "seed": int(rng.integers(2**31)), "batch": int(rng.integers(1, 3))}
    if op == "attention-projections":
        heads_q = int(rng.choice([1, 2, 4]))
        sc.update(heads_q=heads_q, heads_kv=int(rng.choice([h for h in (1, 2) if heads_q % h == 0])),
                  n_q=int(rng.integers(1, 7)), d_head=int(rng.choice([2, 4])), d_model=int(rng.integers(2, 10)),
                  source=str(rng.choice(["self", "cross"])))
        if sc["source"] == "cross":
            sc["n_k"] = int(rng.integers(1, 8))
        elif rng.random() < 0.5:
            sc["mask"] = {"causal": "lower-right"}
    elif op == "rope":
        d = int(rng.choice([2, 4, 8, 16]))
        sc.update(n=int(rng.integers(1, 12)), d_head=d, heads=int(rng.integers(1, 3)),
                  layout=str(rng.choice(["half", "interleaved"])), position_offset=int(rng.integers(0, 100)))
        if rng.random() < 0.3 and d > 2:
            sc["rotary_dim"] = d // 2 if (d // 2) % 2 == 0 else d
    elif op == "rmsnorm":
        sc.update(n=int(rng.integers(1, 8)), d_model=int(rng.choice([1, 2, 3, 8, 16, 64])),
                  eps=float(rng.choice([0.0, 1e-6, 1e-2])))
    elif op == "swiglu":
        sc.update(n=int(rng.integers(1, 6)), d_model=int(rng.integers(1, 12)), d_ff=int(rng.integers(1, 16)))
    elif op == "block":
        heads_q = int(rng.choice([1, 2, 4]))
        sc.update(heads_q=heads_q, heads_kv=int(rng.choice([h for h in (1, 2) if heads_q % h == 0])),
                  n_q=int(rng.integers(1, 6)), d_head=int(rng.choice([2, 4])), d_model=int(rng.integers(2, 10)),
                  d_ff=int(rng.integers(2, 12)))
        if rng.random() < 0.6:
            sc["mask"] = {"causal": "lower-right"}
    elif op == "infonce":
        sc.update(dim=int(rng.choice([1, 2, 8, 16])), hard_negatives=int(rng.integers(0, 3)),
                  in_batch=bool(rng.random() < 0.6), similarity=str(rng.choice(["dot", "cosine"])),
                  temperature=float(np.round(math.exp(rng.uniform(math.log(0.01), math.log(2.0))), 4)),
                  learn_temperature=bool(rng.random() < 0.4))
        sc["batch"] = int(rng.integers(2, 5))
    return sc


def categories(with_torch: bool) -> list[tuple[str, float]]:
    cats = [("attention/naive", 0.16), ("attention/tiled", 0.10), ("impl/numpy-einsum", 0.06),
            ("impl/numpy-flash", 0.05), ("impl/numpy-float32-inside", 0.05), ("ops", 0.20)]
    if with_torch:
        cats += [("attention/torch", 0.10), ("impl/torch-plain", 0.06), ("impl/torch-custom", 0.06),
                 ("impl/torch-sdpa", 0.08), ("impl/torch-softmax32", 0.04)]
    total = sum(w for _, w in cats)
    return [(c, w / total) for c, w in cats]


def derivative_categories(with_torch: bool) -> list[tuple[str, float]]:
    """``--derivatives``: modes jvp and hvp, on every engine and flavour that computes them."""
    cats = [("jvp/naive", 0.2), ("jvp/tiled", 0.2), ("jvp/impl/numpy-example", 0.1), ("hvp/naive", 0.2)]
    if with_torch:
        cats += [("jvp/impl/torch-plain", 0.1), ("jvp/impl/torch-jvp-function", 0.1), ("hvp/impl/torch-plain", 0.1),
                 ("hvp/impl/torch-jvp-function", 0.1)]
    total = sum(w for _, w in cats)
    return [(c, w / total) for c, w in cats]


def draw_derivative(rng, category: str) -> dict:
    mode, rest = category.split("/", 1)
    sc = _attention(rng, str(rng.choice(["float64", "float32"])), small=True)
    sc["check"] = {"mode": mode}
    if rest == "tiled":
        sc.update(engine="tiled", block_q=int(rng.choice([1, 4, 8, 64])), block_k=int(rng.choice([1, 3, 8, 64])))
    if rest.startswith("impl/"):
        sc["implementation"] = {"numpy-example": "correct_impls:numpy_jvp", "torch-plain": "correct_impls:torch_plain",
                                "torch-jvp-function": "correct_impls:torch_jvp_function"}[rest[5:]]
        if "torch" in rest:
            sc["backend"] = "torch"
    return sc


VARIANTS = ("softcap", "alibi", "softcap+alibi", "bias", "softcap+bias+alibi", "relative_bias",
            "softcap+bias+relative_bias+alibi", "varlen", "softcap+varlen", "softcap+bias+varlen", "alibi+varlen",
            "softcap+relative_bias+alibi+varlen", "sinks", "softcap+alibi+sinks", "softcap+bias+sinks", "sinks+varlen",
            "softcap+alibi+sinks+varlen", "lse", "sinks+lse", "softcap+alibi+sinks+lse", "bias+lse", "lse+varlen",
            "dropout", "sinks+dropout", "softcap+alibi+sinks+lse+dropout", "dropout+varlen")
#: The LSE as an output: float64/float32 along the VJP, on the NumPy engines and user code.
LSE_PLACES = ("naive", "tiled", "impl/numpy", "impl/torch", "impl/jax")

#: Packed batches with position-dependent stages: the built-in engines only (the correct implementations here take
#: ALiBi's and T5's positions on the packed axis, not each document's).
ENGINES_ONLY = ("alibi+varlen", "softcap+relative_bias+alibi+varlen", "softcap+alibi+sinks+varlen")


def _packed(rng, sc: dict) -> None:
    """A packed batch in place of the scenario's batch and lengths: 1 to 4 documents (some of one query, some
    empty of queries), a mask within each that leaves no row empty."""
    docs = int(rng.integers(1, 5))
    lq = [int(x) for x in rng.choice([0, 1, 1, 2, 3, 5, 7], size=docs)]
    if not sum(lq):
        lq[0] = 1
    causal = str(rng.choice(["none", "lower-right", "upper-left"]))
    # under lower-right a document needs as many keys as queries; any other needs one key where it has queries
    lk = [int(a + rng.integers(0, 4)) if causal == "lower-right" else int(rng.integers(1 if a else 0, 8))
          for a in lq]
    if not sum(lk):
        lk[0] = 1
    sc.update(batch=1, n_q=sum(lq), n_k=sum(lk), varlen={"seqlens_q": lq, "seqlens_k": lk})
    mask = {"causal": causal}
    if causal == "lower-right" and rng.random() < 0.3:
        mask["window"] = [int(rng.integers(0, 4)), 0]
    sc["mask"] = mask


def variant_categories(with_torch: bool) -> list[tuple[str, float]]:
    """``--variants``: the score stages (soft-capping, bias, T5's, ALiBi) and packed batches on every engine, flavour,
    dtype, derivative."""
    where = [("naive", 0.16), ("tiled", 0.12), ("jvp/naive", 0.08), ("jvp/tiled", 0.06), ("hvp/naive", 0.08),
             ("impl/numpy", 0.1)]
    if with_torch:
        where += [("torch", 0.14), ("impl/torch", 0.12), ("hvp/impl/torch", 0.04)]
    if _has("jax"):
        where += [("impl/jax", 0.06), ("jvp/impl/jax", 0.02)]
    cats = [(f"{variant}/{w}", p) for variant in VARIANTS for w, p in where
            if not (variant in ENGINES_ONLY and w.split("/")[-2:-1] == ["impl"])
            and not (("lse" in variant or "dropout" in variant) and w not in LSE_PLACES)]
    total = sum(w for _, w in cats)
    return [(c, w / total) for c, w in cats]


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def draw_variant(rng, category: str) -> dict:
    variant, *parts = category.split("/")
    mode = parts[0] if parts[0] in ("jvp", "hvp") else None
    rest = "/".join(parts[1:] if mode else parts)
    torch = rest in ("torch", "impl/torch")
    half = not mode and (torch or rest == "impl/jax") and "lse" not in variant and "dropout" not in variant
    dtype = str(rng.choice(["float64", "float32", "float16", "bfloat16"] if half else ["float64", "float32"]))
    sc = _attention(rng, dtype, small=mode is not None)
    if "varlen" in variant:
        _packed(rng, sc)
    if "softcap" in variant:
        sc["softcap"] = float(np.round(math.exp(rng.uniform(math.log(0.3), math.log(60.0))), 3))
    if "alibi" in variant:
        if rng.random() < 0.5:  # head counts that are not a power of two, where the slopes' rule differs
            heads_kv = int(rng.choice([1, 3]))
            sc.update(heads_q=int(rng.choice([3, 6, 12] if heads_kv == 3 else [3, 5, 6, 12])), heads_kv=heads_kv)
            sc.pop("kv_map", None)
        alibi = {"form": str(rng.choice(["distance", "column"]))}
        if rng.random() < 0.25:
            alibi["slopes"] = [float(np.round(x, 4)) for x in rng.uniform(0.01, 1.0, sc["heads_q"])]
        if rng.random() < 0.3 and not (mode or rest == "torch" or dtype in ("float16", "bfloat16")):
            alibi["grad"] = True  # learned slopes, their gradient checked
        sc["alibi"] = alibi
    if "relative_bias" in variant:
        # the settings follow from the bucket count (correct_impls._relative): even -> bidirectional
        buckets = int(rng.choice([4, 8, 16, 32, 3, 5, 7]))
        fixed = mode is not None or rest in ("torch",) or dtype in ("float16", "bfloat16")
        sc["relative_bias"] = {"buckets": buckets, "max_distance": 3 * buckets, "bidirectional": buckets % 2 == 0,
                               "grad": not fixed}
    if "bias" in variant.replace("relative_bias", ""):
        per_batch, per_head = bool(rng.random() < 0.5), bool(rng.random() < 0.7)
        # a bias's gradient: the NumPy engines, NumPy and torch code, float64/float32, modes full/sample/directional
        fixed = mode is not None or rest in ("torch", "impl/jax") or dtype in ("float16", "bfloat16")
        sc["bias"] = {"shape": [sc["batch"] if per_batch else 1, sc["heads_q"] if per_head else 1,
                                sc["n_q"], sc["n_k"]], "grad": not fixed}
    if "sinks" in variant:
        # learned sinks: float64/float32 on the NumPy engines and user code, not along JVP/HVP or the torch closed forms
        learnable = not (mode or rest == "torch" or dtype in ("float16", "bfloat16"))
        sinks = {"grad": bool(learnable and rng.random() < 0.7)}
        if rng.random() < 0.4:  # given logits, some large: a sink that takes most of a row's weight
            sinks["values"] = [float(np.round(x, 3)) for x in rng.normal(0.0, 3.0, sc["heads_q"])]
        sc["sinks"] = sinks
    if "lse" in variant:
        sc["outputs"] = ["o", "lse"]
    if "dropout" in variant:
        sc["dropout"] = {"p": float(np.round(rng.uniform(0.05, 0.7), 3))}
        if rest.startswith("impl/") and rng.random() < 0.4:
            sc["dropout"]["drawn_by"] = "code"  # the code draws its mask from dropout_seed and returns it
    if mode:
        sc["check"] = {"mode": mode}
    if rest == "tiled":
        sc.update(engine="tiled", block_q=int(rng.choice([1, 4, 8, 64])), block_k=int(rng.choice([1, 3, 8, 64])))
    if rest.startswith("impl/"):
        flavour = rest[5:]
        learned = flavour == "numpy" and sc.get("alibi", {}).get("grad")
        sinks = flavour == "numpy" and sc.get("sinks", {}).get("grad")
        sc["implementation"] = (f"correct_impls:{flavour}_variants" + ("_learned_slopes" if learned else "")
                                + ("_learned_sinks" if sinks and not learned else "_sinks" if sinks else ""))
        if variant == "varlen" and flavour in ("numpy", "torch"):  # a loop over cu_seqlens' documents
            sc["implementation"] = f"correct_impls:{flavour}_varlen"
        if flavour != "numpy":
            sc["backend"] = flavour
    elif torch:
        sc["backend"] = "torch"
    return sc


IMPLS = {"impl/numpy-einsum": "correct_impls:einsum", "impl/numpy-flash": "correct_impls:flash",
         "impl/numpy-float32-inside": "correct_impls:float32_inside", "impl/torch-plain": "correct_impls:torch_plain",
         "impl/torch-custom": "correct_impls:torch_custom", "impl/torch-sdpa": "correct_impls:torch_sdpa",
         "impl/torch-softmax32": "correct_impls:torch_softmax32"}


def distributed_categories(with_torch: bool) -> list[tuple[str, float]]:
    """``--distributed``: context-parallel attention on real ranks: the built-in ring, zigzag ring and Ulysses (with
    softcap, ALiBi and learned sinks drawn in), a per-rank all-gather attention written as users write it
    (correct_impls.cp_allgather), and JAX per-shard code under shard_map (examples/context_parallel_jax.py)."""
    cats = []
    if with_torch:
        cats += [("cp/ring", 0.17), ("cp/zigzag", 0.14), ("cp/ulysses", 0.12), ("cp/per-document", 0.08),
                 ("cp/impl/allgather", 0.14)]
    if _has_jax():
        cats += [("cp/jax/ring", 0.08), ("cp/jax/ring-vjp", 0.1), ("cp/jax/allgather", 0.09), ("cp/jax/ulysses", 0.08)]
    return cats


_JAX_CP = {"cp/jax/ring": "cp_jax_ring", "cp/jax/ring-vjp": "cp_jax_ring_vjp", "cp/jax/allgather": "cp_jax_allgather",
           "cp/jax/ulysses": "cp_jax_ulysses"}


def draw_distributed(rng, category: str) -> dict:
    jax = category in _JAX_CP
    if jax:
        kind = "ulysses" if category == "cp/jax/ulysses" else str(rng.choice(["contiguous", "zigzag"]))
    else:
        kind = category.split("/")[1] if not category.startswith("cp/impl") else str(rng.choice(
            ["contiguous", "zigzag"]))
    sharding = {"ring": "contiguous"}.get(kind, kind)
    ws = int(rng.choice([1, 2, 2, 3, 3, 4]))
    if sharding == "ulysses":
        heads_kv = ws * int(rng.choice([1, 2]))
        heads_q = heads_kv * int(rng.choice([1, 2]))
    else:
        heads_kv = int(rng.choice([1, 2, 3]))
        heads_q = heads_kv * int(rng.choice([1, 2, 3]))
    least = 2 * ws if sharding == "zigzag" else ws
    n = int(rng.integers(max(least, 2), 21))
    if jax:  # shard_map: equal shards
        n = least * int(rng.integers(max(1, -(-2 // least)), 20 // least + 1))
    documents = None
    if sharding == "per-document":  # a packed batch: one document long enough to give every rank rows
        documents = [int(rng.integers(2 * ws, 2 * ws + 8))] + [int(x) for x in rng.integers(1, 9,
                                                                                           int(rng.integers(0, 3)))]
        rng.shuffle(documents)
        n = sum(documents)
    mask = {"causal": str(rng.choice(["lower-right", "upper-left"])) if rng.random() < 0.7 else None}
    if rng.random() < 0.3:
        mask["window"] = [int(rng.integers(0, n)), 0 if mask["causal"] else int(rng.integers(0, n))]
    doc = {"op": "attention", "batch": int(rng.choice([1, 2])), "heads_q": heads_q, "heads_kv": heads_kv, "n_q": n,
           "n_k": n, "d_head": int(rng.choice([2, 4, 8])), "dtype": str(rng.choice(["float64", "float64", "float32"])),
           "seed": int(rng.integers(2**31)), "mask": mask,
           "distributed": {"world_size": ws, "sharding": sharding}}
    if rng.random() < 0.35:
        doc["outputs"] = ["o", "lse"]
    if rng.random() < 0.3:
        doc["scale"] = float(np.round(rng.uniform(0.05, 2.0), 4))
    if documents is not None:
        doc.update(batch=1, varlen={"seqlens_q": documents})
        del doc["n_q"], doc["n_k"]
    if category.startswith("cp/impl"):
        doc.update(backend="torch", implementation="correct_impls:cp_allgather")
    elif jax:
        doc.update(backend="jax", implementation=f"correct_impls:{_JAX_CP[category]}")
        if category == "cp/jax/allgather" and rng.random() < 0.4:
            doc["sinks"] = {"grad": bool(rng.random() < 0.7)}
    else:  # the built-in ring and Ulysses take the variants (their parameters replicated on every rank)
        if rng.random() < 0.25:
            doc["softcap"] = float(np.round(rng.uniform(1.0, 20.0), 2))
        if rng.random() < 0.25:
            doc["alibi"] = {"grad": bool(rng.random() < 0.6), "form": str(rng.choice(["distance", "column"]))}
        if rng.random() < 0.25:
            doc["sinks"] = {"grad": bool(rng.random() < 0.7)}
    return doc


def draw(rng, category: str) -> dict:
    half = ["float64", "float32", "float16", "bfloat16"]
    if category == "ops":
        op = str(rng.choice(["attention-projections", "rope", "rmsnorm", "swiglu", "block", "infonce"]))
        return _plain_op(rng, op, str(rng.choice(["float64", "float32"])))
    torch = category in ("attention/torch",) or category.startswith("impl/torch")
    dtype = str(rng.choice(half if torch else ["float64", "float32"]))
    sc = _attention(rng, dtype)
    if category == "attention/tiled":
        sc.update(engine="tiled", block_q=int(rng.choice([1, 4, 8, 64])), block_k=int(rng.choice([1, 3, 8, 64])))
    if torch:
        sc["backend"] = "torch"
    if category in IMPLS:
        sc["implementation"] = IMPLS[category]
    return sc


def run_one(args) -> dict:
    index, category, doc = args
    from gradcheck_cli.checker import run_scenario
    from gradcheck_cli.errors import ScenarioError
    from gradcheck_cli.scenario import loads
    doc = {**doc, "name": f"case-{index}"}
    text = yaml.safe_dump({"scenarios": [doc]})
    try:
        (sc,) = loads(text, file=f"case-{index}.yaml", base_dir=HERE)
    except ScenarioError as exc:
        return {"index": index, "category": category, "doc": doc, "verdict": "rejected", "why": str(exc)}
    start = time.perf_counter()
    result = run_scenario(sc)
    off = [{"name": c.name, "tensor": c.tensor, "verdict": c.verdict, "detail": c.detail[:400]}
           for c in result.checks if c.verdict != "pass"]
    return {"index": index, "category": category, "doc": doc, "verdict": result.verdict, "checks": off,
            "hints": list(result.hints), "seconds": round(time.perf_counter() - start, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="write every case and its verdict here")
    ap.add_argument("--only", default=None, help="only categories starting with this (e.g. impl/, attention/tiled)")
    ap.add_argument("--having", default=None, help="only categories containing this (e.g. sinks)")
    ap.add_argument("--show", type=int, default=20, help="list this many non-passing cases")
    ap.add_argument("--derivatives", action="store_true", help="modes jvp and hvp (JVP and double backward)")
    ap.add_argument("--variants", action="store_true", help="the score stages (soft-capping), every engine/flavour")
    ap.add_argument("--distributed", action="store_true", help="context-parallel attention on real ranks")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    rng = np.random.default_rng(args.seed)
    kind = ("variants" if args.variants else "derivatives" if args.derivatives else "distributed"
            if args.distributed else "plain")
    cats = {"variants": variant_categories, "derivatives": derivative_categories, "plain": categories,
            "distributed": distributed_categories}[kind](_has_torch())
    pick = {"variants": draw_variant, "derivatives": draw_derivative, "plain": draw,
            "distributed": draw_distributed}[kind]
    if args.only or args.having:
        cats = [(c, w) for c, w in cats if c.startswith(args.only or "") and (args.having or "") in c]
        total = sum(w for _, w in cats)
        cats = [(c, w / total) for c, w in cats]
    names, weights = [c for c, _ in cats], [w for _, w in cats]
    cases = []
    for i in range(args.count):
        cat = str(rng.choice(names, p=weights))
        cases.append((i, cat, pick(rng, cat)))
    start = time.perf_counter()
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(run_one, cases, chunksize=4)
    else:
        results = [run_one(c) for c in cases]
    counts = collections.defaultdict(collections.Counter)
    for r in results:
        counts[r["category"]][r["verdict"]] += 1
        if r["category"].startswith(("attention", "impl", "jvp", "hvp", "softcap", "alibi", "bias", "relative_bias",
                                     "cp")):
            counts[f"  dtype {r['doc']['dtype']}"][r["verdict"]] += 1
        else:
            counts[f"  op {r['doc']['op']}"][r["verdict"]] += 1
    verdicts = ("pass", "inconclusive", "fail", "rejected")
    print(f"{'category':32s}" + "".join(f"{v:>14s}" for v in verdicts))
    for cat in sorted(counts):
        print(f"{cat:32s}" + "".join(f"{counts[cat][v]:>14d}" for v in verdicts))
    overall = collections.Counter(r["verdict"] for r in results)
    print(f"{'all':32s}" + "".join(f"{overall[v]:>14d}" for v in verdicts))
    print(f"{len(results)} scenarios in {time.perf_counter() - start:.0f} s")
    reasons = collections.Counter()
    for r in results:
        for c in r.get("checks", []):
            reasons[(r["verdict"], c["name"], c["verdict"])] += 1
    if reasons:
        print("\nchecks that did not pass (scenario verdict, check, check verdict): count")
        for key, n in reasons.most_common():
            print(f"  {key}: {n}")
    shown = sorted((r for r in results if r["verdict"] != "pass"), key=lambda r: r["verdict"] != "fail")[:args.show]
    for r in shown:
        print(f"\n[{r['verdict']}] {r['category']} {json.dumps(r['doc'])}")
        for c in r.get("checks", []):
            print(f"   {c['verdict']}: {c['name']} ({c['tensor']}): {c['detail'][:300]}")
        if r.get("why"):
            print(f"   {r['why']}")
        for h in r.get("hints", []):
            print(f"   hint: {h[:200]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if overall["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
