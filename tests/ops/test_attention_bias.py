"""An additive bias (``bias: {shape, grad}``): dBias against torch autograd of an independent forward for every
broadcast shape, the tiled engine block by block against the naive one, user code given ``attn_bias=`` and
returning dbias, its faults where they apply, and the loader's messages."""
import numpy as np
import pytest

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import formulas, tiled
from gradcheck_cli.ops.attention import stages as score_stages
from gradcheck_cli.ops.attention.stages.bias import Bias, sum_broadcast
from gradcheck_cli.ops.attention.stages.softcap import Softcap

from helpers import make, with_examples


def _inputs(seed=0, b=2, h=4, n=5, m=9, d=4):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(s) for s in [(b, h, n, d), (b, h, m, d), (b, h, m, d), (b, h, n, d)])
    return q, k, v, g, np.arange(h), masks.build_visible(b, h, n, m, causal="lower-right", key_lengths=(m, m - 2))


@pytest.mark.parametrize("shape", [(2, 4, 5, 9), (1, 4, 5, 9), (2, 1, 5, 9), (1, 1, 5, 9)])
def test_dbias_equals_torch_autograd_of_the_definition(shape):
    torch = pytest.importorskip("torch")
    q, k, v, g, kv_map, visible = _inputs()
    bias = np.random.default_rng(1).standard_normal(shape)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, bias)]

    def f(q, k, v, b):  # capped, then the bias, then the mask
        s = 1.5 * torch.tanh(0.6 * (q @ k.transpose(-1, -2)) / 1.5) + b
        return torch.softmax(s.masked_fill(~torch.from_numpy(visible), float("-inf")), -1) @ v

    o = f(*leaves)
    want = torch.autograd.grad(o, leaves, torch.tensor(g))
    stages = (Softcap(1.5), Bias(bias, True))
    np.testing.assert_allclose(formulas.forward(q, k, v, visible, 0.6, kv_map, stages=stages), o.detach(),
                               rtol=1e-12, atol=1e-13)
    got = formulas.backward(q, k, v, visible, 0.6, kv_map, g, stages=stages)
    for a, b in zip((got.q, got.k, got.v, got.params["bias"]), want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    hidden = ~visible.any(axis=tuple(i for i in (0, 1) if shape[i] == 1), keepdims=True)
    assert np.all(got.params["bias"][np.broadcast_to(hidden, shape)] == 0)  # the mask comes after the bias


def test_sum_broadcast_is_the_one_reduction():
    g = np.arange(2 * 3 * 2 * 2, dtype=float).reshape(2, 3, 2, 2)
    np.testing.assert_array_equal(sum_broadcast(g, (2, 3)), g)
    np.testing.assert_array_equal(sum_broadcast(g, (1, 3)), g.sum(0, keepdims=True))
    np.testing.assert_array_equal(sum_broadcast(g, (1, 1)), g.sum((0, 1), keepdims=True))
    np.testing.assert_array_equal(sum_broadcast(np.stack([g, g]), (2, 3)), 2 * g)  # copies summed too


def test_tiled_blocks_give_the_naive_gradients():
    q, k, v, g, kv_map, visible = _inputs(n=7, m=11)
    stages = (Bias(np.random.default_rng(2).standard_normal((1, 4, 7, 11)), True),)
    params: dict = {}
    t = tiled.backward(q, k, v, visible, 0.5, kv_map, g, block_q=2, block_k=3, stages=stages, params=params)
    n = formulas.backward(q, k, v, visible, 0.5, kv_map, g, stages=stages)
    for a, b in zip((*t, params["bias"]), (n.q, n.k, n.v, n.params["bias"])):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("engine", [{}, {"engine": "tiled", "block_q": 2, "block_k": 4}])
@pytest.mark.parametrize("shape", [[1, 2, 4, 7], [2, 1, 4, 7]])
def test_scenarios_check_dbias_like_q_k_v(engine, shape):
    sc = make(batch=2, heads_q=2, n_q=4, n_k=7, d_head=4, bias={"shape": shape}, mask={"causal": "lower-right"},
              **engine)
    result = checker.run_scenario(sc)
    assert result.passed
    assert {"q", "k", "v", "bias"} <= {c.tensor for c in result.checks if c.name.startswith("gradient ")}
    for fault in ("bias-broadcast-sum", "bias-hidden-gradient", "bias-scaled"):
        assert fault in checker.applicable_faults(sc)
        failed = {c.name for c in checker.run_scenario(sc, (fault,)).checks if c.verdict == "fail"}
        assert "gradient bias" in failed and failed <= {"gradient bias", "backward agrees with the reference"}


def test_a_fixed_bias_is_no_input_and_its_faults_do_not_apply():
    sc = make(heads_q=2, n_q=4, n_k=7, d_head=4, bias={"grad": False})
    result = checker.run_scenario(sc)
    assert result.passed and "bias" not in {c.tensor for c in result.checks}
    assert all("not checked" in score_stages.why_not(sc, f) for f in checker.applicable_faults(sc)
               if f.startswith("bias-"))
    assert "bias" not in score_stages.params(score_stages.from_scenario(sc))


def test_user_code_gets_attn_bias_and_returns_dbias():
    ok = with_examples(implementation="bias_attention:numpy_bias", heads_q=2, n_q=4, n_k=7, d_head=4,
                       bias={"shape": [1, 2, 4, 7]}, mask={"causal": "lower-right"})
    result = checker.run_scenario(ok)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert any(c.tensor == "bias" and c.name == "backward agrees with the reference" for c in result.checks)
    broken = with_examples(implementation="bias_attention:numpy_bias_not_summed", batch=2, heads_q=2, n_q=4, n_k=7,
                           d_head=4, bias={"shape": [1, 2, 4, 7]})
    failed = {(c.name, c.tensor) for c in checker.run_scenario(broken).checks if c.verdict == "fail"}
    assert ("gradient bias", "bias") in failed


@pytest.mark.parametrize("name, backend", [("torch_bias", "torch"), ("jax_bias", "jax")])
@pytest.mark.parametrize("shape", [[1, 2, 4, 7], [2, 1, 4, 7]])
def test_sdpa_and_jax_with_a_fixed_bias_pass(name, backend, shape):
    """A bias per batch element goes with the perturbed copies stacked along the batch axis (found by the
    variants grid: a JAX forward was handed the unstacked bias)."""
    pytest.importorskip(backend)
    sc = with_examples(implementation=f"bias_attention:{name}", backend=backend, dtype="float32", batch=2, heads_q=2,
                       n_q=4, n_k=7, d_head=4, bias={"grad": False, "shape": shape}, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("shape", [[2, 2, 4, 7], [1, 1, 4, 7]])
def test_jax_code_with_a_learned_bias_checks_its_gradient_and_a_fault_in_it_is_caught(shape):
    """jax.vjp along attn_bias too (flavours.jax's grad_kw): dbias checked like dq; a copy stack padded to the
    compiled size carries the bias's copies padded with it (the pad once looked the bias up among q, k, v)."""
    pytest.importorskip("jax")
    keys = dict(backend="jax", dtype="float32", batch=2, heads_q=2, n_q=4, n_k=7, d_head=4, bias={"shape": shape},
                mask={"causal": "lower-right"})
    result = checker.run_scenario(with_examples(implementation="bias_attention:jax_bias", **keys))
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"gradient bias", "backward agrees with the reference"} <= {c.name for c in result.checks
                                                                       if c.tensor == "bias"}
    if shape[0] == 1:  # the controls once (each fault a JAX run)
        cells = checker.negative_controls([with_examples(implementation="bias_attention:jax_bias", **keys)])
        assert {"bias-broadcast-sum", "bias-scaled", "bias-hidden-gradient"} <= {c.fault for c in cells
                                                                                 if c.status == "detected"}


@pytest.mark.parametrize("shape", [[2, 2, 4, 7], [1, 1, 4, 7]])
def test_sdpa_with_a_learned_mask_checks_its_gradient_and_a_detached_one_fails(shape):
    pytest.importorskip("torch")
    keys = dict(backend="torch", batch=2, heads_q=2, n_q=4, n_k=7, d_head=4, bias={"shape": shape},
                mask={"causal": "lower-right"})
    result = checker.run_scenario(with_examples(implementation="bias_attention:torch_bias", **keys))
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"gradient bias"} <= {c.name for c in result.checks if c.tensor == "bias"}
    cells = checker.negative_controls([with_examples(implementation="bias_attention:torch_bias", **keys)])
    assert cells and {c.status for c in cells} <= {"detected", "not applicable"}  # n/a: gqa-sum, an unbroadcast bias
    assert {"bias-hidden-gradient", "bias-scaled", "softmax-term"} <= {c.fault for c in cells if c.status == "detected"}
    failed = {c.name for c in checker.run_scenario(with_examples(implementation="bias_attention:torch_bias_detached",
                                                                 **keys)).checks if c.verdict == "fail"}
    assert "gradient bias" in failed


