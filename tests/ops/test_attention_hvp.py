"""The HVP (double backward: the Hessian of L = sum(O * G) times a direction) of the built-in attention: the closed
form against torch's double backward, central differences of the backward, the Hessian's symmetry, its term sizes
and its faults."""
import numpy as np
import pytest

from gradcheck_cli.ops.attention.directional import hvp, hvp_terms
from gradcheck_cli.ops.attention.formulas import FAULTS, HVP_FAULTS, backward

from helpers import DERIVATIVE_MASKS, derivative_case

MASKS = DERIVATIVE_MASKS
HEADS = [(4, 2), (3, 3), (4, 1)]


def _case(mask, dtype=np.float64, heads=(4, 2), seed=0):
    """(q, k, v, visible, scale, kv_map, grad_o, direction (dq, dk, dv))."""
    q, k, v, visible, scale, kv_map, rng = derivative_case(mask, dtype, heads, seed)
    grad_o = rng.standard_normal(q.shape[:-1] + (v.shape[-1],)).astype(dtype)
    direction = [rng.standard_normal(x.shape).astype(dtype) for x in (q, k, v)]
    return q, k, v, visible, scale, kv_map, grad_o, direction


def _close(mine, theirs, rtol):
    """Each of the three blocks within rtol of the other's largest element."""
    for m, t in zip(mine, theirs):
        assert m.shape == t.shape
        np.testing.assert_allclose(m, t, rtol=rtol, atol=rtol * np.abs(t).max())


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", HEADS)
def test_closed_form_agrees_with_torch_double_backward(mask, heads):
    torch = pytest.importorskip("torch")
    q, k, v, visible, scale, kv_map, grad_o, (dq, dk, dv) = _case(MASKS[mask], heads=heads)
    kv, hidden = torch.tensor(kv_map), ~torch.tensor(visible)
    x = [torch.tensor(t, requires_grad=True) for t in (q, k, v)]
    s = scale * x[0] @ x[1][:, kv].transpose(-1, -2)
    o = torch.softmax(s.masked_fill(hidden, -torch.inf), -1) @ x[2][:, kv]
    grads = torch.autograd.grad((o * torch.tensor(grad_o)).sum(), x, create_graph=True)
    theirs = torch.autograd.grad(sum((g * torch.tensor(t)).sum() for g, t in zip(grads, (dq, dk, dv))), x)
    mine = hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk, dv)
    for m, t in zip(mine, theirs):
        np.testing.assert_allclose(m, t.numpy(), rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("heads", HEADS)
def test_closed_form_agrees_with_central_differences_of_the_backward(heads):
    q, k, v, visible, scale, kv_map, grad_o, (dq, dk, dv) = _case(MASKS["causal+padding"], heads=heads)
    h = 1e-5
    plus = backward(q + h * dq, k + h * dk, v + h * dv, visible, scale, kv_map, grad_o)
    minus = backward(q - h * dq, k - h * dk, v - h * dv, visible, scale, kv_map, grad_o)
    num = [(getattr(plus, t) - getattr(minus, t)) / (2 * h) for t in "qkv"]
    _close(hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk, dv), num, 1e-7)


def test_linear_in_the_direction_and_none_is_zero():
    q, k, v, visible, scale, kv_map, grad_o, (dq, dk, dv) = _case(MASKS["causal+padding"])
    full = hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk, dv)
    parts = [hvp(q, k, v, visible, scale, kv_map, grad_o, **{n: t}) for n, t in zip(("dq", "dk", "dv"), (dq, dk, dv))]
    _close(full, [sum(p[i] for p in parts) for i in range(3)], 1e-12)
    zeros = [np.zeros_like(x) for x in (q, k, v)]
    assert all(np.array_equal(a, b) for a, b in zip(hvp(q, k, v, visible, scale, kv_map, grad_o), zeros))


@pytest.mark.parametrize("mask", ["none", "causal+padding"])
@pytest.mark.parametrize("heads", HEADS)
def test_the_hessian_is_symmetric(mask, heads):
    q, k, v, visible, scale, kv_map, grad_o, u = _case(MASKS[mask], heads=heads)
    w = _case(MASKS[mask], heads=heads, seed=1)[-1]

    def inner(x, y):
        return sum(float((a * b).sum()) for a, b in zip(x, y))

    uhw = inner(u, hvp(q, k, v, visible, scale, kv_map, grad_o, *w))
    whu = inner(w, hvp(q, k, v, visible, scale, kv_map, grad_o, *u))
    assert abs(uhw - whu) <= 1e-11 * max(abs(uhw), abs(whu)), (uhw, whu)


