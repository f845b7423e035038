"""Recipes for real libraries (examples/recipes/): each passes on the library as it is, with every applicable
fault detected, and its shipped broken variant fails with the right check named. Skipped where the library
is not installed (.ci/run installs pinned versions)."""
from pathlib import Path

import pytest
import yaml

from gradcheck_cli import checker, scenario

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"


@pytest.fixture(scope="module")
def llama():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return scenario.load(RECIPES / "hf_llama.yaml")


def test_the_llama_recipes_pass_and_every_fault_is_caught_on_them(llama):
    assert {sc.op for sc in llama} == {"rmsnorm", "rope", "swiglu", "attention"} and len(llama) == 5
    for sc in llama:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
    assert {c.status for c in checker.negative_controls(llama)} == {"detected"}


def test_llama_rope_with_the_other_layouts_tables_fails_the_reference(llama):
    doc = {"scenarios": [{"name": "t", "op": "rope", "heads": 2, "n": 6, "d_head": 8, "backend": "torch",
                          "dtype": "float32", "implementation": "hf_llama:rope_interleaved_tables"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=RECIPES)[0])
    assert "forward agrees with the reference" in {c.name for c in result.checks if not c.passed}


def test_llama_rmsnorm_in_float64_is_said_to_compute_in_float32(llama):
    doc = {"scenarios": [{"name": "t", "op": "rmsnorm", "n": 3, "d_model": 8, "backend": "torch",
                          "implementation": "hf_llama:rmsnorm"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=RECIPES)[0])
    assert result.verdict == "inconclusive", [(c.name, c.verdict) for c in result.checks]
    assert any("float32" in c.detail for c in result.checks if c.verdict == "inconclusive")


def test_jax_nn_dot_product_attention_passes_in_float32_and_is_said_to_compute_in_float32_in_float64():
    pytest.importorskip("jax")
    scenarios = scenario.load(RECIPES / "jax_nn.yaml")
    for sc in scenarios:
        assert checker.run_scenario(sc).verdict == "pass", sc.name
    assert {c.status for c in checker.negative_controls(scenarios[:1])} == {"detected"}
    doc = {"scenarios": [{"name": "t", "heads_q": 2, "n_q": 4, "d_head": 4, "backend": "jax",
                          "implementation": "jax_nn:dot_product_attention"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=RECIPES)[0])
    assert result.verdict == "inconclusive" and any("float32" in h for h in result.hints), result.hints
