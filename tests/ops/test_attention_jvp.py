"""The JVP (forward mode) of the built-in attention: the closed form against torch's forward-mode AD, a loop
reference and central differences; check mode jvp, its faults and the adjoint identity."""
import dataclasses

import numpy as np
import pytest

from gradcheck_cli import checker
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import JVP_FAULTS, forward, jvp

from helpers import DERIVATIVE_MASKS, derivative_case, make

MASKS = DERIVATIVE_MASKS

# torch.func.jvp of SDPA goes through torch.jit.script, which warns that it is deprecated (torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _case(mask, dtype=np.float64, heads=(4, 2), seed=0):
    q, k, v, visible, scale, kv_map, rng = derivative_case(mask, dtype, heads, seed)
    tangents = [rng.standard_normal(x.shape).astype(dtype) for x in (q, k, v)]
    return q, k, v, visible, scale, kv_map, tangents


def _loop_jvp(q, k, v, visible, scale, kv_map, dq, dk, dv):
    """Row by row, key by key: dO_i = sum_j A_ij (dS_ij - mu_i) V_j + A_ij dV_j."""
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for b in range(q.shape[0]):
        for r in range(q.shape[1]):
            g = kv_map[r]
            for i in range(q.shape[2]):
                keys = [j for j in range(k.shape[2]) if visible[b, r, i, j]]
                s = np.array([scale * q[b, r, i] @ k[b, g, j] for j in keys])
                a = np.exp(s - s.max())
                a /= a.sum()
                ds = np.array([scale * (dq[b, r, i] @ k[b, g, j] + q[b, r, i] @ dk[b, g, j]) for j in keys])
                mu = a @ ds
                for n, j in enumerate(keys):
                    out[b, r, i] += a[n] * (ds[n] - mu) * v[b, g, j] + a[n] * dv[b, g, j]
    return out


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (4, 1)])
def test_closed_form_agrees_with_torch_forward_mode(mask, heads):
    torch = pytest.importorskip("torch")
    q, k, v, visible, scale, kv_map, (dq, dk, dv) = _case(MASKS[mask], heads=heads)
    kv = torch.tensor(kv_map)

    def plain(q, k, v):
        s = scale * q @ k[:, kv].transpose(-1, -2)
        return torch.softmax(s.masked_fill(~torch.tensor(visible), -torch.inf), -1) @ v[:, kv]

    _, theirs = torch.func.jvp(plain, tuple(map(torch.tensor, (q, k, v))), tuple(map(torch.tensor, (dq, dk, dv))))
    mine = jvp(q, k, v, visible, scale, kv_map, dq, dk, dv)
    np.testing.assert_allclose(mine, theirs.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mask", list(MASKS))
def test_closed_form_agrees_with_a_loop_reference(mask):
    q, k, v, visible, scale, kv_map, (dq, dk, dv) = _case(MASKS[mask])
    np.testing.assert_allclose(jvp(q, k, v, visible, scale, kv_map, dq, dk, dv),
                               _loop_jvp(q, k, v, visible, scale, kv_map, dq, dk, dv), rtol=1e-12, atol=1e-12)


def test_closed_form_agrees_with_central_differences_and_is_linear():
    q, k, v, visible, scale, kv_map, (dq, dk, dv) = _case(MASKS["causal+padding"])
    h = 1e-5
    num = (forward(q + h * dq, k + h * dk, v + h * dv, visible, scale, kv_map)
           - forward(q - h * dq, k - h * dk, v - h * dv, visible, scale, kv_map)) / (2 * h)
    full = jvp(q, k, v, visible, scale, kv_map, dq, dk, dv)
    np.testing.assert_allclose(full, num, rtol=1e-7, atol=1e-8)
    parts = sum(jvp(q, k, v, visible, scale, kv_map, **{n: t}) for n, t in zip(("dq", "dk", "dv"), (dq, dk, dv)))
    np.testing.assert_allclose(full, parts, rtol=1e-12, atol=1e-12)


def test_hidden_keys_contribute_nothing_and_float32_stays_float32():
    q, k, v, visible, scale, kv_map, (dq, dk, dv) = _case(MASKS["padding"], dtype=np.float32)
    dk2, dv2 = dk.copy(), dv.copy()
    dk2[1, :, 6:], dv2[1, :, 6:] = 1e3, -1e3  # tangents of keys batch element 1 never sees
    a, b = jvp(q, k, v, visible, scale, kv_map, dq, dk, dv), jvp(q, k, v, visible, scale, kv_map, dq, dk2, dv2)
    assert a.dtype == np.float32 and np.array_equal(a, b)


@pytest.mark.parametrize("fault", JVP_FAULTS)
def test_every_jvp_fault_changes_the_jvp_and_not_the_forward(fault):
    q, k, v, visible, scale, kv_map, (dq, dk, dv) = _case(MASKS["causal+padding"])
    clean = jvp(q, k, v, visible, scale, kv_map, dq, dk, dv)
    broken = jvp(q, k, v, visible, scale, kv_map, dq, dk, dv, faults=(fault,))
    assert np.abs(clean - broken).max() > 1e-3 * np.abs(clean).max()
    assert np.array_equal(forward(q, k, v, visible, scale, kv_map, (fault,)), forward(q, k, v, visible, scale, kv_map))


JVP_SCENARIO = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=9, d_head=8, check={"mode": "jvp"},
                    mask={"causal": "lower-right", "key_lengths": [9, 6]})


