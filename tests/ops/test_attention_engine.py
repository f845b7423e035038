"""The attention engine against an independent loop implementation, torch autograd, and its own laws."""
import numpy as np
import pytest
from hypothesis import assume, given

from gradcheck_cli import checker
from gradcheck_cli.ops import attention as A

from helpers import make, random_inputs
from reference import attention_loops
from strategies import scenarios, valid_or_none


@given(scenarios())
def test_backward_matches_independent_loops(keys):
    sc = valid_or_none(keys)
    assume(sc is not None)
    q, k, v, g = random_inputs(sc, sc.seed)
    kv_map = np.array(sc.kv_map)
    o = A.forward(q, k, v, sc.visible, sc.scale, kv_map)
    grads = A.backward(q, k, v, sc.visible, sc.scale, kv_map, g)
    o_ref, gq, gk, gv = attention_loops(q, k, v, sc.visible, sc.scale, kv_map, g)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.q, gq, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads.k, gk, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads.v, gv, rtol=1e-10, atol=1e-12)


@given(scenarios())
def test_every_check_passes_on_a_correct_engine(keys):
    sc = valid_or_none(keys)
    assume(sc is not None)
    result = checker.run_scenario(sc)
    failed = [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]
    assert not failed


def test_forward_accepts_leading_copy_axes():
    sc = make(batch=2, heads_q=4, heads_kv=2, n_q=3, n_k=5, d_head=4, mask={"causal": "lower-right"})
    q, k, v, _ = random_inputs(sc)
    kv_map = np.array(sc.kv_map)
    rng = np.random.default_rng(1)
    copies = q[None] + 0.1 * rng.standard_normal((3, 2) + q.shape)  # two extra leading axes
    batched = A.forward(copies, k, v, sc.visible, sc.scale, kv_map)
    assert batched.shape == (3, 2) + (2, 4, 3, 4)
    for a in range(3):
        for b in range(2):
            np.testing.assert_allclose(batched[a, b], A.forward(copies[a, b], k, v, sc.visible, sc.scale, kv_map),
                                       rtol=1e-13, atol=1e-14)
    # perturbed copies of k and of v, the other operands shared
    kc = k[None] + 0.1 * rng.standard_normal((4,) + k.shape)
    vc = v[None] + 0.1 * rng.standard_normal((4,) + v.shape)
    for i in range(4):
        np.testing.assert_allclose(A.forward(q, kc, v, sc.visible, sc.scale, kv_map)[i],
                                   A.forward(q, kc[i], v, sc.visible, sc.scale, kv_map), rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(A.forward(q, k, vc, sc.visible, sc.scale, kv_map)[i],
                                   A.forward(q, k, vc[i], sc.visible, sc.scale, kv_map), rtol=1e-13, atol=1e-14)


def test_sum_groups_is_the_adjoint_of_repeat_kv():
    rng = np.random.default_rng(0)
    kv_map = np.array([0, 2, 1, 0, 2, 2])
    x = rng.standard_normal((2, 3, 4, 5))
    y = rng.standard_normal((2, 6, 4, 5))
    lhs = np.sum(A.repeat_kv(x, kv_map) * y)
    rhs = np.sum(x * A.sum_groups(y, kv_map, 3))
    assert lhs == pytest.approx(rhs, rel=1e-13)


def test_fully_peaked_rows_stay_finite():
    """Large logits: max-subtraction keeps the softmax finite (no overflow to inf/NaN)."""
    sc = make(n_q=4, d_head=2, scale=1000.0)
    q, k, v, g = random_inputs(sc)
    o = A.forward(q * 50, k * 50, v, sc.visible, sc.scale, np.array(sc.kv_map))
    assert np.isfinite(o).all()


def _torch():
    """torch autograd as a second opinion; the test skips cleanly where torch is not installed."""
    return pytest.importorskip("torch")


@given(scenarios())
def test_backward_matches_torch_autograd(keys):
    torch = _torch()
    sc = valid_or_none(keys)
    assume(sc is not None)
    q, k, v, g = random_inputs(sc, sc.seed)
    kv_map = np.array(sc.kv_map)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    idx = torch.tensor(kv_map)
    s = (tq @ tk[:, idx].transpose(-1, -2)) * sc.scale
    s = s.masked_fill(~torch.tensor(sc.visible), float("-inf"))
    o = torch.softmax(s, dim=-1) @ tv[:, idx]
    (o * torch.tensor(g)).sum().backward()
    grads = A.backward(q, k, v, sc.visible, sc.scale, kv_map, g)
    np.testing.assert_allclose(A.forward(q, k, v, sc.visible, sc.scale, kv_map), o.detach().numpy(),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.q, tq.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads.k, tk.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads.v, tv.grad.numpy(), rtol=1e-10, atol=1e-12)
