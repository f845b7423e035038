"""The ops beyond attention: each backward against an independent implementation (a loop forward
differentiated by the complex step; torch autograd where installed), each fault caught on its
shipped config, the invariants' properties, and bad keys rejected with file, line and key."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from gradcheck_cli import checker, scenario
from gradcheck_cli.ops import OPS, rmsnorm, rope, swiglu
from helpers import assert_rejected, make
from reference import complex_step_gradients, rmsnorm_ref, rope_ref, swiglu_ref


def _close(mine: dict, ref: dict, rtol=1e-10):
    for name, value in ref.items():
        scale = max(np.abs(value).max(), 1.0)
        assert np.abs(mine[name] - value).max() <= rtol * scale, name


def test_rmsnorm_backward_against_complex_step():
    sc = make(op="rmsnorm", batch=2, n=3, d_model=5, eps=0.01)
    p = OPS["rmsnorm"].build(sc)
    g = p.arrays["grad_output"]
    ref = complex_step_gradients(lambda x, gamma: rmsnorm_ref(x, gamma, 0.01), p.inputs, g)
    _close(p.gradients, ref)
    assert np.allclose(p.output, rmsnorm_ref(p.inputs["x"], p.inputs["gamma"], 0.01), rtol=1e-13)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_backward_against_complex_step(layout):
    sc = make(op="rope", heads=2, n=4, d_head=6, rotary_dim=4, layout=layout, position_offset=7, base=100.0)
    p = OPS["rope"].build(sc)
    ref = complex_step_gradients(lambda x: rope_ref(x, 100.0, 4, layout, 7), p.inputs, p.arrays["grad_output"])
    _close(p.gradients, ref)
    assert np.allclose(p.output, rope_ref(p.inputs["x"], 100.0, 4, layout, 7), rtol=1e-13, atol=1e-14)


def test_swiglu_backward_against_complex_step():
    sc = make(op="swiglu", batch=2, n=2, d_model=3, d_ff=4)
    p = OPS["swiglu"].build(sc)
    ref = complex_step_gradients(swiglu_ref, p.inputs, p.arrays["grad_output"])
    _close(p.gradients, ref)


def test_backwards_against_torch_autograd():
    torch = pytest.importorskip("torch")
    # RMSNorm
    sc = make(op="rmsnorm", batch=2, n=3, d_model=6, eps=1e-3)
    p = OPS["rmsnorm"].build(sc)
    x, gamma = (torch.tensor(p.inputs[t], requires_grad=True) for t in ("x", "gamma"))
    y = gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-3)
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    _close(p.gradients, {"x": x.grad.numpy(), "gamma": gamma.grad.numpy()})
    # SwiGLU
    sc = make(op="swiglu", batch=2, n=3, d_model=4, d_ff=5)
    p = OPS["swiglu"].build(sc)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.inputs.items()}
    y = (torch.nn.functional.silu(t["x"] @ t["w1"]) * (t["x"] @ t["w3"])) @ t["w2"]
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    _close(p.gradients, {k: v.grad.numpy() for k, v in t.items()})
    # RoPE, half layout written as HF's rotate_half
    sc = make(op="rope", heads=2, n=5, d_head=8)
    p = OPS["rope"].build(sc)
    x = torch.tensor(p.inputs["x"], requires_grad=True)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    freqs = torch.outer(torch.arange(5, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    rotated = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    y = x * emb.cos() + rotated * emb.sin()
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    _close(p.gradients, {"x": x.grad.numpy()})


@pytest.mark.parametrize("config, op", [("rmsnorm.yaml", "rmsnorm"), ("rope.yaml", "rope"), ("swiglu.yaml", "swiglu")])
def test_each_fault_is_caught_on_its_config(root, config, op):
    for sc in scenario.load(root / "configs" / config):
        assert checker.run_scenario(sc).passed
        for fault, f in OPS[op].faults.items():
            result = checker.run_scenario(sc, (fault,))
            failed = {c.name for c in result.checks if c.verdict == "fail"}
            assert failed and failed <= set(f.caught_by), (sc.name, fault, failed)


def test_invariants_catch_their_faults_without_finite_differences():
    cases = [("rmsnorm", dict(n=3, d_model=5), "rmsnorm-feedback", "<G_x, x> = 0 per row when eps = 0"),
             ("rope", dict(n=4, d_head=4), "rope-transpose", "backward is the transpose of the forward"),
             ("swiglu", dict(n=3, d_model=3, d_ff=4), "gate-branch", "<G_W3, W_3> = L")]
    for op, keys, fault, check in cases:
        sc = make(op=op, **keys)
        invariant = {c.name: c for c in OPS[op].problem(sc, (fault,)).invariants()}[check]
        assert not invariant.passed, (op, fault)
        assert {c.name: c for c in OPS[op].problem(sc).invariants()}[check].passed


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


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**16))
def test_swiglu_euler_identities_property(batch, n, d, f, seed):
    rng = np.random.default_rng(seed)
    x, w1, w3 = rng.standard_normal((batch, n, d)), rng.standard_normal((d, f)), rng.standard_normal((d, f))
    w2, g = rng.standard_normal((f, d)), rng.standard_normal((batch, n, d))
    grads = swiglu.backward(x, w1, w3, w2, g)
    loss = np.sum(swiglu.forward(x, w1, w3, w2) * g)
    for w in ("w3", "w2"):
        assert abs(np.sum(grads[w] * {"w3": w3, "w2": w2}[w]) - loss) <= 1e-10 * max(abs(loss), 1.0)


BAD_OP_KEYS = [
    ("op: rmsnorm\n    n: 3\n", 2, "scenarios[0].d_model", "is required"),
    ("op: rmsnorm\n    d_model: 4\n    eps: -1\n", 5, "scenarios[0].eps", "must be >= 0"),
    ("op: rmsnorm\n    d_model: 4\n    heads_q: 2\n", 5, "scenarios[0].heads_q", "does not apply to op rmsnorm"),
    ("op: rmsnorm\n    d_model: 4\n    d_ff: 2\n", 5, "scenarios[0].d_ff", "it is a key of swiglu"),
    ("op: rope\n    n: 3\n    d_head: 5\n", 5, "scenarios[0].d_head", "must be even"),
    ("op: rope\n    n: 3\n    d_head: 4\n    rotary_dim: 6\n", 6, "scenarios[0].rotary_dim", "larger than d_head"),
    ("op: rope\n    n: 3\n    d_head: 4\n    layout: diagonal\n", 6, "scenarios[0].layout", "expected one of"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 0\n", 5, "scenarios[0].d_ff", "must be >= 1"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 2\n    dtype: float16\n", 6, "scenarios[0].dtype", "expected one of"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 2\n    check: {colouring: true}\n", 6, "scenarios[0].check.colouring",
     "no independent output blocks"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 2\n    implementation: a:b\n", 6, "scenarios[0].implementation",
     "does not apply to op swiglu"),
]


@pytest.mark.parametrize("extra, line, key, words", BAD_OP_KEYS, ids=[b[2] + ":" + b[3] for b in BAD_OP_KEYS])
def test_bad_op_keys_name_file_line_and_key(extra, line, key, words):
    assert_rejected(f"scenarios:\n  - name: s\n    {extra}", line, key, words)


from reference import infonce_ref, projections_ref  # noqa: E402


@pytest.mark.parametrize("source", ["self", "cross"])
def test_projections_backward_against_complex_step(source):
    keys = dict(op="attention-projections", batch=2, n_q=3, d_model=4, d_head=2, heads_q=2, heads_kv=1,
                mask={"causal": "lower-right"}, source=source)
    if source == "cross":
        keys.update(n_k=4, d_value=3, mask={"key_lengths": [4, 2]})
    sc = make(**keys)
    p = OPS["attention-projections"].build(sc)
    kv = np.asarray(sc.kv_map)
    ref = complex_step_gradients(
        lambda x, w_q, w_k, w_v, w_o, m=None: projections_ref(x, w_q, w_k, w_v, w_o, sc.visible, sc.scale, kv, 2, 1, m),
        p.inputs, p.arrays["grad_output"])
    _close(p.gradients, ref)


@pytest.mark.parametrize("similarity, in_batch, hard, learn", [("dot", True, 0, False), ("cosine", True, 2, True),
                                                               ("dot", False, 2, True), ("cosine", False, 1, False)])
def test_infonce_backward_against_complex_step(similarity, in_batch, hard, learn):
    sc = make(op="infonce", batch=3, dim=4, similarity=similarity, in_batch=in_batch, hard_negatives=hard,
              learn_temperature=learn, temperature=0.5)
    p = OPS["infonce"].build(sc)

    def f(q, p, n=None, tau=None):
        return infonce_ref(q, p, n, 0.5 if tau is None else tau, similarity, in_batch)
    _close(p.gradients, complex_step_gradients(f, p.inputs, p.arrays["grad_output"]))
    assert np.allclose(p.output, infonce_ref(p.inputs["q"], p.inputs["p"], p.inputs.get("n"), 0.5, similarity, in_batch))


def test_block_and_projections_against_torch_autograd():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    sc = make(op="block", batch=2, n_q=4, d_model=8, d_ff=6, d_head=4, heads_q=2, heads_kv=1,
              mask={"causal": "lower-right"}, rope_layout="half")
    p = OPS["block"].build(sc)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in p.inputs.items()}

    def norm(x, gamma):
        return gamma * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def rope_t(x):  # HF's rotate_half formulation
        inv = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4))
        emb = torch.cat([torch.outer(torch.arange(4, dtype=torch.float64), inv)] * 2, dim=-1)
        return x * emb.cos() + torch.cat([-x[..., 2:], x[..., :2]], dim=-1) * emb.sin()

    def split_t(z, h):
        return z.view(2, 4, h, -1).transpose(1, 2)

    h1 = norm(t["x"], t["gamma1"])
    q, k, v = rope_t(split_t(h1 @ t["w_q"], 2)), rope_t(split_t(h1 @ t["w_k"], 1)), split_t(h1 @ t["w_v"], 1)
    o = F.scaled_dot_product_attention(q, k.expand(2, 2, 4, 4), v.expand(2, 2, 4, 4),
                                       attn_mask=torch.tensor(sc.visible))
    h = t["x"] + o.transpose(1, 2).reshape(2, 4, 8) @ t["w_o"]
    h2 = norm(h, t["gamma2"])
    y = h + (F.silu(h2 @ t["w1"]) * (h2 @ t["w3"])) @ t["w2"]
    (y * torch.tensor(p.arrays["grad_output"])).sum().backward()
    _close(p.gradients, {k: v.grad.numpy() for k, v in t.items()}, rtol=1e-9)


@pytest.mark.parametrize("config", ["attention-projections.yaml", "infonce.yaml", "logit-scale.yaml", "block.yaml"])
def test_each_fault_is_caught_on_the_other_configs(root, config):
    for sc in scenario.load(root / "configs" / config):
        assert checker.run_scenario(sc).passed, sc.name
    cells = checker.negative_controls(scenario.load(root / "configs" / config))
    assert not [c for c in cells if c.status == "missed"]
    assert {c.fault for c in cells if c.status == "detected"} == set(OPS[sc.op].faults)


def test_block_catches_every_fault_of_its_parts(root):
    parts = ("attention", "attention-projections", "rope", "rmsnorm", "swiglu")
    assert set(OPS["block"].faults) == {f for op in parts for f, rec in OPS[op].faults.items() if rec.engine}


def test_logit_scale_prediction_fails_only_where_the_seed_says():
    independent = checker.run_scenario(make(op="logit-scale", d_heads=[8, 32], draws=4000)).checks
    assert all(c.passed for c in independent) and len(independent) == 4
    correlated = checker.run_scenario(make(op="logit-scale", d_heads=[32], draws=4000, correlation=0.4)).checks
    names = {c.name: c for c in correlated}
    assert names["Var(q.k) != d sq^2 sk^2 (correlated)"].passed
    assert names["Var(q.k) = d sq^2 sk^2 (1 + (d-1) rho^2)"].passed
    broken = checker.run_scenario(make(op="logit-scale", d_heads=[32], draws=4000), ("logit-scale-divisor",))
    assert {c.name for c in broken.checks if not c.passed} == {"Var(q.k / sqrt(d)) = sq^2 sk^2"}


MORE_BAD = [
    ("op: attention-projections\n    n_q: 3\n    d_head: 2\n    d_model: 4\n    n_k: 5\n", 7, "scenarios[0].n_k",
     "n_k must equal n_q"),
    ("op: attention-projections\n    n_q: 3\n    d_head: 2\n    d_model: 4\n    source: both\n", 7,
     "scenarios[0].source", "expected one of"),
    ("op: block\n    n_q: 3\n    d_head: 4\n    d_model: 4\n", 2, "scenarios[0].d_ff", "is required"),
    ("op: block\n    n_q: 3\n    d_head: 3\n    d_model: 4\n    d_ff: 4\n", 5, "scenarios[0].d_head", "must be even"),
    ("op: infonce\n    dim: 4\n    hard_negatives: -1\n", 5, "scenarios[0].hard_negatives", "must be >= 0"),
    ("op: infonce\n    dim: 4\n    temperature: 0\n", 5, "scenarios[0].temperature", "must be > 0"),
    ("op: infonce\n    dim: 4\n    in_batch: yes please\n", 5, "scenarios[0].in_batch", "expected true or false"),
    ("op: infonce\n    dim: 4\n    batch: 1\n", 5, "scenarios[0].batch", "at least one negative"),
    ("op: logit-scale\n    correlation: 1.0\n", 4, "scenarios[0].correlation", "must be in [0, 1)"),
    ("op: logit-scale\n    d_heads: [8, 8]\n", 4, "scenarios[0].d_heads[1]", "listed twice"),
    ("op: logit-scale\n    draws: 10\n", 4, "scenarios[0].draws", "at least 100"),
]


@pytest.mark.parametrize("extra, line, key, words", MORE_BAD, ids=[b[2] + ":" + b[3] for b in MORE_BAD])
def test_more_bad_op_keys(extra, line, key, words):
    test_bad_op_keys_name_file_line_and_key(extra, line, key, words)
