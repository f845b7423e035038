"""The hunt's Done-when, measured: each edge-only bug of examples/hunt_edges.py is hunted from a scenario where it
passes (examples/hunt.yaml), with the default space; the time to find it and the size it shrinks to are compared
with a brute-force search over the same space.

The brute force goes through every scenario of the space in ascending input elements (batch 1..4, KV heads 1..4,
group 1..8, n_q and n_k 1..300, d_head 1..256; at each size every causal kind, softmax scale and dtype of the
space; windows and padding left out) and judges each directly: the implementation's output and gradients against the
correct implementation it departs from (hunt_edges.Correct), in the same dtype on the tool's own seeded inputs, with
no finite differences (that is what makes it affordable; the tool itself is the judge in the hunts).
It stops at the first failing scenario (the smallest), at the hunts' largest result (or half of it, when that is over
200 elements: enough to decide "within 2x"), or after --brute-seconds; without a failure it states the size below
which nothing fails (a lower bound on the smallest).

    python benchmarks/hunt/edges.py --json benchmarks/hunt/results.json
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

import hunt_edges  # noqa: E402

from gradcheck_cli.masks import build_visible  # noqa: E402
from gradcheck_cli.ops.attention.inputs import seeded_inputs  # noqa: E402

BUGS = ("tail-block-dropped", "large-head-unscaled", "group-of-four-half-summed", "decode-causal-offset",
        "unstable-exp")
CAUSAL = ("none", "upper-left", "lower-right")
SCALES = (None, 0.5, 1.0, 4.0, 16.0, 64.0)
DTYPES = ("float64", "float32")


def sizes(limit: int):
    """Every (batch, heads_kv, group, n_q, n_k, d_head) of the space with at most ``limit`` input elements, in
    ascending elements."""
    out = []
    for b in range(1, 5):
        for hkv in range(1, 5):
            for g in range(1, 9):
                for d in range(1, 257):
                    base = b * hkv * d
                    if base * (g + 2) > limit:
                        break
                    for nq in range(1, 301):
                        if base * (g * nq + 2) > limit:
                            break
                        for nk in range(1, 301):
                            e = base * (g * nq + 2 * nk)
                            if e > limit:
                                break
                            out.append((e, b, hkv, g, nq, nk, d))
    out.sort()
    return out


def fails(impl, size, causal, scale, dtype) -> bool:
    e, b, hkv, g, nq, nk, d = size
    sc = types.SimpleNamespace(seed=0, batch=b, heads_q=hkv * g, heads_kv=hkv, n_q=nq, n_k=nk, d_head=d, d_value=d,
                               dtype=dtype, loss_rows=None)
    x, grad = seeded_inputs(sc)
    visible = build_visible(b, hkv * g, nq, nk, causal=causal)
    kv_map = np.repeat(np.arange(hkv), g)
    s = 1 / math.sqrt(d) if scale is None else scale
    with np.errstate(all="ignore"):
        got = [impl.forward(x["q"], x["k"], x["v"], visible, s, kv_map),
               *impl.backward(x["q"], x["k"], x["v"], visible, s, kv_map, grad)]
        ref = [hunt_edges.correct.forward(x["q"], x["k"], x["v"], visible, s, kv_map),
               *hunt_edges.correct.backward(x["q"], x["k"], x["v"], visible, s, kv_map, grad)]
    tol = 1e-10 if dtype == "float64" else 1e-5
    for a, r in zip(got, ref):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        both_nan = np.isnan(a) & np.isnan(r)
        scale_r = np.nanmax(np.abs(r)) if np.isfinite(r).any() else 1.0
        if (~both_nan & ~(np.abs(a - r) <= tol * (scale_r + 1e-30))).any():
            return True
    return False


def brute(name: str, limit: int, seconds: float, start: int = 0, part: tuple[int, int] = (1, 1)) -> dict:
    """The brute force of one bug over the sizes with ``start`` .. ``limit`` input elements (``part`` (i, n): every
    n-th size from the i-th, to split the work over processes)."""
    impl = getattr(hunt_edges, name.replace("-", "_"))
    began, checked = time.monotonic(), 0
    chosen = [sz for sz in sizes(limit) if sz[0] >= start]
    for size in chosen[part[0] - 1::part[1]]:
        if time.monotonic() - began > seconds:
            return {"smallest": None, "nothing_fails_below": size[0], "checked": checked,
                    "seconds": round(time.monotonic() - began, 1)}
        for dtype in DTYPES:
            for scale in SCALES:
                for causal in CAUSAL:
                    checked += 1
                    if fails(impl, size, causal, scale, dtype):
                        return {"smallest": size[0], "at": {"batch": size[1], "heads_kv": size[2], "group": size[3],
                                                           "n_q": size[4], "n_k": size[5], "d_head": size[6],
                                                           "causal": causal, "scale": scale, "dtype": dtype},
                                "checked": checked, "seconds": round(time.monotonic() - began, 1)}
    return {"smallest": None, "nothing_fails_below": limit + 1, "checked": checked,
            "seconds": round(time.monotonic() - began, 1)}


def hunt(name: str, seed: int, budget: float, folder: Path) -> dict:
    record = folder / f"{name}-{seed}.json"
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "gradcheck_cli", "hunt", str(folder / "hunt.yaml"), "--select", name,
                          "--seed", str(seed), "--budget", str(budget), "--no-database", "--no-progress",
                          "--json", str(record)], capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - began
    data = json.loads(record.read_text())
    return {"exit": run.returncode, "wall_s": round(wall, 1), "search_s": data["search_s"],
            "shrink_s": data["shrink_s"], "tried": data["tried"],
            "first": data["first"] and data["first"]["elements"],
            "smallest": data["smallest"] and data["smallest"]["elements"],
            "keys": data["smallest"] and {k: v for k, v in data["smallest"]["keys"].items()
                                          if k not in ("name", "implementation")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--budget", type=float, default=120.0)
    parser.add_argument("--brute-seconds", type=float, default=600.0)
    parser.add_argument("--bugs", nargs="+", default=list(BUGS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--brute-only", metavar="BUG", help="only the brute force of BUG (no hunts)")
    parser.add_argument("--no-brute", action="store_true", help="only the hunts")
    parser.add_argument("--brute-range", default="0:0", metavar="FROM:TO", help="input elements FROM..TO")
    parser.add_argument("--part", default="1/1", metavar="I/N", help="every N-th size from the I-th")
    args = parser.parse_args()
    if args.brute_only:
        low, high = map(int, args.brute_range.split(":"))
        i, n = map(int, args.part.split("/"))
        print(json.dumps({"bug": args.brute_only, "from": low, "to": high, "part": args.part,
                          "brute": brute(args.brute_only, high, args.brute_seconds, low, (i, n))}))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for f in ("hunt.yaml", "hunt_edges.py"):
            (folder / f).write_text((ROOT / "examples" / f).read_text())
        for name in args.bugs:
            hunts = [hunt(name, seed, args.budget, folder) for seed in args.seeds]
            largest = max(h["smallest"] or 0 for h in hunts)
            # to the hunts' largest result, or to half of it (enough to decide "within 2x") when that is large
            b = {"smallest": None, "nothing_fails_below": 0} if args.no_brute else brute(
                name, max(largest if largest <= 200 else math.ceil(largest / 2), 1), args.brute_seconds)
            floor = b["smallest"] or b["nothing_fails_below"]
            row = {"bug": name, "hunts": hunts, "brute": b,
                   "within_2x": all(h["smallest"] is not None and h["smallest"] <= 2 * floor for h in hunts),
                   "found_within_budget": all(h["exit"] == 1 and h["search_s"] <= args.budget for h in hunts)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
