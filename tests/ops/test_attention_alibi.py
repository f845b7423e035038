"""ALiBi (``alibi: {slopes, form}``): the slopes against the paper's published values and the rule for other
head counts, the bias against torch autograd of an independent forward, distance and column forms equal under a
lower-right causal mask (and not without it), the tiled engine blockwise without an n_q x n_k array, user code
given ``alibi_slopes=`` (``alibi_form=`` only for the column form), the faults where they apply, and the
loader's messages."""
from pathlib import Path

import numpy as np
import pytest

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import directional, formulas, tiled
from gradcheck_cli.ops.attention import stages as score_stages
from gradcheck_cli.ops.attention.stages.alibi import Alibi, geometric, powers_of_two

from helpers import make, with_examples


def test_geometric_slopes_are_the_papers():
    assert geometric(8) == [2.0 ** -(i + 1) for i in range(8)]  # 1/2, 1/4, ..., 1/256
    assert geometric(4) == [2.0 ** -(2 * (i + 1)) for i in range(4)]
    # not a power of two: the 4 slopes of 4 heads, then every other slope of 8 heads (1/2, 1/8)
    assert geometric(6) == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    assert len(geometric(12)) == 12 and len(set(geometric(12))) == 12
    assert powers_of_two(6) != geometric(6)  # the bug of transformers #28380


def _inputs(seed=0, h=6, n=5, m=9, d=4):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(s) for s in [(2, h, n, d), (2, h, m, d), (2, h, m, d), (2, h, n, d)])
    return q, k, v, g, np.arange(h)


def test_the_closed_forms_equal_torch_autograd_of_the_definition():
    torch = pytest.importorskip("torch")
    q, k, v, g, kv_map = _inputs()
    n, m = q.shape[2], k.shape[2]
    visible = masks.build_visible(2, 6, n, m, causal="lower-right", key_lengths=(9, 8))
    slopes = np.array(geometric(6))
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    bias = torch.tensor(-slopes[:, None, None] * np.abs(i + m - n - j))

    def f(q, k, v):  # from the definition: S + bias, masked, softmax
        s = 0.7 * (q @ k.transpose(-1, -2)) + bias
        return torch.softmax(s.masked_fill(~torch.from_numpy(visible), float("-inf")), -1) @ v

    stages = (Alibi(slopes, "distance", n, m),)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    o = f(*leaves)
    grads = torch.autograd.grad(o, leaves, torch.tensor(g))
    np.testing.assert_allclose(formulas.forward(q, k, v, visible, 0.7, kv_map, stages=stages), o.detach(),
                               rtol=1e-12, atol=1e-13)
    mine = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages)
    for a, b in zip((mine.q, mine.k, mine.v), grads):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    plain = formulas.forward(q, k, v, visible, 0.7, kv_map)
    assert np.abs(plain - o.detach().numpy()).max() > 1e-2  # the bias matters on these inputs


