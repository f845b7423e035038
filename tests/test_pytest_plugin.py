"""Scenario files collected by pytest through the shipped plugin, and reports that do not change."""
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gradcheck_cli.cli import main


@pytest.mark.slow  # a pytest subprocess: ~3 s
def test_gradcheck_yaml_files_become_test_items(tmp_path, root):
    (tmp_path / "attn.gradcheck.yaml").write_text(
        "scenarios:\n"
        "  - {name: good, n_q: 4, d_head: 4, mask: {causal: lower-right}}\n"
        "  - {name: peaked, n_q: 4, d_head: 4, scale: 2.0, sweep: {batch: [1, 2]}}\n")
    (tmp_path / "broken.gradcheck.yaml").write_text(
        "scenarios:\n"
        "  - {name: gqa-overwrite, implementation: 'broken_attention:gqa_overwrite', heads_q: 4, heads_kv: 2,"
        " n_q: 4, d_head: 4}\n")
    (tmp_path / "broken_attention.py").write_text((root / "examples/broken_attention.py").read_text())
    (tmp_path / "my_attention.py").write_text((root / "examples/my_attention.py").read_text())
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    out = done.stdout
    assert "1 failed, 3 passed" in out, out
    assert "gradient v" in out and "reproduce: attn-gradcheck run" in out and "--select gqa-overwrite" in out
    # the same diagnosis as the command line: where, heat map, and the cause
    assert "where: " in out and "heat map, KV head x key row" in out
    assert "hint: errors only in K/V gradients of KV heads shared by several query heads" in out
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             str(tmp_path / "attn.gradcheck.yaml")], capture_output=True, text=True, cwd=tmp_path)
    assert "attn.gradcheck.yaml::peaked[batch=2]" in listed.stdout, listed.stdout


def _suite(folder, root):
    """A folder with a passing, a failing and an inconclusive scenario file (the last: an implementation that
    computes in float32 inside a float64 scenario, exit code 3 on the command line)."""
    (folder / "attn.gradcheck.yaml").write_text(
        "scenarios:\n"
        "  - {name: good, n_q: 4, d_head: 4, mask: {causal: lower-right}}\n"
        "  - {name: tangent, n_q: 4, d_head: 4, dtype: float32, check: {mode: jvp}}\n")
    (folder / "broken.gradcheck.yaml").write_text(
        "scenarios:\n  - {name: overwrite, heads_q: 4, heads_kv: 2, n_q: 4, d_head: 4,"
        " implementation: 'broken_attention:gqa_overwrite'}\n")
    (folder / "lower.gradcheck.yaml").write_text(
        "scenarios:\n  - {name: float32-inside, n_q: 4, d_head: 4, implementation: 'correct_impls:float32_inside'}\n")
    for name in ("examples/broken_attention.py", "examples/my_attention.py", "benchmarks/correct_impls.py"):
        (folder / name.split("/")[1]).write_text((root / name).read_text())


def _run(pytester, *args):
    """pytest in this process (the plugin is already imported): (exit code, outcome counts, output)."""
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
    out = result.stdout.str() + result.stderr.str()
    return int(result.ret), (result.parseoutcomes() if int(result.ret) in (0, 1) else {}), out


def test_inconclusive_scenarios_fail_by_default_and_map_to_skip_or_xfail_on_request(pytester, root):
    _suite(pytester.path, root)
    code, counts, out = _run(pytester)
    assert code == 1 and (counts["failed"], counts["passed"]) == (2, 2), out
    assert "INCONCLUSIVE" in out and "computes in about float32" in out
    code, counts, out = _run(pytester, "--gradcheck-inconclusive=xfail")
    assert code == 1 and (counts["failed"], counts["passed"], counts["xfailed"]) == (1, 2, 1), out
    code, counts, out = _run(pytester, "-o", "gradcheck_inconclusive=skip", "-rs")
    assert (counts["failed"], counts["passed"], counts["skipped"]) == (1, 2, 1), out
    assert "inconclusive: gradient q, gradient k" in out
    code, _, out = _run(pytester, "-o", "gradcheck_inconclusive=maybe")
    assert code == 4 and "expected one of fail, skip, xfail" in out, out


def test_items_are_selected_by_name_or_keyword(pytester, root):
    _suite(pytester.path, root)
    code, counts, out = _run(pytester, "-k", "jvp and float32")  # the op, mode, dtype and engine are keywords
    assert code == 0 and (counts["passed"], counts["deselected"]) == (1, 3), out
    code, counts, out = _run(pytester, "-k", "overwrite")  # and the scenario's name
    assert code == 1 and (counts["failed"], counts["deselected"]) == (1, 3), out


@pytest.mark.slow  # a pytest subprocess with two xdist workers: ~4 s
def test_items_spread_over_xdist_workers(tmp_path, root):
    pytest.importorskip("xdist")
    _suite(tmp_path, root)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "-v", "-k",
                           "not overwrite", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    out = done.stdout + done.stderr
    # the items ran in the workers, each collecting the files itself
    assert "2 workers [3 items]" in out and "[gw" in out and "1 failed, 2 passed" in out, out


def test_reports_are_byte_identical_across_runs_apart_from_timing(root, tmp_path):
    paths = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        CliRunner().invoke(main, ["run", str(root / "configs/gqa.yaml"), "--fault", "gqa-sum", "--json", str(path)])
        report = json.loads(path.read_text())
        for s in report["scenarios"]:
            s.pop("elapsed_s")
        paths.append(json.dumps(report, sort_keys=True))
    assert paths[0] == paths[1]
