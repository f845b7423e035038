"""The GPU check (run by benchmarks/gpu_check.sh): the torch backend on ``device: cuda`` in float32, float16 and
bfloat16 (SDPA's flash, memory-efficient and math kernels as user code, and the tool's own torch engine), a broken
kernel that must fail, a directional check of the tool's torch engine at training scale (B=1, Hq=32, Hkv=8,
n=8192, d=128), and the built-in
context-parallel ring on NCCL when there are several GPUs. One summary table: scenario, expected and actual
verdict, time, peak GPU memory (the device's, all processes, sampled by nvidia-smi).

``--dry-run`` runs every step on ``device: cpu`` at small sizes (the ring on gloo), so the script is tested where
there is no GPU. Exit 0 when every verdict is the expected one, 1 otherwise, 2 when CUDA is wanted and missing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from gradcheck_cli import api  # noqa: E402
from gradcheck_cli.errors import GradcheckError  # noqa: E402

#: The training-scale directional check, and its dry-run size.
TRAINING = {"batch": 1, "heads_q": 32, "heads_kv": 8, "n_q": 8192, "d_head": 128}
TRAINING_DRY = {"batch": 1, "heads_q": 4, "heads_kv": 2, "n_q": 64, "d_head": 16}


def scenarios(device: str, dry: bool, gpus: int) -> list[tuple[dict, str]]:
    """(scenario keys, expected verdict) of every step."""
    small = {"batch": 2, "heads_q": 4, "heads_kv": 2, "n_q": 16, "d_head": 16, "mask": {"causal": "lower-right"},
             "backend": "torch", "device": device}
    out = []
    for dtype in ("float32", "float16", "bfloat16"):
        for kernel in ("flash", "efficient", "math"):
            out.append(({**small, "name": f"sdpa-{kernel}-{dtype}", "dtype": dtype,
                         "implementation": f"kernels:{kernel}"}, "pass"))
        out.append(({**small, "name": f"broken-unscaled-{dtype}", "dtype": dtype,
                     "implementation": "kernels:broken_unscaled"}, "fail"))
    out.append(({**small, "name": "engine-torch-float64", "dtype": "float64"}, "pass"))
    out.append(({**small, "name": "engine-torch-float32", "dtype": "float32"}, "pass"))
    scale = TRAINING_DRY if dry else TRAINING
    out.append(({**scale, "name": "training-scale-directional", "backend": "torch", "device": device,
                 "dtype": "float32", "mask": {"causal": "lower-right"},
                 "check": {"mode": "directional", "directions": 4}}, "pass"))
    if dry or gpus >= 2:
        world = 2 if dry else min(gpus, 4)
        ring = {"batch": 1, "heads_q": 4, "heads_kv": 2, "n_q": 12 * world, "d_head": 8,
                "mask": {"causal": "lower-right"}, "device": device}
        for sharding in ("contiguous", "zigzag"):
            out.append(({**ring, "name": f"context-parallel-{sharding}-{world}",
                         "distributed": {"world_size": world, "sharding": sharding,
                                         "backend": "gloo" if dry else "nccl"}}, "pass"))
    return out


class PeakMemory:
    """The device's used memory, all processes, sampled by nvidia-smi every 0.2 s while a step runs (MiB)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.peak, self.stop = 0, threading.Event()

    def _sample(self) -> None:
        while not self.stop.is_set():
            try:
                used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=5).stdout.split()
                self.peak = max([self.peak, *(int(u) for u in used if u.isdigit())])
            except (OSError, subprocess.SubprocessError):
                return
            self.stop.wait(0.2)

    def __enter__(self) -> PeakMemory:
        if self.enabled:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.enabled:
            self.thread.join()

    def text(self) -> str:
        return f"{self.peak} MiB" if self.enabled else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every step on device: cpu at small sizes")
    parser.add_argument("--out", type=Path, help="also write the summary table here")
    args = parser.parse_args()
    import torch
    gpus = torch.cuda.device_count() if not args.dry_run else 0
    if not args.dry_run and gpus == 0:
        print("error: no CUDA device is visible to torch (torch.cuda.device_count() is 0); run with --dry-run on a "
              "machine without a GPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    steps = scenarios(device, args.dry_run, gpus)
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(Path(__file__).with_name("kernels.py"), Path(tmp) / "kernels.py")
        config = Path(tmp) / "gpu.yaml"
        config.write_text(yaml.safe_dump({"scenarios": [keys for keys, _ in steps]}, sort_keys=False))
        os.environ["GPU_CHECK_DRY"] = "1" if args.dry_run else "0"
        for keys, expected in steps:
            began = time.monotonic()
            with PeakMemory(not args.dry_run) as memory:
                try:
                    verdict = api.run(api.RunOptions(str(config), selects=(keys["name"],))).report["verdict"]
                except GradcheckError as exc:  # refused (a key this torch or device lacks): said, and counted
                    verdict = "error"
                    print(f"{keys['name']}: {exc}", file=sys.stderr)
            ok &= verdict == expected
            rows.append((keys["name"], expected, verdict, f"{time.monotonic() - began:.1f} s", memory.text()))
            print(f"{rows[-1][0]}: {verdict} (expected {expected}) in {rows[-1][3]}", flush=True)
    device_name = "dry run on the CPU" if args.dry_run else torch.cuda.get_device_name(0) + f" x{gpus}"
    header = ("scenario", "expected", "verdict", "time", "peak GPU memory")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    table = [f"# benchmarks/gpu_check.sh{' --dry-run' if args.dry_run else ''}: {device_name}, torch "
             f"{torch.__version__}"]
    table += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    table.append(f"{sum(r[1] == r[2] for r in rows)} of {len(rows)} as expected")
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
