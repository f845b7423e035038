"""A user's JAX function for the ops without attention's block structure (ops/jax_flavour.py): gradients by
jax.vjp, weight gradients included, compiled once per shape, checked like a NumPy implementation's."""
from pathlib import Path

import pytest
import yaml

from gradcheck_cli import checker, scenario

pytest.importorskip("jax")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_shipped_jax_implementations_pass_and_every_fault_is_caught_on_them():
    scenarios = scenario.load(EXAMPLES / "jax_ops.yaml")
    assert {sc.op for sc in scenarios} == {"layernorm", "rmsnorm", "rope", "swiglu", "infonce", "attention-projections",
                                          "block"}
    for sc in scenarios:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
        assert "compiled once per shape" in {c.name for c in result.checks}
    # controls through the JAX flavour on one scenario of each kind of fault (every op's faults are controlled
    # on its torch and NumPy implementations, through the same engine)
    controls = checker.negative_controls([sc for sc in scenarios if sc.name in ("jax-rmsnorm", "jax-swiglu",
                                                                                 "jax-attention-projections")])
    assert {c.status for c in controls} == {"detected"}


def test_a_stop_gradient_on_the_normalisation_fails_where_the_vjp_misses_the_feedback():
    doc = {"scenarios": [{"name": "t", "op": "rmsnorm", "n": 3, "d_model": 6, "eps": 0.0, "backend": "jax",
                          "implementation": "jax_ops:rmsnorm_stop_gradient"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=EXAMPLES)[0])
    failed = {(c.name, c.tensor) for c in result.checks if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x"),
                      ("<G_x, x> = d eps mean(g xhat) / s^2", "g_x")}, failed


def test_a_jax_attention_passes_every_control_and_a_finitely_masked_one_fails_the_mask_checks():
    scenarios = scenario.load(EXAMPLES / "jax_attention.yaml")
    for sc in scenarios:
        assert checker.run_scenario(sc).verdict == "pass", sc.name
    assert {c.status for c in checker.negative_controls(scenarios[:1])} == {"detected"}
    doc = {"scenarios": [{"name": "t", "heads_q": 2, "n_q": 4, "d_head": 4, "mask": {"causal": "lower-right"},
                          "backend": "jax", "implementation": "jax_attention:attention_additive_mask"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=EXAMPLES)[0])
    failed = {c.name for c in result.checks if not c.passed}
    assert {"forward agrees with the reference", "row 0's unseen K/V rows get zero gradient"} <= failed, failed
    assert any("hidden keys reach O" in h for h in result.hints), result.hints