@pytest.mark.parametrize("bias, extra, message", [
    ({"shape": [3, 2, 4, 4]}, {}, "expected [B|1, H|1, n_q, n_k]"),
    ({"shape": [1, 2, 4]}, {}, "expected [B|1, H|1, n_q, n_k]"),
    ({"grad": "yes"}, {}, "expected true or false"),
    ({}, {"check": {"mode": "jvp"}}, "not built"),
    ({}, {"backend": "torch"}, "not the torch closed forms"),
    ({}, {"backend": "torch", "implementation": "bias_attention:torch_bias", "dtype": "bfloat16"},
     "float64 and float32"),
    ({"size": 3}, {}, "unknown key 'size'"),
])
def test_bad_bias_is_refused_with_its_key(bias, extra, message):
    if extra.get("backend") == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ScenarioError) as err:
        make(heads_q=2, n_q=4, d_head=4, bias=bias, **extra)
    assert message in str(err.value) and "bias" in str(err.value)


def test_scenarios_with_biases_of_one_shape_get_their_own_values():
    """The binding of user code and the JAX peer's compiled programs are cached per stage *values* (two seeds give
    two biases of one shape: a cache by label handed the second scenario the first one's bias)."""
    one, two = (score_stages.from_scenario(make(seed=s, heads_q=2, n_q=4, n_k=7, d_head=4, bias={})) for s in (1, 2))
    assert score_stages.labels(one) == score_stages.labels(two) and score_stages.keys(one) != score_stages.keys(two)

    class Probe:
        def forward(self, *args, attn_bias):
            return attn_bias

    probe = Probe()
    got = [score_stages.bind(probe, st, lambda a, same: a, "t").forward() for st in (one, two)]
    assert not np.array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[1], two[0].bias)


