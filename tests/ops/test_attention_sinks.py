"""Learnable attention sinks (``sinks: {values, grad}``): the closed forms, the tiled engine and the fast forward
against torch autograd of gpt-oss's own formulation (the sink as one more score column, dropped after the softmax),
the invariants as sinks change them, the faults where they apply, user code given ``sinks=`` (the examples and
their broken variants, with the hints that name the cause), and the loader's messages."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import copies, formulas, tiled
from gradcheck_cli.ops.attention import stages as score_stages
from gradcheck_cli.ops.attention.stages.alibi import Alibi, geometric
from gradcheck_cli.ops.attention.stages.sinks import Sinks
from gradcheck_cli.ops.attention.stages.softcap import Softcap

from helpers import make, with_code, with_examples


def _inputs(seed=0, b=2, h=4, hkv=2, n=5, m=9, d=4):
    rng = np.random.default_rng(seed)
    q, g = (rng.standard_normal((b, h, n, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, hkv, m, d)) for _ in range(2))
    return q, k, v, g, np.arange(h) // (h // hkv)


def _gpt_oss(torch, q, k, v, visible, scale, kv_map, sinks, extra=None):
    """gpt-oss's eager attention (transformers): the sink concatenated as a score column, softmax, dropped."""
    s = scale * (q @ k[:, kv_map].transpose(-1, -2))
    if extra is not None:
        s = extra(s)
    s = s.masked_fill(~torch.from_numpy(visible), float("-inf"))
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([s, col], dim=-1)
    return torch.softmax(logits - logits.max(-1, keepdim=True).values, -1)[..., :-1] @ v[:, kv_map]


@pytest.mark.parametrize("causal, window", [("lower-right", None), ("none", None), ("lower-right", (2, 0))])
def test_the_closed_forms_and_the_tiled_engine_equal_torch_autograd_of_gpt_oss(causal, window):
    torch = pytest.importorskip("torch")
    q, k, v, g, kv_map = _inputs()
    visible = masks.build_visible(2, 4, 5, 9, causal=causal, window=window, key_lengths=(9, 7))
    sinks = np.array([0.5, -1.0, 3.0, -0.2])
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks)]
    o = _gpt_oss(torch, *leaves[:3], visible, 0.7, torch.from_numpy(kv_map), leaves[3])
    want = torch.autograd.grad(o, leaves, torch.tensor(g))
    stages = (Sinks(sinks, grad=True),)
    np.testing.assert_allclose(formulas.forward(q, k, v, visible, 0.7, kv_map, stages=stages), o.detach(),
                               rtol=1e-12, atol=1e-13)
    mine = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages)
    for a, b in zip((mine.q, mine.k, mine.v, mine.params["sinks"]), want):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    o_t, lse = tiled.forward(q, k, v, visible, 0.7, kv_map, block_q=2, block_k=4, with_lse=True, stages=stages)
    np.testing.assert_allclose(o_t, o.detach(), rtol=1e-12, atol=1e-13)
    s = 0.7 * np.einsum("bhid,bhjd->bhij", q, k[:, kv_map])
    full = np.concatenate([np.where(visible, s, -np.inf), np.broadcast_to(sinks[None, :, None, None], (2, 4, 5, 1))],
                          axis=-1)
    np.testing.assert_allclose(lse, np.log(np.exp(full).sum(-1)), rtol=1e-13)  # the sink is in the LSE
    params: dict = {}
    for a, b in zip(tiled.backward(q, k, v, visible, 0.7, kv_map, g, block_q=3, block_k=2, stages=stages,
                                   params=params), want[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(params["sinks"], want[3], rtol=1e-11, atol=1e-12)
    # the weights: rows of A sum to 1 - p, and the sinks change the output
    p = formulas.sink_weight(q, k, visible, 0.7, kv_map, stages)
    a = formulas.attention_weights(q, k, visible, 0.7, kv_map, stages=stages)
    np.testing.assert_allclose(a.sum(-1), 1 - p, rtol=1e-13)
    assert np.abs(formulas.forward(q, k, v, visible, 0.7, kv_map) - o.detach().numpy()).max() > 1e-2


def test_the_sink_gradient_with_softcap_and_learned_alibi_equals_torch_autograd():
    torch = pytest.importorskip("torch")
    q, k, v, g, kv_map = _inputs(1, h=6, hkv=3, n=4, m=7)
    visible = masks.build_visible(2, 6, 4, 7, causal="lower-right")
    sinks, slopes = np.linspace(-2, 2, 6), np.array(geometric(6))
    i, j = np.arange(4)[:, None], np.arange(7)[None, :]
    dist = torch.tensor(-np.abs(i + 3 - j).astype(np.float64))
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks, slopes)]

    def extra(s):
        return 2.0 * torch.tanh(s / 2.0) + leaves[4][:, None, None] * dist
    o = _gpt_oss(torch, *leaves[:3], visible, 0.7, torch.from_numpy(kv_map), leaves[3], extra)
    want = torch.autograd.grad(o, leaves, torch.tensor(g))
    stages = (Softcap(2.0), Alibi(slopes, "distance", 4, 7, grad=True), Sinks(sinks, grad=True))
    mine = formulas.backward(q, k, v, visible, 0.7, kv_map, g, stages=stages)
    for a, b in zip((mine.q, mine.k, mine.v, mine.params["sinks"], mine.params["alibi_slopes"]), want):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), m=st.integers(1, 11), big=st.booleans(), causal=st.sampled_from(["none", "upper-left"]),
       seed=st.integers(0, 2**16))
