"""RMSNorm (ops/rmsnorm.py): its backward against a loop forward differentiated by the complex step and
against torch autograd, its invariant catching its fault, and its laws for any shape."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli.ops import OPS, rmsnorm

from helpers import assert_close, make, with_examples
from reference import complex_step_gradients, rmsnorm_ref


def test_rmsnorm_backward_against_complex_step():
    sc = make(op="rmsnorm", batch=2, n=3, d_model=5, eps=0.01)
    p = OPS["rmsnorm"].problem(sc)
    g = p.arrays["grad_output"]
    ref = complex_step_gradients(lambda x, gamma: rmsnorm_ref(x, gamma, 0.01), p.inputs, g)
    assert_close(p.gradients, ref)
    assert np.allclose(p.output, rmsnorm_ref(p.inputs["x"], p.inputs["gamma"], 0.01), rtol=1e-13)


def test_rmsnorm_backward_against_torch_autograd():
    torch = pytest.importorskip("torch")
    sc = make(op="rmsnorm", batch=2, n=3, d_model=6, eps=1e-3)
    p = OPS["rmsnorm"].problem(sc)
    x, gamma = (torch.tensor(p.inputs[t], requires_grad=True) for t in ("x", "gamma"))
    y = gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-3)
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    assert_close(p.gradients, {"x": x.grad.numpy(), "gamma": gamma.grad.numpy()})


def test_rmsnorm_invariant_catches_its_fault_without_finite_differences():
    sc, check = make(op="rmsnorm", n=3, d_model=5), "<G_x, x> = d eps mean(g xhat) / s^2"
    assert not {c.name: c for c in OPS["rmsnorm"].problem(sc, ("rmsnorm-feedback",)).invariants()}[check].passed
    assert {c.name: c for c in OPS["rmsnorm"].problem(sc).invariants()}[check].passed


@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 9), st.floats(0, 1), st.integers(0, 2**16))
def test_rmsnorm_scale_invariance_property(batch, n, d, eps, seed):
    """For any shape and eps: G_x(c x) = G_x(x) / c at eps = 0, and <G_x, x> = 0 exactly up to rounding."""
    rng = np.random.default_rng(seed)
    x, gamma, g = rng.standard_normal((batch, n, d)), rng.standard_normal(d), rng.standard_normal((batch, n, d))
    gx, _ = rmsnorm.backward(x, gamma, 0.0, g)
    assert np.abs((gx * x).sum(-1)).max() <= 1e-12 * max(np.abs(gx * x).sum(-1).max(), 1.0)
    gx3, _ = rmsnorm.backward(3 * x, gamma, 0.0, g)
    # rounding is relative to the terms g gamma / r, not to G_x (which is 0 when d = 1)
    terms = np.abs(g * gamma).max() / np.sqrt((x * x).mean(-1)).min()
    assert np.allclose(gx3 * 3, gx, rtol=1e-10, atol=1e-12 * terms)
    y = rmsnorm.forward(x, gamma, eps)
    assert y.shape == x.shape and np.isfinite(y).all()


def _user(spec: str, **keys):
    return with_examples(op="rmsnorm", batch=2, n=4, d_model=8, implementation=spec, **keys)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_correct_user_rmsnorm_passes_and_its_fault_is_caught_on_it(dtype):
    from gradcheck_cli import checker
    sc = _user("my_rmsnorm:rmsnorm", dtype=dtype)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {"forward agrees with the reference", "deterministic"} <= {c.name for c in result.checks}
    assert {c.status for c in checker.negative_controls([sc])} == {"detected"}


def test_a_user_rmsnorm_missing_the_feedback_term_fails_where_it_is_wrong():
    from gradcheck_cli import checker
    failed = {(c.name, c.tensor) for c in checker.run_scenario(_user("my_rmsnorm:missing_feedback", eps=0.0)).checks
              if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x"),
                      ("<G_x, x> = d eps mean(g xhat) / s^2", "g_x")}, failed
