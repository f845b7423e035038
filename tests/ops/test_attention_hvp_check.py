"""Checking a double backward (``check: {mode: hvp}``): the naive engine's closed form, torch implementations
(double backward with create_graph=True) and JAX ones (jax.grad over jax.vjp) against central differences of their
own gradients; the Hessian's symmetry; what is caught (examples/torch_hvp.yaml's saved weights, with its hint;
every HVP fault) and what is refused or reported without a traceback."""
import dataclasses

import pytest
import yaml
from click.testing import CliRunner

from gradcheck_cli import checker, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import GradcheckError, ScenarioError
from gradcheck_cli.ops.attention import HVP_FAULTS

from helpers import JAX_ATTENTION, ROOT, make, with_examples

SHAPE = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=8, d_head=8,
             mask={"causal": "lower-right", "key_lengths": [8, 6]}, check={"mode": "hvp"})


def _failed(result):
    return {c.name for c in result.checks if c.verdict == "fail"}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_the_naive_engine_passes_with_its_rows_and_every_hvp_fault_is_caught(dtype):
    sc = make(**SHAPE, dtype=dtype)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert [c.name for c in result.checks[:4]] == ["hvp q", "hvp k", "hvp v", "Hessian is symmetric"]
    assert [c.tensor for c in result.checks[:3]] == ["hq", "hk", "hv"]
    assert not any(c.name.startswith("gradient ") for c in result.checks)
    cells = checker.negative_controls([sc])
    assert {c.fault for c in cells if c.status == "detected"} >= set(HVP_FAULTS)


def test_mode_hvp_is_refused_where_nothing_computes_it():
    with pytest.raises(ScenarioError, match="mode hvp"):
        make(**SHAPE, engine="tiled")
    with pytest.raises(ScenarioError, match="mode hvp"):
        with_examples(implementation="my_attention:attention", **SHAPE)  # NumPy code has no double backward
    # a scenario built by hand past the loader is an error, not a crash
    with pytest.raises(GradcheckError, match="computes no derivative"):
        checker.run_scenario(dataclasses.replace(make(**SHAPE), engine="tiled"))


def test_mode_hvp_is_refused_in_half_precision():
    pytest.importorskip("torch")  # without it, backend torch is refused first, as not installed
    with pytest.raises(ScenarioError, match="differences the gradients: it needs dtype float64 or float32"):
        make(backend="torch", implementation="m:f", dtype="float16", **SHAPE)


def test_the_config_refusal_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"scenarios": [{"name": "x", **SHAPE, "engine": "tiled"}]}))
    out = CliRunner().invoke(main, ["run", str(cfg)])
    assert out.exit_code == 2 and "check.mode" in out.output and "Traceback" not in out.output


def test_saved_weights_give_a_wrong_double_backward_that_is_caught_and_explained():
    pytest.importorskip("torch")
    results = {sc.name: checker.run_scenario(sc) for sc in scenario.load(ROOT / "examples/torch_hvp.yaml")}
    assert results["hvp-mine-float64"].verdict == "pass" and results["hvp-mine-float32"].verdict == "pass"
    saved = results["hvp-saved-weights"]
    failed = _failed(saved)
    assert {"hvp q", "hvp k", "double backward agrees with the reference"} <= failed
    assert "backward agrees with the reference" not in failed  # its gradients are right
    assert len(saved.hints) == 1 and "count as constants" in saved.hints[0]
    hq = next(c for c in saved.checks if c.name == "hvp q")
    assert hq.tensor == "hq" and "query row" in str(hq.diagnosis)


def test_torch_negative_controls_catch_every_hvp_fault():
    pytest.importorskip("torch")
    sc = next(s for s in scenario.load(ROOT / "examples/torch_hvp.yaml") if s.name == "hvp-mine-float64")
    cells = checker.negative_controls([sc])
    assert {c.fault for c in cells if c.status == "detected"} >= set(HVP_FAULTS)


ONCE = '''
import torch
from torch.autograd.function import once_differentiable
def plain(q, k, v, visible, scale, kv_map):
    s = scale * q @ k[:, kv_map].transpose(-1, -2)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v[:, kv_map]
class Once(torch.autograd.Function):
    @staticmethod
    def forward(q, k, v, visible, scale, kv_map):
        return plain(q, k, v, visible, scale, kv_map)
    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3])
        ctx.rest = inputs[3:]
    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        q, k, v = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            return (*torch.autograd.grad(plain(q, k, v, *ctx.rest), (q, k, v), g), None, None, None)
def once(*args):
    return Once.apply(*args)
'''


def test_a_once_differentiable_backward_gets_a_clear_message(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "once.py").write_text(ONCE)
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "backend": "torch", "implementation": "once:once",
                                                       **SHAPE}]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    row = next(c for c in result.checks if c.name == "hvp")
    assert row.verdict == "fail" and "differentiated again" in row.detail, row.detail
    assert not result.hints  # the row says why; the hint about constants is for a wrong H u, not a refused one


