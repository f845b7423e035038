"""The finite differences' fast forward (ops/attention/copies.py): the reference forward's values for any shape,
mask, GQA map and block size, on copies stacked on any input; it skips the key blocks no query of a row
block sees; the max-subtraction is dropped only under its bound; and the check in every run catches a
fast path that drifts from the reference."""
import platform

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcheck_cli import checker, numeric
from gradcheck_cli.ops import attention
from gradcheck_cli.ops.attention import copies, naive
from gradcheck_cli.ops.attention.args import Args

from helpers import examples, make
from strategies import problems


@settings(max_examples=examples(2))
@given(problems(), st.integers(1, 40), st.sampled_from([0.7, 40.0]), st.booleans())
def test_fast_forward_equals_the_reference_on_stacked_copies(p, rows, scale, masked):
    q, k, v, _, visible, kv_map, _, _, _ = p
    vis = visible if masked else None
    fast = copies.Forward(vis, scale, kv_map, q.shape[-2], k.shape[-2], rows=rows)
    faults = () if masked else ("mask",)
    rng = np.random.default_rng(0)
    assert np.allclose(fast(q, k, v), attention.forward(q, k, v, visible, scale, kv_map, faults), rtol=1e-12,
                       atol=1e-12)
    for name, x in (("q", q), ("k", k), ("v", v)):
        stacked = x + rng.standard_normal((5,) + x.shape)
        args = {"q": q, "k": k, "v": v, name: stacked}
        expected = attention.forward(**args, visible=visible, scale=scale, kv_map=kv_map, faults=faults)
        for pieces in (1, 10**9):  # exponentials by pieces of rows (many copies), and over whole blocks (few)
            copies.PIECE_MATRICES, saved = pieces, copies.PIECE_MATRICES
            try:
                mine = fast(**args)
            finally:
                copies.PIECE_MATRICES = saved
            assert mine.shape == (5,) + q.shape[:-1] + (v.shape[-1],)
            assert np.allclose(mine, expected, rtol=1e-12, atol=1e-12)


def test_key_blocks_no_query_sees_are_skipped():
    sc = make(n_q=128, d_head=8, mask={"causal": "lower-right"})
    fast = copies.Forward(sc.visible, sc.scale, np.array([0]), 128, 128)
    spans = [(r.stop - r.start, k.stop - k.start) for r, k, *_ in fast.blocks]
    assert spans == [(32, 32), (32, 64), (32, 96), (32, 128)]   # 62.5% of the score matrix
    # on many copies, exponentials only over the keys some row of each piece of 8 rows sees; only the diagonal
    # tile has hidden keys inside that span, and only there is it zeroed after the exponential
    for (*_, pieces), end in zip(fast.blocks, (32, 64, 96, 128)):
        assert [(p.start, p.stop, c.stop) for p, c, _ in pieces] == [(0, 8, end - 24), (8, 16, end - 16),
                                                                    (16, 24, end - 8), (24, 32, end)]
        assert all(c.start == 0 and hidden.shape[-2:] == (8, c.stop) and hidden[..., :, :c.stop - 8].sum() == 0
                   for _, c, hidden in pieces)
    exponentials = sum((p.stop - p.start) * (c.stop - c.start) for *_, pieces in fast.blocks for p, c, _ in pieces)
    assert exponentials == 128 * 129 // 2 + 4 * 4 * 28  # the visible set, and 28 hidden per 8 x 8 diagonal tile
    window = make(n_q=96, d_head=8, mask={"window": [8, 0]})
    spans = [(k.start, k.stop) for _, k, *_ in copies.Forward(window.visible, 1.0, np.array([0]), 96, 96).blocks]
    assert spans == [(0, 32), (24, 64), (56, 96)]


def test_the_shift_is_dropped_only_under_its_bound():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 1, 1, 16, 8))
    visible = np.ones((1, 1, 16, 16), dtype=bool)
    small = copies.Forward(visible, 0.3, np.array([0]), 16, 16)
    assert not small._needs_shift(q, k, np.float64)
    # logits far past exp's range: the bound asks for the shift, and the result is still the reference
    big = copies.Forward(visible, 500.0, np.array([0]), 16, 16)
    assert big._needs_shift(q, k, np.float64)
    assert np.allclose(big(q, k, v), attention.forward(q, k, v, visible, 500.0, np.array([0])), rtol=1e-12)
    # float32's range is smaller: the same logits need the shift there
    q32, k32 = (x.astype(np.float32) for x in (q, k))
    assert copies.Forward(visible, 12.0, np.array([0]), 16, 16)._needs_shift(q32, k32, np.float32)
    assert not copies.Forward(visible, 12.0, np.array([0]), 16, 16)._needs_shift(q, k, np.float64)


@pytest.mark.parametrize("drift", [1e-9, 0.0])
def test_a_fast_path_that_drifts_from_the_reference_fails_the_run(monkeypatch, drift):
    """The check ``fast forward agrees with the reference`` is what makes the fast path trustworthy: a
    bias of 1e-9 (invisible to finite differences, which difference it away) must fail it."""
    blocks = copies.Forward._blocks

    def biased(self, q, k_t, v_rep, shift, out, *stages):
        blocks(self, q, k_t, v_rep, shift, out, *stages)
        out += drift

    monkeypatch.setattr(copies.Forward, "_blocks", biased)
    result = checker.run_scenario(make(n_q=12, d_head=4, mask={"causal": "lower-right"}))
    check = next(c for c in result.checks if c.name == "fast forward agrees with the reference")
    assert check.passed is (drift == 0.0)
    assert result.passed is (drift == 0.0)
    # the gradient checks themselves still pass: only the agreement check can see this
    assert all(c.passed for c in result.checks if c.kind == "gradient")


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_the_agreement_check_takes_the_path_the_differences_of_each_tensor_take(monkeypatch, tensor):
    """Copies of K put the scale on Q and read K^T in place, copies of Q lay out scale * K^T once: a drift in the
    path of one tensor's copies alone fails the check, which evaluates each tensor's moved copies as the
    differences stack them (a copy axis on that tensor only)."""
    call = copies.Forward.__call__

    def drifting(self, q, k, v):
        out = call(self, q, k, v)
        moved = {"q": q, "k": k, "v": v}
        if moved[tensor].ndim > min(x.ndim for x in moved.values()):
            out += 1e-9
        return out

    monkeypatch.setattr(copies.Forward, "__call__", drifting)
    check = copies.agreement(*_agreement_args(make(n_q=40, d_head=4, mask={"causal": "lower-right"})))
    assert not check.passed


