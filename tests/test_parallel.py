"""--jobs, --shard, merge and Ctrl-C: the same numbers whatever the split, shards that merge back into
the unsharded report, and an interrupted run that stops promptly and keeps what finished."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from gradcheck_cli import checker, runner, scenario
from gradcheck_cli.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def untimed(report: dict) -> dict:
    """A JSON report without its only timing fields."""
    report = json.loads(json.dumps(report))
    for s in report["scenarios"]:
        s.pop("elapsed_s")
    return report


@pytest.fixture(scope="module")
def sweep_reports(tmp_path_factory):
    """configs/sweep.yaml with negative controls, once with --jobs 1 and once with --jobs 2."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("jobs")
    reports = {}
    for jobs in (1, 2):
        path = out / f"j{jobs}.json"
        result = run("run", os.path.join(root, "configs/sweep.yaml"), "--negative-controls", "--jobs", jobs,
                     "--json", path)
        assert result.exit_code == 0, result.output
        reports[jobs] = json.loads(path.read_text())
    return reports


def test_jobs_give_byte_identical_reports_apart_from_timing(sweep_reports):
    one, two = sweep_reports[1], sweep_reports[2]
    assert json.dumps(untimed(one), sort_keys=True) == json.dumps(untimed(two), sort_keys=True)
    assert [s["index"] for s in one["scenarios"]] == list(range(9))
    assert len(one["negative_controls"]["cells"]) == 9 * 5


def test_shard_split_is_deterministic_and_complete():
    scs = list(range(10))
    shards = [runner.shard(scs, i, 3) for i in (1, 2, 3)]
    assert shards == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(x for s in shards for x in s) == scs
    assert runner.shard(scs[:2], 3, 3) == []


def test_shards_merge_back_into_the_unsharded_report(root, tmp_path, sweep_reports):
    cfg = root / "configs/sweep.yaml"
    paths = []
    for i in (1, 2, 3, 4):
        path = tmp_path / f"s{i}.json"
        result = run("run", cfg, "--negative-controls", "--shard", f"{i}/4", "--json", path)
        assert result.exit_code == 0, result.output
        paths.append(path)
    assert [len(json.loads(p.read_text())["scenarios"]) for p in paths] == [3, 2, 2, 2]
    merged = tmp_path / "merged.json"
    result = run("merge", *reversed(paths), "--json", merged)
    assert result.exit_code == 0, result.output
    data = json.loads(merged.read_text())
    whole = untimed(sweep_reports[1])
    assert data["shard"] is None and data["merged_from"] == [str(p) for p in reversed(paths)]
    data.pop("merged_from")
    assert json.dumps(untimed(data), sort_keys=True) == json.dumps(whole, sort_keys=True)
    assert "9 scenario(s)" in result.output


def test_merge_refuses_incomplete_or_overlapping_shards(root, tmp_path):
    cfg = root / "configs/sweep.yaml"
    for i in (1, 2):
        assert run("run", cfg, "--shard", f"{i}/3", "--select", "causal*",
                   "--json", tmp_path / f"{i}.json").exit_code == 0
    missing = run("merge", tmp_path / "1.json", tmp_path / "2.json")
    assert missing.exit_code == 2 and "shard 3/3" in missing.stderr and "missing" in missing.stderr
    twice = run("merge", tmp_path / "1.json", tmp_path / "1.json")
    assert twice.exit_code == 2 and "twice" in twice.stderr
    (tmp_path / "bad.json").write_text("{not json")
    bad = run("merge", tmp_path / "bad.json")
    assert bad.exit_code == 2 and "bad.json" in bad.stderr and "Traceback" not in bad.output
    (tmp_path / "other.json").write_text(json.dumps({"tool": "something else"}))
    other = run("merge", tmp_path / "other.json")
    assert other.exit_code == 2 and "not an attn-gradcheck JSON report" in other.stderr


def test_merge_verdict_is_the_worst_of_its_parts(root, tmp_path):
    cfg = root / "configs/sweep.yaml"
    assert run("run", cfg, "--select", "masks*", "--json", tmp_path / "ok.json").exit_code == 0
    assert run("run", root / "configs/gqa.yaml", "--fault", "gqa-sum", "--json", tmp_path / "bad.json").exit_code == 1
    result = run("merge", tmp_path / "ok.json", tmp_path / "bad.json", "--json", tmp_path / "m.json")
    assert result.exit_code == 1
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["verdict"] == "fail" and data["config"] is None
    assert [s["config"] for s in data["scenarios"]][:1] == [str(cfg)]
    assert data["summary"]["scenarios"] == 3 + 4


def test_bad_shard_values_are_usage_errors(root):
    for value in ("0/3", "4/3", "x", "1/0", "2"):
        result = run("run", root / "configs/quickstart.yaml", "--shard", value)
        assert result.exit_code == 2 and "I/N" in result.output, value


def test_empty_shard_passes_with_a_note(root, tmp_path):
    result = run("run", root / "configs/quickstart.yaml", "--shard", "5/5", "--json", tmp_path / "r.json")
    assert result.exit_code == 0 and "no scenario falls in this shard" in result.output
    assert json.loads((tmp_path / "r.json").read_text())["scenarios"] == []


