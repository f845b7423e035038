"""Stated power is real: every check reports the smallest uniform relative error it would have caught
(``detectable``); an error of twice that is caught by that check, one of half that passes it. And the
agreement with the float64 reference has teeth in every precision: a uniform 0.1% error in a gradient
is caught in float32 and 1% in float16 (n >= 16), while correct code passes. In bfloat16 a plain
computation's own dQ/dK are 2.5-3.5% off the reference, and FlashAttention's rule allows twice that:
5% is caught in dV, 8% in every gradient (docs/verdicts.md
"How verdicts, power and precision work")."""
import numpy as np
import pytest

from gradcheck_cli import checker, verdict
from gradcheck_cli.precision import Policy, detectable

from helpers import make

SHAPE = dict(batch=2, heads_q=4, heads_kv=2, n_q=6, n_k=9, d_head=4, mask={"causal": "lower-right",
                                                                          "key_lengths": [9, 7]})
BIG = dict(batch=1, heads_q=2, heads_kv=1, n_q=16, n_k=24, d_head=32, mask={"causal": "lower-right"})


def _scenario(dtype="float64", shape=SHAPE, backend="numpy"):
    impl = "my_attention:attention" if backend == "numpy" else "torch_attention:attention"
    return make(**shape, dtype=dtype, backend=backend, implementation=impl)


@pytest.fixture(autouse=True)
def _examples_on_path(root, monkeypatch):
    monkeypatch.syspath_prepend(str(root / "examples"))


def _check(result, kind, tensor):
    (c,) = [c for c in result.checks if c.kind == kind and c.tensor == tensor]
    return c


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["gradient", "reference"])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_twice_the_stated_power_is_caught_and_half_of_it_passes(dtype, kind, tensor):
    sc = _scenario(dtype)
    clean = checker.run_scenario(sc)
    assert clean.verdict == "pass"
    power = _check(clean, kind, tensor).detectable
    assert power is not None and 0 < power < 0.1
    fault = f"scale-d{tensor}"
    caught = checker.run_scenario(sc, (fault,), sizes={fault: 2 * power})
    assert _check(caught, kind, tensor).verdict == "fail"
    unseen = checker.run_scenario(sc, (fault,), sizes={fault: 0.5 * power})
    assert _check(unseen, kind, tensor).verdict == "pass"


def test_the_summary_of_power_is_the_best_check_of_each_tensor():
    result = checker.run_scenario(_scenario())
    for t in "qkv":
        assert result.detectable[t] == min(c.detectable for c in result.checks if c.tensor == t and c.detectable)
    assert set(result.detectable) == {"o", "q", "k", "v"}


@pytest.mark.parametrize("dtype,size,tensors", [("float32", 1e-3, "qkv"), ("float16", 1e-2, "qkv"),
                                                ("bfloat16", 5e-2, "v"), ("bfloat16", 8e-2, "qkv")])
def test_uniform_errors_of_the_target_size_are_caught_in_every_precision(dtype, size, tensors):
    backend = "numpy" if dtype == "float32" else "torch"
    if backend == "torch":
        pytest.importorskip("torch")
    sc = _scenario(dtype, BIG, backend)
    assert checker.run_scenario(sc).verdict == "pass"
    for tensor in tensors:
        fault = f"scale-d{tensor}"
        for sign in (1, -1):
            result = checker.run_scenario(sc, (fault,), sizes={fault: sign * size})
            assert result.verdict == "fail", (tensor, sign, [(c.name, c.tensor, c.verdict, c.detail[:120])
                                                             for c in result.checks if c.verdict != "pass"])


def test_detectable_is_the_threshold_of_the_rule():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(200)
    got = ref + rng.standard_normal(200) * 1e-9
    allowed = np.full(200, 1e-6)
    d = detectable(got, ref, allowed)
    for sign in (1, -1):
        assert (np.abs(got * (1 + sign * 1.01 * d) - ref) > allowed).any()
        assert (np.abs(got * (1 + sign * 0.99 * d) - ref) <= allowed).all() or sign == (1 if d == (
            (allowed + np.abs(got - ref)) / np.abs(got)).min() else -1)
    assert detectable(np.zeros(3), np.zeros(3), np.ones(3)) == float("inf")


def test_one_lucky_probe_cannot_make_a_fail():
    """Rounding dominates: one probe's two differences agree by chance (its own estimate is tiny), but
    the estimate pooled over every probe says the differences are this inaccurate: inconclusive."""
    floor = np.full(10, 1e-3)
    own = np.full(10, 2e-3)
    own[3] = 1e-9                                   # the lucky one
    disc = np.full(10, 1e-4)
    disc[3] = 5e-3                                  # out of tolerance, and 10x its own estimate
    allowed = np.full(10, 1e-3)
    pooled = verdict.pooled_scale(own, floor)
    assert verdict.decide(disc, allowed, verdict.estimate(own, floor, pooled)) == "inconclusive"
    assert verdict.decide(disc, allowed, own) == "fail"  # what the one-probe rule said
    disc[3] = 1.0                                   # far beyond anything the differences could do
    assert verdict.decide(disc, allowed, verdict.estimate(own, floor, pooled)) == "fail"


def test_half_precision_policy_has_a_floor_from_the_terms_not_the_plain_maximum():
    """The terms' share grows with each element's terms, up to PLAIN_SHARE x the plain error (never beyond)."""
    policy = Policy.for_dtype("float16")
    allowed = policy.allowed(1.0, np.array([1.0, 4.0, 1e9]))
    assert allowed[2] > allowed[1] > allowed[0] > 2.0 + policy.slack
    assert allowed[2] == 2.0 + policy.slack + policy.share
