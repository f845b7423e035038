"""The reports a run writes (report/formats.py): the JSON contract, JUnit, negative controls in both, and the
saved arrays, through the command line."""
import json
import xml.etree.ElementTree as ET

import numpy as np
from click.testing import CliRunner

from gradcheck_cli.cli import main
from gradcheck_cli.ops.attention import ENGINE_FAULTS

from reference import attention_loops


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_json_report_contract(root, tmp_path):
    path = tmp_path / "r.json"
    result = run("run", root / "configs/quickstart.yaml", "--fault", "scale", "--json", path)
    assert result.exit_code == 1
    report = json.loads(path.read_text())
    assert set(report) == {"tool", "version", "schema_version", "config", "faults", "passed", "verdict",
                           "summary", "scenarios", "negative_controls", "shard", "interrupted", "engine", "run_id"}
    assert report["tool"] == "attn-gradcheck" and report["faults"] == ["scale"] and report["passed"] is False
    assert set(report["summary"]) == {"scenarios", "checks", "passed", "failed", "inconclusive", "not_applicable"}
    s = report["scenarios"][0]
    assert set(s) == {"name", "op", "dtype", "epsilon", "tolerance", "mode", "faults", "passed", "verdict",
                      "elapsed_s", "checks", "hints", "reproduce", "index", "config", "engine", "detectable"}
    c = s["checks"][0]
    assert set(c) == {"kind", "name", "tensor", "shape", "max_abs_error", "relative_error", "tolerance",
                      "noise_floor", "worst_index", "passed", "verdict", "fd_error", "detail", "diagnosis",
                      "detectable"}
    assert report["schema_version"] == 3
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
    # 3 gradient checks, 3 independence checks, the fast forward, 11 invariants
    assert suites["gqa-4x2"].get("failures") == "0" and int(suites["gqa-4x2"].get("tests")) == 18


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
