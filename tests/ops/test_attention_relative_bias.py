"""T5's relative position bias (``relative_bias: {buckets, max_distance, bidirectional, grad}``): its buckets against
transformers' own function, the table's gradient against torch autograd of an independent forward, the tiled engine
block by block against the naive one, user code given ``relative_attention_bias=`` in NumPy, torch and JAX, its
faults where they apply, and the loader's messages."""
import numpy as np
import pytest

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import formulas, tiled
from gradcheck_cli.ops.attention import stages as score_stages
from gradcheck_cli.ops.attention.stages.relative_bias import RelativeBias, bucket
from gradcheck_cli.ops.attention.stages.softcap import Softcap

from helpers import make, with_examples


@pytest.mark.parametrize("buckets, max_distance, bidirectional", [(32, 128, True), (32, 128, False), (8, 16, True),
                                                                   (6, 9, False), (4, 5, True)])
def test_the_buckets_are_transformers_t5s(buckets, max_distance, bidirectional):
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = np.arange(-300, 301)
    want = t5.T5Attention._relative_position_bucket(torch.as_tensor(rel), bidirectional=bidirectional,
                                                    num_buckets=buckets, max_distance=max_distance)
    np.testing.assert_array_equal(bucket(rel, buckets, max_distance, bidirectional), want.numpy())


def _inputs(seed=0, b=2, h=3, n=5, m=11, d=4):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(s) for s in [(b, h, n, d), (b, h, m, d), (b, h, m, d), (b, h, n, d)])
    return q, k, v, g, np.arange(h), masks.build_visible(b, h, n, m, causal="lower-right", key_lengths=(m, m - 3))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_table_gradient_equals_torch_autograd_of_the_definition(bidirectional):
    torch = pytest.importorskip("torch")
    q, k, v, g, kv_map, visible = _inputs()
    table = np.random.default_rng(1).standard_normal((8, 3))
    n, m = q.shape[2], k.shape[2]
    rel = np.arange(m)[None, :] - (np.arange(n)[:, None] + m - n)
    idx = torch.as_tensor(bucket(rel, 8, 6, bidirectional))
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, table)]

    def f(q, k, v, w):  # capped, then the relative bias (an embedding lookup), then the mask
        s = 1.5 * torch.tanh(0.6 * (q @ k.transpose(-1, -2)) / 1.5) + w[idx].permute(2, 0, 1)
        return torch.softmax(s.masked_fill(~torch.from_numpy(visible), float("-inf")), -1) @ v

    o = f(*leaves)
    want = torch.autograd.grad(o, leaves, torch.tensor(g))
    stages = (Softcap(1.5), RelativeBias(table, True, n, m, 6, bidirectional))
    np.testing.assert_allclose(formulas.forward(q, k, v, visible, 0.6, kv_map, stages=stages), o.detach(),
                               rtol=1e-12, atol=1e-13)
    got = formulas.backward(q, k, v, visible, 0.6, kv_map, g, stages=stages)
    for a, b in zip((got.q, got.k, got.v, got.params["relative_bias"]), want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_tiled_blocks_give_the_naive_gradients():
    q, k, v, g, kv_map, visible = _inputs(n=7, m=13)
    stages = (RelativeBias(np.random.default_rng(2).standard_normal((6, 3)), True, 7, 13, 9, False),)
    params: dict = {}
    t = tiled.backward(q, k, v, visible, 0.5, kv_map, g, block_q=2, block_k=3, stages=stages, params=params)
    n = formulas.backward(q, k, v, visible, 0.5, kv_map, g, stages=stages)
    assert params["relative_bias"].shape == (6, 3)
    for a, b in zip((*t, params["relative_bias"]), (n.q, n.k, n.v, n.params["relative_bias"])):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("engine", [{}, {"engine": "tiled", "block_q": 2, "block_k": 4}])
def test_scenarios_check_the_table_like_q_k_v_and_its_faults_fail_only_it(engine):
    sc = make(batch=2, heads_q=2, n_q=4, n_k=12, d_head=4, relative_bias={"buckets": 8, "max_distance": 10},
              mask={"causal": "lower-right"}, **engine)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"q", "k", "v", "relative_bias"} <= {c.tensor for c in result.checks if c.name.startswith("gradient ")}
    failed = {c.name for c in checker.run_scenario(sc, ("relative-bias-scatter",)).checks if c.verdict == "fail"}
    # (the tiled engine writes one pair per bucket per block: its agreement with the naive engine may fail too)
    assert "gradient relative_bias" in failed and failed <= {"gradient relative_bias", "backward agrees with the "
                                                             "reference", "tiled agrees with the naive engine"}
    failed = {c.name for c in checker.run_scenario(sc, ("relative-bias-offset-backward",)).checks
              if c.verdict == "fail"}
    assert {"gradient q", "gradient relative_bias"} <= failed


