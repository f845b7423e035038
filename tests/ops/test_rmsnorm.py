"""RMSNorm (ops/rmsnorm.py): its backward against a loop forward differentiated by the complex step and
against torch autograd, its invariant catching its fault, and its laws for any shape."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli.ops import OPS, rmsnorm

from helpers import assert_close, make
from reference import complex_step_gradients, rmsnorm_ref


def test_rmsnorm_backward_against_complex_step():
    sc = make(op="rmsnorm", batch=2, n=3, d_model=5, eps=0.01)
    p = OPS["rmsnorm"].build(sc)
    g = p.arrays["grad_output"]
    ref = complex_step_gradients(lambda x, gamma: rmsnorm_ref(x, gamma, 0.01), p.inputs, g)
    assert_close(p.gradients, ref)
    assert np.allclose(p.output, rmsnorm_ref(p.inputs["x"], p.inputs["gamma"], 0.01), rtol=1e-13)


def test_rmsnorm_backward_against_torch_autograd():
    torch = pytest.importorskip("torch")
    sc = make(op="rmsnorm", batch=2, n=3, d_model=6, eps=1e-3)
    p = OPS["rmsnorm"].build(sc)
    x, gamma = (torch.tensor(p.inputs[t], requires_grad=True) for t in ("x", "gamma"))
    y = gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-3)
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    assert_close(p.gradients, {"x": x.grad.numpy(), "gamma": gamma.grad.numpy()})


def test_rmsnorm_invariant_catches_its_fault_without_finite_differences():
    sc, check = make(op="rmsnorm", n=3, d_model=5), "<G_x, x> = 0 per row when eps = 0"
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
