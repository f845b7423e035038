"""The command line and its reports, through click's runner with stderr kept separate."""
import json
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner

from gradcheck_cli.ops.attention import ENGINE_FAULTS
from gradcheck_cli.cli import main
from gradcheck_cli.ops import FAULTS, OPS
from helpers import CONFIGS
from reference import attention_loops


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_quickstart_passes_and_softmax_fault_fails(root):
    ok = run("run", root / "configs/quickstart.yaml")
    assert ok.exit_code == 0, ok.output
    assert "all checks passed" in ok.stdout
    bad = run("run", root / "configs/quickstart.yaml", "--break-softmax-term")
    assert bad.exit_code == 1
    assert "FAIL gradient q" in bad.stdout and "worst at q[" in bad.stdout


def test_mask_fault_passes_gradients_but_fails_invariants(root):
    result = run("run", root / "configs/seed-causal-first-row.yaml", "--fault", "mask", "--json", "/dev/null")
    assert result.exit_code == 1
    lines = [l for l in result.stdout.splitlines() if l.startswith("gradient ")]
    assert lines and all(l.rstrip().endswith("pass") for l in lines)
    assert "FAIL unseen K/V rows get zero gradient" in result.stdout


def test_plain_output_without_a_terminal(root):
    result = run("run", root / "configs/quickstart.yaml", env={"NO_COLOR": "1"})
    assert "\x1b[" not in result.stdout


def test_faults_command_lists_every_fault():
    result = run("faults")
    assert result.exit_code == 0
    for name, fault in FAULTS.items():
        assert name in result.stdout and fault.caught_by[0] in result.stdout


@pytest.mark.parametrize("args", [[], ["run"], ["faults"], ["validate"], ["merge"], ["schema"], ["sweep-eps"]])
def test_help_everywhere(args):
    result = run(*args, "--help")
    assert result.exit_code == 0 and "Usage:" in result.stdout


def test_unknown_fault_is_a_usage_error(root):
    result = run("run", root / "configs/quickstart.yaml", "--fault", "nonsense")
    assert result.exit_code == 2 and "nonsense" in result.stderr


def test_fault_and_negative_controls_do_not_mix(root):
    result = run("run", root / "configs/quickstart.yaml", "--fault", "mask", "--negative-controls")
    assert result.exit_code == 2


def test_report_folders_are_created(root, tmp_path):
    result = run("run", root / "configs/quickstart.yaml", "--json", tmp_path / "a" / "r.json",
                 "--junit", tmp_path / "b" / "r.xml", "--save-arrays", tmp_path / "c" / "d")
    assert result.exit_code == 0
    assert (tmp_path / "a" / "r.json").is_file() and (tmp_path / "b" / "r.xml").is_file()
    assert len(list((tmp_path / "c" / "d").glob("*.npz"))) == 3
    mode = (tmp_path / "a" / "r.json").stat().st_mode & 0o777
    assert mode & 0o044 == 0o044  # readable by group and others, like any CI artifact (not mkstemp's 0600)


@pytest.mark.parametrize("args,words", [
    (["--json", "/proc/no/r.json"], "cannot write there"),
    (["--json", "{t}/same", "--junit", "{t}/same"], "would overwrite"),
    (["--json", "{t}/a/causal-self.npz", "--save-arrays", "{t}/a"], "would overwrite"),
    (["--json", "{root}/configs/quickstart.yaml"], "would overwrite the input"),
    (["--json", "{t}"], "is a folder"),
])
def test_unwritable_or_clashing_reports_fail_before_running(root, tmp_path, args, words):
    args = [a.format(t=tmp_path, root=root) for a in args]
    result = run("run", root / "configs/quickstart.yaml", *args)
    assert result.exit_code == 2 and words in result.stderr and result.stdout == ""


def test_a_report_that_cannot_be_written_leaves_none(root, tmp_path, monkeypatch):
    """The third rename fails at the end of the run (a full or vanished disk): none is written."""
    from gradcheck_cli.report import outputs
    calls, real = {"n": 0}, os.replace

    def replace(a, b):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(outputs.os, "replace", replace)
    result = run("run", root / "configs/quickstart.yaml", "--json", tmp_path / "r.json", "--save-arrays", tmp_path / "arrays")
    assert result.exit_code == 2 and "cannot write the reports" in result.stderr and "none written" in result.stderr
    assert not (tmp_path / "r.json").exists()
    assert list((tmp_path / "arrays").iterdir()) == []


