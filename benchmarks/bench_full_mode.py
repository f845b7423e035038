"""Full-mode checks (every element) timed against a one-element-at-a-time NumPy loop and
torch.autograd.gradcheck (when torch is installed) on the same function, in the same run. Prints the
best of R wall times and the ratios (this machine is noisy). gradcheck runs twice: on the attention
function itself (its whole Jacobian, what people usually call) and on the scalar L = sum(O * G) that
attn-gradcheck differentiates (the like-for-like comparison).

Scenarios: the issue's B=1, H=1, n_q=n_k=64, d=32 and n=128, d=64, causal, float64; and a GQA scenario
with padding (B=2, Hq=8, Hkv=2, n=32, d=16, causal, key_lengths [32, 23]). The slow references
(the loop, gradcheck) run once where a scenario has over 20,000 elements.

The GEMM floor: an exhaustive central-difference check needs 2 N forwards (N = input elements); counting
only the two GEMMs of each forward (Q K^T and A V, full size) at this machine's float64 GEMM rate,
measured in the same run on stacked products of the same shapes.

    python benchmarks/bench_full_mode.py [--repeat 3] [--json out.json] [--only causal-n64-d32 ...]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.numeric import colours, perturb
from gradcheck_cli.ops import attention

SCENARIOS = [
    {"name": "causal-n64-d32", "n_q": 64, "d_head": 32, "mask": {"causal": "lower-right"}},
    {"name": "causal-n128-d64", "n_q": 128, "d_head": 64, "mask": {"causal": "lower-right"}},
    {"name": "gqa-padded-n32", "batch": 2, "heads_q": 8, "heads_kv": 2, "n_q": 32, "d_head": 16,
     "mask": {"causal": "lower-right", "key_lengths": [32, 23]}},
]


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_rate(n_q: int, n_k: int, d: int, repeat: int) -> float:
    """float64 GEMM rate (flop/s) on stacked [64, n_q, d] @ [d, n_k] products, BLAS's own threads."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, n_q, d)), rng.standard_normal((d, n_k))
    return 2.0 * 64 * n_q * n_k * d / best_of(repeat, lambda: a @ b)


