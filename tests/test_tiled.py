"""The tiled (FlashAttention-style) engine: the same function as the naive engine to rounding, for any
shape, mask, GQA map and block size; it passes every shipped attention scenario and catches the same
faults by finite differences; masks can be built block by block."""
import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gradcheck_cli import checker, masks, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops import OPS, attention, tiled
from conftest import CONFIGS, load_config
from helpers import make


@st.composite
def problems(draw):
    batch, heads_kv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(1, 20)), draw(st.integers(1, 24))
    causal = draw(st.sampled_from(["none", "upper-left", "lower-right"]))
    window = draw(st.none() | st.tuples(st.none() | st.integers(0, 6), st.none() | st.integers(0, 6)))
    lengths = draw(st.none() | st.lists(st.integers(1, n_k), min_size=batch, max_size=batch))
    visible = masks.build_visible(batch, heads_q, n_q, n_k, causal=causal, window=window, key_lengths=lengths)
    if masks.first_empty_row(visible) is not None:
        visible = masks.build_visible(batch, heads_q, n_q, n_k)  # every row needs a key
        causal, window, lengths = "none", None, None
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    q, k = rng.standard_normal((batch, heads_q, n_q, d)), rng.standard_normal((batch, heads_kv, n_k, d))
    v, g = rng.standard_normal((batch, heads_kv, n_k, dv)), rng.standard_normal((batch, heads_q, n_q, dv))
    kv_map = np.arange(heads_q) // (heads_q // heads_kv)
    return q, k, v, g, visible, kv_map, draw(st.integers(1, 9)), draw(st.integers(1, 9)), (causal, window, lengths)


@settings(max_examples=60, deadline=None)
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


@settings(max_examples=40, deadline=None)
@given(problems())
def test_blockwise_masks_equal_the_materialised_ones(p):
    q, k, v, g, visible, kv_map, bq, bk, (causal, window, lengths) = p
    block = masks.blockwise(q.shape[-2], k.shape[-2], causal=causal, window=window, key_lengths=lengths)
    o = tiled.forward(q, k, v, block, 0.5, kv_map, block_q=bq, block_k=bk)
    assert np.allclose(o, attention.forward(q, k, v, visible, 0.5, kv_map), rtol=1e-12, atol=1e-12)
    g_q, g_k, g_v = tiled.backward(q, k, v, block, 0.5, kv_map, g, block_q=bq, block_k=bk)
    assert np.allclose(g_k, attention.backward(q, k, v, visible, 0.5, kv_map, g).k, rtol=1e-12, atol=1e-12)


def _attention_scenarios():
    for path in CONFIGS:
        try:
            scs = load_config(path)
        except pytest.skip.Exception:
            continue
        for sc in scs:
            if sc.op == "attention" and sc.backend == "numpy" and sc.implementation is None:
                yield sc


def test_every_shipped_attention_scenario_passes_on_the_tiled_engine():
    ran = 0
    for sc in _attention_scenarios():
        for bq, bk in ((64, 64), (3, 5)):
            result = checker.run_scenario(dataclasses.replace(sc, engine="tiled", block_q=bq, block_k=bk))
            assert result.passed, (sc.name, bq, bk, [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed])
            assert any(c.name == "tiled agrees with the naive engine" for c in result.checks)
            ran += 1
    assert ran >= 40


@pytest.mark.parametrize("fault", sorted(OPS["attention"].faults))
def test_finite_differences_catch_every_fault_on_the_tiled_engine(root, fault):
    f = OPS["attention"].faults[fault]
    caught = False
    for sc in scenario.load(root / "configs" / "tiled.yaml"):
        result = checker.run_scenario(sc, (fault,))
        failed = {c.name for c in result.checks if c.verdict == "fail"}
        agreement = "tiled agrees with the naive engine"
        assert failed <= set(f.caught_by) | {agreement}, failed
        caught |= bool(failed - {agreement})  # caught without the comparison with the naive engine
    assert caught


def test_engine_keys_are_checked():
    with pytest.raises(ScenarioError, match="block sizes apply to engine: tiled"):
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
