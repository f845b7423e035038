"""Why the fast forward (gradcheck_cli/ops/attention/copies.py) works in blocks of 32 query rows: the float64 GEMM
rate of stacked products of the shapes one copy of the n=128, d=64 causal forward needs, on one BLAS
thread (as each finite-difference worker runs), as one 128-row product or as 32-row blocks over the keys
each block sees. Prints GFLOP/s and microseconds per copy, best of R.

    python benchmarks/bench_row_blocks.py [--repeat 20] [--copies 36]
"""
from __future__ import annotations

import argparse

import numpy as np
from bench_full_mode import best_of as best  # run from the repository root: benchmarks/ is on the path
from threadpoolctl import threadpool_limits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--copies", type=int, default=36)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n, d, c = 128, 64, args.copies
    q, v = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    k_t = rng.standard_normal((c, d, n))                       # copies of K, stored as K^T
    with threadpool_limits(1, "blas"):
        whole = best(args.repeat, lambda: np.matmul(np.matmul(q, k_t), v))
        flops_whole = c * 2 * 2 * n * n * d

        def blocks():
            for start in range(0, n, 32):
                keys = start + 32                               # causal: block rows see keys [0, start + 32)
                np.matmul(np.matmul(q[start:start + 32], k_t[..., :keys]), v[:keys])
        blocked = best(args.repeat, blocks)
        flops_blocked = c * 2 * 2 * sum(32 * (s + 32) * d for s in range(0, n, 32))
    for name, t, flops in (("one 128-row product pair", whole, flops_whole),
                           ("32-row blocks over the keys they see", blocked, flops_blocked)):
        print(f"{name:38s} {flops / t / 1e9:6.1f} GFLOP/s  {t / c * 1e6:7.1f} us per copy  "
              f"({flops / flops_whole:.1%} of the full products)")


if __name__ == "__main__":
    main()
