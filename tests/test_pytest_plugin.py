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