def peak_gemm_rate(repeat: int) -> float:
    """float64 GEMM rate (flop/s) of one large square product: the machine's rate as the issue counts it."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((1024, 1024)), rng.standard_normal((1024, 1024))
    return 2.0 * 1024**3 / best_of(repeat, lambda: a @ b)


def numpy_loop(sc, problem, epsilon):
    """Central differences one element at a time: two calls of the plain reference forward
    (``attention.forward``) per element."""
    g, kv_map = problem.arrays["grad_output"], np.asarray(sc.kv_map)

    def loss(name, x):
        args = {**problem.inputs, name: x}
        return float(np.sum(attention.forward(**args, visible=sc.visible, scale=sc.scale, kv_map=kv_map) * g))

    for name, x in problem.inputs.items():
        flat = x.ravel()
        for i in range(x.size):
            plus, minus = perturb(flat[i:i + 1], epsilon)
            xp, xm = x.copy(), x.copy()
            xp.ravel()[i], xm.ravel()[i] = plus[0], minus[0]
            (loss(name, xp) - loss(name, xm)) / (plus[0] - minus[0])


def torch_gradcheck(sc, problem, repeat):
    try:
        import torch
    except ImportError:
        return None
    q, k, v = (torch.tensor(problem.inputs[t], requires_grad=True) for t in "qkv")
    hidden = torch.tensor(~sc.visible)
    idx = torch.tensor(sc.kv_map)

    def f(q, k, v):
        s = (q @ k[:, idx].transpose(-1, -2)) * sc.scale
        return torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ v[:, idx]

    grad_out = torch.tensor(problem.arrays["grad_output"])

    def scalar(q, k, v):  # the same scalar L = sum(O * G) that attn-gradcheck differentiates
        return (f(q, k, v) * grad_out).sum()

    def passes(fn):  # each timed call must also pass (no untimed extra run)
        assert torch.autograd.gradcheck(fn, (q, k, v))

    return (best_of(repeat, lambda: passes(f)), best_of(repeat, lambda: passes(scalar)), torch.__version__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--only", nargs="+", choices=[k["name"] for k in SCENARIOS], help="these scenarios only")
    args = ap.parse_args()
    figures = []
    for keys in SCENARIOS:
        if args.only and keys["name"] not in args.only:
            continue
        sc = scenario.loads(yaml.safe_dump({"scenarios": [keys]}))[0]
        problem = attention.OP.problem(sc)
        elements = sum(x.size for x in problem.inputs.values())
        coloured_forwards = sum(2 * len(colours(problem.parts[t])) for t in problem.inputs)
        fig = {"scenario": sc.name, "shape": sc.describe(), "elements": elements, "forwards": 2 * elements,
               "coloured_forwards": coloured_forwards}
        plain_sc = dataclasses.replace(sc, colouring=False)
        for key, scen in (("plain_s", plain_sc), ("coloured_s", sc)):
            assert checker.run_scenario(scen).passed
            fig[key] = best_of(args.repeat, lambda scen=scen: checker.run_scenario(scen))
        slow = 1 if elements > 20_000 else args.repeat
        fig["numpy_loop_s"] = best_of(slow, lambda problem=problem, sc=sc: numpy_loop(sc, problem, sc.epsilon))
        torch_fig = torch_gradcheck(sc, problem, slow)
        rate = gemm_rate(sc.n_q, sc.n_k, sc.d_head, args.repeat)
        gemm_flops = 2 * sc.batch * sc.heads_q * sc.n_q * sc.n_k * (sc.d_head + sc.d_value)
        peak = peak_gemm_rate(args.repeat)
        fig["gemm_rate_gflops"], fig["peak_gemm_rate_gflops"] = rate / 1e9, peak / 1e9
        fig["gemm_floor_s"] = 2 * elements * gemm_flops / rate
        fig["peak_gemm_floor_s"] = 2 * elements * gemm_flops / peak
        if torch_fig:
            fig["torch_gradcheck_s"], fig["torch_gradcheck_scalar_s"], fig["torch_version"] = torch_fig
        figures.append(fig)

        plain, col = fig["plain_s"], fig["coloured_s"]
        print(f"{sc.name} ({sc.describe()}): {elements} elements; forwards: {2 * elements} one element at a time, "
              f"{coloured_forwards} coloured; best of {args.repeat}")
        print(f"  attn-gradcheck (default: coloured) {col:7.3f} s")
        print(f"  attn-gradcheck, colouring: false  {plain:7.3f} s")
        print(f"  one-element NumPy loop            {fig['numpy_loop_s']:7.3f} s   "
              f"{fig['numpy_loop_s'] / col:5.1f}x default, {fig['numpy_loop_s'] / plain:5.1f}x colouring: false")
        for label, floor_key, rate_key in (("peak", "peak_gemm_floor_s", "peak_gemm_rate_gflops"),
                                           ("same-shape", "gemm_floor_s", "gemm_rate_gflops")):
            floor = fig[floor_key]
            print(f"  GEMM floor, {label} rate {fig[rate_key]:.0f} GFLOP/s {floor:7.3f} s: default run "
                  f"{col / floor:.2f}x the floor, colouring: false {plain / floor:.2f}x")
        if torch_fig:
            t = fig["torch_gradcheck_s"]
            print(f"  torch.autograd.gradcheck          {t:7.3f} s   {t / col:5.1f}x default, "
                  f"{t / plain:5.1f}x colouring: false")
            t = fig["torch_gradcheck_scalar_s"]
            print(f"  torch gradcheck of L = sum(O*G)   {t:7.3f} s   {t / col:5.1f}x default, "
                  f"{t / plain:5.1f}x colouring: false")
        else:
            print("  torch.autograd.gradcheck          (torch not installed)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()