JAX = JAX_ATTENTION + '''def _f(q, k, v, visible, scale, kv_map):
    return attention(q, k, v, visible, scale, kv_map), (q, k, v, visible, scale, kv_map)
def _b(res, g):
    q, k, v, visible, scale, kv_map = res
    s = scale * q @ jnp.swapaxes(k[:, kv_map], -1, -2)
    a = jax.lax.stop_gradient(jax.nn.softmax(jnp.where(visible, s, -jnp.inf), -1))  # a constant to autodiff
    ga = g @ jnp.swapaxes(v[:, kv_map], -1, -2)
    gs = a * (ga - (a * ga).sum(-1, keepdims=True))
    dq = scale * gs @ k[:, kv_map]
    dk = jnp.zeros_like(k).at[:, kv_map].add(scale * jnp.swapaxes(gs, -1, -2) @ q)
    dv = jnp.zeros_like(v).at[:, kv_map].add(jnp.swapaxes(a, -1, -2) @ g)
    return dq, dk, dv, None, None, None
custom.defvjp(_f, _b)
'''


def test_jax_double_backward_passes_and_a_stop_gradient_in_bwd_is_caught(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "jx2.py").write_text(JAX)
    scs = scenario.loads(yaml.safe_dump({"scenarios": [
        {"name": n, "backend": "jax", "implementation": f"jx2:{n}", **SHAPE} for n in ("attention", "custom")]}),
        base_dir=tmp_path)
    good, custom = (checker.run_scenario(sc) for sc in scs)
    assert good.verdict == "pass", [(c.name, c.detail) for c in good.checks if not c.passed]
    assert {"hvp q", "hvp k"} <= _failed(custom) and "backward agrees with the reference" not in _failed(custom)
    assert any("count as constants" in h for h in custom.hints)


def test_a_sweep_over_the_mode_checks_every_derivative_of_one_scenario():
    text = yaml.safe_dump({"scenarios": [{"name": "all", **{k: v for k, v in SHAPE.items() if k != "check"},
                                          "sweep": {"check.mode": ["full", "jvp", "hvp"]}}]})
    scs = scenario.loads(text)
    assert [sc.mode for sc in scs] == ["full", "jvp", "hvp"]
    assert [sc.derivatives for sc in scs] == [("vjp",), ("jvp",), ("hvp",)]
    results = [checker.run_scenario(sc) for sc in scs]
    assert all(r.verdict == "pass" for r in results)
    assert results[1].checks[0].name == "jvp (random tangent)" and results[2].checks[0].name == "hvp q"
    faults = [set(checker.applicable_faults(sc)) for sc in scs]
    assert "jvp-centring" in faults[1] and not {"jvp-centring", "softmax-term"} & faults[2]


def test_the_symmetry_and_adjoint_invariants_catch_the_faults_in_float32_too():
    """Their bounds leave them power in float32: each fault of the double backward breaks the Hessian's symmetry,
    each JVP fault that changes the JVP along the random tangent the adjoint identity."""
    hvp32 = next(sc for sc in scenario.load(ROOT / "configs/hvp.yaml") if sc.dtype == "float32")
    for fault in HVP_FAULTS:
        assert "Hessian is symmetric" in _failed(checker.run_scenario(hvp32, (fault,))), fault
    from gradcheck_cli.ops.attention import JVP_FAULTS
    jvp32 = next(sc for sc in scenario.load(ROOT / "configs/jvp.yaml") if sc.dtype == "float32")
    for fault in JVP_FAULTS:
        assert "adjoint identity" in _failed(checker.run_scenario(jvp32, (fault,))), fault


@pytest.mark.parametrize("dtype, scale", [("float32", 2.0), ("float32", 3.0), ("float64", 3.0)])
def test_a_correct_double_backward_at_a_peaked_softmax_passes(dtype, scale):
    for seed in (0, 1):
        sc = make(batch=2, heads_q=2, n_q=8, n_k=8, d_head=16, scale=scale, dtype=dtype, seed=seed,
                  check={"mode": "hvp"})
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]


def test_a_saturated_float64_double_backward_does_not_fail(tmp_path):
    """Scale 54: the second derivatives are about 1e-34 and their rounding comes from logits in the hundreds;
    the reference check once failed this correct code on 101 ulps of terms that left the logits out."""
    pytest.importorskip("torch")
    (tmp_path / "plain.py").write_text(
        "import torch\n"
        "def attention(q, k, v, visible, scale, kv_map):\n"
        "    s = scale * q @ k[:, kv_map].transpose(-1, -2)\n"
        "    return torch.softmax(s.masked_fill(~visible, float('-inf')), -1) @ v[:, kv_map]\n")
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{
        "name": "x", "batch": 1, "heads_q": 1, "heads_kv": 1, "n_q": 3, "n_k": 22, "d_head": 8, "seed": 174131848,
        "scale": 53.6102, "mask": {"causal": "lower-right"}, "check": {"mode": "hvp"}, "backend": "torch",
        "implementation": "plain:attention"}]}), base_dir=tmp_path)[0]
    assert checker.run_scenario(sc).verdict != "fail"
