"""Recipes for real libraries (examples/recipes/): each passes on the library as it is, with every applicable
fault detected, and its shipped broken variant fails with the right check named. Skipped where the library
is not installed (.ci/run installs pinned versions).

All of them are slow: the libraries' imports (transformers: ~5 s) and JAX's compilations (one per shape, seconds per
scenario) cost more than the rest of the default run's user code together. By default the same machinery runs on
the shipped torch and JAX implementations (tests/ops/test_torch_flavour.py, test_jax_flavour.py), torch modules and a
JAX function with its parameters (tests/ops/test_user_modules.py), and jax.nn.dot_product_attention itself
(tests/ops/test_attention_convention.py); .ci/run runs these."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from gradcheck_cli import checker, scenario

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"

pytestmark = pytest.mark.slow


def _names(path) -> list[str]:
    return [doc["name"] for doc in yaml.safe_load(path.read_text())["scenarios"]]


def _recipes(config: str, *libraries: str) -> dict:
    """A recipe file's scenarios by name, skipped where one of its libraries is not installed."""
    for library in libraries:
        pytest.importorskip(library)
    return {sc.name: sc for sc in scenario.load(RECIPES / config)}


@pytest.fixture(scope="module")
def llama():
    return _recipes("hf_llama.yaml", "torch", "transformers")


def test_the_llama_recipes_cover_every_op_and_map_four_modules(llama):
    assert {sc.op for sc in llama.values()} == {"rmsnorm", "rope", "swiglu", "attention", "attention-projections",
                                                "block"}
    assert len(llama) == 9 and sum(sc.module is not None for sc in llama.values()) == 4


@pytest.mark.parametrize("name", _names(RECIPES / "hf_llama.yaml"))
def test_each_llama_recipe_passes(llama, name):
    result = checker.run_scenario(llama[name])
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]


# the layer modules' faults are the decoder layer's too: its controls stand for theirs
@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "hf_llama.yaml")
                                  if n not in ("llama-attention-module", "llama-mlp-module")])
def test_every_fault_is_caught_on_the_llama_recipes(llama, name):
    cells = checker.negative_controls([llama[name]])
    assert cells and {c.status for c in cells} == {"detected"}, [(c.fault, c.status) for c in cells]


def test_the_llama_decoder_layer_checks_every_weight_and_a_detached_residual_fails_gradient_x(llama):
    layer = llama["llama-decoder-layer"]
    result = checker.run_scenario(layer)
    assert {c.tensor for c in result.checks if c.name.startswith("gradient ")} == {
        "x", "gamma1", "w_q", "w_k", "w_v", "w_o", "gamma2", "w1", "w3", "w2"}
    broken = dataclasses.replace(layer, implementation="hf_llama:decoder_layer_detached_residual")
    failed = {(c.name, c.tensor) for c in checker.run_scenario(broken).checks if not c.passed}
    assert ("gradient x", "x") in failed and ("backward agrees with the reference", "x") in failed
    assert not {t for _, t in failed} - {"x"}, failed  # every weight's gradient is still right


def test_torch_multihead_attention_passes_with_its_fused_weight_and_a_keep_mask_fails_the_reference():
    pytest.importorskip("torch")
    scenarios = scenario.load(RECIPES / "torch_nn.yaml")
    for sc in scenarios:
        assert checker.run_scenario(sc).verdict == "pass", sc.name
    broken = dataclasses.replace(scenarios[0], implementation="torch_nn:multihead_attention_keep_mask")
    failed = {c.name for c in checker.run_scenario(broken).checks if not c.passed}
    assert {"forward agrees with the reference", "hidden x rows do not change y"} <= failed, failed


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


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "jax_nn.yaml") if not n.startswith("broken-")])
def test_each_jax_and_flax_recipe_passes_in_float32(name):
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    (sc,) = [sc for sc in scenario.load(RECIPES / "jax_nn.yaml") if sc.name == name]
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("name, failed, hint", [
    ("broken-jax-blockwise-lse-log2", "lse agrees with the reference", "log2 units"),
    ("broken-jax-nn-lse-residual", "gradient q", "returned detached (lax.stop_gradient")])
def test_the_jax_lse_recipes_that_break_fail_with_the_cause_named(name, failed, hint):
    """jax.nn.dot_product_attention's residual LSE is under lax.stop_gradient: as an output it has no gradient."""
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    (sc,) = [sc for sc in scenario.load(RECIPES / "jax_nn.yaml") if sc.name == name]
    result = checker.run_scenario(sc)
    assert failed in {c.name for c in result.checks if c.verdict == "fail"}
    assert any(hint in h for h in result.hints), result.hints
    assert result.verdict == "fail"