def test_the_order_in_force_is_the_scenarios():
    """``stages: [bias, softcap]`` caps the biased scores: the closed forms follow it (against torch autograd of
    c tanh((S + B) / c)), and differ from the default order's."""
    torch = pytest.importorskip("torch")
    keys = dict(batch=2, heads_q=2, n_q=4, n_k=7, d_head=4, softcap=1.5, bias={"shape": [1, 2, 4, 7]},
                mask={"causal": "lower-right"})
    sc = make(stages=["bias", "softcap"], **keys)
    stages = score_stages.from_scenario(sc)
    assert [st.name for st in stages] == ["bias", "softcap"]
    assert [st.name for st in score_stages.from_scenario(make(**keys))] == ["softcap", "bias"]
    q, k, v, g, kv_map, visible = _inputs(h=2, n=4, m=7)
    b = stages[0].bias
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, b)]
    s = 1.5 * torch.tanh((0.6 * (leaves[0] @ leaves[1].transpose(-1, -2)) + leaves[3]) / 1.5)
    o = torch.softmax(s.masked_fill(~torch.from_numpy(visible), float("-inf")), -1) @ leaves[2]
    want = torch.autograd.grad(o, leaves, torch.tensor(g))
    got = formulas.backward(q, k, v, visible, 0.6, kv_map, g, stages=stages)
    for a, w in zip((got.q, got.k, got.v, got.params["bias"]), want):
        np.testing.assert_allclose(a, w, rtol=1e-11, atol=1e-12)
    assert checker.run_scenario(sc).passed
    default = formulas.forward(q, k, v, visible, 0.6, kv_map, stages=(Softcap(1.5), Bias(b, True)))
    assert np.abs(default - o.detach().numpy()).max() > 1e-2  # the order matters: code in the other one fails


