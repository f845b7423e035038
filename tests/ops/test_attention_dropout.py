"""Attention dropout with a keep mask (``dropout: {p}``): the closed forms, the tiled engine and the fast forward
against torch autograd of the definition (softmax, times M / (1 - p), times V), with sinks and the LSE output too;
the engines' scenarios and faults; user code given keep_mask= and dropout_p= (the examples pass, the broken ones
fail with the cause named); the loader's refusals."""
import numpy as np
import pytest

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import copies, formulas, tiled
from gradcheck_cli.ops.attention.stages.dropout import Dropout
from gradcheck_cli.ops.attention.stages.sinks import Sinks

from helpers import make, with_code, with_examples


@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_closed_forms_tiled_engine_and_fast_forward_equal_torch_autograd_of_the_definition(with_sinks):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, g = (rng.standard_normal((2, 4, 5, 4)) for _ in range(2))
    k, v = (rng.standard_normal((2, 2, 9, 4)) for _ in range(2))
    kv_map = np.arange(4) // 2
    visible = masks.build_visible(2, 4, 5, 9, causal="lower-right", key_lengths=(9, 7))
    keep = rng.random((2, 4, 5, 9)) >= 0.3
    sinks = np.array([0.5, -1.0, 3.0, -0.2])
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    s = (0.7 * (leaves[0] @ leaves[1][:, kv_map].transpose(-1, -2))).masked_fill(~torch.from_numpy(visible),
                                                                                   float("-inf"))
    if with_sinks:
        s = torch.cat([s, leaves[3].reshape(1, -1, 1, 1).expand(2, -1, 5, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :9] * torch.from_numpy(keep) / 0.7
    o = p @ leaves[2][:, kv_map]
    want = torch.autograd.grad(o, leaves if with_sinks else leaves[:3], torch.tensor(g))
    stages = ((Sinks(sinks, grad=True),) if with_sinks else ()) + (Dropout(keep, 0.3),)
    np.testing.assert_allclose(formulas.forward(q, k, v, visible, 0.7, kv_map, stages=stages), o.detach(),
                               rtol=1e-12, atol=1e-13)
    mine = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages)
    got = (mine.q, mine.k, mine.v) + ((mine.params["sinks"],) if with_sinks else ())
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(tiled.forward(q, k, v, visible, 0.7, kv_map, block_q=2, block_k=4, stages=stages),
                               o.detach(), rtol=1e-12, atol=1e-13)
    params: dict = {}
    for a, b in zip(tiled.backward(q, k, v, visible, 0.7, kv_map, g, block_q=3, block_k=2, stages=stages,
                                   params=params), want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    fast = copies.Forward(visible, 0.7, kv_map, 5, 9, rows=2, stages=stages)
    np.testing.assert_allclose(fast(q[None], k, v)[0], o.detach(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("keys", [{}, {"engine": "tiled", "block_q": 2, "block_k": 3}, {"dtype": "float32"},
                                  {"sinks": {"grad": True}, "outputs": ["o", "lse"], "softcap": 2.0}])
def test_engine_scenarios_pass_and_the_dropout_faults_fail_them(keys):
    sc = make(batch=2, heads_q=4, heads_kv=2, n_q=4, n_k=7, d_head=4, dropout={"p": 0.3},
              mask={"causal": "lower-right", "key_lengths": [7, 5]}, **keys)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    for fault, must in (("dropout-dv-unmasked", "gradient v"), ("dropout-ds-dropped", "gradient q"),
                        ("dropout-scale-p", "shifting every V row shifts O by as much")):
        failed = {c.name for c in checker.run_scenario(sc, (fault,)).checks if c.verdict == "fail"}
        assert must in failed, (fault, failed)


@pytest.mark.parametrize("name, backend", [("torch_dropout", "torch"), ("numpy_dropout", "numpy"),
                                           ("jax_dropout", "jax")])
def test_the_examples_pass(name, backend):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    sc = with_examples(implementation=f"dropout_attention:{name}", backend=backend, heads_q=4, heads_kv=2, n_q=4,
                       n_k=7, d_head=4, dropout={"p": 0.25}, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("name, backend, hint", [
    ("torch_dropout_scale_p", "torch", "scales the kept weights by p"),
    ("numpy_dv_unmasked", "numpy", "missing from dV"),
    ("numpy_ds_dropped", "numpy", "built from the dropped weights")])
def test_the_broken_examples_fail_with_the_cause_named(name, backend, hint):
    pytest.importorskip({"numpy": "numpy", "torch": "torch"}[backend])
    sc = with_examples(implementation=f"dropout_attention:{name}", backend=backend, batch=2, heads_q=4, heads_kv=2,
                       n_q=4, n_k=7, d_head=4, dropout={"p": 0.25}, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert result.verdict == "fail"
    assert any(hint in h for h in result.hints), result.hints


def test_the_keep_mask_is_seeded_and_passed_as_booleans():
    from gradcheck_cli.ops.attention import stages as score_stages
    a, b = (score_stages.from_scenario(make(heads_q=2, n_q=6, d_head=2, dropout={"p": 0.5}, seed=s))[-1]
            for s in (1, 1))
    assert a.keep.dtype == bool and (a.keep == b.keep).all() and 0.2 < a.keep.mean() < 0.8
    assert score_stages.kwargs((a,))["dropout_p"] == 0.5


@pytest.mark.parametrize("dropout, extra, words", [
    ({"p": 1.0}, {}, "in (0, 1)"), ({"p": 0.0}, {}, "must be > 0"),
    ({"p": 0.1}, {"check": {"mode": "jvp"}}, "not check.mode jvp yet"),
    ({"p": 0.1}, {"backend": "torch"}, "not the torch closed forms")])
def test_bad_dropout_is_refused_with_its_key(dropout, extra, words):
    if extra.get("backend") == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ScenarioError) as err:
        make(heads_q=2, n_q=3, d_head=2, dropout=dropout, **extra)
    assert "dropout" in str(err.value.key) and words in str(err.value), str(err.value)


def test_the_keep_mask_stays_boolean_on_stacked_copies(tmp_path):
    """Code that uses the mask as a condition (torch.where, ~keep_mask) gets booleans on every call, the perturbed
    copies stacked along the batch axis included (a cold trial's false FAIL)."""
    pytest.importorskip("torch")
    sc = with_code(
        tmp_path,
        "import torch\n"
        "def where_drop(q, k, v, visible, scale, kv_map, *, keep_mask, dropout_p):\n"
        "    assert keep_mask.dtype == torch.bool\n"
        "    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float('-inf'))\n"
        "    return torch.where(keep_mask, torch.softmax(s, -1) / (1 - dropout_p), 0.0) @ v[:, kv_map]\n",
        backend="torch", function="where_drop", heads_q=4, heads_kv=2, n_q=5, n_k=7, d_head=4,
        dropout={"p": 0.3})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


# --- a keep mask the code draws (dropout: {p, drawn_by: code}) ---

_DRAWN = {"dropout": {"p": 0.25, "drawn_by": "code"}, "heads_q": 4, "heads_kv": 2, "n_q": 5, "n_k": 7, "d_head": 4,
          "mask": {"causal": "lower-right"}}


@pytest.mark.parametrize("name, backend, extra", [
    ("torch_global", "torch", {}), ("torch_generator", "torch", {"batch": 3}),
    ("numpy_drawn", "numpy", {"batch": 2}), ("jax_drawn", "jax", {"dtype": "float32"})])
def test_code_that_draws_its_mask_from_dropout_seed_passes(name, backend, extra):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    sc = with_examples(implementation=f"dropout_drawn:{name}", backend=backend, **{**_DRAWN, **extra})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    kept = next(c for c in result.checks if c.name == "keep mask keeps 1 - p of the weights")
    assert "the same mask on all" in kept.detail


@pytest.mark.parametrize("name, failed, hint", [
    ("torch_unseeded", "keep mask the same on every call", "changes from call to call"),
    ("torch_keeps_p", "keep mask keeps 1 - p of the weights", None),
    ("torch_mask_flipped", "forward agrees with the reference", "keeps the entries the keep_mask it returns drops")])
def test_a_mask_drawn_wrongly_fails_the_check_that_names_it(name, failed, hint):
    pytest.importorskip("torch")
    result = checker.run_scenario(with_examples(implementation=f"dropout_drawn:{name}", backend="torch", **_DRAWN))
    assert failed in {c.name for c in result.checks if c.verdict == "fail"}
    assert hint is None or any(hint in h for h in result.hints), result.hints


def _drawn_code(tmp_path, body: str, **keys):
    return checker.run_scenario(with_code(
        tmp_path,
        "import torch\n"
        "def f(q, k, v, visible, scale, kv_map, *, dropout_p, dropout_seed, return_lse=False):\n"
        "    g = torch.Generator().manual_seed(dropout_seed)\n"
        "    keep = torch.rand(q.shape[:-1] + (k.shape[-2],), generator=g, dtype=q.dtype) >= dropout_p\n"
        "    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float('-inf'))\n"
        "    o = (torch.softmax(s, -1) * keep / (1 - dropout_p)) @ v[:, kv_map]\n"
        "    lse = torch.logsumexp(s, -1)\n" + body,
        backend="torch", function="f", **_DRAWN, **keys))


def test_a_drawn_mask_with_the_lse_output_and_as_float_zeros_and_ones_passes(tmp_path):
    pytest.importorskip("torch")
    result = _drawn_code(tmp_path, "    return o, lse, keep.to(q.dtype)\n", outputs=["o", "lse"])
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("body, words", [
    ("    return o\n", "returns (o, keep_mask)"),
    ("    return o, keep / (1 - dropout_p)\n", "already scaled by 1 / (1 - p)"),
    ("    return o, keep[0]\n", "keep_mask must be [B, Hq, n_q, n_k]")])
def test_a_drawn_mask_returned_wrongly_is_a_failed_check_that_says_so(tmp_path, body, words):
    pytest.importorskip("torch")
    result = _drawn_code(tmp_path, body)
    assert result.verdict == "fail"
    assert any(words in c.detail for c in result.checks if c.verdict == "fail"), \
        [(c.name, c.detail) for c in result.checks if c.verdict == "fail"]


def test_drawn_by_code_without_code_is_refused_with_its_key():
    with pytest.raises(ScenarioError) as err:
        make(heads_q=2, n_q=3, d_head=2, dropout={"p": 0.1, "drawn_by": "code"})
    assert err.value.key.endswith("dropout.drawn_by") and "no code of yours" in str(err.value), str(err.value)
