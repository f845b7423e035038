"""RoPE (ops/rope.py): its backward against a loop forward differentiated by the complex step and against
torch autograd (HF's rotate_half), its invariant catching its fault, and orthogonality for any shape."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli.ops import OPS, rope

from helpers import assert_close, make, with_examples
from reference import complex_step_gradients, rope_ref


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_backward_against_complex_step(layout):
    sc = make(op="rope", heads=2, n=4, d_head=6, rotary_dim=4, layout=layout, position_offset=7, base=100.0)
    p = OPS["rope"].problem(sc)
    ref = complex_step_gradients(lambda x: rope_ref(x, 100.0, 4, layout, 7), p.inputs, p.arrays["grad_output"])
    assert_close(p.gradients, ref)
    assert np.allclose(p.output, rope_ref(p.inputs["x"], 100.0, 4, layout, 7), rtol=1e-13, atol=1e-14)


def test_rope_backward_against_torch_autograd():
    """The half layout written as HF's rotate_half."""
    torch = pytest.importorskip("torch")
    sc = make(op="rope", heads=2, n=5, d_head=8)
    p = OPS["rope"].problem(sc)
    x = torch.tensor(p.inputs["x"], requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    freqs = torch.outer(torch.arange(5, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    rotated = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    y = x * emb.cos() + rotated * emb.sin()
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    assert_close(p.gradients, {"x": x.grad.numpy()})


def test_rope_invariant_catches_its_fault_without_finite_differences():
    sc, check = make(op="rope", n=4, d_head=4), "backward is the transpose of the forward"
    assert not {c.name: c for c in OPS["rope"].problem(sc, ("rope-transpose",)).invariants()}[check].passed
    assert {c.name: c for c in OPS["rope"].problem(sc).invariants()}[check].passed


@given(st.integers(1, 6), st.sampled_from([2, 4, 8]), st.sampled_from(["half", "interleaved"]),
       st.integers(0, 5000), st.integers(0, 2**16))
def test_rope_is_orthogonal_property(n, d, layout, offset, seed):
    rng = np.random.default_rng(seed)
    theta = rope.angles(n, d, 10000.0, offset)
    x, g = rng.standard_normal((2, n, d)), rng.standard_normal((2, n, d))
    y = rope.forward(x, theta, layout)
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    assert np.allclose(rope.backward(rope.forward(x, theta, layout), theta, layout), x, atol=1e-12)
    assert abs(np.sum(y * g) - np.sum(x * rope.backward(g, theta, layout))) <= 1e-10 * np.abs(y * g).sum()


def _user(spec: str, **keys):
    return with_examples(op="rope", batch=2, heads=2, n=5, d_head=8, implementation=spec, **keys)


@pytest.mark.parametrize("keys", [{}, {"dtype": "float32"}, {"rotary_dim": 4, "position_offset": 9}])
def test_a_correct_user_rope_passes_and_its_fault_is_caught_on_it(keys):
    from gradcheck_cli import checker
    sc = _user("my_rope:rope", **keys)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {c.status for c in checker.negative_controls([sc])} == {"detected"}


def test_a_user_rope_in_the_other_layout_fails_the_reference_and_one_rotating_forward_fails_the_transpose():
    from gradcheck_cli import checker
    other = {c.name for c in checker.run_scenario(_user("my_rope:rope", layout="interleaved")).checks if not c.passed}
    assert "forward agrees with the reference" in other
    failed = {(c.name, c.tensor) for c in checker.run_scenario(_user("my_rope:forward_rotation")).checks
              if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x"),
                      ("backward is the transpose of the forward", "g_x")}, failed
