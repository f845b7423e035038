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
from gradcheck_cli.ops.attention import directional, tiled

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


def _tangents(rng, *xs):
    return [rng.standard_normal(x.shape) for x in xs]


@settings(max_examples=examples(1.5))
@given(problems())
def test_tiled_jvp_equals_the_closed_form_for_any_shape_mask_and_block(p):
    """The online-softmax JVP (running sums of exp(S - m) dS, exp(S - m) dS V, exp(S - m) dV beside l and acc_o)
    is directional.jvp to rounding: causal in both alignments, windows, key lengths, GQA, blocks that do not divide
    n, each tangent alone, and with a blockwise mask; perturbed copies on a leading axis broadcast."""
    q, k, v, _, visible, kv_map, bq, bk, (causal, window, lengths) = p
    dq, dk, dv = _tangents(np.random.default_rng(q.size), q, k, v)
    ref = attention.jvp(q, k, v, visible, 0.7, kv_map, dq, dk, dv)
    mine = tiled.jvp(q, k, v, visible, 0.7, kv_map, dq, dk, dv, block_q=bq, block_k=bk)
    np.testing.assert_allclose(mine, ref, rtol=1e-13, atol=1e-13)
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(tiled.jvp(q, k, v, visible, 0.7, kv_map, block_q=bq, block_k=bk, **{name: t}),
                                   attention.jvp(q, k, v, visible, 0.7, kv_map, **{name: t}), rtol=1e-13, atol=1e-13)
    block = masks.blockwise(q.shape[-2], k.shape[-2], causal=causal, window=window, key_lengths=lengths)
    np.testing.assert_allclose(tiled.jvp(q, k, v, block, 0.7, kv_map, dq, dk, dv, block_q=bq, block_k=bk), ref,
                               rtol=1e-13, atol=1e-13)
    copies = tiled.jvp(np.stack([q, 2 * q]), k, v, visible, 0.7, kv_map, dq, dk, dv, block_q=bq, block_k=bk)
    np.testing.assert_allclose(copies[0], ref, rtol=1e-13, atol=1e-13)


@settings(max_examples=examples(1.0))
@given(problems())
def test_tiled_jvp_terms_equal_the_closed_form_ones_by_blocks(p):
    """The noise floor's terms of the JVP, by the JVP's blocks (online softmax, hidden blocks skipped), are
    directional.jvp_terms's: every tangent alone and together, any blocks, a blockwise mask too."""
    q, k, v, _, visible, kv_map, bq, bk, (causal, window, lengths) = p
    dq, dk, dv = _tangents(np.random.default_rng(q.size + 1), q, k, v)
    for t in (dict(dq=dq, dk=dk, dv=dv), dict(dq=dq), dict(dk=dk), dict(dv=dv)):
        ref = directional.jvp_terms(q, k, v, visible, 0.7, kv_map, **t)
        np.testing.assert_allclose(tiled.jvp_terms(q, k, v, visible, 0.7, kv_map, **t, block_q=bq, block_k=bk), ref,
                                   rtol=1e-12, atol=1e-14)
    block = masks.blockwise(q.shape[-2], k.shape[-2], causal=causal, window=window, key_lengths=lengths)
    np.testing.assert_allclose(tiled.jvp_terms(q, k, v, block, 0.7, kv_map, dq, dk, dv, block_q=bq, block_k=bk),
                               directional.jvp_terms(q, k, v, visible, 0.7, kv_map, dq, dk, dv), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fault", [None, *attention.JVP_FAULTS, "mask"])
@pytest.mark.parametrize("blocks", [(1, 1), (2, 3), (4, 7), (64, 64)])
def test_tiled_jvp_with_an_explicit_mask_and_the_faults_of_the_naive_engine(fault, blocks):
    """A random explicit mask (every row keeps a key) on MQA and GQA heads: equal to directional.jvp, with each JVP
    fault (and the forward's mask fault) the same bug in both engines; float32 stays float32."""
    rng = np.random.default_rng(7)
    b, hq, hkv, n_q, n_k, d, dv = 2, 6, 2, 7, 11, 5, 3
    visible = rng.random((b, hq, n_q, n_k)) < 0.4
    visible[..., rng.integers(0, n_k)] = True
    q, k, v = rng.standard_normal((b, hq, n_q, d)), rng.standard_normal((b, hkv, n_k, d)), \
        rng.standard_normal((b, hkv, n_k, dv))
    dq, dk, dv_ = _tangents(rng, q, k, v)
    faults = () if fault is None else (fault,)
    for kv_map in (np.arange(hq) // 3, np.zeros(hq, dtype=np.intp)):
        kv = k if kv_map.any() else k[:, :1]
        vv, dkk, dvv = (v, dk, dv_) if kv_map.any() else (v[:, :1], dk[:, :1], dv_[:, :1])
        ref = attention.jvp(q, kv, vv, visible, 0.3, kv_map, dq, dkk, dvv, faults)
        mine = tiled.jvp(q, kv, vv, visible, 0.3, kv_map, dq, dkk, dvv, faults, *blocks)
        np.testing.assert_allclose(mine, ref, rtol=1e-13, atol=1e-13)
    f32 = [x.astype(np.float32) for x in (q, k, v, dq, dk, dv_)]
    out = tiled.jvp(*f32[:3], visible, 0.3, np.arange(hq) // 3, *f32[3:], faults, *blocks)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, attention.jvp(*f32[:3], visible, 0.3, np.arange(hq) // 3, *f32[3:], faults),
                               rtol=1e-4, atol=1e-4)


def _attention_scenarios():
    for path in CONFIGS:
        try:
            scs = load_config(path)
        except pytest.skip.Exception:
            continue
        for sc in scs:
            # the double backward (mode hvp) is the naive engine's only
            # (a distributed scenario runs its ranks' code, not an engine)
            if (sc.op == "attention" and sc.backend == "numpy" and sc.implementation is None and sc.mode != "hvp"
                    and dict(sc.params).get("distributed") is None):
                yield sc


# Blocks of 3x5 cross every shipped scenario's rows and keys; 64x64 (one block for most of them) in the slow set.
@pytest.mark.parametrize("bq, bk", [(3, 5), pytest.param(64, 64, marks=pytest.mark.slow)])
def test_every_shipped_attention_scenario_passes_on_the_tiled_engine(bq, bk):
    ran = 0
    for sc in _attention_scenarios():
        result = checker.run_scenario(dataclasses.replace(sc, engine="tiled", block_q=bq, block_k=bk))
        assert result.passed, (sc.name, bq, bk, [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed])
        assert any(c.name == "tiled agrees with the naive engine" for c in result.checks)
        ran += 1
    assert ran >= 20


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


def test_tiled_jvp_needs_no_score_sized_arrays():
    """n = 2048 on one head: the tiled JVP with a blockwise mask keeps its running sums per query block and
    never allocates an n x n array (tracemalloc sees every NumPy allocation)."""
    import tracemalloc
    n, d = 2048, 16
    rng = np.random.default_rng(0)
    q, k, v, dq, dk, dv = (rng.standard_normal((1, 1, n, d)) for _ in range(6))
    mask = masks.blockwise(n, n, causal="lower-right")
    kv_map = np.zeros(1, dtype=np.intp)
    tracemalloc.start()
    tiled.jvp(q, k, v, mask, 0.25, kv_map, dq, dk, dv, block_q=128, block_k=128)
    tiled.jvp_terms(q, k, v, mask, 0.25, kv_map, dq, dk, dv, block_q=128, block_k=128)  # its noise floor's too
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