def test_jax_nn_in_float64_is_said_to_compute_in_float32():
    pytest.importorskip("jax")
    pytest.importorskip("flax")  # jax_nn.py imports it
    # (the controls of a user's JAX attention and layer run in tests/ops/test_jax_flavour.py)
    doc = {"scenarios": [{"name": "t", "heads_q": 2, "n_q": 4, "d_head": 4, "backend": "jax",
                          "implementation": "jax_nn:dot_product_attention"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=RECIPES)[0])
    assert result.verdict == "inconclusive" and any("float32" in h for h in result.hints), result.hints


def _failed(sc, implementation):
    result = checker.run_scenario(dataclasses.replace(sc, implementation=implementation))
    return {c.name for c in result.checks if not c.passed}


def _importorskip_timm():
    """timm 1.0.x needs torchvision to be imported; the recipe then loads timm's attention.py from the
    installed package, so only timm's presence is required."""
    import importlib.util
    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is not installed")


def test_timm_vit_attention_passes_with_its_fused_qkv_and_the_default_proj_bias_fails_the_reference():
    pytest.importorskip("torch")
    _importorskip_timm()
    scenarios = scenario.load(RECIPES / "timm_vit.yaml")
    for sc in scenarios:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
    controls = {(c.fault, c.status) for c in checker.negative_controls(scenarios[1:])}
    assert {f for f, st in controls if st != "detected"} == {"gqa-sum"}, controls  # one KV head per query head
    assert _failed(scenarios[0], "timm_vit:attention_default_bias") == {"forward agrees with the reference"}


def test_torchtune_rmsnorm_rope_and_attention_pass_and_an_untransposed_rope_fails_the_reference():
    pytest.importorskip("torch")
    pytest.importorskip("torchtune")
    scenarios = scenario.load(RECIPES / "torchtune_llama.yaml")
    assert [sc.op for sc in scenarios] == ["rmsnorm", "rope", "attention-projections"]
    for sc in scenarios:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
    assert {c.status for c in checker.negative_controls(scenarios[:2])} == {"detected"}
    assert "forward agrees with the reference" in _failed(scenarios[1], "torchtune_llama:rope_untransposed")


def test_x_transformers_attention_and_rmsnorm_pass_and_a_causal_built_module_fails_the_reference():
    pytest.importorskip("torch")
    pytest.importorskip("x_transformers")
    scenarios = scenario.load(RECIPES / "x_transformers_attention.yaml")
    for sc in scenarios:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
    assert {c.status for c in checker.negative_controls(scenarios[2:])} == {"detected"}
    failed = _failed(scenarios[0], "x_transformers_attention:attention_causal_built_in")
    assert "forward agrees with the reference" in failed and "hidden x rows do not change y" not in failed, failed


def test_rotary_embedding_torch_passes_interleaved_and_a_dropped_offset_fails_the_reference():
    pytest.importorskip("torch")
    pytest.importorskip("rotary_embedding_torch")
    scenarios = scenario.load(RECIPES / "rotary_torch.yaml")
    for sc in scenarios:
        assert sc.p("layout") == "interleaved"
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (sc.name, [(c.name, c.detail) for c in result.checks if not c.passed])
    assert {c.status for c in checker.negative_controls(scenarios)} == {"detected"}
    failed = _failed(scenarios[1], "rotary_torch:rotary_offset_dropped")
    assert {"forward agrees with the reference", "backward agrees with the reference"} <= failed, failed
    assert not {c for c in failed if c.startswith("gradient") or c.startswith("rotation")}, failed


@pytest.fixture(scope="module")
def variants():
    return _recipes("hf_variants.yaml", "torch", "transformers")


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "hf_variants.yaml") if not n.startswith("broken")])
def test_each_variant_recipe_passes_with_every_fault_caught(variants, name):
    """Gemma 2's soft-capped eager attention and BLOOM's ALiBi, as the library computes them."""
    result = checker.run_scenario(variants[name])
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    cells = checker.negative_controls([variants[name]])
    # not applicable where the variant cannot show the fault (tanh' ~ 1 at cap 50, no offset in the column form)
    assert cells and {c.status for c in cells} <= {"detected", "not applicable"}, [(c.fault, c.status) for c in cells]
    assert {c.fault for c in cells if c.status == "detected"} >= {"softmax-term", "mask", "gqa-sum", "swap-dk-dv"}


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "hf_variants.yaml") if n.startswith("broken")])
def test_each_broken_variant_recipe_fails_the_reference(variants, name):
    failed = {c.name for c in checker.run_scenario(variants[name]).checks if c.verdict == "fail"}
    assert "forward agrees with the reference" in failed, failed


