"""The tiled (FlashAttention-style) engine: the same function as the naive engine to rounding, for any
shape, mask, GQA map and block size; it passes every shipped attention scenario and catches the same
faults by finite differences; masks can be built block by block."""
import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings

from gradcheck_cli import checker, masks, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops import attention
from gradcheck_cli.ops.attention import tiled

from helpers import CONFIGS, examples, load_config, make
from strategies import problems


@settings(max_examples=examples(1.5))
@given(problems())
def test_tiled_equals_naive_for_any_shape_mask_and_block(p):
    q, k, v, g, visible, kv_map, bq, bk, _ = p
    scale = 0.7
    o = attention.forward(q, k, v, visible, scale, kv_map)
    ref = attention.backward(q, k, v, visible, scale, kv_map, g)
    o_t, lse = tiled.forward(q, k, v, visible, scale, kv_map, block_q=bq, block_k=bk, with_lse=True)
    g_q, g_k, g_v = tiled.backward(q, k, v, visible, scale, kv_map, g, block_q=bq, block_k=bk)
    for mine, theirs in ((o_t, o), (g_q, ref.q), (g_k, ref.k), (g_v, ref.v)):
        assert np.allclose(mine, theirs, rtol=1e-12, atol=1e-12)
    # the log-sum-exp is that of the visible scores
    s = np.where(visible, scale * q @ np.swapaxes(k[:, kv_map], -1, -2), -np.inf)
    assert np.allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-12)
    # perturbed copies on a leading axis, as finite differences use them
    copies = np.stack([q, 2 * q])
    assert np.allclose(tiled.forward(copies, k, v, visible, scale, kv_map, block_q=bq, block_k=bk),
                       attention.forward(copies, k, v, visible, scale, kv_map), rtol=1e-12, atol=1e-12)


@given(problems())
def test_blockwise_masks_equal_the_materialised_ones(p):
    q, k, v, g, visible, kv_map, bq, bk, (causal, window, lengths) = p
    block = masks.blockwise(q.shape[-2], k.shape[-2], causal=causal, window=window, key_lengths=lengths)
    o = tiled.forward(q, k, v, block, 0.5, kv_map, block_q=bq, block_k=bk)
    assert np.allclose(o, attention.forward(q, k, v, visible, 0.5, kv_map), rtol=1e-12, atol=1e-12)
    g_q, g_k, g_v = tiled.backward(q, k, v, block, 0.5, kv_map, g, block_q=bq, block_k=bk)
    ref = attention.backward(q, k, v, visible, 0.5, kv_map, g)
    for mine, theirs in ((g_q, ref.q), (g_k, ref.k), (g_v, ref.v)):  # G_Q and G_V were computed, never compared
        assert np.allclose(mine, theirs, rtol=1e-12, atol=1e-12)


def _attention_scenarios():
    for path in CONFIGS:
        try:
            scs = load_config(path)
        except pytest.skip.Exception:
            continue
        for sc in scs:
            # (mode jvp: the tiled engine computes no JVP yet)
            if sc.op == "attention" and sc.backend == "numpy" and sc.implementation is None and sc.mode != "jvp":
                yield sc


def test_every_shipped_attention_scenario_passes_on_the_tiled_engine():
    ran = 0
    for sc in _attention_scenarios():
        for bq, bk in ((64, 64), (3, 5)):
            result = checker.run_scenario(dataclasses.replace(sc, engine="tiled", block_q=bq, block_k=bk))
            assert result.passed, (sc.name, bq, bk,
                                   [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed])
            assert any(c.name == "tiled agrees with the naive engine" for c in result.checks)
            ran += 1
    assert ran >= 40


def test_engine_keys_are_checked():
    with pytest.raises(ScenarioError, match="applies to engine: tiled"):
        make(n_q=4, d_head=2, block_q=8)
    with pytest.raises(ScenarioError, match="expected one of naive, tiled"):
        make(n_q=4, d_head=2, engine="flash")
    with pytest.raises(ScenarioError, match="does not apply to op rmsnorm"):
        make(op="rmsnorm", d_model=4, engine="tiled")


def test_engine_option_overrides_and_reaches_worker_processes(root, tmp_path):
    for jobs in ("1", "2"):
        out = CliRunner().invoke(main, ["run", str(root / "configs/gqa.yaml"), "--engine", "tiled", "--jobs", jobs])
        assert out.exit_code == 0, out.output
        assert out.output.count("tiled 64x64") == 4 and "tiled agrees with the naive engine" in out.output