def test_plain_output_ignores_a_narrow_columns_setting(root):
    result = run("run", root / "configs/quickstart.yaml", "--break-softmax-term", env={"COLUMNS": "40"})
    lines = result.stdout.splitlines()
    assert all(line == line.rstrip() for line in lines)
    row = next(line for line in lines if line.startswith("gradient q"))
    assert row.split()[-1] == "FAIL" and "e+00" in row and "\u2026" not in result.stdout


def test_json_report_contract(root, tmp_path):
    path = tmp_path / "r.json"
    result = run("run", root / "configs/quickstart.yaml", "--fault", "scale", "--json", path)
    assert result.exit_code == 1
    report = json.loads(path.read_text())
    assert set(report) == {"tool", "version", "schema_version", "config", "faults", "passed", "verdict",
                           "summary", "scenarios", "negative_controls", "shard", "interrupted", "engine", "run_id"}
    assert report["tool"] == "attn-gradcheck" and report["faults"] == ["scale"] and report["passed"] is False
    assert set(report["summary"]) == {"scenarios", "checks", "passed", "failed", "inconclusive"}
    s = report["scenarios"][0]
    assert set(s) == {"name", "op", "dtype", "epsilon", "tolerance", "mode", "faults", "passed", "verdict",
                      "elapsed_s", "checks", "hints", "reproduce", "index", "config", "engine", "detectable"}
    c = s["checks"][0]
    assert set(c) == {"kind", "name", "tensor", "shape", "max_abs_error", "relative_error", "tolerance",
                      "noise_floor", "worst_index", "passed", "verdict", "fd_error", "detail", "diagnosis",
                      "detectable"}
    assert report["schema_version"] == 2
    assert c["kind"] == "gradient" and c["tensor"] == "q" and c["passed"] is False
    assert report["summary"]["failed"] == sum(not c["passed"] for s in report["scenarios"] for c in s["checks"])
    assert list(tmp_path.iterdir()) == [path]  # no temp files left behind


def test_negative_controls_json_and_junit(root, tmp_path):
    result = run("run", root / "configs/gqa.yaml", "--negative-controls", "--json", tmp_path / "r.json",
                 "--junit", tmp_path / "r.xml")
    assert result.exit_code == 0, result.stdout
    assert "negative controls" in result.stdout
    nc = json.loads((tmp_path / "r.json").read_text())["negative_controls"]
    assert nc["passed"] is True
    names = ("gqa-4x2", "mqa", "gqa-interleaved", "gqa-plain-differences")
    assert {(c["fault"], c["scenario"]) for c in nc["cells"]} == {(f, s) for f in ENGINE_FAULTS for s in names}
    assert {c["status"] for c in nc["cells"]} <= {"detected", "not applicable"}
    root_el = ET.parse(tmp_path / "r.xml").getroot()
    suites = {s.get("name"): s for s in root_el.iter("testsuite")}
    assert set(suites) == set(names) | {"negative-controls"}
    assert suites["gqa-4x2"].get("failures") == "0" and int(suites["gqa-4x2"].get("tests")) == 16  # 3 gradient checks, 3 independence checks, the fast forward, 9 invariants


def test_negative_controls_exit_1_when_a_fault_is_missed(tmp_path):
    cfg = tmp_path / "weak.yaml"
    cfg.write_text("scenarios: [{name: weak, n_q: 8, d_head: 8, scale: 0.8, dtype: float32, epsilon: 1.0e-6}]\n")
    result = run("run", cfg, "--negative-controls")
    assert result.exit_code == 1
    assert "MISSED scale on weak" in result.stdout


def test_junit_failure_carries_the_worst_element(root, tmp_path):
    run("run", root / "configs/quickstart.yaml", "--break-softmax-term", "--junit", tmp_path / "r.xml")
    failures = list(ET.parse(tmp_path / "r.xml").getroot().iter("failure"))
    assert failures and any("worst at q[" in (f.text or "") for f in failures)