@pytest.mark.parametrize("form", ["distance", "column"])
def test_the_slopes_gradient_equals_torch_autograd_of_the_definition(form):
    torch = pytest.importorskip("torch")
    q, k, v, g, kv_map = _inputs()
    n, m = q.shape[2], k.shape[2]
    visible = masks.build_visible(2, 6, n, m, causal="lower-right", key_lengths=(9, 8))
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    d = torch.tensor(-np.abs(i + m - n - j) if form == "distance" else np.broadcast_to(j, (n, m)), dtype=torch.float64)
    slopes = np.array(geometric(6))
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, slopes)]

    def f(q, k, v, m):
        s = 0.7 * (q @ k.transpose(-1, -2)) + m[:, None, None] * d
        return torch.softmax(s.masked_fill(~torch.from_numpy(visible), float("-inf")), -1) @ v

    want = torch.autograd.grad(f(*leaves), leaves, torch.tensor(g))
    stages = (Alibi(slopes, form, n, m, grad=True),)
    mine = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages)
    for a, b in zip((mine.q, mine.k, mine.v, mine.params["alibi_slopes"]), want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    params: dict = {}
    tiled.backward(q, k, v, visible, 0.7, kv_map, g, block_q=2, block_k=4, stages=stages, params=params)
    np.testing.assert_allclose(params["alibi_slopes"], want[3], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("keys", [{}, {"engine": "tiled", "block_q": 2, "block_k": 4},
                                  {"implementation": "correct_impls:numpy_variants_learned_slopes"},
                                  {"implementation": "correct_impls:torch_variants", "backend": "torch"}])
def test_learned_slopes_are_checked_like_q_k_v_and_their_faults_fail_them(keys, monkeypatch):
    if keys.get("backend") == "torch":
        pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # correct_impls
    sc = make(batch=2, heads_q=6, heads_kv=3, n_q=4, n_k=7, d_head=4, alibi={"grad": True},
              mask={"causal": "lower-right"}, **keys)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert "gradient alibi_slopes" in {c.name for c in result.checks}
    for fault in ("alibi-slope-grad-sign", "alibi-slope-grad-batch"):
        failed = {c.name for c in checker.run_scenario(sc, (fault,)).checks if c.verdict == "fail"}
        assert "gradient alibi_slopes" in failed, (fault, failed)
        assert failed <= {"gradient alibi_slopes", "backward agrees with the reference",
                          "tiled agrees with the naive engine"}, (fault, failed)
    fixed = make(heads_q=6, n_q=4, n_k=7, d_head=4, alibi={"form": "column", "grad": True})
    assert "no sign" in score_stages.why_not(fixed, "alibi-slope-grad-sign")
    assert "not checked" in score_stages.why_not(make(heads_q=6, n_q=4, n_k=7, d_head=4, alibi={}),
                                                 "alibi-slope-grad-batch")


@pytest.mark.parametrize("extra, message", [({"check": {"mode": "jvp"}}, "not built"),
                                            ({"backend": "torch"}, "not the torch closed forms"),
                                            ({"dtype": "bfloat16", "backend": "torch",
                                              "implementation": "alibi_attention:torch_alibi"}, "float64 and float32")])
def test_learned_slopes_where_not_built_are_refused_with_the_key(extra, message):
    if extra.get("backend") == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ScenarioError) as err:
        with_examples(heads_q=4, n_q=4, d_head=4, alibi={"grad": True}, **extra)
    assert message in str(err.value) and "alibi.grad" in str(err.value)


def test_distance_and_column_forms_agree_only_under_lower_right_causal_masking():
    q, k, v, g, kv_map = _inputs()
    n, m = q.shape[2], k.shape[2]
    slopes = geometric(6)
    causal = masks.build_visible(2, 6, n, m, causal="lower-right")
    full = np.ones_like(causal)
    dist, col = (Alibi(slopes, "distance", n, m),), (Alibi(slopes, "column", n, m),)
    for vis, same in ((causal, True), (full, False)):
        a = formulas.forward(q, k, v, vis, 0.7, kv_map, stages=dist)
        b = formulas.forward(q, k, v, vis, 0.7, kv_map, stages=col)
        assert np.allclose(a, b, rtol=1e-12, atol=1e-13) == same


def test_tiled_blockwise_equals_naive_without_a_score_sized_array():
    import tracemalloc
    q, k, v, g, kv_map = _inputs(n=7, m=11)
    visible = masks.build_visible(2, 6, 7, 11, causal="lower-right")
    stages = (Alibi(geometric(6), "distance", 7, 11),)
    np.testing.assert_allclose(tiled.forward(q, k, v, visible, 0.7, kv_map, block_q=2, block_k=3, stages=stages),
                               formulas.forward(q, k, v, visible, 0.7, kv_map, stages=stages), rtol=1e-12, atol=1e-13)
    naive = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages)
    for a, b in zip(tiled.backward(q, k, v, visible, 0.7, kv_map, g, block_q=3, block_k=4, stages=stages),
                    (naive.q, naive.k, naive.v)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    u = [np.random.default_rng(3).standard_normal(x.shape) for x in (q, k, v)]
    np.testing.assert_allclose(tiled.jvp(q, k, v, visible, 0.7, kv_map, *u, block_q=2, block_k=5, stages=stages),
                               directional.jvp(q, k, v, visible, 0.7, kv_map, *u, stages=stages), rtol=1e-11,
                               atol=1e-12)
    n, d = 2048, 16  # one head at n = 2048: the bias is made block by block, never n x n
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 1, n, d)) for _ in range(4))
    big = (Alibi([0.25], "distance", n, n),)
    big[0]._cached = score_stages.alibi.CACHE_BYTES  # no reuse cache: the blocks alone
    tracemalloc.start()
    o, lse = tiled.forward(q, k, v, masks.blockwise(n, n, causal="lower-right"), 0.25, np.zeros(1, np.intp),
                           block_q=128, block_k=128, with_lse=True, stages=big)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < n * n * 8 / 10, peak


