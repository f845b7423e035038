"""False alarms of ``attn-gradcheck hunt``: hunts from correct implementations over every op and flavour (NumPy,
torch, JAX; plain attention, its variants, the layers, the built-in engine), one seed each. A finding (exit 1) is
a false alarm; an inconclusive hunt (exit 3) is reported with its reason.

    python benchmarks/hunt/correct.py --budget 20 --json benchmarks/hunt/correct.json
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: (file, scenario): every scenario passes as written.
STARTS = (
    ("examples/attention.yaml", "mine"),
    ("examples/hunt.yaml", "correct"),
    ("examples/torch.yaml", "torch-mine-float64"),
    ("examples/jax_attention.yaml", "jax-causal-gqa"),
    ("configs/quickstart.yaml", "cache-gqa"),
    ("examples/softcap.yaml", "mine-numpy"),
    ("examples/softcap.yaml", "mine-torch"),
    ("examples/sinks.yaml", "mine-torch"),
    ("examples/alibi.yaml", "mine-numpy"),
    ("examples/bias.yaml", "mine-numpy"),
    ("examples/lse.yaml", "mine-numpy"),
    ("examples/dropout.yaml", "mine-numpy"),
    ("examples/varlen.yaml", "mine-numpy"),
    ("examples/relative_bias.yaml", "mine-numpy"),
    ("examples/rmsnorm.yaml", "my-rmsnorm"),
    ("examples/layernorm.yaml", "my-layernorm"),
    ("examples/torch_ops.yaml", "torch-swiglu"),
    ("examples/rope.yaml", "my-rope"),
    ("examples/infonce.yaml", "my-infonce"),
    ("examples/torch_ops.yaml", "torch-attention-projections"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in ("examples", "configs"):
            shutil.copytree(ROOT / folder, Path(tmp) / folder)
        for seed, (config, name) in enumerate(STARTS):
            record = Path(tmp) / f"{seed}.json"
            run = subprocess.run([sys.executable, "-m", "gradcheck_cli", "hunt", config, "--select", name, "--seed",
                                  str(seed), "--budget", str(args.budget), "--shrink-budget", "30", "--no-database",
                                  "--no-progress", "--json", str(record)], capture_output=True, text=True, cwd=tmp)
            data = json.loads(record.read_text()) if record.exists() else {}
            row = {"config": config, "scenario": name, "seed": seed, "exit": run.returncode,
                   "tried": data.get("tried"), "skipped": data.get("skipped"), "inconclusive": data.get("inconclusive"),
                   "inconclusive_float32": data.get("inconclusive_float32"),
                   "smallest": data.get("smallest"),
                   "error": run.stderr.strip()[-300:] if run.returncode == 2 else None}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "smallest"}), flush=True)
    false = [r for r in rows if r["exit"] == 1]
    print(f"{len(rows)} hunts, {sum(r['tried'] or 0 for r in rows)} scenarios checked: {len(false)} false finding(s); "
          f"exit codes {sorted(r['exit'] for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