def test_interrupt_keeps_what_finished(root, tmp_path, monkeypatch):
    real = checker.run_scenario
    calls = []

    def second_interrupts(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(checker, "run_scenario", second_interrupts)
    result = run("run", root / "configs/quickstart.yaml", "--json", tmp_path / "r.json")
    assert result.exit_code == 130 and "interrupted after 1 of 3" in result.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["interrupted"] is True and [s["name"] for s in data["scenarios"]] == ["causal-self"]
    assert data["passed"] is False and data["verdict"] == "interrupted"  # what did not run did not pass
    assert "INTERRUPTED after 1 of 3 scenario(s)" in result.stdout and "all checks passed" not in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def _lines_until(proc, words: str) -> str:
    """The run's stdout up to the line with ``words`` (all of it, if the run ends first)."""
    seen = []
    while (line := proc.stdout.readline()) and words not in line:
        seen.append(line)
    return "".join(seen) + line


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_sigint_stops_promptly_and_writes_a_partial_report(tmp_path, jobs):
    """A real Ctrl-C (SIGINT to the process group) in the middle of a long run: sent once the first scenario's
    line is out, while the next (seconds of work) runs; that it is missing from the report is the proof the
    run stopped there instead of finishing it."""
    cfg = tmp_path / "slow.yaml"
    cfg.write_text("scenarios:\n"
                   "  - {name: quick, n_q: 4, d_head: 4}\n"
                   "  - {name: slow, n_q: 96, d_head: 48, heads_q: 4, check: {colouring: false}}\n"
                   "  - {name: slower, n_q: 96, d_head: 48, heads_q: 4, check: {colouring: false}}\n")
    report = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(cfg), "--jobs", jobs,
                             "--json", str(report)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        seen = _lines_until(proc, "quick: passed")
        assert "quick: passed" in seen, (seen, proc.stderr.read())
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)  # a guard against a hang, not a measure
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted after 1 of 3" in err
    data = json.loads(report.read_text())
    assert data["interrupted"] is True and [s["name"] for s in data["scenarios"]] == ["quick"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "slow.yaml"]


def test_scenarios_know_their_position_in_the_file():
    scs = scenario.loads("scenarios:\n  - {name: a, n_q: 2, d_head: 2, sweep: {batch: [1, 2]}}\n"
                         "  - {name: b, n_q: 2, d_head: 2}\n")
    assert [(sc.name, sc.index) for sc in scs] == [("a[batch=1]", 0), ("a[batch=2]", 1), ("b", 2)]


def test_merge_refuses_shards_of_different_selections_and_accepts_path_spellings(root, tmp_path, monkeypatch):
    monkeypatch.chdir(root)
    assert run("run", "configs/sweep.yaml", "--shard", "1/2", "--json", tmp_path / "a.json").exit_code == 0
    assert run("run", "configs/sweep.yaml", "--shard", "2/2", "--select", "causal*",
               "--json", tmp_path / "b.json").exit_code == 0
    mixed = run("merge", tmp_path / "a.json", tmp_path / "b.json")
    assert mixed.exit_code == 2 and "selected different scenarios" in mixed.stderr
    assert run("run", "./configs/sweep.yaml", "--shard", "2/2", "--json", tmp_path / "c.json").exit_code == 0
    both = run("merge", tmp_path / "a.json", tmp_path / "c.json", "--junit", tmp_path / "m.xml")
    assert both.exit_code == 0 and "9 scenario(s)" in both.output
    xml = (tmp_path / "m.xml").read_text()
    assert xml.count("<testsuite ") == 9


HANGS = """
import os, sys, time
sys.path.insert(0, {examples!r})
from my_attention import Attention
class Impl(Attention):
    @staticmethod
    def forward(*args):
        open({marker!r}, "w").close()
        while True:
            time.sleep(0.05)
impl = Impl()
"""


@pytest.mark.parametrize("moment", ["at once", "after the first scenario", "inside the implementation"])
@pytest.mark.slow  # three subprocesses, signalled
def test_sigint_at_any_moment_ends_with_130_and_no_traceback(root, tmp_path, moment):
    """Ctrl-C while Python starts (sent at once), between or inside built-in checks (once the first scenario's
    line is out) and inside an implementation's worker (once its forward has written a file, then hangs):
    exit 130, never a hang, no traceback, nothing left behind."""
    marker = tmp_path / "running"
    (tmp_path / "hangs.py").write_text(HANGS.format(examples=str(root / "examples"), marker=str(marker)))
    cfg = tmp_path / "slow.yaml"
    cfg.write_text("scenarios:\n  - {name: quick, n_q: 4, d_head: 4}\n"
                   + ("  - {name: hangs, n_q: 3, d_head: 2, implementation: 'hangs:impl'}\n"
                      if moment == "inside the implementation" else
                      "  - {name: slow, n_q: 128, d_head: 64, heads_q: 4, check: {colouring: false}}\n"))
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(cfg), "--no-progress",
                             "--json", str(tmp_path / "r.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    try:
        if moment != "at once":
            seen = _lines_until(proc, "quick: passed")
            assert "quick: passed" in seen, (seen, proc.stderr.read())
        if moment == "inside the implementation":
            for _ in range(6000):  # polls for the file (at most 10 minutes: never a verdict on time)
                if marker.exists() or proc.poll() is not None:
                    break
                time.sleep(0.1)
            assert marker.exists(), proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)  # a guard against a hang, not a measure
    finally:
        proc.kill()
        proc.wait()
    if moment == "at once":
        if proc.returncode == -signal.SIGINT:  # before Python set its handler: the default action, which a
            return                             # shell reports as 130 too
        if "Fatal Python error: init_import_site" in err:
            return  # the interpreter's own start-up (site.py) took the Ctrl-C, before any of our code ran
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "interrupted" in err
    if moment != "at once":
        assert [s["name"] for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]] == ["quick"]
    leftovers = [p.name for p in tmp_path.iterdir()
                 if p.name not in ("slow.yaml", "r.json", "hangs.py", "running", "__pycache__")]
    assert not leftovers
