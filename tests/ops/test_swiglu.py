"""SwiGLU (ops/swiglu.py): its backward against a loop forward differentiated by the complex step and
against torch autograd, its invariant catching its fault, and its Euler identities for any shape."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli.ops import OPS, swiglu

from helpers import assert_close, make, with_examples
from reference import complex_step_gradients, swiglu_ref


def test_swiglu_backward_against_complex_step():
    sc = make(op="swiglu", batch=2, n=2, d_model=3, d_ff=4)
    p = OPS["swiglu"].problem(sc)
    ref = complex_step_gradients(swiglu_ref, p.inputs, p.arrays["grad_output"])
    assert_close(p.gradients, ref)


def test_swiglu_backward_against_torch_autograd():
    torch = pytest.importorskip("torch")
    sc = make(op="swiglu", batch=2, n=3, d_model=4, d_ff=5)
    p = OPS["swiglu"].problem(sc)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.inputs.items()}
    y = (torch.nn.functional.silu(t["x"] @ t["w1"]) * (t["x"] @ t["w3"])) @ t["w2"]
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    assert_close(p.gradients, {k: v.grad.numpy() for k, v in t.items()})


def test_swiglu_invariant_catches_its_fault_without_finite_differences():
    sc, check = make(op="swiglu", n=3, d_model=3, d_ff=4), "<G_W3, W_3> = L"
    assert not {c.name: c for c in OPS["swiglu"].problem(sc, ("gate-branch",)).invariants()}[check].passed
    assert {c.name: c for c in OPS["swiglu"].problem(sc).invariants()}[check].passed


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**16))
def test_swiglu_euler_identities_property(batch, n, d, f, seed):
    rng = np.random.default_rng(seed)
    x, w1, w3 = rng.standard_normal((batch, n, d)), rng.standard_normal((d, f)), rng.standard_normal((d, f))
    w2, g = rng.standard_normal((f, d)), rng.standard_normal((batch, n, d))
    grads = swiglu.backward(x, w1, w3, w2, g)
    loss = np.sum(swiglu.forward(x, w1, w3, w2) * g)
    for w in ("w3", "w2"):
        assert abs(np.sum(grads[w] * {"w3": w3, "w2": w2}[w]) - loss) <= 1e-10 * max(abs(loss), 1.0)


def _user(spec: str, **keys):
    return with_examples(op="swiglu", batch=2, n=3, d_model=6, d_ff=8, implementation=spec, **keys)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_correct_user_swiglu_passes_weight_gradients_included_and_its_faults_are_caught(dtype):
    from gradcheck_cli import checker
    sc = _user("my_swiglu:swiglu", dtype=dtype)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {("gradient w1", "w1"), ("gradient w3", "w3"), ("gradient w2", "w2"),
            ("backward agrees with the reference", "w2")} <= {(c.name, c.tensor) for c in result.checks}
    assert {c.status for c in checker.negative_controls([sc])} == {"detected"}


def test_a_user_swiglu_with_the_sigmoids_derivative_fails_in_x_and_w1_only():
    from gradcheck_cli import checker
    failed = {(c.name, c.tensor) for c in checker.run_scenario(_user("my_swiglu:sigmoid_for_silu")).checks
              if not c.passed}
    assert failed == {("gradient x", "x"), ("gradient w1", "w1"), ("backward agrees with the reference", "x"),
                      ("backward agrees with the reference", "w1")}, failed
