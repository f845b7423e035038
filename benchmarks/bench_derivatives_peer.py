"""Modes jvp and hvp against torch's own checks of the same derivatives, in the same run: a plain torch attention
(GQA, causal, float64) checked by ``attn-gradcheck`` (``check: {mode: jvp}`` / ``{mode: hvp}``, its whole run:
directions, reference checks, invariants) and by ``torch.autograd.gradcheck(check_forward_ad=True,
check_backward_ad=False)`` / ``torch.autograd.gradgradcheck``, each in its exact mode (every Jacobian column) and
in ``fast_mode=True`` (one random direction, as attn-gradcheck's).

    python benchmarks/bench_derivatives_peer.py [--n 64] [--d 32] [--repeat 3]
"""
from __future__ import annotations

import argparse

import torch
import yaml
from bench_full_mode import best_of

from gradcheck_cli import checker, scenario


def attention(q, k, v, visible, scale, kv_map):
    s = scale * q @ k[:, kv_map].transpose(-1, -2)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v[:, kv_map]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--d", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--exact", action="store_true", help="also torch's exact (every column) checks: slow")
    args = parser.parse_args()
    shape = dict(batch=1, heads_q=4, heads_kv=2, n_q=args.n, d_head=args.d, mask={"causal": "lower-right"},
                 backend="torch", implementation="bench_derivatives_peer:attention")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, args.n, args.d, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, args.n, args.d, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    visible = torch.ones(args.n, args.n, dtype=torch.bool).tril().expand(1, 4, args.n, args.n)
    kv_map = torch.tensor([0, 0, 1, 1])

    def fn(q, k, v):
        return attention(q, k, v, visible, args.d ** -0.5, kv_map)

    print(f"B=1 Hq=4 Hkv=2 n={args.n} d={args.d} float64 causal; best of {args.repeat}")
    for mode in ("jvp", "hvp"):
        sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": mode, **shape, "check": {"mode": mode}}]}),
                            base_dir=__import__("pathlib").Path(__file__).parent)[0]
        ours = best_of(args.repeat, lambda sc=sc: checker.run_scenario(sc))
        if mode == "jvp":
            fast = best_of(args.repeat, lambda: torch.autograd.gradcheck(fn, (q, k, v), check_forward_ad=True,
                                                                         check_backward_ad=False, fast_mode=True))
        else:
            fast = best_of(args.repeat, lambda: torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=True))
        line = f"mode {mode}: attn-gradcheck {ours:.2f} s; torch fast_mode {fast:.2f} s ({fast / ours:.1f}x ours)"
        if args.exact:
            if mode == "jvp":
                exact = best_of(1, lambda: torch.autograd.gradcheck(fn, (q, k, v), check_forward_ad=True,
                                                                    check_backward_ad=False))
            else:
                exact = best_of(1, lambda: torch.autograd.gradgradcheck(fn, (q, k, v)))
            line += f"; torch exact {exact:.1f} s ({exact / ours:.0f}x ours)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
