"""Diagnosis of failures: breakdowns count the right elements, and each cause hint fires on its own
fault (and on nothing else, and never on a passing run)."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from gradcheck_cli import checker, diagnose, indices
from gradcheck_cli.cli import main
from gradcheck_cli.ops import OPS
from gradcheck_cli.ops.attention import ENGINE_FAULTS
from gradcheck_cli.ops.registry import Structure

from helpers import make, with_examples

#: A phrase that only the hint of each fault contains.
HINT_OF = {
    "softmax-term": "row-sum term",
    "mask": "the forward lets hidden keys reach O",
    "mask-backward": "the backward ignores or misapplies the visible set",
    "scale": "scale factor in the backward",
    "gqa-sum": "GQA reduction",
}

SCENARIOS = {
    "causal-gqa": dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=7, d_head=4, mask={"causal": "lower-right"}),
    "padded-cross": dict(batch=2, heads_q=2, heads_kv=1, n_q=4, n_k=6, d_head=3, d_value=2,
                         mask={"key_lengths": [6, 4]}),
    "window": dict(heads_q=2, n_q=9, n_k=9, d_head=4, mask={"causal": "lower-right", "window": [2, 0]}),
}


def test_every_fault_has_a_hint():
    assert set(HINT_OF) == set(ENGINE_FAULTS)


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("fault", [None, *ENGINE_FAULTS])
def test_hint_names_the_fault_and_only_it(name, fault):
    sc = make(**SCENARIOS[name])
    result = checker.run_scenario(sc, (fault,) if fault else ())
    text = " | ".join(result.hints)
    if fault is None or not checker.fault_applies(sc, fault):
        assert result.passed and result.hints == ()
        return
    assert not result.passed
    assert HINT_OF[fault] in text, text
    for other, phrase in HINT_OF.items():
        if other != fault:
            assert phrase not in text, (other, text)


def test_scale_hint_says_the_factor_is_one_over_scale():
    sc = make(n_q=4, n_k=4, d_head=9)  # scale 1/3
    hint = checker.run_scenario(sc, ("scale",)).hints[0]
    assert "both 3 x" in hint and "1/scale (3)" in hint


def _full_evidence(sc, fault, tensor):
    res = checker.run_scenario(sc, (fault,))
    analytic, numeric = res.arrays[f"analytic_{tensor}"], res.arrays[f"numeric_{tensor}"]
    return res, diagnose.Evidence(analytic.astype(float), numeric, np.full(analytic.shape, 1e-6))


def test_softmax_hint_from_the_k_gradients_alone():
    """A user implementation has no G_S invariant: the hint then comes from sum_j G_K[j] != 0."""
    sc = make(heads_q=2, n_q=5, n_k=6, d_head=4, mask={"causal": "lower-right"})
    res, ev = _full_evidence(sc, "softmax-term", "k")
    problem = OPS["attention"].problem(sc, ("softmax-term",))
    without = [c for c in res.checks if c.name != "score-gradient rows sum to 0"]
    hints = problem.hints({"k": ev}, without)
    assert any("does not sum to 0 over the keys" in h for h in hints), hints
    # and the clean engine's K gradients do sum to zero, so the hint stays quiet
    res, ev = _full_evidence(sc, "gqa-sum", "k")  # not applicable here: a clean run
    assert problem.hints({"k": ev}, list(res.checks)) == []


def test_mask_backward_breakdown_counts_rows():
    """Query rows that see every key are exactly right under mask-backward; all others are wrong."""
    sc = make(**SCENARIOS["causal-gqa"])
    res = checker.run_scenario(sc, ("mask-backward",))
    q = next(c for c in res.checks if c.name == "gradient q")
    classes = {c["label"]: c for c in q.diagnosis["classes"]}
    full, hidden = classes["query rows that see every key"], classes["query rows with hidden keys"]
    # lower-right with n_q=5, n_k=7: only the last query row sees every key
    assert full["checked"] == 2 * 4 * 1 * 4 and full["out_of_tolerance"] == 0
    assert hidden["checked"] == 2 * 4 * 4 * 4 and hidden["out_of_tolerance"] == q.diagnosis["out_of_tolerance"] > 0
    assert q.diagnosis["axes"]["query row"]["out_of_tolerance"][-1] == 0
    heat = q.diagnosis["heat"]
    assert heat["rows"] == "query head" and len(heat["levels"]) == 4 and all(row[-1] == 0 for row in heat["levels"])


def test_breakdown_of_a_known_error_pattern():
    shape = (2, 3, 4, 2)
    analytic = np.zeros(shape)
    numeric = np.zeros(shape)
    analytic[1, 2, 3, 0] = 5.0      # 5000x what is allowed -> heat digit 4
    analytic[0, 1, 0, 1] = 0.05     # 50x -> digit 2
    allowed = np.full(shape, 1e-3)
    ev = diagnose.Evidence(analytic, numeric, allowed)
    rows = np.zeros((2, 3, 4), dtype=bool)
    rows[..., 0] = True
    d = diagnose.breakdown("x", ev, Structure(("b", "h", "r", "c"), {"first rows": rows}, ("h", "r")))
    assert d["checked"] == 48 and d["out_of_tolerance"] == 2
    assert d["axes"]["b"]["out_of_tolerance"] == [1, 1]
    assert d["axes"]["h"]["max_abs_error"] == [0.0, 0.05, 5.0]
    assert d["axes"]["c"]["out_of_tolerance"] == [1, 1]  # the last axis too (the report says it when part is wrong)
    assert d["classes"] == [{"label": "first rows", "checked": 12, "out_of_tolerance": 1, "max_abs_error": 0.05}]
    assert d["heat"]["levels"] == [[0, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 4]]
    assert [w["index"] for w in d["worst"]] == [[1, 2, 3, 0], [0, 1, 0, 1]]
    assert d["worst"][0]["analytic"] == 5.0 and d["worst"][0]["numeric"] == 0.0


def test_breakdown_in_sample_mode_marks_unchecked_cells():
    analytic = np.ones((1, 1, 3, 2))
    ev = diagnose.Evidence.from_sites(analytic, np.array([0, 1]), np.array([0.5, 1.0]), np.array([1e-3, 1e-3]))
    d = diagnose.breakdown("x", ev, Structure(("b", "h", "r", "c"), {}, ("h", "r")))
    assert d["checked"] == 2 and d["out_of_tolerance"] == 1
    assert d["heat"]["levels"] == [[3, -1, -1]]


def test_heat_map_bins_long_axes():
    n = diagnose.HEAT_MAX * 2 + 1
    analytic = np.zeros((1, 1, n, 1))
    analytic[0, 0, n - 1, 0] = 1.0
    ev = diagnose.Evidence(analytic, np.zeros_like(analytic), np.full(analytic.shape, 0.5))
    heat = diagnose.breakdown("x", ev, Structure(("b", "h", "r", "c"), {}, ("h", "r")))["heat"]
    assert heat["bin"] == [1, 3] and len(heat["levels"][0]) == 43 and heat["levels"][0][-1] == 1


def test_ranges():
    assert indices.ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert indices.ranges([]) == ""


def test_directional_failure_says_how_to_localise():
    sc = make(n_q=4, n_k=4, d_head=4, check={"mode": "directional", "directions": 4})
    res = checker.run_scenario(sc, ("softmax-term",))
    assert any("rerun with check: {mode: sample}" in h for h in res.hints)
    assert all(c.diagnosis is None for c in res.checks)


def test_reports_carry_diagnosis_and_hints(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - {name: g, heads_q: 4, heads_kv: 2, n_q: 3, n_k: 3, d_head: 2}\n")
    out = CliRunner().invoke(main, ["run", str(cfg), "--fault", "gqa-sum", "--json", str(tmp_path / "r.json"),
                                    "--junit", str(tmp_path / "r.xml")])
    assert out.exit_code == 1
    assert "hint: errors only in K/V gradients of KV heads shared" in out.output
    assert "heat map, KV head x key row" in out.output and "where: " in out.output
    data = json.loads((tmp_path / "r.json").read_text())
    scen = data["scenarios"][0]
    assert any("GQA reduction" in h for h in scen["hints"])
    k = next(c for c in scen["checks"] if c["name"] == "gradient k")
    assert k["diagnosis"]["out_of_tolerance"] > 0 and k["diagnosis"]["heat"]["rows"] == "KV head"
    q = next(c for c in scen["checks"] if c["name"] == "gradient q")
    assert q["diagnosis"] is None
    assert "GQA reduction" in (tmp_path / "r.xml").read_text()


def test_user_implementation_hints(root, monkeypatch):
    monkeypatch.syspath_prepend(str(root / "examples"))
    from gradcheck_cli import load
    results = {sc.name: checker.run_scenario(sc) for sc in load(root / "examples" / "broken.yaml")}
    assert any(HINT_OF["gqa-sum"] in h for h in results["gqa-overwrite"].hints)
    assert any(HINT_OF["mask"] in h for h in results["ignores-padding"].hints)


@pytest.mark.parametrize("fault", ["softmax-term", "scale", "gqa-sum", "mask-backward"])
def test_torch_backend_hints(fault):
    pytest.importorskip("torch")
    sc = make(backend="torch", heads_q=4, heads_kv=2, n_q=4, n_k=5, d_head=4, mask={"causal": "lower-right"})
    text = " | ".join(checker.run_scenario(sc, (fault,)).hints)
    assert HINT_OF[fault] in text, text


def test_non_finite_values_fail_naming_the_first_bad_element(monkeypatch):
    import dataclasses
    sc = make(n_q=3, d_head=2)
    real = OPS["attention"].problem

    def nan_build(sc, faults=()):
        problem = real(sc, faults)
        problem.gradients["k"] = problem.gradients["k"].copy()
        problem.gradients["k"][0, 0, 2, 1] = np.nan
        problem.gradients["k"][0, 0, 2, 0] = np.inf  # earlier in C order: named first
        return problem
    monkeypatch.setitem(OPS, "attention", dataclasses.replace(OPS["attention"], engines={}, build=nan_build))
    res = checker.run_scenario(sc)
    assert res.verdict == "fail"
    [check] = res.checks
    assert (check.name, check.tensor, check.worst_index) == ("analytic gradient is finite", "k", (0, 0, 2, 0))
    assert "inf at k[0, 0, 2, 0] (first of 2 non-finite element(s) of 6)" in check.detail
    assert "leaves the range of float64" in res.hints[0]


def test_float16_overflow_is_named_not_a_wall_of_nan():
    pytest.importorskip("torch")
    sc = make(backend="torch", dtype="float16", n_q=4, d_head=4, scale=100000)
    res = checker.run_scenario(sc)
    names = {(c.name, c.tensor) for c in res.checks}
    assert ("output is finite", "o") in names and res.verdict == "fail"
    assert "largest finite 65504" in res.hints[0]


def test_the_mask_backward_hint_for_code_does_not_claim_untouched_rows_are_right():
    """Code whose backward recomputes A without the mask moves the gradients of key rows every query sees too:
    its hint rests on the fingerprint and says so, never that the rows the mask does not touch are right (a report
    seen printing that beside 'key rows every query sees: 16 of 16 out of tolerance')."""
    sc = with_examples(implementation="my_attention:attention", heads_q=2, n_q=6, n_k=6, d_head=4,
                       mask={"causal": "lower-right"})
    res = checker.run_scenario(sc, ("mask-backward",))
    assert res.verdict.value == "fail"
    said = [h for h in res.hints if "ignores or misapplies the visible set" in h]
    assert said and not any("does not touch are right" in h for h in said), res.hints
    k = next(c for c in res.checks if c.name == "gradient k")
    every = {c["label"]: c for c in k.diagnosis["classes"]}["key rows every query sees"]
    assert every["out_of_tolerance"] > 0  # the contradiction the old wording made
