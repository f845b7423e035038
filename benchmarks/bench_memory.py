"""Peak memory of one forward + backward, naive engine against the tiled (FlashAttention-style) engine,
for one head, d = 64, causal, float64, n = 1k .. 16k, measured side by side in one run.

Each measurement runs in a fresh process: the inputs are made first, then ``tracemalloc`` (which NumPy
reports every array allocation to) records the peak of everything the engine allocates; the process's
maximum resident set size is reported beside it. The naive engine gets the materialised visible set (it
is part of what it needs); the tiled engine builds its mask block by block (``masks.blockwise``), so it
never holds an n x n array. ``--documents D``: a packed batch of D documents of n / D each (varlen), causal
within each, in both engines.

    python benchmarks/bench_memory.py [--sizes 1024 2048 4096 8192 16384] [--documents 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time, tracemalloc
import numpy as np
from gradcheck_cli import masks
from gradcheck_cli.ops import attention
from gradcheck_cli.ops.attention import tiled
engine, n, d, block, docs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
documents = None if docs == 0 else ([n // docs] * (docs - 1) + [n - (docs - 1) * (n // docs)],) * 2
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((1, 1, n, d)) for _ in range(4))
kv_map = np.zeros(1, dtype=np.intp)
scale = d ** -0.5
tracemalloc.start()
start = time.perf_counter()
if engine == "naive":
    visible = masks.build_visible(1, 1, n, n, causal="lower-right", documents=documents)
    o = attention.forward(q, k, v, visible, scale, kv_map)
    grads = attention.backward(q, k, v, visible, scale, kv_map, g)
else:
    visible = masks.blockwise(n, n, causal="lower-right", documents=documents)
    o, lse = tiled.forward(q, k, v, visible, scale, kv_map, block_q=block, block_k=block, with_lse=True)
    grads = tiled.backward(q, k, v, visible, scale, kv_map, g, block_q=block, block_k=block, saved=(o, lse))
elapsed = time.perf_counter() - start
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"engine": engine, "n": n, "peak_bytes": peak, "seconds": elapsed,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def measure(engine: str, n: int, d: int, block: int, documents: int = 0) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, engine, str(n), str(d), str(block), str(documents)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--documents", type=int, default=0, help="a packed batch of this many documents (varlen)")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    packed = f", {args.documents} packed documents (varlen)" if args.documents else ""
    print(f"one head, d={args.d}, causal{packed}, float64, forward + backward; tiled blocks {args.block}x{args.block}")
    print(f"{'n':>6}  {'naive peak':>12}  {'tiled peak':>12}  {'tiled/naive':>11}  {'naive s':>8}  {'tiled s':>8}  "
          f"{'naive RSS':>10}  {'tiled RSS':>10}")
    for n in args.sizes:
        naive, tiled = (measure(engine, n, args.d, args.block, args.documents) for engine in ("naive", "tiled"))
        ratio = tiled["peak_bytes"] / naive["peak_bytes"]
        rows.append({"n": n, "naive": naive, "tiled": tiled, "ratio": ratio})
        print(f"{n:>6}  {naive['peak_bytes'] / 2**20:>9.1f} MiB  {tiled['peak_bytes'] / 2**20:>9.1f} MiB  "
              f"{ratio:>10.2%}  {naive['seconds']:>8.2f}  {tiled['seconds']:>8.2f}  "
              f"{naive['max_rss_bytes'] / 2**20:>6.0f} MiB  {tiled['max_rss_bytes'] / 2**20:>6.0f} MiB", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
