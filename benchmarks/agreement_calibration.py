"""Where the agreement allowance comes from: correct implementations against the float64 reference, in
float32, float16 and bfloat16, over random shapes and masks.

The rule (gradcheck_cli/precision.py): element i of O, dQ, dK, dV may differ from the float64 reference
by  factor x E_plain + slack + ulps x eps x T_i (in half precision the last at most PLAIN_SHARE x E_plain),
where E_plain is the largest error of the plain computations in the same precision on the same inputs (in
half precision torch autograd of the plain forward, the closed forms and SDPA), T_i the size of the terms
element i is made of (ops/attention/rounding.py term_sizes) and eps the dtype's machine epsilon. For each
correct implementation this prints the ulps it NEEDS (the largest (e_i - factor E_plain - slack) / (eps
T_i); <= 0: the plain error alone covers it), the largest multiple of E_plain it errs by, the cases in
which some element falls outside the rule, and for the rule's ulps the smallest uniform relative error in
a gradient that the rule detects (both signs), for n >= 16 (the issue's targets: 0.1% float32, 1% float16,
5% bfloat16).

    python benchmarks/agreement_calibration.py [--cases 200] [--seed 0]
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gradcheck_cli import precision  # noqa: E402
from gradcheck_cli.ops import attention as engine  # noqa: E402
from gradcheck_cli.tolerance import machine_epsilon  # noqa: E402


def _case(rng):
    b, hq = int(rng.integers(1, 3)), int(rng.choice([1, 2, 4]))
    hkv = int(rng.choice([h for h in (1, 2, 4) if hq % h == 0]))
    n_q = int(rng.choice([1, 2, 4, 8, 16, 32, 64]))
    n_k = int(rng.choice([n for n in (2, 4, 8, 16, 32, 64, 96) if n >= n_q]))
    d = int(rng.choice([4, 8, 16, 32, 64]))
    scale = float(np.exp(rng.uniform(np.log(0.1), np.log(4.0)))) if rng.random() < 0.4 else d ** -0.5
    visible = np.ones((b, hq, n_q, n_k), dtype=bool)
    if rng.random() < 0.5:
        visible &= np.tril(np.ones((n_q, n_k), dtype=bool), k=n_k - n_q)
    kv_map = np.arange(hq) // (hq // hkv)
    x = {"q": rng.standard_normal((b, hq, n_q, d)), "k": rng.standard_normal((b, hkv, n_k, d)),
         "v": rng.standard_normal((b, hkv, n_k, d))}
    g = rng.standard_normal((b, hq, n_q, d))
    return x, g, visible, scale, kv_map


def _torch_impls(dtype):
    import correct_impls as ci
    import torch

    from gradcheck_cli.ops.attention.torch_engine import formulas as tb
    dt = tb.DTYPES[dtype]

    def run(fn):
        def call(x, g, visible, scale, kv_map):
            leaves = [torch.from_numpy(x[t]).to(dt).requires_grad_(True) for t in "qkv"]
            vis, km = torch.from_numpy(visible), torch.as_tensor(kv_map)
            o = fn(*leaves, vis, scale, km)
            grads = torch.autograd.grad(o, leaves, torch.from_numpy(g).to(dt))
            return {t: y.detach().double().numpy() for t, y in zip("oqkv", (o, *grads))}
        return call

    def closed(x, g, visible, scale, kv_map):
        q, k, v = (torch.from_numpy(x[t]).to(dt) for t in "qkv")
        vis, km = torch.from_numpy(visible), torch.as_tensor(kv_map)
        o = tb.forward(q, k, v, vis, scale, km)
        grads = tb.backward(q, k, v, vis, scale, km, torch.from_numpy(g).to(dt))
        return {t: y.double().numpy() for t, y in zip("oqkv", (o, *grads))}

    return {"plain": run(lambda q, k, v, vis, s, km: tb.forward(q, k, v, vis, s, km)),
            "closed-forms": closed, "sdpa": run(ci.torch_sdpa), "custom": run(ci.torch_custom),
            "softmax32": run(ci.torch_softmax32)}


def _numpy_impls(dtype):
    import correct_impls as ci

    def run(obj):
        def call(x, g, visible, scale, kv_map):
            args = [x[t].astype(dtype) for t in "qkv"]
            o = obj.forward(*args, visible, scale, kv_map)
            grads = obj.backward(*args, visible, scale, kv_map, g.astype(dtype))
            return {t: y.astype(np.float64) for t, y in zip("oqkv", (o, *grads))}
        return call

    def builtin(x, g, visible, scale, kv_map):
        args = [x[t].astype(dtype) for t in "qkv"]
        o = engine.forward(*args, visible, scale, kv_map)
        gr = engine.backward(*args, visible, scale, kv_map, g.astype(dtype))
        return {t: y.astype(np.float64) for t, y in zip("oqkv", (o, gr.q, gr.k, gr.v))}

    return {"plain": builtin, "einsum": run(ci.einsum), "flash(f64 acc)": run(ci.flash)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
        flavours = [("float32", "numpy"), ("float32", "torch"), ("float16", "torch"), ("bfloat16", "torch")]
    except ImportError:
        flavours = [("float32", "numpy")]
    rng = np.random.default_rng(args.seed)
    need = collections.defaultdict(float)
    times = collections.defaultdict(float)
    failed = collections.Counter()
    worst_detect = collections.defaultdict(float)
    for _ in range(args.cases):
        x, g, visible, scale, kv_map = _case(rng)
        for dtype, flavour in flavours:
            impls = _numpy_impls(np.dtype(dtype)) if flavour == "numpy" else _torch_impls(dtype)
            rounded = _round(x, dtype)
            g_r = _round({"g": g}, dtype)["g"]
            ref_o = engine.forward(rounded["q"], rounded["k"], rounded["v"], visible, scale, kv_map)
            ref = engine.backward(rounded["q"], rounded["k"], rounded["v"], visible, scale, kv_map, g_r)
            reference = {"o": ref_o, "q": ref.q, "k": ref.k, "v": ref.v}
            terms = engine.term_sizes(rounded, g_r, lambda span, a=ref.a: a[..., span, :], scale, kv_map)
            # the plain computations the tool measures E_plain on: in half precision also the closed forms and SDPA
            ways = ["plain"] + (["closed-forms", "sdpa"] if dtype in ("float16", "bfloat16") else [])
            got_all = {name: impl(rounded, g_r, visible, scale, kv_map) for name, impl in impls.items()}
            eps = machine_epsilon(dtype)
            policy = precision.Policy.for_dtype(dtype)
            for name, got in got_all.items():
                for t in "oqkv":
                    e_plain = max([float(np.abs(got_all[w][t] - reference[t]).max()) for w in ways]
                                  + [policy.plain_floor(reference[t])])
                    e = np.abs(got[t] - reference[t])
                    spare = e - policy.factor * e_plain - policy.slack
                    key = (dtype, flavour, name, t)
                    need[key] = max(need[key], float((spare / np.maximum(eps * terms[t], 1e-300)).max()))
                    times[key] = max(times[key], float((e - policy.slack).max()) / e_plain)
                    failed[key] += bool((e > policy.allowed(e_plain, terms[t])).any())
                    if t != "o" and x["q"].shape[-2] >= 16 and name != "plain":
                        allowed = policy.allowed(e_plain, terms[t])
                        d = precision.detectable(got[t], reference[t], allowed)
                        worst_detect[key] = max(worst_detect[key], d)
    print(f"{args.cases} cases; 'x plain': the largest (error - slack) / E_plain of an element (the rule allows "
          f"factor {precision.DEFAULT_FACTOR:g} x plain + the terms' share, in half precision at most "
          f"{precision.PLAIN_SHARE} x plain); 'out': cases with an element out of the rule")
    print(f"{'dtype':9s} {'flavour':7s} {'implementation':16s} {'tensor':6s} {'ulps needed':>12s} {'x plain':>8s} "
          f"{'out':>4s} {'detects (n>=16)':>16s}")
    for key in sorted(need):
        dtype, flavour, name, t = key
        det = worst_detect.get(key)
        print(f"{dtype:9s} {flavour:7s} {name:16s} {t:6s} {need[key]:12.3g} {times[key]:8.3g} {failed[key]:4d} "
              f"{'' if det is None else f'{det:16.3%}'}")


def _round(x: dict, dtype: str) -> dict:
    if dtype in ("float16", "bfloat16"):
        import torch
        dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        return {t: torch.from_numpy(v).to(dt).double().numpy() for t, v in x.items()}
    return {t: v.astype(dtype).astype(np.float64) for t, v in x.items()}


if __name__ == "__main__":
    main()