def test_float32_stays_float32_and_close_to_float64():
    case64 = _case(MASKS["causal+padding"])
    case32 = _case(MASKS["causal+padding"], dtype=np.float32)
    q, k, v, visible, scale, kv_map, grad_o, direction = case32
    mine = hvp(q, k, v, visible, scale, kv_map, grad_o, *direction)
    assert all(h.dtype == np.float32 for h in mine)
    q, k, v, visible, scale, kv_map, grad_o, direction = case64
    _close(mine, hvp(q, k, v, visible, scale, kv_map, grad_o, *direction), 1e-4)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("parts", ["qkv", "q", "k", "v"])
def test_term_sizes_bound_the_hvp(mask, parts):
    q, k, v, visible, scale, kv_map, grad_o, direction = _case(MASKS[mask], heads=(4, 2))
    tangent = {f"d{n}": t for n, t in zip("qkv", direction) if n in parts}
    sizes = hvp_terms(q, k, v, visible, scale, kv_map, grad_o, **tangent)
    for h, bound in zip(hvp(q, k, v, visible, scale, kv_map, grad_o, **tangent), sizes):
        assert bound.dtype == np.float64 and bound.shape == h.shape
        assert np.all(np.abs(h) <= bound * (1 + 1e-12))
    # and not far above it: a bound a thousand times the value leaves the checks no power. Cancellation alone
    # puts the terms' median at about 70 x |H| here (A without its logits' share), the logits' share taken once at
    # about 190 x; taken at every use of A, as it once was, it compounded to about 770 x
    h_all = np.concatenate([np.abs(x).ravel() for x in hvp(q, k, v, visible, scale, kv_map, grad_o, **tangent)])
    b_all = np.concatenate([b.ravel() for b in sizes])
    assert np.median(b_all[h_all > 0] / h_all[h_all > 0]) < 400
    # bounds on float32 inputs are float64 and as large (the formulas evaluated on the float32 values)
    q32 = [x.astype(np.float32) for x in (q, k, v, grad_o)]
    sizes32 = hvp_terms(*q32[:3], visible, scale, kv_map, q32[3], **{n: t.astype(np.float32) for n, t in
                                                                     tangent.items()})
    _close(sizes32, sizes, 1e-5)


@pytest.mark.parametrize("fault", HVP_FAULTS)
def test_every_hvp_fault_changes_the_parts_of_the_hvp_its_record_names(fault):
    """The checks "hvp q", "hvp k", "hvp v" are the parts H_Q, H_K, H_V of H u along a random direction of every
    input: a fault's record names those it changes, and it leaves the others alone."""
    q, k, v, visible, scale, kv_map, grad_o, (dq, dk, dv) = _case(MASKS["causal+padding"], heads=(4, 2))
    record = FAULTS[fault]
    assert record.derivative == "hvp"
    clean = hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk, dv)
    broken = hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk, dv, faults=(fault,))
    for part, c, b in zip("qkv", clean, broken):
        change = np.abs(c - b).max() / np.abs(c).max()
        if f"hvp {part}" in record.caught_by:
            assert change > 1e-3, (part, change)
        else:
            assert change == 0, (part, change)
    no_faults = hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk, dv)
    assert all(np.array_equal(a, b) for a, b in zip(no_faults, hvp(q, k, v, visible, scale, kv_map, grad_o, dq, dk,
                                                                      dv, faults=())))


def test_the_hvp_faults_are_their_own():
    assert set(HVP_FAULTS) == {"hvp-d-term", "hvp-softmax-tangent", "hvp-dk-path"}
    from gradcheck_cli.ops.attention.formulas import ENGINE_FAULTS, JVP_FAULTS
    assert not set(HVP_FAULTS) & (set(ENGINE_FAULTS) | set(JVP_FAULTS))
    assert not any(FAULTS[f].forward for f in HVP_FAULTS)