def test_a_fast_path_that_drops_a_key_fails_the_run(monkeypatch):
    init = copies.Forward.__init__

    def short(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.blocks = [(r, slice(k.start, k.stop - 1) if k.stop - k.start > 1 else k, None, None, ())
                       for r, k, *_ in self.blocks]

    monkeypatch.setattr(copies.Forward, "__init__", short)
    result = checker.run_scenario(make(n_q=12, d_head=4))
    assert not next(c for c in result.checks if c.name == "fast forward agrees with the reference").passed
    assert not result.passed


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_kept_for_reuse_on_glibc(monkeypatch):
    assert numeric.keep_freed_memory() is True
    monkeypatch.setenv("ATTN_GRADCHECK_KEEP_FREED_MEMORY", "0")  # the opt-out leaves malloc alone
    assert numeric.keep_freed_memory.__wrapped__() is False


@pytest.mark.parametrize("keys", [dict(n_q=3, n_k=32, d_head=64, scale=100.0, seed=0),
                                  dict(n_q=5, n_k=32, d_head=64, scale=100.0, seed=1),
                                  dict(dtype="float32", batch=2, heads_q=2, n_q=8, n_k=64, d_head=256, scale=10.0),
                                  dict(batch=2, heads_q=4, heads_kv=2, n_q=40, d_head=32, scale=30.0, seed=1,
                                       mask={"causal": "lower-right"})])
def test_agreement_allows_the_rounding_of_large_logits(keys):
    """With scale * d in the thousands two engines' scores differ by eps * |scale| sum_c |q_c k_c|, and near
    ties pass that on to O: the allowance is per element, from the size of the terms (found in review:
    an allowance relative to |O| and |v| failed correct runs)."""
    check = copies.agreement(*_agreement_args(make(**keys)))
    assert check.passed, check
    assert check.max_abs_error < check.tolerance / 8  # with room to spare, not by a hair


def _agreement_args(sc):
    inputs, _ = attention.seeded_inputs(sc)
    kv_map = np.asarray(sc.kv_map)
    fast = copies.Forward(sc.visible, sc.scale, kv_map, sc.n_q, sc.n_k)
    return (fast, lambda q, k, v: attention.forward(q, k, v, sc.visible, sc.scale, kv_map), inputs,
            Args(sc.visible, sc.scale, kv_map), (), np.random.default_rng(0))


def test_visible_may_be_any_shape_that_broadcasts():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((3, 2, 2, 6, 4))
    visible = np.array([True] * 5 + [False])[None, None, None, :]  # [1, 1, 1, n_k]: the last key is padding
    fast = copies.Forward(visible, 0.5, np.arange(2), 6, 6)
    assert np.allclose(fast(q, k, v), attention.forward(q, k, v, visible, 0.5, np.arange(2)), rtol=1e-12)


def test_a_zero_gradient_checked_by_noisy_differences_passes():
    """Only row 0 carries gradient and it sees one key: G_Q and G_K are exactly 0, and differences of a
    forward that rounds (e * v) / e pick up noise far below the floor. That verifies the zero; it is not
    a check without power."""
    result = checker.run_scenario(make(batch=2, heads_q=2, n_q=8, d_head=8, loss_rows=[0],
                                       mask={"causal": "upper-left"}))
    verdicts = {c.tensor: c.verdict for c in result.checks if c.kind == "gradient"}
    assert verdicts == {"q": "pass", "k": "pass", "v": "pass"}
    assert result.passed
    assert all("verified negligible" in c.detail for c in result.checks
               if c.tensor in ("q", "k") and c.kind == "gradient")


def test_below_the_floor_a_wrong_zero_and_the_right_tiny_gradient_get_the_same_verdict(monkeypatch):
    """Found in review: keyed on the analytic side alone, a backward that returns G_Q = 0 where the true
    G_Q is tiny (a saturated softmax) passed while the right one was inconclusive. Both are now judged on
    analytic and numeric alike: below the floor, and the floor small against the problem's gradients."""
    keys = dict(n_q=4, n_k=6, d_head=4, scale=30.0, mask={"causal": "upper-left"})
    right = checker.run_scenario(make(**keys))
    backward = attention.backward

    def zero_q(*args, **kwargs):
        import dataclasses
        g = backward(*args, **kwargs)
        return dataclasses.replace(g, q=np.zeros_like(g.q))
    monkeypatch.setattr(naive, "backward", zero_q)  # the built-in engine's backward
    wrong = checker.run_scenario(make(**keys))
    verdict = {name: {c.tensor: c.verdict for c in r.checks if c.kind == "gradient"}["q"]
               for name, r in (("right", right), ("wrong", wrong))}
    assert verdict == {"right": "pass", "wrong": "pass"}, verdict  # both verified negligible (G_Q ~ 1e-10)