@pytest.fixture(scope="module")
def learned_bias():
    return _recipes("learned_bias.yaml", "torch", "jax")


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "learned_bias.yaml") if not n.startswith("broken")])
def test_each_learned_bias_recipe_passes_with_its_gradient_checked_and_every_fault_caught(learned_bias, name):
    """PyTorch SDPA with a learned float attn_mask, jax.nn.dot_product_attention with bias=: dbias is checked by
    finite differences and against the reference, and the bias's faults are caught on them."""
    result = checker.run_scenario(learned_bias[name])
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"gradient bias", "backward agrees with the reference"} <= {c.name for c in result.checks
                                                                       if c.tensor == "bias"}
    cells = checker.negative_controls([learned_bias[name]])
    assert cells and {c.status for c in cells} <= {"detected", "not applicable"}, [(c.fault, c.status) for c in cells]
    assert {"bias-hidden-gradient", "bias-scaled", "softmax-term"} <= {c.fault for c in cells if c.status == "detected"}


@pytest.mark.parametrize("name, check", [("broken-sdpa-bias-scaled", "forward agrees with the reference"),
                                         ("broken-sdpa-mask-under-no-grad", "gradient bias"),
                                         ("broken-jax-bias-stop-gradient", "gradient bias")])
def test_each_broken_learned_bias_recipe_fails_the_right_check(learned_bias, name, check):
    failed = {(c.name, c.tensor) for c in checker.run_scenario(learned_bias[name]).checks if c.verdict == "fail"}
    assert (check, "o" if check.startswith("forward") else "bias") in failed, failed
    if check == "gradient bias":  # the gradient of q, k and v is right: only the bias's fails
        assert {t for _, t in failed} == {"bias"}, failed


@pytest.fixture(scope="module")
def t5_relative():
    return _recipes("t5_relative.yaml", "torch", "transformers")


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "t5_relative.yaml") if not n.startswith("broken")])
def test_each_t5_recipe_passes_with_its_table_checked_and_every_fault_caught(t5_relative, name):
    """transformers' T5 compute_bias and eager attention, the embedding's weight checked end to end."""
    result = checker.run_scenario(t5_relative[name])
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"gradient relative_bias", "backward agrees with the reference"} <= {
        c.name for c in result.checks if c.tensor == "relative_bias"}
    cells = checker.negative_controls([t5_relative[name]])
    assert cells and {c.status for c in cells} <= {"detected", "not applicable"}, [(c.fault, c.status) for c in cells]
    assert {"relative-bias-scatter", "relative-bias-offset-backward", "softmax-term"} <= {
        c.fault for c in cells if c.status == "detected"}


@pytest.mark.parametrize("name, check", [("broken-t5-bias-detached", "gradient relative_bias"),
                                         ("broken-t5-cache-offset-dropped", "forward agrees with the reference")])
def test_each_broken_t5_recipe_fails_the_right_check(t5_relative, name, check):
    failed = {(c.name, c.tensor) for c in checker.run_scenario(t5_relative[name]).checks if c.verdict == "fail"}
    assert (check, "o" if check.startswith("forward") else "relative_bias") in failed, failed
    if check == "gradient relative_bias":  # q, k and v are right: only the table's checks fail
        assert {t for _, t in failed} == {"relative_bias"}, failed


@pytest.fixture(scope="module")
def hf_packed():
    return _recipes("hf_packed.yaml", "torch", "transformers")


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "hf_packed.yaml") if not n.startswith("broken")])
def test_each_hf_packed_recipe_passes_with_every_fault_caught(hf_packed, name):
    """transformers' packed sequences (restarting position ids, find_packed_sequence_indices, sdpa_mask) as the
    library builds them: a packed batch with cu_seqlens passes, and the packed batch's faults are caught on it."""
    result = checker.run_scenario(hf_packed[name])
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    cells = checker.negative_controls([hf_packed[name]])
    assert {c.status for c in cells} <= {"detected", "not applicable"}, [(c.fault, c.status) for c in cells]
    assert {c.fault for c in cells if c.status == "detected"} >= {"softmax-term", "varlen-packed-causal",
                                                                   "varlen-single-query"}