def test_tiled_needs_no_score_sized_arrays():
    """n = 2048 on one head: the tiled engine's forward and backward with a blockwise mask never
    allocate an n x n array (tracemalloc sees every NumPy allocation)."""
    import tracemalloc
    n, d = 2048, 16
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 1, n, d)) for _ in range(4))
    mask = masks.blockwise(n, n, causal="lower-right")
    kv_map = np.zeros(1, dtype=np.intp)
    tracemalloc.start()
    o, lse = tiled.forward(q, k, v, mask, 0.25, kv_map, block_q=128, block_k=128, with_lse=True)
    tiled.backward(q, k, v, mask, 0.25, kv_map, g, block_q=128, block_k=128, saved=(o, lse))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < n * n * 8 / 10, peak  # a tenth of one float64 score matrix


def test_agreement_holds_on_peaked_and_saturated_rows():
    """Large logits: the tiled engine forms S exactly as its forward did, and gradients that are zero to
    rounding (a saturated row) are compared against the size of their terms."""
    for scale in (50.0, 1000.0):
        sc = make(engine="tiled", block_q=8, block_k=8, batch=2, heads_q=2, n_q=32, d_head=16, scale=scale,
                  mask={"causal": "lower-right"})
        result = checker.run_scenario(sc)
        assert result.passed, [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]
        cells = checker.negative_controls([sc])
        assert not [c for c in cells if c.status == "missed"], cells


def test_mask_backward_is_the_same_bug_in_both_engines():
    sc = make(engine="tiled", block_q=4, block_k=4, heads_q=2, n_q=9, d_head=4, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc, ("mask-backward",))
    agreement = [c for c in result.checks if c.name == "tiled agrees with the naive engine"]
    assert agreement and all(c.passed for c in agreement)
    assert {"gradient q", "gradient k", "gradient v"} <= {c.name for c in result.checks if c.verdict == "fail"}


def test_the_tiled_backward_checks_its_score_gradient_rows():
    """Without A, the row sums of G_S are accumulated over the blocks: softmax-term is caught in float32
    directional mode, where finite differences alone lack the power."""
    keys = dict(engine="tiled", dtype="float32", batch=2, heads_q=6, heads_kv=2, n_q=11, n_k=29, d_head=4,
                scale=0.1, seed=14, check={"mode": "directional"})
    clean = checker.run_scenario(make(**keys))
    assert clean.passed and any(c.name == "score-gradient rows sum to 0" for c in clean.checks)
    broken = checker.run_scenario(make(**keys), ("softmax-term",))
    assert "score-gradient rows sum to 0" in {c.name for c in broken.checks if c.verdict == "fail"}


def test_the_engine_is_recorded_in_reports_and_merge_refuses_a_mix(root, tmp_path):
    run = CliRunner().invoke
    cfg = str(root / "configs/gqa.yaml")
    out = run(main, ["run", cfg, "--engine", "tiled", "--fault", "gqa-sum", "--json", str(tmp_path / "t.json")])
    assert out.exit_code == 1 and "--fault gqa-sum --engine tiled" in out.output
    data = __import__("json").loads((tmp_path / "t.json").read_text())
    assert data["engine"] == "tiled" and {s["engine"] for s in data["scenarios"]} == {"tiled"}
    assert run(main, ["run", cfg, "--shard", "1/2", "--engine", "tiled",
                      "--json", str(tmp_path / "a.json")]).exit_code == 0
    assert run(main, ["run", cfg, "--shard", "2/2", "--json", str(tmp_path / "b.json")]).exit_code == 0
    mixed = run(main, ["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert mixed.exit_code == 2 and "different engines" in mixed.stderr


@pytest.mark.slow  # loads a 30000-query scenario: ~4 s
def test_engine_naive_override_keeps_the_memory_refusal(tmp_path):
    cfg = tmp_path / "big.yaml"
    cfg.write_text("scenarios:\n  - {name: big, n_q: 12000, d_head: 8, engine: tiled}\n")
    assert len(scenario.load(cfg, memory_limit=2**32)) == 1  # 4 GiB: fine on the tiled engine
    with pytest.raises(ScenarioError, match="needs about .* GiB on the naive engine"):
        scenario.with_engine(scenario.load(cfg, memory_limit=2**32), "naive", memory_limit=2**32)
