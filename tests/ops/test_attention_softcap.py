"""Soft-capping (``softcap: c``, the score stage S -> c tanh(S / c)): its closed forms against torch autograd of
an independent forward (values, gradients, JVP, HVP), the stage machinery's chain rule against finite
differences, the tiled engine and the fast forward against the naive one, user code given ``softcap=`` only
when the scenario has it, and the loader's messages."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcheck_cli import checker
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import copies, directional, formulas, tiled
from gradcheck_cli.ops.attention import stages as score_stages
from gradcheck_cli.ops.attention.stages import softcap
from gradcheck_cli.ops.attention.stages.softcap import Softcap

from helpers import make, with_examples


def _inputs(seed=0, b=2, h=2, n=5, m=7, d=4, spread=2.0):
    rng = np.random.default_rng(seed)
    q, k, v, g = (rng.standard_normal(s) * spread for s in [(b, h, n, d), (b, h, m, d), (b, h, m, d), (b, h, n, d)])
    visible = np.broadcast_to(np.tril(np.ones((n, m), bool), m - n), (b, h, n, m)).copy()
    visible[1, :, :, -2:] = False  # padding in batch 1
    visible[1, :, :, 0] = True
    return q, k, v, g, visible, np.arange(h)


def _torch_forward(torch, visible, scale, cap):
    def f(q, k, v):  # written from the definition, not from the package
        s = cap * torch.tanh((q @ k.transpose(-1, -2)) * scale / cap)
        return torch.softmax(s.masked_fill(~torch.from_numpy(visible), float("-inf")), dim=-1) @ v
    return f


@pytest.mark.parametrize("cap", [0.7, 3.0, 50.0])
def test_closed_forms_equal_torch_autograd_of_the_definition(cap):
    torch = pytest.importorskip("torch")
    q, k, v, g, visible, kv_map = _inputs()
    stages, scale = (Softcap(cap),), 0.6
    f = _torch_forward(torch, visible, scale, cap)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    o = f(*leaves)
    grads = torch.autograd.grad(o, leaves, torch.tensor(g), create_graph=True)
    np.testing.assert_allclose(formulas.forward(q, k, v, visible, scale, kv_map, stages=stages), o.detach(),
                               rtol=1e-12, atol=1e-13)
    mine = formulas.backward(q, k, v, visible, scale, kv_map, g, stages=stages)
    for a, b in zip((mine.q, mine.k, mine.v), grads):
        np.testing.assert_allclose(a, b.detach(), rtol=1e-11, atol=1e-12)
    u = [np.random.default_rng(1).standard_normal(x.shape) for x in (q, k, v)]
    _, o_dot = torch.func.jvp(f, tuple(torch.tensor(x) for x in (q, k, v)), tuple(torch.tensor(x) for x in u))
    np.testing.assert_allclose(directional.jvp(q, k, v, visible, scale, kv_map, *u, stages=stages), o_dot,
                               rtol=1e-11, atol=1e-12)
    hu = torch.autograd.grad(sum((a * torch.tensor(b)).sum() for a, b in zip(grads, u)), leaves)
    for a, b in zip(directional.hvp(q, k, v, visible, scale, kv_map, g, *u, stages=stages), hu):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11)


def test_the_cap_changes_the_numbers():
    """A test that cannot fail is a defect: with the stage the output is not plain attention's."""
    q, k, v, g, visible, kv_map = _inputs()
    plain = formulas.forward(q, k, v, visible, 0.6, kv_map)
    capped = formulas.forward(q, k, v, visible, 0.6, kv_map, stages=(Softcap(1.0),))
    assert np.abs(plain - capped).max() > 0.1


@settings(max_examples=40, deadline=None)
@given(s=st.floats(-40, 40), cap=st.floats(0.2, 60), cap2=st.floats(0.2, 60))
def test_the_chain_of_stages_is_differentiated_right(s, cap, cap2):
    """jet() of two stages in a row against central differences of apply(): f' and f'' of the composition."""
    chain = (Softcap(cap), Softcap(cap2))
    x = np.array([s])
    _, d1, d2 = score_stages.jet(chain, x)
    h = 1e-4 * max(1.0, abs(s))
    f = lambda y: score_stages.apply(chain, np.array([y]))[0]  # noqa: E731
    assert d1[0] == pytest.approx((f(s + h) - f(s - h)) / (2 * h), rel=1e-5, abs=1e-7)
    slope = lambda y: score_stages.jet(chain, np.array([y]))[1][0]  # noqa: E731
    assert d2[0] == pytest.approx((slope(s + h) - slope(s - h)) / (2 * h), rel=1e-4, abs=1e-6)
    assert abs(f(s)) <= score_stages.bound(chain, abs(s)) + 1e-12


