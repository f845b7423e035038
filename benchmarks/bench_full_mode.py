"""Full-mode check of B=1, H=1, n_q=n_k=64, d=32, causal, float64: attn-gradcheck against a
one-element-at-a-time NumPy loop and torch.autograd.gradcheck (when torch is installed) on the same
function, in the same run. Prints best-of-R wall times and ratios (this machine is noisy).

    python benchmarks/bench_full_mode.py [--repeat 3] [--n 64] [--d 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.numeric import perturb
from gradcheck_cli.ops import attention


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    n, d = args.n, args.d

    sc = scenario.loads(yaml.safe_dump({"scenarios": [
        {"name": f"bench-n{n}-d{d}", "n_q": n, "d_head": d, "mask": {"causal": "lower-right"}}]}))[0]
    problem = attention.build(sc)
    elements = sum(x.size for x in problem.inputs.values())
    figures = {"scenario": sc.describe(), "elements": elements, "forwards": 2 * elements}

    result = checker.run_scenario(sc)
    assert result.passed
    figures["attn_gradcheck_s"] = best_of(args.repeat, lambda: checker.run_scenario(sc))

    def loop():
        for name, x in problem.inputs.items():
            flat = x.ravel()
            for i in range(x.size):
                plus, minus = perturb(flat[i:i + 1], sc.epsilon)
                xp, xm = x.copy(), x.copy()
                xp.ravel()[i], xm.ravel()[i] = plus[0], minus[0]
                (problem.loss(name, xp) - problem.loss(name, xm)) / (plus[0] - minus[0])
    figures["numpy_loop_s"] = best_of(args.repeat, loop)

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        q, k, v = (torch.tensor(problem.inputs[t], requires_grad=True) for t in "qkv")
        hidden = torch.tensor(~sc.visible)

        def f(q, k, v):
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            return torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ v

        assert torch.autograd.gradcheck(f, (q, k, v))
        figures["torch_gradcheck_s"] = best_of(args.repeat, lambda: torch.autograd.gradcheck(f, (q, k, v)))
        figures["torch_version"] = torch.__version__

    print(f"full-mode check, {sc.describe()}: {elements} elements, {2 * elements} forwards, best of {args.repeat}")
    ours = figures["attn_gradcheck_s"]
    print(f"  attn-gradcheck (all checks)     {ours:8.3f} s")
    print(f"  one-element NumPy loop          {figures['numpy_loop_s']:8.3f} s   ({figures['numpy_loop_s'] / ours:5.1f}x slower)")
    if "torch_gradcheck_s" in figures:
        t = figures["torch_gradcheck_s"]
        print(f"  torch.autograd.gradcheck        {t:8.3f} s   ({t / ours:5.1f}x slower)")
    else:
        print("  torch.autograd.gradcheck        (torch not installed)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
