"""The checker (checker.py): the seed's two fault exercises behave as the seed describes, faults that do not
apply or that a check lacks the power for are reported as such, colouring, the float32 noise floor and the
three-valued verdict. The fault contract over every op and shipped config is tests/test_fault_contract.py."""
import numpy as np

from gradcheck_cli import checker

from helpers import make


def _failed(result):
    return {(c.kind, c.name, c.tensor) for c in result.checks if not c.passed}


def test_seed_exercise_softmax_term_fails_the_gradient_check():
    sc = make(n_q=5, d_head=4, mask={"causal": "lower-right"})
    failed = _failed(checker.run_scenario(sc, ("softmax-term",)))
    assert ("gradient", "gradient q", "q") in failed and ("gradient", "gradient k", "k") in failed
    assert ("gradient", "gradient v", "v") not in failed  # G_V does not go through the softmax backward


def test_seed_exercise_mask_passes_gradients_but_fails_invariants():
    sc = make(n_q=6, d_head=4, loss_rows=[0], mask={"causal": "upper-left"})
    result = checker.run_scenario(sc, ("mask",))
    failed = _failed(result)
    assert all(c.passed for c in result.checks if c.kind == "gradient")  # finite differences agree
    assert ("invariant", "unseen K/V rows get zero gradient", "k") in failed  # the loss is on row 0 only
    assert ("invariant", "row 0's unseen K/V rows get zero gradient", "k") in failed
    assert ("invariant", "attention is 0 off the visible set", "a") in failed


def test_not_applicable_faults_are_reported_as_such():
    sc = make(n_q=4, d_head=4, scale=1.0)  # no mask, no shared KV heads, scale 1
    status = {c.fault: c.status for c in checker.negative_controls([sc])}
    assert status["scale"] == status["gqa-sum"] == status["mask"] == status["mask-backward"] == "not applicable"
    assert status["softmax-term"] == "detected"


def test_a_check_without_power_is_reported_missed():
    # float32 with a step far below its rounding: the noise (~10% of the gradients) swamps a scale fault
    # that moves G_Q and G_K by 25% (at scale 0.25 they move by 300%, which is caught even there)
    sc = make(n_q=8, d_head=8, scale=0.8, dtype="float32", epsilon=1e-6)
    status = {c.fault: c.status for c in checker.negative_controls([sc])}
    assert status["scale"] == "missed"


def test_colouring_gives_the_same_numbers_and_catches_the_same_faults():
    keys = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=7, d_head=4, scale=0.4,
                mask={"causal": "lower-right", "key_lengths": [7, 5]})
    plain, coloured = make(**keys, check={"colouring": False}), make(**keys)
    a, b = checker.run_scenario(plain), checker.run_scenario(coloured)
    assert a.passed and b.passed
    for t in "qkv":
        np.testing.assert_allclose(a.arrays[f"numeric_{t}"], b.arrays[f"numeric_{t}"], rtol=1e-6, atol=1e-8)
    assert {c.tensor for c in b.checks if c.name == "perturbations stay in their block"} == {"q", "k", "v"}
    status = {c.fault: c.status for c in checker.negative_controls([coloured])}
    assert set(status.values()) == {"detected"}


def test_colouring_catches_a_forward_that_mixes_rows(monkeypatch):
    """If the forward leaked between query rows, colouring would be invalid: the check must say so.
    Finite differences evaluate the fast forward (ops/attention/copies.py), so that is the one made to leak
    (the naive engine's reference too, so that only the independence check can see it)."""
    from gradcheck_cli.ops.attention import copies
    from gradcheck_cli.ops.attention import naive as attention

    def mix(o, q):
        return o + 0.1 * q[..., :1, : o.shape[-1]].sum(axis=-2, keepdims=True)  # row 0 of q feeds every row
    reference, fast = attention.forward, copies.Forward.__call__
    monkeypatch.setattr(attention, "forward", lambda q, k, v, *a, **kw: mix(reference(q, k, v, *a, **kw), q))
    monkeypatch.setattr(copies.Forward, "__call__", lambda self, q, k, v, **kw: mix(fast(self, q, k, v, **kw), q))
    sc = make(n_q=4, d_head=3, check={"colouring": True})
    failed = {(c.name, c.tensor) for c in checker.run_scenario(sc).checks if not c.passed}
    assert ("perturbations stay in their block", "q") in failed
    assert ("fast forward agrees with the reference", "o") not in failed


