"""The log-sum-exp as a second output (``outputs: [o, lse]``): the closed forms, the tiled engine and the fast
forward against torch autograd of the definition (O and torch.logsumexp, with and without sinks, the sinks'
gradient gaining p_i G_L_i), the engines' scenarios and faults, user code called with return_lse=True (the
examples pass; the broken ones fail with the cause named), and the loader's refusals."""
import numpy as np
import pytest

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import copies, formulas, tiled
from gradcheck_cli.ops.attention.stages.sinks import Sinks

from helpers import make, with_code, with_examples


def _inputs(seed=0, b=2, h=4, hkv=2, n=5, m=9, d=4):
    rng = np.random.default_rng(seed)
    q, g = (rng.standard_normal((b, h, n, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, hkv, m, d)) for _ in range(2))
    return q, k, v, g, rng.standard_normal((b, h, n)), np.arange(h) // (h // hkv)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_closed_forms_tiled_engine_and_fast_forward_equal_torch_autograd_of_the_definition(with_sinks):
    torch = pytest.importorskip("torch")
    q, k, v, g, g_l, kv_map = _inputs()
    visible = masks.build_visible(2, 4, 5, 9, causal="lower-right", key_lengths=(9, 7))
    sinks = np.array([0.5, -1.0, 3.0, -0.2])
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    s = 0.7 * (leaves[0] @ leaves[1][:, kv_map].transpose(-1, -2))
    s = s.masked_fill(~torch.from_numpy(visible), float("-inf"))
    if with_sinks:
        s = torch.cat([s, leaves[3].reshape(1, -1, 1, 1).expand(2, -1, 5, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1)[..., :9] @ leaves[2][:, kv_map]
    loss = (o * torch.tensor(g)).sum() + (lse * torch.tensor(g_l)).sum()
    want = torch.autograd.grad(loss, leaves if with_sinks else leaves[:3])
    stages = (Sinks(sinks, grad=True),) if with_sinks else ()
    np.testing.assert_allclose(formulas.log_sum_exp(q, k, visible, 0.7, kv_map, stages=stages), lse.detach(),
                               rtol=1e-13)
    mine = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages, grad_lse=g_l)
    got = (mine.q, mine.k, mine.v) + ((mine.params["sinks"],) if with_sinks else ())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    params: dict = {}
    for a, b in zip(tiled.backward(q, k, v, visible, 0.7, kv_map, g, block_q=2, block_k=4, stages=stages,
                                   params=params, grad_lse=g_l), want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    if with_sinks:
        np.testing.assert_allclose(params["sinks"], want[3], rtol=1e-11, atol=1e-12)
    fast = copies.Forward(visible, 0.7, kv_map, 5, 9, rows=2, stages=stages)
    o_fast, lse_fast = fast(q[None], k, v, with_lse=True)
    np.testing.assert_allclose(lse_fast[0], lse.detach(), rtol=1e-13)
    np.testing.assert_allclose(o_fast[0], o.detach(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("keys", [{}, {"engine": "tiled", "block_q": 2, "block_k": 3}, {"dtype": "float32"},
                                  {"sinks": {"grad": True}}, {"sinks": {"grad": True}, "engine": "tiled"}])
def test_engine_scenarios_pass_and_the_lse_faults_fail_them(keys):
    sc = make(batch=2, heads_q=4, heads_kv=2, n_q=4, n_k=7, d_head=4, outputs=["o", "lse"],
              mask={"causal": "lower-right", "key_lengths": [7, 5]}, **keys)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    failed = {c.name for c in checker.run_scenario(sc, ("lse-grad-ignored",)).checks if c.verdict == "fail"}
    assert {"gradient q", "gradient k"} <= failed, failed
    if "sinks" in keys:
        failed = {c.name for c in checker.run_scenario(sc, ("sink-grad-lse",)).checks if c.verdict == "fail"}
        assert failed and failed <= {"gradient sinks", "backward agrees with the reference",
                                     "tiled agrees with the naive engine"}, failed


def test_without_the_lse_output_the_lse_faults_do_not_apply():
    from gradcheck_cli.ops.attention import why_not
    plain = make(heads_q=2, n_q=3, d_head=2, sinks={"grad": True})
    assert "no lse" in why_not(plain, "lse-grad-ignored")
    assert "no output" in why_not(plain, "sink-grad-lse")
    assert "lse-grad-ignored" not in checker.applicable_faults(plain)


@pytest.mark.parametrize("name, backend, keys", [
    ("torch_lse", "torch", {}), ("torch_lse", "torch", {"dtype": "float32"}), ("numpy_lse", "numpy", {}),
    ("jax_lse", "jax", {})])
def test_the_examples_pass(name, backend, keys):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    sc = with_examples(implementation=f"lse_attention:{name}", backend=backend, heads_q=4, heads_kv=2, n_q=4,
                       n_k=7, d_head=4, outputs=["o", "lse"], mask={"causal": "lower-right"}, **keys)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert "lse agrees with the reference" in {c.name for c in result.checks}


@pytest.mark.parametrize("name, backend, fails, hint", [
    ("numpy_lse_ignored", "numpy", "gradient q", "ignores the log-sum-exp's upstream gradient"),
    ("torch_lse_log2", "torch", "lse agrees with the reference", "log2 units"),
    ("torch_lse_no_max", "torch", "lse agrees with the reference", "without the row maximum"),
    ("torch_lse_unmasked", "torch", "lse agrees with the reference", "the mask is missing from it")])
def test_the_broken_examples_fail_with_the_cause_named(name, backend, fails, hint):
    pytest.importorskip({"numpy": "numpy", "torch": "torch"}[backend])
    sc = with_examples(implementation=f"lse_attention:{name}", backend=backend, batch=2, heads_q=4, heads_kv=2,
                       n_q=4, n_k=7, d_head=4, outputs=["o", "lse"], mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert fails in {c.name for c in result.checks if c.verdict == "fail"}
    assert any(hint in h for h in result.hints), result.hints


def test_code_that_returns_o_alone_is_told_what_to_return():
    pytest.importorskip("torch")
    sc = with_examples(implementation="sinks_attention:torch_sinks_ignored", backend="torch", heads_q=4, n_q=4,
                       d_head=4, outputs=["o", "lse"], sinks={})
    result = checker.run_scenario(sc)
    assert [c.name for c in result.checks if c.verdict == "fail"] == ["implementation runs"]
    detail = next(c.detail for c in result.checks if c.name == "implementation runs")
    assert "return_lse" in detail and "gradcheck_cli" not in detail  # no place in the tool named as the code's
    assert any("returns (o, lse)" in h for h in result.hints), result.hints


@pytest.mark.parametrize("extra, words", [
    ({"check": {"mode": "hvp"}}, "not check.mode hvp yet"), ({"backend": "torch"}, "not the torch closed forms"),
    ({"outputs": ["lse"]}, "o comes first"), ({"outputs": ["lse", "o"]}, "o comes first"),
    ({"outputs": ["o", "x"]}, "expected one of o, lse")])
def test_where_the_lse_output_is_not_built_it_is_refused_with_the_key(extra, words):
    if extra.get("backend") == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ScenarioError) as err:
        make(heads_q=2, n_q=3, d_head=2, **{"outputs": ["o", "lse"], **extra})
    assert "outputs" in str(err.value.key) and words in str(err.value), str(err.value)


def _flash_style(tmp_path, lse_axes: str, **convention):
    """Torch code in FlashAttention's layout (q, k, v, o [B, n, H, d]) returning its LSE as ``lse_axes``."""
    return checker.run_scenario(with_code(
        tmp_path,
        "import torch\n"
        "def f(q, k, v, visible, scale, kv_map, *, return_lse=False):\n"
        "    q, k, v = (t.transpose(1, 2) for t in (q, k[:, :, kv_map], v[:, :, kv_map]))\n"
        "    s = (scale * q @ k.transpose(-1, -2)).masked_fill(~visible, float('-inf'))\n"
        "    o = (torch.softmax(s, -1) @ v).transpose(1, 2)\n"
        "    lse = torch.logsumexp(s, -1)\n"
        f"    return (o, lse if {lse_axes!r} == 'bhn' else lse.transpose(1, 2)) if return_lse else o\n",
        backend="torch", function="f", outputs=["o", "lse"], heads_q=4, heads_kv=2, n_q=5, n_k=7,
        d_head=4, mask={"causal": "lower-right"}, convention={"layout": "bnhd", **convention}))


@pytest.mark.parametrize("lse_axes, convention", [("bhn", {}), ("bnh", {"lse_layout": "bnh"})])
def test_the_lse_in_either_order_beside_o_in_flash_attention_layout_passes(tmp_path, lse_axes, convention):
    """q, k, v, o as [B, n, H, d] with softmax_lse [B, H, n] (FlashAttention's, the default lse_layout) or
    [B, n, H] (jax.nn.dot_product_attention's residual: lse_layout bnh)."""
    pytest.importorskip("torch")
    result = _flash_style(tmp_path, lse_axes, **convention)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


def test_an_lse_in_the_other_order_is_told_which_lse_layout_to_set(tmp_path):
    pytest.importorskip("torch")
    result = _flash_style(tmp_path, "bnh")
    detail = " ".join(c.detail for c in result.checks if c.verdict == "fail")
    assert "lse must be [B, Hq, n_q] = [1, 4, 5]" in detail and "lse_layout: bnh" in detail, detail