def test_a_fixed_table_is_no_input_and_the_scatter_fault_does_not_apply():
    sc = make(heads_q=2, n_q=4, n_k=7, d_head=4, relative_bias={"grad": False})
    result = checker.run_scenario(sc)
    assert result.passed and "relative_bias" not in {c.tensor for c in result.checks}
    assert "not checked" in score_stages.why_not(sc, "relative-bias-scatter")
    square = make(n_q=5, n_k=5, d_head=4, relative_bias={})
    assert "n_q = n_k" in score_stages.why_not(square, "relative-bias-offset-backward")


@pytest.mark.parametrize("backend, name, dtype", [("numpy", "numpy_relative", "float64"),
                                                  ("numpy", "numpy_relative", "float32"),
                                                  ("torch", "torch_relative", "float64"),
                                                  ("jax", "jax_relative", "float32")])
def test_user_code_gets_the_table_and_its_gradient_is_checked(backend, name, dtype):
    if backend != "numpy":
        pytest.importorskip(backend)
    sc = with_examples(implementation=f"relative_bias_attention:{name}", backend=backend, dtype=dtype, heads_q=2,
                       heads_kv=1, n_q=4, n_k=18, d_head=4, relative_bias={"buckets": 8, "max_distance": 16},
                       mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"gradient relative_bias", "backward agrees with the reference"} <= {
        c.name for c in result.checks if c.tensor == "relative_bias"}
    if backend == "torch":
        cells = checker.negative_controls([sc])
        assert {"relative-bias-scatter", "relative-bias-offset-backward"} <= {c.fault for c in cells
                                                                              if c.status == "detected"}


def test_numpy_fancy_index_accumulation_is_caught_by_the_tables_checks_alone():
    sc = with_examples(implementation="relative_bias_attention:numpy_relative_fancy_index", heads_q=2, n_q=4, n_k=18,
                       d_head=4, relative_bias={"buckets": 8, "max_distance": 16})
    failed = {(c.name, c.tensor) for c in checker.run_scenario(sc).checks if c.verdict == "fail"}
    assert failed == {("gradient relative_bias", "relative_bias"),
                      ("backward agrees with the reference", "relative_bias")}


@pytest.mark.parametrize("given, extra, message", [
    ({"buckets": 5}, {}, "even number"),
    ({"buckets": 2}, {}, "even number of at least 4"),
    ({"buckets": 1, "bidirectional": False}, {}, ">= 2"),
    ({"buckets": 16, "max_distance": 4}, {}, "must exceed the exact buckets"),
    ({}, {"check": {"mode": "hvp"}}, "not built"),
    ({}, {"backend": "torch"}, "not the torch closed forms"),
    ({"size": 3}, {}, "unknown key 'size'"),
])
def test_bad_relative_bias_is_refused_with_its_key(given, extra, message):
    if extra.get("backend") == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ScenarioError) as err:
        make(heads_q=2, n_q=4, d_head=4, relative_bias=given, **extra)
    assert message in str(err.value) and "relative_bias" in str(err.value)