def test_saved_arrays_recompute_independently(root, tmp_path):
    result = run("run", root / "configs/gqa.yaml", "--save-arrays", tmp_path / "arrays")
    assert result.exit_code == 0
    data = np.load(tmp_path / "arrays" / "gqa-4x2.npz")
    assert set(data.files) >= {"q", "k", "v", "visible", "grad_output", "scale", "kv_map", "output",
                               "analytic_q", "analytic_k", "analytic_v", "numeric_q", "numeric_k", "numeric_v"}
    assert data["visible"].dtype == bool and data["visible"].shape == (2, 4, 6, 6)
    o, gq, gk, gv = attention_loops(data["q"], data["k"], data["v"], data["visible"], float(data["scale"]),
                                    data["kv_map"], data["grad_output"])
    np.testing.assert_allclose(data["output"], o, rtol=1e-12, atol=1e-13)
    for name, ref in (("q", gq), ("k", gk), ("v", gv)):
        np.testing.assert_allclose(data[f"analytic_{name}"], ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(data[f"numeric_{name}"], ref, rtol=1e-6, atol=1e-8)


def test_validate_runs_nothing(root):
    result = run("validate", root / "configs/gqa.yaml")
    assert result.exit_code == 0 and "4 scenario(s) valid" in result.stdout


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and "attn-gradcheck" in result.stdout


def test_out_of_memory_is_exit_2_without_a_traceback(root, monkeypatch):
    from gradcheck_cli import checker

    def exhausted(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(checker, "run_scenario", exhausted)
    result = run("run", root / "configs/quickstart.yaml")
    assert result.exit_code == 2 and "ran out of memory" in result.stderr and "Traceback" not in result.stderr


def test_select_deselect_and_the_reproduce_line(root, tmp_path):
    config = str(root / "configs/quickstart.yaml")
    result = run("run", config, "--select", "c*", "--deselect", "cross-*", "--fault", "scale", "--json", tmp_path / "r.json")
    names = [s["name"] for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]]
    assert names == ["causal-self", "cache-gqa"] and result.exit_code == 1
    line = next(l for l in result.stdout.splitlines() if "reproduce:" in l and "cache-gqa" in l)
    again = run(*line.split("reproduce: attn-gradcheck ")[1].split())  # the line runs just that scenario
    assert again.exit_code == 1 and "1 scenario(s)" in again.stdout and "cache-gqa" in again.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["scenarios"][1]["reproduce"].endswith("--select cache-gqa --fault scale")
    none = run("run", config, "--select", "nothing*")
    assert none.exit_code == 2 and "no scenario is left by --select" in none.stderr


def test_validate_takes_several_files_and_reports_each_bad_one(root, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scenarios: [{name: a, n_q: 0, d_head: 2}]\n")
    result = run("validate", root / "configs/gqa.yaml", bad, root / "configs/quickstart.yaml")
    assert result.exit_code == 2 and "4 scenario(s) valid" in result.stdout and "3 scenario(s) valid" in result.stdout
    assert "bad.yaml:1" in result.stderr


def test_pre_commit_hooks_are_well_formed(root):
    import yaml
    hooks = yaml.safe_load((root / ".pre-commit-hooks.yaml").read_text())
    assert {h["id"] for h in hooks} == {"attn-gradcheck-validate", "attn-gradcheck-run"}
    assert all(h["entry"].split()[0] == "attn-gradcheck" and h["language"] == "python" for h in hooks)


def test_report_paths_that_clash_with_a_folder_are_refused_before_running(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    same = run("run", root / "configs/quickstart.yaml", "--json", "r.json", "--save-arrays", "r.json")
    assert same.exit_code == 2 and "--save-arrays folder" in same.stderr and "causal-self" not in same.stdout
    assert not (tmp_path / "r.json").exists()
    folder = run("run", root / "configs/quickstart.yaml", "--json", "outdir/")
    assert folder.exit_code == 2 and "names a folder" in folder.stderr and not (tmp_path / "outdir").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_writes_its_reports(path, tmp_path):
    """Every shipped config runs through the whole CLI with every report (JSON that parses, JUnit, arrays)."""
    if "backend: torch" in path.read_text():
        pytest.importorskip("torch")
    result = run("run", path, "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml",
                 "--save-arrays", tmp_path / "arrays")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "pass" and data["summary"]["failed"] == 0
    ET.fromstring((tmp_path / "r.xml").read_bytes())
    assert len(list((tmp_path / "arrays").glob("*.npz"))) == len(data["scenarios"])


def test_a_reader_that_goes_away_ends_with_141_not_1(root):
    """`attn-gradcheck run ... | head -1`: 1 would read as "a check failed"; 141 is 128 + SIGPIPE."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(root / "configs/sweep.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err