ENGINES = {"naive": {}, "tiled": dict(engine="tiled", block_q=2, block_k=4)}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_mode_jvp_passes_clean_with_its_rows(dtype, engine):
    result = checker.run_scenario(make(**JVP_SCENARIO, **ENGINES[engine], dtype=dtype))
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    names = [c.name for c in result.checks]
    assert names[:5] == ["jvp (random tangent)", "jvp q", "jvp k", "jvp v", "adjoint identity"]
    assert not any(n.startswith("gradient ") for n in names)
    assert all(c.detectable is not None and c.detectable < 0.05 for c in result.checks[:4])


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_jvp_fault_is_detected_and_the_wrong_path_located(engine):
    sc = make(**JVP_SCENARIO, **ENGINES[engine])
    cells = checker.negative_controls([sc])
    assert {c.fault for c in cells if c.status == "detected"} >= set(JVP_FAULTS)
    k_path = checker.run_scenario(sc, ("jvp-k-path",))
    failed = {c.name for c in k_path.checks if c.verdict == "fail"}
    assert {"jvp k", "adjoint identity"} <= failed and not {"jvp q", "jvp v"} & failed
    assert k_path.hints and "K tangent's path" in k_path.hints[0]


def test_adjoint_identity_catches_a_jvp_that_disagrees_with_a_correct_vjp():
    from gradcheck_cli.checker.tangents import adjoint_identity
    from gradcheck_cli.ops import OPS
    sc = make(**JVP_SCENARIO)
    problem = OPS["attention"].problem(sc, ("jvp-centring",))
    tangent = {n: np.random.default_rng(1).standard_normal(x.shape) for n, x in problem.inputs.items()}

    def identity(p):
        return adjoint_identity(sc, p, tangent, p.tangents.jvp(tangent), p.tangents.jvp_terms(tangent), 2.0**-52)
    assert not identity(problem).passed
    assert identity(OPS["attention"].problem(sc)).passed


def test_mode_jvp_is_refused_where_no_engine_computes_it():
    assert make(**JVP_SCENARIO, engine="tiled").engine == "tiled"  # both built-in engines compute it
    with pytest.raises(ScenarioError, match="mode jvp"):
        make(op="rmsnorm", check={"mode": "jvp"})
    sc = make(**JVP_SCENARIO)
    assert not set(JVP_FAULTS) & set(checker.applicable_faults(dataclasses.replace(sc, mode="full")))


@pytest.mark.parametrize("fault, named", [("jvp-centring", "centring term is missing"),
                                          ("jvp-k-path", "K tangent's path"), ("jvp-scale", "dS lacks the scale"),
                                          ("jvp-mask", "ignores the mask")])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_jvp_fault_gets_the_one_hint_that_names_it(engine, fault, named):
    sc = make(**JVP_SCENARIO, **ENGINES[engine])
    result = checker.run_scenario(sc, (fault,))
    assert len(result.hints) == 1 and named in result.hints[0], result.hints
    assert checker.run_scenario(sc).hints == ()


@pytest.mark.parametrize("mode", ["jvp", "hvp"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_derivative_zero_to_rounding_passes_instead_of_lacking_power(mode, dtype):
    # every row sees one key: A = 1 and O = that key's V row, which moves with neither q nor k
    sc = make(batch=1, heads_q=2, n_q=4, n_k=4, d_head=4, dtype=dtype, check={"mode": mode},
              mask={"causal": "lower-right", "window": [0, 0]})
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    row = next(c for c in result.checks if c.name == f"{mode} q")
    # the JVP along q is zero to rounding beside jvp v's (O moves with V); the whole Hessian is exactly zero
    assert ("zero to rounding" if mode == "jvp" else "zero on both sides") in row.detail, row.detail