def test_the_fast_forward_equals_the_closed_form_on_perturbed_copies_of_the_sinks(n, m, big, causal, seed):
    q, k, v, g, kv_map = _inputs(seed, n=n, m=m)
    visible = masks.build_visible(2, 4, n, m, causal=causal)
    if not visible.any(-1).all():
        return  # rows that see no key are refused at load
    rng = np.random.default_rng(seed)
    sinks = rng.normal(0, 30 if big else 1, 4)  # big: the sink dominates (and the max-subtraction matters)
    fast = copies.Forward(visible, 0.7, kv_map, n, m, rows=4, stages=(Sinks(sinks, grad=True),))
    moved = sinks[None] + rng.normal(0, 0.01, (3, 4))  # three perturbed copies of the sinks
    out = fast(q, k, v, stages=score_stages.moved(fast.stages, "sinks", moved))
    for c in range(3):
        np.testing.assert_allclose(out[c], formulas.forward(q, k, v, visible, 0.7, kv_map,
                                                            stages=(Sinks(moved[c], grad=True),)),
                                   rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("keys", [{}, {"engine": "tiled", "block_q": 2, "block_k": 4}, {"dtype": "float32"},
                                  {"implementation": "correct_impls:numpy_variants_learned_sinks"},
                                  {"implementation": "correct_impls:torch_variants", "backend": "torch"},
                                  {"implementation": "correct_impls:jax_variants", "backend": "jax"}])
def test_learned_sinks_are_checked_like_q_k_v_and_their_faults_fail_them(keys, monkeypatch):
    from pathlib import Path
    if keys.get("backend") in ("torch", "jax"):
        pytest.importorskip(keys["backend"])
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # correct_impls
    sc = make(batch=2, heads_q=4, heads_kv=2, n_q=4, n_k=7, d_head=4, sinks={"grad": True},
              mask={"causal": "lower-right", "key_lengths": [7, 5]}, **keys)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert "gradient sinks" in {c.name for c in result.checks}
    for fault in ("sink-grad-dropped", "sink-grad-batch", "sink-grad-sign"):
        failed = {c.name for c in checker.run_scenario(sc, (fault,)).checks if c.verdict == "fail"}
        assert "gradient sinks" in failed, (fault, failed)
        assert failed <= {"gradient sinks", "backward agrees with the reference",
                          "tiled agrees with the naive engine"}, (fault, failed)
    failed = {c.name for c in checker.run_scenario(sc, ("sink-scaled",)).checks if c.verdict == "fail"}
    assert "gradient sinks" in failed or "forward agrees with the reference" in failed, failed


def test_the_invariants_follow_the_sinks_and_still_catch_a_wrong_normaliser():
    """With a sink, rows of A sum to 1 - p, G_S rows to p c, O lies between its V rows and 0 and shifting V moves O
    by (1 - p) c: all pass on correct code where large sinks make p near 1 (a row nearly all sink), and the
    softmax-term fault (the row-sum term of dS dropped) still fails the row-sum invariant."""
    sc = make(batch=2, heads_q=4, heads_kv=2, n_q=6, n_k=9, d_head=8, mask={"causal": "upper-left"},
              sinks={"values": [9.0, -3.0, 0.5, 14.0], "grad": True})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    names = {c.name for c in result.checks}
    assert {"attention rows sum to 1", "score-gradient rows sum to 0", "O rows in the range of visible V rows",
            "shifting every V row shifts O by as much"} <= names
    failed = {c.name for c in checker.run_scenario(sc, ("softmax-term",)).checks if c.verdict == "fail"}
    assert "score-gradient rows sum to 0" in failed


def test_a_forward_without_the_sink_fails_the_invariants_of_the_sinks():
    """User code that forgets the sinks is caught by the reference and by the invariants (O shifted by c, not
    (1 - p) c), and the hint says the sinks are left out."""
    pytest.importorskip("torch")
    sc = with_examples(implementation="sinks_attention:torch_sinks_ignored", backend="torch", heads_q=4, n_q=4,
                       n_k=6, d_head=4, sinks={"grad": False}, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    failed = {c.name for c in result.checks if c.verdict == "fail"}
    assert {"forward agrees with the reference", "shifting every V row shifts O by as much"} <= failed
    assert any("leaves the sinks out of the softmax" in h for h in result.hints), result.hints


@pytest.mark.parametrize("name, backend, keys", [
    ("torch_sinks", "torch", {}), ("torch_sinks", "torch", {"dtype": "float32"}),
    ("torch_sinks", "torch", {"sinks": {"values": [0.5, -1.0, 2.0, 0.0]}}),
    ("numpy_sinks", "numpy", {}), ("jax_sinks", "jax", {})])
def test_the_examples_pass(name, backend, keys):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    sc = with_examples(**{"implementation": f"sinks_attention:{name}", "backend": backend, "heads_q": 4,
                          "heads_kv": 2, "n_q": 4, "n_k": 7, "d_head": 4, "sinks": {"grad": True},
                          "mask": {"causal": "lower-right"}, **keys})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("name, backend, fails, hint", [
    ("torch_sink_scaled", "torch", "forward agrees with the reference", "multiplies the sink logits by the softmax"),
    ("torch_sink_detached", "torch", "gradient sinks", "sinks gets no gradient at all"),
    ("numpy_lse_no_sink", "numpy", "gradient q", "recomputes P without the sinks"),
    ("numpy_sink_first_batch", "numpy", "gradient sinks", "first batch element's alone"),
    ("numpy_delta_no_sink", "numpy", "gradient q", "normalised without the sink")])
def test_the_broken_examples_fail_with_the_cause_named(name, backend, fails, hint):
    pytest.importorskip({"numpy": "numpy", "torch": "torch"}[backend])
    sc = with_examples(implementation=f"sinks_attention:{name}", backend=backend, batch=2, heads_q=4, heads_kv=2,
                       n_q=4, n_k=7, d_head=4, sinks={"grad": True}, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    failed = {c.name for c in result.checks if c.verdict == "fail"}
    assert fails in failed, failed
    assert any(hint in h for h in result.hints), result.hints
    assert not any("normalisation is wrong" in h for h in result.hints), result.hints


def test_faults_apply_where_they_can():
    fixed = make(heads_q=4, n_q=4, n_k=7, d_head=4, sinks={"grad": False})
    assert "not checked" in score_stages.why_not(fixed, "sink-grad-sign")
    assert "another function" in score_stages.why_not(fixed, "sink-scaled")
    one = make(heads_q=4, n_q=4, n_k=7, d_head=4, sinks={"grad": True}, scale=1.0)
    assert "scale 1" in score_stages.why_not(one, "sink-scaled")
    assert "batch 1" in score_stages.why_not(one, "sink-grad-batch")
    assert score_stages.why_not(make(batch=2, heads_q=4, n_q=4, d_head=4, sinks={"grad": True}),
                                "sink-grad-batch") is None


def test_the_sinks_come_last_whatever_the_order_of_the_stages():
    sc = make(heads_q=2, n_q=3, n_k=4, d_head=2, softcap=2.0, bias={"grad": False}, sinks={},
              stages=["bias", "softcap"])
    assert [st.name for st in score_stages.from_scenario(sc)] == ["bias", "softcap", "sinks"]
    seeded = score_stages.from_scenario(make(heads_q=3, n_q=3, d_head=2, sinks={}))[-1].logits()
    assert seeded.shape == (3,) and np.abs(seeded).max() > 0  # seeded from the scenario's seed


@pytest.mark.parametrize("sinks, extra, key, words", [
    ({"values": [1.0, 2.0]}, {}, "sinks.values", "has 2 logits but heads_q is 4"),
    ({"values": [1.0, "x", 2.0, 3.0]}, {}, "sinks.values", "finite number"),
    ({"values": [1e30, 1.0, 2.0, 3.0]}, {}, "sinks.values", "takes all of a row's weight"),
    ({"grad": "yes"}, {}, "sinks.grad", ""),
    ({"value": [1.0]}, {}, "sinks.value", "values"),
    ({"grad": True}, {"check": {"mode": "jvp"}}, "sinks.grad", "JVP along the sinks is not built"),
    ({}, {"stages": ["sinks"]}, "stages", "")])
def test_bad_sinks_are_refused_with_their_key(sinks, extra, key, words):
    with pytest.raises(ScenarioError) as err:
        make(heads_q=4, n_q=3, d_head=2, sinks=sinks, **extra)
    assert key in str(err.value.key) and words in str(err.value), (err.value.key, str(err.value))


@pytest.mark.parametrize("keys", [
    {"check": {"mode": "jvp"}}, {"check": {"mode": "hvp"}, "softcap": 2.0},
    {"check": {"mode": "jvp"}, "engine": "tiled", "block_q": 2, "block_k": 3},
    {"backend": "torch"}, {"backend": "torch", "dtype": "bfloat16"},
    {"backend": "torch", "dtype": "float16", "implementation": "sinks_attention:torch_sinks"},
    {"backend": "torch", "check": {"mode": "hvp"}, "implementation": "sinks_attention:torch_sinks"},
    {"backend": "jax", "dtype": "bfloat16", "implementation": "sinks_attention:jax_sinks"}])
def test_fixed_sinks_pass_in_every_mode_engine_and_precision_and_a_left_out_sink_fails(keys):
    """Fixed sinks: the JVP/HVP closed forms (the softmax with one more fixed column), the tiled JVP, the torch
    closed forms and the half-precision peers (torch and JAX) all take the sink; the JVP-centring fault is still
    caught along the JVP, and code that leaves the sink out fails in half precision too."""
    if keys.get("backend") in ("torch", "jax"):
        pytest.importorskip(keys["backend"])
    base = dict(batch=2, heads_q=4, heads_kv=2, n_q=4, n_k=7, d_head=4, sinks={"values": [0.5, -1.0, 2.0, 0.0]},
                mask={"causal": "lower-right"})
    sc = with_examples(**base, **keys)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    if keys.get("check") == {"mode": "jvp"}:
        assert not checker.run_scenario(sc, ("jvp-centring",)).passed
    if keys.get("implementation") == "sinks_attention:torch_sinks" and keys.get("dtype"):
        broken = with_examples(**base, **{**keys, "implementation": "sinks_attention:torch_sinks_ignored"})
        assert checker.run_scenario(broken).verdict == "fail"


def test_the_sinks_are_passed_in_the_inputs_dtype_as_a_models_parameter_is(tmp_path):
    """gpt-oss's eager form concatenates its sinks parameter (bf16 in a bf16 model) to the scores without a cast:
    the tool passes the sinks in the inputs' dtype, so that code runs as it is (torch.cat refuses mixed dtypes)."""
    pytest.importorskip("torch")
    source = ("import torch\n"
              "def gpt_oss(q, k, v, visible, scale, kv_map, *, sinks):\n"
              "    assert sinks.dtype == q.dtype, (sinks.dtype, q.dtype)\n"
              "    s = (scale * (q @ k[:, kv_map].transpose(-1, -2))).masked_fill(~visible, float('-inf'))\n"
              "    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)\n"
              "    return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1] @ v[:, kv_map]\n")
    for dtype in ("bfloat16", "float16", "float32"):
        sc = with_code(tmp_path, source, name=dtype, backend="torch", function="gpt_oss", dtype=dtype,
                       heads_q=4, heads_kv=2, n_q=4, n_k=6, d_head=4, sinks={"values": [0.5, -1.0, 2.0, 0.0]},
                       mask={"causal": "lower-right"})
        result = checker.run_scenario(sc)
        assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
