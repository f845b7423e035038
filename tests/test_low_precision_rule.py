"""The half-precision agreement rule stays within its stated factor of the plain computations' error plus its
stated slack (issue 22, item 3): an implementation as accurate as a plain computation passes, one four times
less accurate fails, at small and large logits; a backward that keeps the log-sum-exp in bfloat16 fails."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli import checker, precision
from gradcheck_cli.tolerance import DEFAULT_FACTOR, DEFAULT_SLACK, PLAIN_SHARE

from helpers import make

HALF = ("float16", "bfloat16")


@pytest.mark.parametrize("dtype", HALF)
@given(plain=st.floats(1e-6, 1.0), terms=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=20))
def test_the_allowance_never_exceeds_the_factor_and_share_of_the_plain_error(dtype, plain, terms):
    policy = precision.Policy.for_dtype(dtype)
    allowed = policy.allowed(plain, np.asarray(terms))
    assert allowed.max() <= (DEFAULT_FACTOR + PLAIN_SHARE[dtype]) * plain + DEFAULT_SLACK[dtype] + 1e-12
    assert allowed.min() >= DEFAULT_FACTOR * plain + DEFAULT_SLACK[dtype]


def _reference_checks(implementation, dtype, scale, seed, **shape):
    keys = dict(batch=2, heads_q=4, heads_kv=2, n_q=16, n_k=16, d_head=16, mask={"causal": "lower-right"})
    sc = make(backend="torch", dtype=dtype, scale=scale, seed=seed, implementation=implementation, **{**keys, **shape})
    result = checker.run_scenario(sc)
    return result, [c for c in result.checks if c.kind == "reference"]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_as_accurate_as_plain_passes_four_times_less_fails(dtype, scale):
    pytest.importorskip("torch")
    for seed in range(2):
        result, checks = _reference_checks("low_precision_attention:as_plain", dtype, scale, seed)
        assert result.verdict == "pass", [(c.tensor, c.max_abs_error, c.detail[:160]) for c in checks]
        result, checks = _reference_checks("low_precision_attention:four_times_plain", dtype, scale, seed)
        assert result.verdict == "fail"
        failed = {c.tensor for c in checks if c.verdict == "fail"}
        assert failed == {"o", "q", "k", "v"}, [(c.tensor, c.max_abs_error, c.detail[-200:]) for c in checks]


def test_a_log_sum_exp_kept_in_bfloat16_fails_at_larger_logits():
    pytest.importorskip("torch")
    for seed in range(2):
        result, checks = _reference_checks("low_precision_attention:lse_in_dtype", "bfloat16", 2.0, seed)
        assert result.verdict == "fail", [(c.tensor, c.max_abs_error, c.tolerance) for c in checks]


def test_an_element_with_no_terms_that_comes_out_nonzero_is_named():
    """An element no product reaches (its terms 0: exactly 0 in exact arithmetic) and nonzero in the result is
    named with its values, also when another element is the one closest to failing."""
    reference = np.array([[1.0, 0.0], [2.0, 3.0]])
    terms = np.array([[1.0, 0.0], [2.0, 3.0]])
    mine = reference + np.array([[0.0, 1e-12], [0.5, 0.0]])  # [1, 0] fails by far more than the termless [0, 1]
    check = precision.agreement("backward agrees", "k", mine, reference, terms, precision.Policy.for_dtype("float64"))
    assert not check.passed
    assert "k[0, 1] has no terms at all (its exact value is 0) but the implementation gives 1e-12 (reference 0)" \
        in check.detail
    only = precision.agreement("backward agrees", "k", reference + np.array([[0.0, 1e-12], [0.0, 0.0]]), reference,
                               terms, precision.Policy.for_dtype("float64"))
    assert "closest to failing at k[0, 1]" in only.detail
    assert "an element with no terms at all: its exact value is 0" in only.detail