def test_hf_packed_positions_without_restarts_let_the_documents_see_each_other(hf_packed):
    result = checker.run_scenario(hf_packed["broken-hf-packed-arange-positions"])
    failed = {c.name for c in result.checks if c.verdict == "fail"}
    assert {"forward agrees with the reference", "documents do not see each other"} <= failed
    assert any("documents of the packed batch see each other" in h for h in result.hints), result.hints


@pytest.fixture(scope="module")
def hf_gpt_oss():
    return _recipes("hf_gpt_oss.yaml", "torch", "transformers")


@pytest.mark.parametrize("name", [n for n in _names(RECIPES / "hf_gpt_oss.yaml") if not n.startswith("broken")])
def test_each_hf_gpt_oss_recipe_passes_with_every_fault_caught(hf_gpt_oss, name):
    """transformers' gpt-oss eager attention with its learnable sinks, as the library runs it: passes, the sinks'
    gradient is checked, and the sinks' faults are caught on it."""
    result = checker.run_scenario(hf_gpt_oss[name])
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert "gradient sinks" in {c.name for c in result.checks}
    cells = checker.negative_controls([hf_gpt_oss[name]])
    assert {c.status for c in cells} <= {"detected", "not applicable"}, [(c.fault, c.status) for c in cells]
    assert {c.fault for c in cells if c.status == "detected"} >= {"softmax-term", "sink-grad-sign", "sink-scaled"}


def test_hf_gpt_oss_with_the_sinks_scaled_fails_with_the_cause_named(hf_gpt_oss):
    result = checker.run_scenario(hf_gpt_oss["broken-gpt-oss-scaled-sinks"])
    assert "forward agrees with the reference" in {c.name for c in result.checks if c.verdict == "fail"}
    assert any("multiplies the sink logits by the softmax scale" in h for h in result.hints), result.hints


def test_flex_attention_recipe_is_refused_without_cuda_and_its_forward_is_right_on_the_cpu():
    """FlexAttention (softcap score_mod, document mask_mod) has no CPU backward in torch 2.13: its recipe sets
    device: cuda, refused here with the key named (exit 2); its forward, run on the CPU, equals the reference, and
    the broken variants' do not; with device: cpu the run fails 'implementation runs' with a hint saying why."""
    import warnings

    import numpy as np
    torch = pytest.importorskip("torch")
    from gradcheck_cli.errors import ScenarioError
    from gradcheck_cli.ops.attention import formulas
    from gradcheck_cli.ops.attention import stages as score_stages
    from gradcheck_cli.ops.attention.args import Args
    from gradcheck_cli.scenario import loads
    text = (RECIPES / "flex_attention.yaml").read_text()
    if not torch.cuda.is_available():
        with pytest.raises(ScenarioError) as err:
            loads(text, base_dir=RECIPES)
        assert err.value.key.endswith("device") and "no CUDA" in str(err.value)
    scs = loads(text.replace("device: cuda", "device: cpu"), base_dir=RECIPES)
    import importlib
    import sys
    sys.path.insert(0, str(RECIPES))
    try:
        recipe = importlib.import_module("flex_attention")
    finally:
        sys.path.remove(str(RECIPES))
    rng = np.random.default_rng(0)
    for sc in scs:
        q, k, v = (rng.standard_normal((1, h, n, 16)) for h, n in ((4, sc.n_q), (2, sc.n_k), (2, sc.n_k)))
        ref = formulas.forward(q, k, v, **Args.of(sc, score_stages.from_scenario(sc)).kw)
        fn = getattr(recipe, sc.implementation.split(":")[1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o = fn(*(torch.tensor(x) for x in (q, k, v)), torch.from_numpy(sc.visible), sc.scale,
                   torch.as_tensor(np.asarray(sc.kv_map)), softcap=2.0,
                   **{kw: torch.as_tensor(a) for kw, a in sc.documents.kwargs().items()})
        gap = float(np.abs(o.numpy() - ref).max())
        assert (gap > 1e-2) if sc.name.startswith("broken") else (gap < 1e-12), (sc.name, gap)
    result = checker.run_scenario(scs[0])
    assert [c.name for c in result.checks if c.verdict == "fail"] == ["implementation runs"]
    assert any("not implemented on the CPU" in h and "device: cuda" in h for h in result.hints), result.hints
