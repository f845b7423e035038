"""Regression tests for false FAILs and false inconclusives on correct code (issue 11): each case below
failed or was inconclusive on correct code before the verdicts were made precision-aware and every
invariant bound was taken from the size of its terms."""
import textwrap

import numpy as np
import pytest

from gradcheck_cli import checker, report
from gradcheck_cli.result import ControlCell, controls_verdict

from helpers import make


def _not_passed(result):
    return [(c.name, c.tensor, c.verdict, c.detail[:200]) for c in result.checks if c.verdict != "pass"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scale", [3.0, 7.0])
def test_tiled_score_gradient_rows_with_large_logits(seed, scale):
    sc = make(engine="tiled", block_q=4, block_k=8, batch=1, heads_q=2, n_q=12, n_k=20, d_head=64, scale=scale,
              seed=seed, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    rows = [c for c in result.checks if c.name == "score-gradient rows sum to 0"]
    assert rows and rows[0].passed, _not_passed(result)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("temperature", [0.01, 0.02])
def test_infonce_logit_rows_when_the_softmax_saturates(dtype, temperature):
    sc = make(op="infonce", batch=4, dim=8, hard_negatives=1, temperature=temperature, dtype=dtype, seed=3)
    result = checker.run_scenario(sc)
    (rows,) = [c for c in result.checks if c.name == "logit gradients sum to 0 per query"]
    assert rows.verdict == "pass" and result.verdict != "fail", _not_passed(result)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_rmsnorm_with_a_single_feature(dtype, eps):
    """d_model = 1: G_x is exactly 0 (eps = 0), or eps / r^3 (tiny), computed as the difference of two
    nearly equal terms. Never a FAIL; with eps > 0 in float32 a G_x below what float32 can resolve is
    inconclusive for lack of power (true), not failed."""
    for seed in range(3):
        sc = make(op="rmsnorm", batch=2, n=5, d_model=1, eps=eps, dtype=dtype, seed=seed)
        result = checker.run_scenario(sc)
        assert all(c.passed for c in result.checks if c.kind == "invariant"), _not_passed(result)
        if eps == 0 or dtype == "float64":
            assert result.verdict == "pass", _not_passed(result)
        else:
            assert result.verdict != "fail" and all("no power" in d for *_, d in _not_passed(result))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("implementation", [None, "correct_impls:torch_sdpa", "correct_impls:torch_custom"])
def test_half_precision_on_small_tensors(root, monkeypatch, dtype, implementation):
    """n = 4, d = 64: the plain computation's largest error is the max of a handful of elements."""
    pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    extra = {"implementation": implementation} if implementation else {}
    for seed in range(6):
        sc = make(backend="torch", dtype=dtype, batch=1, heads_q=1, n_q=4, n_k=4, d_head=64, seed=seed, **extra)
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (seed, _not_passed(result))


def test_v_differences_are_not_charged_the_logits_rounding():
    """Moving V leaves the logits alone: float32 on peaked rows keeps its power on V."""
    for seed in range(3):
        sc = make(dtype="float32", batch=1, heads_q=2, n_q=8, n_k=24, d_head=64, scale=0.9, seed=seed)
        result = checker.run_scenario(sc)
        assert result.verdict == "pass", (seed, _not_passed(result))


def test_rounding_that_depends_on_the_batch_size_is_not_a_leak(tmp_path, monkeypatch):
    """A float32 forward whose summation order changes with the batch size (as XLA's kernels do): the
    blocks stay independent to the rounding of their own terms."""
    (tmp_path / "batchy.py").write_text(textwrap.dedent("""
        import numpy as np
        from my_attention import Attention

        class Batchy(Attention):
            @staticmethod
            def forward(q, k, v, visible, scale, kv_map):
                if q.shape[0] <= 2:
                    return Attention.forward(q, k, v, visible, scale, kv_map)
                p = np.exp(np.where(visible, scale * q @ np.swapaxes(k[:, kv_map], -1, -2), -np.inf))
                p = p / p[..., ::-1].sum(axis=-1, keepdims=True)      # sums in the other order
                return (p @ v[:, kv_map]).astype(q.dtype)

        impl = Batchy()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from helpers import ROOT
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    sc = make(dtype="float32", batch=2, heads_q=2, n_q=6, n_k=9, d_head=8, scale=0.5, implementation="batchy:impl")
    result = checker.run_scenario(sc)
    blocks = [c for c in result.checks if c.name == "perturbations stay in their block"]
    assert blocks and all(c.passed for c in blocks), _not_passed(result)
    assert result.verdict == "pass", _not_passed(result)


def test_negative_controls_where_no_fault_applies_are_inconclusive_not_a_pass():
    cells = [ControlCell("a", "s1", "detected", 1.0, ("x",)), ControlCell("a", "s2", "not applicable", 0.0, (), "why"),
             ControlCell("b", "s2", "not applicable", 0.0, (), "why")]
    assert controls_verdict(cells) == ("inconclusive", ["s2"])
    data = report.json_report("c.yaml", (), [], cells)
    assert data["verdict"] == "inconclusive" and data["passed"] is False
    assert data["negative_controls"]["powerless"] == ["s2"] and data["negative_controls"]["verdict"] == "inconclusive"
    cells.append(ControlCell("b", "s1", "missed", 1.0, ()))
    assert controls_verdict(cells)[0] == "fail"


def test_an_implementation_that_computes_in_float32_gets_the_precision_verdict_everywhere(root, monkeypatch):
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    for seed in range(5):
        sc = make(batch=2, heads_q=4, heads_kv=2, n_q=7, n_k=9, d_head=16, seed=seed, mask={"causal": "lower-right"},
                  implementation="correct_impls:float32_inside")
        result = checker.run_scenario(sc)
        assert result.verdict == "inconclusive", _not_passed(result)
        assert any("computes internally in about float32" in h for h in result.hints)
        assert len(result.hints) == 1, result.hints
        sc32 = make(batch=2, heads_q=4, heads_kv=2, n_q=7, n_k=9, d_head=16, seed=seed, dtype="float32",
                    mask={"causal": "lower-right"}, implementation="correct_impls:float32_inside")
        assert checker.run_scenario(sc32).verdict == "pass"


def test_the_precision_of_a_correct_float64_implementation_is_float64(root, monkeypatch):
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    sc = make(batch=2, heads_q=2, n_q=7, n_k=9, d_head=16, implementation="correct_impls:flash")
    result = checker.run_scenario(sc)
    assert result.verdict == "pass"
    for c in result.checks:
        if c.kind == "reference":
            assert "ulps of float64" in c.detail and c.detectable is not None and c.detectable < 1e-10
    assert np.isfinite(list(result.detectable.values())).all()


@pytest.mark.parametrize("seed", [264721, 1])
def test_a_layer_whose_query_and_key_weights_get_no_gradient_passes(seed):
    """One key per query: the softmax is 1 whatever W_Q and W_K are, so their gradients are exactly 0 in the
    reference and rounding (1e-16) in torch's autograd: judged by the size of the terms they are made of (the
    attention's, composed through the projections), not by their zero value (issue 22: a false FAIL)."""
    pytest.importorskip("torch")
    from helpers import with_examples
    sc = with_examples(op="attention-projections", backend="torch", batch=2, heads_q=1, heads_kv=1, n_q=1, d_head=7,
                       d_model=12, seed=seed, mask={"causal": "lower-right"},
                       implementation="torch_ops:attention_projections")
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", _not_passed(result)


def test_a_block_with_one_key_per_query_passes_in_float32():
    """The block's gradients judged by the terms of its parts (attention's, RMSNorm's, RoPE's, SwiGLU's)
    composed, not by each tensor's largest value: W_Q and W_K get no gradient with one key per query."""
    pytest.importorskip("torch")
    from helpers import with_examples
    sc = with_examples(op="block", backend="torch", dtype="float32", seed=105366, batch=3, heads_q=2, heads_kv=1,
                       n_q=1, d_head=8, d_model=9, d_ff=7, mask={"causal": "lower-right"},
                       implementation="torch_ops:block")
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", _not_passed(result)


@pytest.mark.parametrize("keys", [
    {"heads_q": 4, "heads_kv": 1, "n_q": 2, "n_k": 1, "d_head": 2, "seed": 273096045, "mask": {"causal": "upper-left"}},
    {"heads_q": 2, "heads_kv": 1, "n_q": 19, "n_k": 22, "d_head": 1, "seed": 863992525, "mask": {"key_lengths": [1]},
     "check": {"mode": "sample"}}])
def test_float32_rounding_of_the_inputs_alone_is_rounding_not_a_changed_function(root, monkeypatch, keys):
    """One visible key per query: O is V rounded to float32, a sawtooth of V whose second difference over two
    equal steps is exactly 0; the precision test takes first differences (the correct grid found it)."""
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    result = checker.run_scenario(make(batch=1, implementation="correct_impls:float32_inside", **keys))
    assert result.verdict == "inconclusive", _not_passed(result)
