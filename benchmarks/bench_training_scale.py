"""A directional check at training scale: B=1, heads_q=32, heads_kv=8, n=2048, d_head=128, float64,
causal, on the tiled engine (blocks 256): the whole run's wall time, and the cost of one direction
(two forwards of L, +h and -h, through the same path the checker uses) against one forward plus one
backward, measured side by side in one run.

    python benchmarks/bench_training_scale.py [--directions 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import yaml

from gradcheck_cli import checker, numeric, scenario
from gradcheck_cli.ops import OPS
from gradcheck_cli.ops.attention import tiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--directions", type=int, default=16)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--engine", default="tiled", choices=("tiled", "naive"))
    parser.add_argument("--json")
    args = parser.parse_args()
    keys = {"name": "training-scale", "batch": 1, "heads_q": 32, "heads_kv": 8, "n_q": 2048, "d_head": 128,
            "mask": {"causal": "lower-right"}, "check": {"mode": "directional", "directions": args.directions},
            "engine": args.engine}
    if args.engine == "tiled":
        keys.update(block_q=args.block, block_k=args.block)
    sc = scenario.loads(yaml.safe_dump({"scenarios": [keys]}))[0]
    print(f"{sc.name}: {sc.describe()}", flush=True)

    problem = OPS["attention"].problem(sc)
    q, k, v = (problem.inputs[t] for t in "qkv")
    kv_map = np.asarray(sc.kv_map)
    g = problem.arrays["grad_output"]
    start = time.perf_counter()
    if args.engine == "tiled":
        o, lse = tiled.forward(q, k, v, sc.visible, sc.scale, kv_map, block_q=sc.block_q, block_k=sc.block_k,
                               with_lse=True)
        t_fwd = time.perf_counter() - start
        tiled.backward(q, k, v, sc.visible, sc.scale, kv_map, g, block_q=sc.block_q, block_k=sc.block_k, saved=(o, lse))
    else:
        from gradcheck_cli.ops import attention
        attention.forward(q, k, v, sc.visible, sc.scale, kv_map)
        t_fwd = time.perf_counter() - start
        attention.backward(q, k, v, sc.visible, sc.scale, kv_map, g)
    t_fwd_bwd = time.perf_counter() - start
    print(f"one forward {t_fwd:.2f} s; forward + backward {t_fwd_bwd:.2f} s", flush=True)

    chunking = numeric.plan(problem.copy_bytes, checker.DEFAULT_MEMORY_BUDGET)
    per_direction = {}
    for name in ("q", "k", "v"):
        start = time.perf_counter()
        numeric.directions(lambda c, name=name: problem.loss(name, c), problem.inputs[name], problem.gradients[name],
                           np.arange(4), 0, sc.epsilon, chunking)
        per_direction[name] = (time.perf_counter() - start) / 4
        print(f"one direction of {name}: {per_direction[name]:.2f} s = {per_direction[name] / t_fwd_bwd:.2f} x "
              "(forward + backward)", flush=True)

    start = time.perf_counter()
    result = checker.run_scenario(sc)
    total = time.perf_counter() - start
    print(f"whole run (3 x {args.directions} directions, Richardson probes, invariants, agreement with the naive "
          f"engine): {total:.0f} s, verdict {result.verdict}", flush=True)
    for c in result.checks:
        print(f"  {c.name} [{c.tensor}]: {c.verdict} (rel err {c.relative_error:.2e})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"forward_s": t_fwd, "forward_backward_s": t_fwd_bwd, "per_direction_s": per_direction,
                       "ratio": {t: s / t_fwd_bwd for t, s in per_direction.items()}, "total_s": total,
                       "verdict": result.verdict}, fh, indent=2)


if __name__ == "__main__":
    main()