def test_scenarios_run_it_and_its_faults_apply_where_they_can():
    sc = make(heads_q=6, heads_kv=3, n_q=4, n_k=7, d_head=4, alibi={"slopes": "geometric"},
              mask={"causal": "lower-right"})
    assert checker.run_scenario(sc).passed
    assert "alibi-offset-backward" in checker.applicable_faults(sc)
    assert not checker.run_scenario(sc, ("alibi-offset-backward",)).passed
    square = make(heads_q=6, heads_kv=3, n_q=7, d_head=4, alibi={}, mask={"causal": "lower-right"})
    assert "n_q = n_k" in score_stages.why_not(square, "alibi-offset-backward")
    column = make(heads_q=6, n_q=4, n_k=7, d_head=4, alibi={"form": "column"})
    assert "column" in score_stages.why_not(column, "alibi-offset-backward")
    four = make(heads_q=4, n_q=4, n_k=7, d_head=4, alibi={})
    assert "power of two" in score_stages.why_not(four, "alibi-slopes-pow2")


@pytest.mark.parametrize("name, form, backend, dtype", [
    ("torch_alibi", "distance", "torch", "float64"), ("torch_bloom", "column", "torch", "float64"),
    ("numpy_alibi", "distance", "numpy", "float64"), ("jax_alibi", "distance", "jax", "float32")])
def test_the_examples_pass(name, form, backend, dtype):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    sc = with_examples(implementation=f"alibi_attention:{name}", backend=backend, heads_q=6, heads_kv=3, n_q=4,
                       n_k=7, d_head=4, dtype=dtype, alibi={"form": form}, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("name, form", [("torch_no_offset", "distance"), ("torch_pow2_slopes", "column")])
def test_the_broken_examples_fail_the_reference(name, form):
    pytest.importorskip("torch")
    sc = with_examples(implementation=f"alibi_attention:{name}", backend="torch", heads_q=6, heads_kv=3, n_q=4,
                       n_k=7, d_head=4, alibi={"form": form}, mask={"causal": "lower-right"})
    failed = {c.name for c in checker.run_scenario(sc).checks if c.verdict == "fail"}
    assert "forward agrees with the reference" in failed, failed


def test_user_code_is_given_the_slopes_and_the_form_only_when_not_the_default():
    dist = score_stages.kwargs((Alibi([0.5, 0.25], "distance", 3, 3),))
    col = score_stages.kwargs((Alibi([0.5, 0.25], "column", 3, 3),))
    assert set(dist) == {"alibi_slopes"} and col["alibi_form"] == "column"
    np.testing.assert_array_equal(dist["alibi_slopes"], [0.5, 0.25])
    negative = checker.negative_controls([with_examples(
        implementation="alibi_attention:numpy_alibi", heads_q=6, heads_kv=3, n_q=4, n_k=7, d_head=4, alibi={},
        mask={"causal": "lower-right"})])
    status = {c.fault: c.status for c in negative}
    assert status["alibi-slopes-pow2"] == "detected" and status["alibi-offset-backward"] == "detected"


def test_slopes_written_1e3_are_numbers():
    """YAML 1.1 reads 1e3 (no dot) as a string; the slopes accept it as the scalar keys do."""
    assert score_stages.from_scenario(make(heads_q=1, n_q=4, d_head=4, alibi={"slopes": ["1e3"]}))[0].slopes[0] == 1000


@pytest.mark.parametrize("alibi, message", [
    ({"slopes": [0.5, 0.25]}, "has 2 slopes but heads_q is 4"),
    ({"slopes": "geometrik"}, "did you mean 'geometric'"),
    ({"slopes": [0.5, -1, 0.1, 0.2]}, "expected a number > 0"),
    ({"form": "row"}, "expected one of distance, column"),
    ({"grad": "yes"}, "expected true or false"),
    ({"size": 2}, "unknown key 'size'"),
    ("yes", "expected a mapping with keys slopes, form"),
])
def test_bad_alibi_is_refused_with_its_key(alibi, message):
    with pytest.raises(ScenarioError) as err:
        make(heads_q=4, n_q=4, d_head=4, alibi=alibi)
    assert message in str(err.value) and "alibi" in str(err.value)