def test_tiled_and_fast_forward_compute_the_naive_engine():
    q, k, v, g, visible, kv_map = _inputs(n=9, m=13)
    stages = (Softcap(1.3),)
    o = formulas.forward(q, k, v, visible, 0.8, kv_map, stages=stages)
    grads = formulas.backward(q, k, v, visible, 0.8, kv_map, g, stages=stages)
    t_o = tiled.forward(q, k, v, visible, 0.8, kv_map, block_q=2, block_k=3, stages=stages)
    t_grads = tiled.backward(q, k, v, visible, 0.8, kv_map, g, block_q=2, block_k=3, stages=stages)
    np.testing.assert_allclose(t_o, o, rtol=1e-12, atol=1e-13)
    for a, b in zip(t_grads, (grads.q, grads.k, grads.v)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)
    u = [np.random.default_rng(2).standard_normal(x.shape) for x in (q, k, v)]
    np.testing.assert_allclose(tiled.jvp(q, k, v, visible, 0.8, kv_map, *u, block_q=4, block_k=4, stages=stages),
                               directional.jvp(q, k, v, visible, 0.8, kv_map, *u, stages=stages),
                               rtol=1e-11, atol=1e-12)
    fast = copies.Forward(visible, 0.8, kv_map, 9, 13, rows=4, stages=stages)
    np.testing.assert_allclose(fast(q[None], k, v)[0], o, rtol=1e-12, atol=1e-13)


def test_scenarios_check_it_and_its_faults_only_where_it_is():
    capped = make(n_q=4, n_k=6, d_head=4, heads_q=2, softcap=2.0, mask={"causal": "lower-right"})
    plain = make(n_q=4, n_k=6, d_head=4, heads_q=2, mask={"causal": "lower-right"})
    ours = set(softcap.REGISTRATION.faults)
    assert ours <= set(checker.applicable_faults(capped))
    assert not ours & set(checker.applicable_faults(plain))
    assert checker.run_scenario(capped).passed
    assert not checker.run_scenario(capped, ("softcap-derivative",)).passed


def test_user_code_gets_softcap_only_when_the_scenario_has_it():
    seen = []

    class Probe:
        def forward(self, q, k, v, visible, scale, kv_map, **kw):
            seen.append(kw)
            return formulas.forward(q, k, v, visible, scale, kv_map,
                                    stages=(Softcap(kw["softcap"]),) if kw else ())

        def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
            g = formulas.backward(q, k, v, visible, scale, kv_map, grad_o,
                                  stages=(Softcap(kw["softcap"]),) if kw else ())
            return g.q, g.k, g.v

    probe = Probe()
    assert score_stages.bind(probe, ()) is probe
    bound = score_stages.bind(probe, (Softcap(2.5),))
    assert bound is score_stages.bind(probe, (Softcap(2.5),))  # one object per implementation and arguments
    q, k, v, g, visible, kv_map = _inputs()
    bound.forward(q, k, v, visible, 1.0, kv_map)
    probe.forward(q, k, v, visible, 1.0, kv_map)
    assert seen == [{"softcap": 2.5}, {}]


@pytest.mark.parametrize("name, backend", [("numpy_attention", "numpy"), ("torch_attention", "torch"),
                                           ("jax_attention", "jax")])
def test_the_examples_pass_in_every_flavour(name, backend):
    pytest.importorskip({"numpy": "numpy", "torch": "torch", "jax": "jax"}[backend])
    sc = with_examples(implementation=f"softcap_attention:{name}", backend=backend, n_q=4, n_k=6, d_head=4,
                       heads_q=2, softcap=1.5, mask={"causal": "lower-right"})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("name, check", [("torch_no_tanh_derivative", "gradient q"),
                                         ("torch_capped_after_mask", "row 0's unseen K/V rows get zero gradient")])
def test_the_broken_examples_fail_where_they_are_wrong(name, check):
    pytest.importorskip("torch")
    sc = with_examples(implementation=f"softcap_attention:{name}", backend="torch", n_q=4, n_k=6, d_head=4,
                       heads_q=2, softcap=1.5, mask={"causal": "lower-right"})
    failed = {c.name for c in checker.run_scenario(sc).checks if c.verdict == "fail"}
    assert check in failed, failed


@pytest.mark.parametrize("keys, message", [
    ({"softcap": 0}, "softcap"), ({"softcap": -1.0}, "softcap"), ({"softcap": "big"}, "softcap"),
    ({"op": "block", "d_model": 8, "d_ff": 8, "softcap": 2.0}, "does not apply to op block"),
])
def test_bad_softcap_is_refused_with_its_key(keys, message):
    base = {"n_q": 4, "d_head": 4}
    with pytest.raises(ScenarioError) as err:
        make(**{**base, **keys})
    assert message in str(err.value)


def test_code_that_refuses_the_keyword_is_told_which_key_passes_it():
    sc = with_examples(implementation="my_attention:attention", n_q=4, d_head=4, softcap=2.0)
    result = checker.run_scenario(sc)
    assert not result.passed
    assert any("the scenario sets softcap" in h and "softcap=" in h for h in result.hints), result.hints


def test_reports_name_the_variants_and_plain_ones_do_not():
    capped = checker.run_scenario(make(n_q=4, d_head=4, softcap=2.0, alibi={})).to_json()
    plain = checker.run_scenario(make(n_q=4, d_head=4)).to_json()
    assert capped["variants"] == ["softcap 2", "alibi distance"] and "variants" not in plain
    assert "softcap 2, alibi distance" in make(n_q=4, d_head=4, softcap=2.0, alibi={}).describe()
