"""The score stages' cost: the full-mode check of causal attention at n = 128, d = 64 (float64, naive engine)
plain, soft-capped, with ALiBi, with both, and with a bias, T5's table and learned ALiBi slopes whose gradients
are checked (each one more input), timed in the same run (best of R); the target is each variant
within 1.3x the plain check. And the tiled engine's peak memory with ALiBi at n (default 16384) against the
naive engine's estimate for the same scenario (target: under 5 %), and with everything at once: learned sinks,
soft-capping and ALiBi on a packed batch of 8 documents, causal with a window, two query heads sharing one KV head.

    python benchmarks/bench_variants.py [--repeat 3] [--n-memory 16384]
"""
from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import yaml

from gradcheck_cli import checker, masks, scenario
from gradcheck_cli.ops.attention import memory, tiled
from gradcheck_cli.ops.attention.stages.alibi import Alibi, geometric
from gradcheck_cli.ops.attention.stages.sinks import Sinks
from gradcheck_cli.ops.attention.stages.softcap import Softcap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_full_mode import best_of  # noqa: E402 (the same timing as the full-mode benchmark)

BASE = {"name": "b", "n_q": 128, "d_head": 64, "mask": {"causal": "lower-right"}}
VARIANTS = {"plain": {}, "softcap": {"softcap": 30.0}, "alibi": {"alibi": {}},
            "softcap+alibi": {"softcap": 30.0, "alibi": {}},
            "bias+grad": {"bias": {}},                                        # its gradient checked: an input
            "relative_bias+grad": {"relative_bias": {"buckets": 32, "max_distance": 128}},
            "alibi+grad": {"alibi": {"grad": True}},
            "sinks+grad": {"sinks": {"grad": True}}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-memory", type=int, default=16384)
    args = ap.parse_args()
    times = {}
    for name, keys in VARIANTS.items():
        (sc,) = scenario.loads(yaml.safe_dump({"scenarios": [{**BASE, **keys}]}))
        assert checker.run_scenario(sc).passed
        times[name] = best_of(args.repeat, lambda sc=sc: checker.run_scenario(sc))
    print(f"full mode, causal, B=1 H=1 n=128 d=64 float64, best of {args.repeat}:")
    for name, t in times.items():
        print(f"  {name:14s} {t:7.3f} s   {t / times['plain']:5.2f}x plain   (target <= 1.30x)")
    n, d = args.n_memory, 64
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 1, n, d)) for _ in range(4))
    stages = (Alibi(geometric(1), "distance", n, n),)
    tracemalloc.start()
    o, lse = tiled.forward(q, k, v, masks.blockwise(n, n, causal="lower-right"), 0.125, np.zeros(1, np.intp),
                           block_q=256, block_k=256, with_lse=True, stages=stages)
    tiled.backward(q, k, v, masks.blockwise(n, n, causal="lower-right"), 0.125, np.zeros(1, np.intp), g,
                   block_q=256, block_k=256, saved=(o, lse), stages=stages)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    naive = memory.attention_need(1, 1, 1, n, n, d, d, "float64")
    print(f"tiled forward + backward with ALiBi at n={n}, d={d}: peak {peak / 2**20:.1f} MiB traced; the naive "
          f"engine's estimate {naive / 2**30:.1f} GiB: {100 * peak / naive:.2f} % (target < 5 %)")
    combined(n, d)


def combined(n: int, d: int) -> None:
    """Sinks (learned), soft-capping and ALiBi on a packed batch, causal with a window, GQA, with the LSE an output
    (its upstream gradient taken by the backward), on the tiled engine."""
    docs = 8
    lengths = [n // docs] * (docs - 1) + [n - (docs - 1) * (n // docs)]
    documents = (lengths, lengths)
    rng = np.random.default_rng(1)
    q, g = (rng.standard_normal((1, 2, n, d)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, n, d)) for _ in range(2))
    kv_map = np.zeros(2, np.intp)
    stages = (Softcap(30.0), Alibi(geometric(2), "distance", n, n, documents=documents),
              Sinks(np.array([0.5, -1.0]), grad=True))
    visible = masks.blockwise(n, n, causal="lower-right", window=(1024, 0), documents=documents)
    grad_lse = rng.standard_normal((1, 2, n))
    params: dict = {}
    tracemalloc.start()
    o, lse = tiled.forward(q, k, v, visible, 0.125, kv_map, block_q=256, block_k=256, with_lse=True, stages=stages)
    tiled.backward(q, k, v, visible, 0.125, kv_map, g, block_q=256, block_k=256, saved=(o, lse), stages=stages,
                   params=params, grad_lse=grad_lse)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    naive = memory.attention_need(1, 2, 1, n, n, d, d, "float64")
    assert np.isfinite(params["sinks"]).all()
    print(f"tiled forward + backward with learned sinks, softcap, ALiBi, the LSE an output, {docs} packed documents, "
          f"a window of 1024 and GQA (Hq=2, Hkv=1) at n={n}, d={d}: peak {peak / 2**20:.1f} MiB traced; the naive "
          f"engine's estimate {naive / 2**30:.1f} GiB: {100 * peak / naive:.2f} % (target < 5 %)")


if __name__ == "__main__":
    main()
