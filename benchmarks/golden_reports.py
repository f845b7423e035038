"""Every shipped config's JSON report, with what varies from run to run (times, run ids, paths) taken out: the
evidence that a refactoring changed no behaviour ("every shipped config's JSON report the same before and after").

    python benchmarks/golden_reports.py write DIR [--controls] [-j N]   # run them all, one canonical JSON each
    python benchmarks/golden_reports.py compare OLD NEW                 # every difference, by config and key path

``write`` runs ``attn-gradcheck run`` on configs/**/*.yaml, examples/*.yaml and examples/recipes/*.yaml (a recipe
whose library is absent is recorded with its exit code and message), on the naive engine and on the tiled one for
configs/, and with ``--controls`` also ``--negative-controls``. Exit codes are part of the record. ``compare`` prints
the differences and exits 1 where there are any (exit 0: the same reports, to the bit)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Keys whose values change between two runs of the same code (times, ids, where the files are).
VOLATILE = {"elapsed_s", "compile_s", "run_id", "reproduce", "config", "path", "started", "finished"}


def canonical(value):
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in sorted(value.items()) if k not in VOLATILE}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def jobs(controls: bool) -> list[tuple[str, list[str]]]:
    configs = sorted(p for p in (ROOT / "configs").rglob("*.yaml"))
    examples = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
    out = []
    for path in configs + examples:
        rel = str(path.relative_to(ROOT))
        out.append((rel.replace("/", "__"), [rel]))
        if path in configs:
            out.append((rel.replace("/", "__") + "@tiled", [rel, "--engine", "tiled"]))
        if controls:
            out.append((rel.replace("/", "__") + "@controls", [rel, "--negative-controls"]))
    return out


def run_one(name: str, args: list[str], out: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "r.json"
        proc = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", *args, "--json", str(report),
                               "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "NO_COLOR": "1"})
        record = {"exit": proc.returncode}
        if report.exists():
            record["report"] = canonical(json.loads(report.read_text()))
        else:
            record["stderr"] = proc.stderr.strip().splitlines()[-1:] if proc.stderr else []
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    return f"{name}: exit {proc.returncode}"


def differences(old, new, path="") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            if k not in old or k not in new:
                out.append(f"{path}.{k}: {'only in new' if k not in old else 'only in old'}")
            else:
                out += differences(old[k], new[k], f"{path}.{k}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: {len(old)} items -> {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    w.add_argument("--controls", action="store_true")
    w.add_argument("-j", "--jobs", type=int, default=2)
    w.add_argument("--only", nargs="*", help="substrings of the job names to run")
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    a = parser.parse_args(argv)
    if a.command == "write":
        a.dir.mkdir(parents=True, exist_ok=True)
        todo = [j for j in jobs(a.controls) if not a.only or any(s in j[0] for s in a.only)]
        with ThreadPoolExecutor(a.jobs) as pool:
            for line in pool.map(lambda j: run_one(*j, a.dir), todo):
                print(line, flush=True)
        return 0
    names = sorted({p.name for p in a.old.glob("*.json")} | {p.name for p in a.new.glob("*.json")})
    found = 0
    for name in names:
        if not (a.old / name).exists() or not (a.new / name).exists():
            print(f"{name}: only in {'new' if not (a.old / name).exists() else 'old'}")
            found += 1
            continue
        diffs = differences(json.loads((a.old / name).read_text()), json.loads((a.new / name).read_text()))
        for d in diffs[:20]:
            print(f"{name}{d}")
        if len(diffs) > 20:
            print(f"{name}: ... {len(diffs) - 20} more")
        found += bool(diffs)
    print(f"{len(names)} reports, {found} differ")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