def test_float32_noise_floor_is_per_block_and_keeps_power_on_large_outputs():
    """The floor bounds the rounding of the terms of L that move (the element's block), not of all
    of L: a 10% wrong backward on a large float32 output is still caught."""
    sc = make(dtype="float32", batch=2, heads_q=8, heads_kv=2, n_q=64, d_head=32, scale=0.9,
              mask={"causal": "lower-right"}, check={"mode": "sample", "samples": 64})
    clean = checker.run_scenario(sc)
    assert clean.passed
    q_check = next(c for c in clean.checks if c.name == "gradient q")
    assert q_check.noise_floor < 1e-2
    assert not checker.run_scenario(sc, ("scale",)).passed


def test_float32_peaked_rows_pass_on_a_correct_engine():
    for seed in range(3):
        sc = make(dtype="float32", heads_q=2, n_q=16, d_head=16, scale=5.0, seed=seed, mask={"causal": "lower-right"})
        result = checker.run_scenario(sc)
        assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


def test_three_valued_verdict():
    """Finite differences that cannot decide say so (inconclusive), and faults still fail outright."""
    peaked = make(dtype="float32", heads_q=2, n_q=16, d_head=16, scale=100.0, seed=2, mask={"causal": "lower-right"})
    result = checker.run_scenario(peaked)
    q = next(c for c in result.checks if c.name == "gradient q")
    assert q.verdict == "inconclusive" and not q.passed and result.verdict == "inconclusive"
    assert q.fd_error > q.max_abs_error / 10 and "use dtype float64" in q.detail
    clean = make(n_q=6, d_head=4, mask={"causal": "lower-right"})
    ok = checker.run_scenario(clean)
    assert all(c.fd_error is not None and c.fd_error < 1e-6 for c in ok.checks if c.kind == "gradient")
    broken = checker.run_scenario(clean, ("softmax-term",))
    assert {c.verdict for c in broken.checks if c.name in ("gradient q", "gradient k")} == {"fail"}
    assert broken.verdict == "fail"


def test_inconclusive_exits_3(tmp_path):
    from click.testing import CliRunner

    from gradcheck_cli.cli import main
    cfg = tmp_path / "p.yaml"
    cfg.write_text("scenarios: [{name: p, dtype: float32, heads_q: 2, n_q: 16, d_head: 16, scale: 100.0, seed: 2, "
                   "mask: {causal: lower-right}}]\n")
    result = CliRunner().invoke(main, ["run", str(cfg), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 3 and "INCONCLUSIVE" in result.stdout
    import json
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["verdict"] == "inconclusive" and report["summary"]["inconclusive"] == 2


def test_a_check_without_power_is_inconclusive_never_pass():
    """A noise floor near the gradient's own size could hide a bug of that size: the verdict says so."""
    for keys in (dict(n_q=8, d_head=8, scale=0.25, dtype="float32", epsilon=1e-6),
                 dict(op="swiglu", n=4, d_model=8, d_ff=8, dtype="float32", epsilon=1e-6)):
        result = checker.run_scenario(make(**keys))
        assert result.verdict == "inconclusive"
        blind = [c for c in result.checks if c.kind == "gradient" and c.verdict == "inconclusive"]
        assert blind and all("no power" in c.detail and "a larger epsilon (now 1e-06" in c.detail for c in blind)
    # a gradient that is zero to rounding is checked with power: it passes
    zero = checker.run_scenario(make(n_q=4, d_head=2, loss_rows=[0], mask={"causal": "upper-left"}))
    assert zero.passed


def test_an_error_a_few_times_the_tolerance_fails_when_the_differences_are_accurate(monkeypatch):
    """Found in review: G_Q off by 5e-6 relative (5x the float64 tolerance) with differences accurate to
    ~1e-9 was 'inconclusive: the finite differences are too inaccurate', contradicting its own estimate.
    Out of tolerance by far more than the finite-difference error is a failure."""
    import dataclasses

    from gradcheck_cli.ops.attention import naive as attention  # the built-in engine
    backward = attention.backward

    def off(*args, **kwargs):
        g = backward(*args, **kwargs)
        return dataclasses.replace(g, q=g.q * (1 + 5e-6))
    monkeypatch.setattr(attention, "backward", off)
    result = checker.run_scenario(make(n_q=6, d_head=8, mask={"causal": "lower-right"}))
    check = next(c for c in result.checks if c.name == "gradient q")
    assert check.verdict == "fail" and 3 < check.relative_error / check.tolerance < 6, check
    assert check.fd_error < 1e-3 * check.max_abs_error
