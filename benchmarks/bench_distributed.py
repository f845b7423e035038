"""The cost of checking context-parallel attention on real ranks: the full-mode check of causal attention at n = 256,
d = 32 (float64, B = 1, Hq = 4, Hkv = 2) by the built-in ring on 4 gloo ranks, against the same scenario checked in
one process (the naive engine, and the same ring on one rank), timed in the same run. The ranks' start-up is
reported separately (it is paid once per scenario); the target is the 4-rank check within 3x the one-process check.

    python benchmarks/bench_distributed.py [--n 256] [--d 32] [--world-size 4] [--repeat 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.ops.attention.distributed import proxy


def _scenario(n: int, d: int, distributed: dict | None):
    doc = {"name": "b", "batch": 1, "heads_q": 4, "heads_kv": 2, "n_q": n, "d_head": d,
           "mask": {"causal": "lower-right"}, "check": {"mode": "full"}}
    if distributed:
        doc["distributed"] = distributed
    return scenario.loads(yaml.safe_dump({"scenarios": [doc]}))[0]


def _timed(sc) -> tuple[float, float, str]:
    """(seconds of the check, seconds of rank start-up within it, verdict)."""
    proxy.stop_all()  # fresh ranks: their start-up measured apart
    start = time.perf_counter()
    result = checker.run_scenario(sc)
    total = time.perf_counter() - start
    startup = sum(r.startup_s for r in proxy._LIVE.values())
    return total, startup, result.verdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="rounds, one after another (each row: its median)")
    args = ap.parse_args()
    runs = (("one process, naive engine", None), ("ring on 1 rank", {"world_size": 1}),
            (f"ring on {args.world_size} ranks", {"world_size": args.world_size}),
            (f"zigzag ring on {args.world_size} ranks", {"world_size": args.world_size, "sharding": "zigzag"}))
    times: dict[str, list] = {label: [] for label, _ in runs}
    for _ in range(args.repeat):  # the rounds interleaved: a slower spell of a shared machine hits every row
        for label, given in runs:
            total, startup, verdict = _timed(_scenario(args.n, args.d, given))
            times[label].append((total - startup, startup, verdict))
    base = statistics.median(t[0] for t in times[runs[0][0]])
    print(f"full-mode check, causal, B=1 Hq=4 Hkv=2 n={args.n} d={args.d} float64"
          + (f", median of {args.repeat} rounds" if args.repeat > 1 else "") + ":")
    for label, rows in times.items():
        check = statistics.median(t[0] for t in rows)
        startup = statistics.median(t[1] for t in rows)
        verdicts = ",".join(sorted({t[2].value for t in rows}))
        print(f"  {label:28s} {check + startup:7.2f} s  (rank start-up {startup:5.2f} s, check {check:6.2f} s = "
              f"{check / base:4.2f}x one process)  {verdicts}")
    print("target: the check on the ranks (start-up apart) within 3x one process")
    proxy.stop_all()


if __name__ == "__main__":
    main()
