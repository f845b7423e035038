"""A user's torch callable for the ops without attention's block structure (flavours/torch.py): its
gradients by autograd, weight gradients included, checked like a NumPy implementation's."""
from pathlib import Path

import pytest
import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.errors import ScenarioError

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_shipped_torch_implementations_pass_and_every_fault_is_caught_on_them():
    scenarios = scenario.load(EXAMPLES / "torch_ops.yaml")
    assert {sc.op for sc in scenarios} == {"layernorm", "rmsnorm", "rope", "swiglu", "infonce", "attention-projections",
                                          "block"}
    for sc in scenarios:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
    # the block's controls run in tests/ops/test_layer_user_code.py (its faults are the other ops')
    controls = checker.negative_controls([sc for sc in scenarios if sc.op != "block"])
    assert {c.status for c in controls} == {"detected"}


def _one(tmp_path, spec: str, **keys):
    (tmp_path / "bad_torch.py").write_text(
        "import torch\n"
        "def numpy_out(x, gamma, eps):\n    return (gamma * x).detach().numpy()\n"
        "def detached(x, gamma, eps):\n    return (gamma * x).detach()\n")
    doc = {"scenarios": [{"name": "t", "op": "rmsnorm", "n": 3, "d_model": 4, "backend": "torch",
                          "implementation": spec, **keys}]}
    base = EXAMPLES if spec.startswith("torch_ops") else tmp_path
    return scenario.loads(yaml.safe_dump(doc), base_dir=base)[0]


def test_a_detached_normalisation_fails_where_autograd_misses_the_feedback(tmp_path):
    result = checker.run_scenario(_one(tmp_path, "torch_ops:rmsnorm_detached", eps=0.0))
    failed = {(c.name, c.tensor) for c in result.checks if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x"),
                      ("<G_x, x> = d eps mean(g xhat) / s^2", "g_x")}, failed


def test_a_detached_log_sum_exp_fails_where_autograd_misses_the_softmax_denominator():
    doc = {"scenarios": [{"name": "t", "op": "infonce", "batch": 4, "dim": 8, "hard_negatives": 2,
                          "backend": "torch", "implementation": "torch_ops:infonce_detached_lse"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=EXAMPLES)[0])
    failed = {(c.name, c.tensor) for c in result.checks if not c.passed}
    wrong = {(check, t) for t in "qpn" for check in (f"gradient {t}", "backward agrees with the reference")}
    assert failed == wrong | {
        ("candidate gradients sum to 0", "g_candidates")}, failed


@pytest.mark.parametrize("spec, words", [("bad_torch:numpy_out", "must return a torch.Tensor, got ndarray"),
                                         ("bad_torch:detached", "does not depend on its inputs through autograd")])
def test_a_callable_that_misbehaves_is_a_failed_check_naming_why(tmp_path, spec, words):
    [check] = checker.run_scenario(_one(tmp_path, spec)).checks
    assert (check.name, check.passed) == ("implementation runs", False) and words in check.detail


def test_backend_torch_needs_an_implementation_for_these_ops():
    with pytest.raises(ScenarioError, match="backend: torch applies to an implementation of yours"):
        scenario.loads(yaml.safe_dump({"scenarios": [{"name": "t", "op": "rmsnorm", "d_model": 4,
                                                      "backend": "torch"}]}))
