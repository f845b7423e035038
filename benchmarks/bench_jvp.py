"""The JVP check at training scale: B=1, heads_q=32, heads_kv=8, n=2048, d_head=128, float64, causal, on the
tiled engine (blocks 256), ``check: {mode: jvp}``. Measured side by side in one run: one forward, one JVP
(``tiled.jvp``), and the cost of the check per direction (its pair of forwards through the checker's path, the
JVP, and its share of the noise floor's terms), against the target of 2 x (forward + JVP).

    python benchmarks/bench_jvp.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.checker.tangents import directions, jvp_checks
from gradcheck_cli.ops import OPS
from gradcheck_cli.ops.attention import tiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--json")
    args = parser.parse_args()
    keys = {"name": "jvp-training-scale", "batch": 1, "heads_q": 32, "heads_kv": 8, "n_q": args.n, "d_head": 128,
            "mask": {"causal": "lower-right"}, "check": {"mode": "jvp"}, "engine": "tiled",
            "block_q": args.block, "block_k": args.block}
    sc = scenario.loads(yaml.safe_dump({"scenarios": [keys]}))[0]
    print(f"{sc.name}: {sc.describe()}", flush=True)

    start = time.perf_counter()
    problem = OPS["attention"].problem(sc)
    t_build = time.perf_counter() - start
    q, k, v = (problem.inputs[t] for t in "qkv")
    kv_map = np.asarray(sc.kv_map)
    rng = np.random.default_rng(0)
    tangent = {t: rng.standard_normal(x.shape) for t, x in problem.inputs.items()}

    start = time.perf_counter()
    tiled.forward(q, k, v, sc.visible, sc.scale, kv_map, block_q=sc.block_q, block_k=sc.block_k)
    t_fwd = time.perf_counter() - start
    start = time.perf_counter()
    tiled.jvp(q, k, v, sc.visible, sc.scale, kv_map, tangent["q"], tangent["k"], tangent["v"],
              block_q=sc.block_q, block_k=sc.block_k)
    t_jvp = time.perf_counter() - start
    print(f"problem built (forward, backward, terms) in {t_build:.1f} s; one forward {t_fwd:.2f} s; "
          f"one JVP {t_jvp:.2f} s", flush=True)

    start = time.perf_counter()
    checks = jvp_checks(sc, problem, np.random.default_rng(1))
    t_checks = time.perf_counter() - start
    count = len(directions(problem.inputs))
    per = t_checks / count
    target = 2 * (t_fwd + t_jvp)
    print(f"JVP checks: {count} directions + the adjoint identity in {t_checks:.1f} s: {per:.2f} s per direction "
          f"= {per / (t_fwd + t_jvp):.2f} x (forward + JVP) (target: within 2x, {target:.2f} s)", flush=True)
    for c in checks:
        print(f"  {c.name}: {c.verdict} (rel err {c.relative_error:.2e})")

    start = time.perf_counter()
    result = checker.run_scenario(sc)
    total = time.perf_counter() - start
    print(f"whole run (build, JVP checks, invariants, agreement with the naive engine): {total:.0f} s, "
          f"verdict {result.verdict}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"forward_s": t_fwd, "jvp_s": t_jvp, "build_s": t_build, "per_direction_s": per,
                       "ratio": per / (t_fwd + t_jvp), "total_s": total, "verdict": result.verdict}, fh, indent=2)


if __name__ == "__main__":
    main()
