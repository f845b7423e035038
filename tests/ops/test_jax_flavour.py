"""A user's JAX function for the ops without attention's block structure (flavours/jax.py): gradients by
jax.vjp, weight gradients included, compiled once per shape, checked like a NumPy implementation's."""
from pathlib import Path

import pytest
import yaml

from gradcheck_cli import checker, scenario

pytest.importorskip("jax")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _shipped(path, slow: set[str]) -> list:
    """The scenario names of a shipped file, those in ``slow`` marked slow."""
    names = [doc["name"] for doc in yaml.safe_load(path.read_text())["scenarios"]]
    assert slow <= set(names)
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


def _scenario(path, name):
    return next(sc for sc in scenario.load(path) if sc.name == name)


def test_the_shipped_jax_implementations_cover_every_op_with_user_code():
    assert {sc.op for sc in scenario.load(EXAMPLES / "jax_ops.yaml")} == {
        "layernorm", "rmsnorm", "rope", "swiglu", "infonce", "attention-projections", "block"}


# One scenario per op by default, but for the block (the layers it composes run here, and the block's interface on
# torch user code in tests/ops/test_layer_user_code.py); the block and the float32 repeats of an op in
# the slow set (the JAX flavour's float32 runs by default in tests/ops/test_attention_convention.py). JAX compiles
# for every shape: seconds per scenario.
@pytest.mark.parametrize("name", _shipped(EXAMPLES / "jax_ops.yaml",
                                          {"jax-block", "jax-swiglu-float32", "jax-infonce-float32"}))
def test_each_shipped_jax_implementation_passes(name):
    result = checker.run_scenario(_scenario(EXAMPLES / "jax_ops.yaml", name))
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert "compiled once per shape" in {c.name for c in result.checks}


def test_every_fault_is_caught_through_the_jax_flavour():
    """Controls through the JAX flavour on one scenario of each kind of fault (every op's faults are controlled
    on its torch and NumPy implementations, through the same engine)."""
    scenarios = [sc for sc in scenario.load(EXAMPLES / "jax_ops.yaml")
                 if sc.name in ("jax-rmsnorm", "jax-swiglu", "jax-attention-projections")]
    controls = checker.negative_controls(scenarios)
    assert {c.status for c in controls} == {"detected"} and {c.scenario for c in controls} == {
        sc.name for sc in scenarios}


def test_a_stop_gradient_on_the_normalisation_fails_where_the_vjp_misses_the_feedback():
    doc = {"scenarios": [{"name": "t", "op": "rmsnorm", "n": 3, "d_model": 6, "eps": 0.0, "backend": "jax",
                          "implementation": "jax_ops:rmsnorm_stop_gradient"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=EXAMPLES)[0])
    failed = {(c.name, c.tensor) for c in result.checks if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x"),
                      ("<G_x, x> = d eps mean(g xhat) / s^2", "g_x")}, failed


# jax-causal-gqa carries the JAX attention's matrix by default; the other shipped scenarios (a KV cache, float32
# with a window, bfloat16: its rule and matrix run by default in tests/ops/test_jax_low_precision.py) are slow.
@pytest.mark.parametrize("name", _shipped(EXAMPLES / "jax_attention.yaml",
                                          {"jax-kv-cache", "jax-float32", "jax-bfloat16-gqa"}))
def test_each_shipped_jax_attention_passes(name):
    result = checker.run_scenario(_scenario(EXAMPLES / "jax_attention.yaml", name))
    assert result.verdict == "pass", [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]


def test_a_jax_attention_passes_every_control():
    cells = checker.negative_controls([_scenario(EXAMPLES / "jax_attention.yaml", "jax-causal-gqa")])
    assert {c.status for c in cells} == {"detected"} and len(cells) >= 10, [(c.fault, c.status) for c in cells]


@pytest.mark.slow  # the mask fault is in the matrix above; this is the same bug written in JAX
def test_a_finitely_masked_jax_attention_fails_the_mask_checks():
    """-10 added to hidden scores: under a causal mask every key is seen by the last query row, so the K/V rows
    query row 0 cannot see are the ones whose gradient must be zero."""
    doc = {"scenarios": [{"name": "t", "heads_q": 2, "n_q": 4, "d_head": 4, "mask": {"causal": "lower-right"},
                          "backend": "jax", "implementation": "jax_attention:attention_additive_mask"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=EXAMPLES)[0])
    failed = {c.name for c in result.checks if not c.passed}
    assert {"forward agrees with the reference", "row 0's unseen K/V rows get zero gradient"} <= failed, failed
    assert any("hidden keys reach O" in h for h in result.hints), result.hints


def test_small_stacks_of_copies_share_one_compiled_shape():
    """Every stack of perturbed copies of a small scenario (the independence test's, the probes', each tensor's
    colours) is padded to one size: the forward and the VJP at the scenario's shapes and one stacked forward."""
    sc = {s.name: s for s in scenario.load(EXAMPLES / "jax_attention.yaml")}["jax-causal-gqa"]
    result = checker.run_scenario(sc)
    assert result.verdict == "pass"
    row = next(c for c in result.checks if c.name == "compiled once per shape")
    assert "each of 3 shape(s)" in row.detail, row.detail


def test_stack_size_pads_small_stacks_to_one_size_and_leaves_large_ones_as_they_are():
    from gradcheck_cli.flavours.jax import MAX_STACK, PAD_BYTES, stack_size
    assert {stack_size(c, 1000) for c in (1, 5, 80, MAX_STACK)} == {MAX_STACK}
    assert stack_size(MAX_STACK + 1, 1000) == MAX_STACK + 1
    assert (stack_size(3, PAD_BYTES // 4), stack_size(5, PAD_BYTES // 4)) == (4, 5)
    assert stack_size(1, 2 * PAD_BYTES) == 1


def test_the_persistent_cache_is_off_on_request_and_never_in_a_folder_others_can_write(tmp_path, monkeypatch):
    from gradcheck_cli.flavours import jax as jax_flavour
    monkeypatch.setenv(jax_flavour.CACHE_ENV, "0")
    assert jax_flavour.persistent_cache.__wrapped__() is None
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(jax_flavour.CACHE_ENV, str(shared))
    assert jax_flavour.persistent_cache.__wrapped__() is None


@pytest.mark.slow  # two processes compiling (seconds): the cache itself; the folder rules are tested above
def test_compiled_programs_are_kept_in_a_private_per_user_folder(tmp_path):
    """A fresh process (each scenario's worker is one) finds what an earlier one compiled: the second run writes
    no entry of its own."""
    import subprocess
    import sys
    code = ("import yaml; from pathlib import Path; from gradcheck_cli import checker, scenario\n"
            "doc = {'scenarios': [{'name': 't', 'heads_q': 2, 'n_q': 3, 'd_head': 4, 'backend': 'jax',"
            " 'implementation': 'jax_attention:attention'}]}\n"
            f"sc = scenario.loads(yaml.safe_dump(doc), base_dir=Path({str(EXAMPLES)!r}))[0]\n"
            "print(checker.run_scenario(sc).verdict)\n")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("ATTN_GRADCHECK_JAX_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    folder = tmp_path / "attn-gradcheck" / "jax"
    entries = sorted(p.name for p in folder.iterdir())
    assert first.stdout.strip() == "pass" and entries
    assert folder.stat().st_mode & 0o077 == 0
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert again.stdout.strip() == "pass"
    assert sorted(p.name for p in folder.iterdir()) == entries  # every program loaded, none compiled again