@pytest.mark.parametrize("order, message", [(["bias"], "lists bias but the scenario sets softcap, bias"),
                                            (["bias", "bias"], "listed twice"), (["bais"], "did you mean 'bias'")])
def test_a_wrong_order_is_refused(order, message):
    with pytest.raises(ScenarioError) as err:
        make(n_q=4, d_head=4, softcap=1.5, bias={}, stages=order)
    assert message in str(err.value) and "stages" in str(err.value)


def test_the_memory_estimate_counts_a_bias():
    """The loader's estimate (checked before anything of size n_q x n_k exists) includes the bias's copies: the
    tiled engine's O(n) memory ends where a score-sized bias begins."""
    from gradcheck_cli.ops.attention import memory
    plain = make(n_q=8, d_head=4, heads_q=2, engine="tiled")
    biased = make(n_q=8, d_head=4, heads_q=2, engine="tiled", bias={"shape": [1, 2, 8, 8]})
    assert memory.need(biased) - memory.need(plain) == 2 * 8 * 8 * 8 * memory.BIAS_COPIES


def test_a_bias_from_a_npy_file_is_checked_and_a_bad_file_is_refused_with_its_key(tmp_path):
    """bias: {values: file.npy}: the user's own values, relative to the YAML; a wrong file names bias.values."""
    import yaml

    from gradcheck_cli import scenario
    values = np.random.default_rng(3).standard_normal((1, 2, 4, 7))
    np.save(tmp_path / "b.npy", values)
    np.save(tmp_path / "wrong.npy", np.ones((1, 2, 4, 6)))
    keys = dict(name="t", heads_q=2, n_q=4, n_k=7, d_head=4, mask={"causal": "lower-right"})
    (sc,) = scenario.loads(yaml.safe_dump({"scenarios": [{**keys, "bias": {"values": "b.npy"}}]}), base_dir=tmp_path)
    np.testing.assert_array_equal(score_stages.from_scenario(sc)[0].bias, values)
    assert checker.run_scenario(sc).passed
    for name, words in (("wrong.npy", "holds shape [1, 2, 4, 6]"), ("missing.npy", "cannot read the file")):
        with pytest.raises(ScenarioError) as err:
            scenario.loads(yaml.safe_dump({"scenarios": [{**keys, "bias": {"values": name}}]}), base_dir=tmp_path)
        assert "bias.values" in str(err.value) and words in str(err.value)


def test_torch_code_with_a_bias_in_float16_at_a_steep_scale_is_judged_against_torch_softmax_too(monkeypatch):
    """A correct torch implementation (torch.softmax) with a fixed bias in float16 at scale 24 (|S| in the
    hundreds): its error is torch.softmax's, above the explicit exponentials' of the other plain ways; with score
    stages (no SDPA) torch.softmax is one of the plain ways, so it passes (a false FAIL of the variants grid,
    seed 92)."""
    pytest.importorskip("torch")
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # correct_impls
    sc = make(op="attention", batch=2, heads_q=2, heads_kv=2, n_q=15, n_k=19, d_head=64, dtype="float16",
              seed=1901553868, scale=24.3413, mask={"causal": "lower-right"},
              bias={"shape": [1, 2, 15, 19], "grad": False}, implementation="correct_impls:torch_variants",
              backend="torch")
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.tensor, c.detail[:200]) for c in result.checks if not c.passed]
