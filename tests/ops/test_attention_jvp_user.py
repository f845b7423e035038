"""The JVP of a user's attention (``check: {mode: jvp}`` with ``implementation:``): a NumPy ``jvp`` method, a
torch ``autograd.Function`` with ``jvp`` through torch.func.jvp, and jax.jvp; what is caught (the centring bug
of examples/torch_jvp.py with its tensor, rows and hint; every JVP fault as a negative control; a 0.1% bug in
float32), and what is refused or reported without a traceback."""
import pytest
import yaml
from click.testing import CliRunner

from gradcheck_cli import checker, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import JVP_FAULTS

from helpers import JAX_ATTENTION, ROOT, make, with_examples

SHAPE = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=8, d_head=8,
             mask={"causal": "lower-right", "key_lengths": [8, 6]}, check={"mode": "jvp"})

# torch.func.jvp of some torch functions goes through torch.jit.script, which warns that it is deprecated
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _failed(result):
    return {c.name for c in result.checks if c.verdict == "fail"}


def test_numpy_jvp_passes_and_every_jvp_fault_is_caught_on_it():
    sc = with_examples(implementation="my_attention:attention", **SHAPE)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    names = [c.name for c in result.checks]
    assert names[:6] == ["jvp (random tangent)", "jvp q", "jvp k", "jvp v", "adjoint identity",
                         "JVP agrees with the reference"]
    cells = checker.negative_controls([sc])
    assert {c.fault for c in cells if c.status == "detected"} >= set(JVP_FAULTS)


def test_the_centring_bug_of_the_example_fails_with_tensor_rows_and_hint():
    pytest.importorskip("torch")
    results = {sc.name: checker.run_scenario(sc) for sc in scenario.load(ROOT / "examples/torch_jvp.yaml")}
    assert all(results[n].verdict == "pass" for n in results if n.startswith("jvp-mine"))
    broken = results["jvp-broken"]
    failed = _failed(broken)
    # the centring term acts on dS, which only the Q and K tangents make: V's path passes
    assert {"jvp (random tangent)", "jvp q", "jvp k", "adjoint identity", "JVP agrees with the reference"} <= failed
    assert "jvp v" not in failed
    jvp_q = next(c for c in broken.checks if c.name == "jvp q")
    assert jvp_q.tensor == "o_dot" and jvp_q.diagnosis is not None
    assert "query row" in str(jvp_q.diagnosis)  # located by head and row (the heat map's axes)
    assert len(broken.hints) == 1 and "centring term is missing" in broken.hints[0]


def test_the_example_config_exits_1_and_prints_the_hint(tmp_path):
    pytest.importorskip("torch")
    out = CliRunner().invoke(main, ["run", str(ROOT / "examples/torch_jvp.yaml"), "--select", "jvp-broken"])
    assert out.exit_code == 1
    assert "centring term is missing" in out.output and "Traceback" not in out.output


def test_a_numpy_implementation_without_jvp_is_bad_input_at_its_key(tmp_path):
    (tmp_path / "nojvp.py").write_text("import numpy as np\nclass A:\n    forward = backward = staticmethod(len)\n"
                                       "attention = A()\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"scenarios": [{"name": "x", "implementation": "nojvp:attention", **SHAPE}]}))
    out = CliRunner().invoke(main, ["run", str(cfg)])
    assert out.exit_code == 2, out.output
    assert "has no callable jvp" in out.output and "implementation" in out.output and "Traceback" not in out.output


def test_jvp_mode_is_refused_for_layers_user_code():
    with pytest.raises(ScenarioError, match="mode jvp checks a forward-mode derivative .JVP.; op rmsnorm has none"):
        make(op="rmsnorm", implementation="m:f", check={"mode": "jvp"})


def test_jvp_mode_is_refused_in_half_precision():
    pytest.importorskip("torch")  # without it, backend torch is refused first, as not installed
    with pytest.raises(ScenarioError, match="differences the forward: it needs dtype float64 or float32"):
        make(backend="torch", implementation="m:f", dtype="bfloat16", **SHAPE)


NO_FORWARD_MODE = '''
import torch
def plain(q, k, v, visible, scale, kv_map):
    s = scale * q @ k[:, kv_map].transpose(-1, -2)
    return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v[:, kv_map]
def _grads(inputs, g):
    q, k, v = (x.detach().requires_grad_() for x in inputs[:3])
    with torch.enable_grad():
        return (*torch.autograd.grad(plain(q, k, v, *inputs[3:]), (q, k, v), g), None, None, None)
class Old(torch.autograd.Function):  # forward(ctx, ...): forward AD, but not torch.func
    @staticmethod
    def forward(ctx, *inputs):
        ctx.inputs = inputs
        return plain(*inputs)
    @staticmethod
    def backward(ctx, g):
        return _grads(ctx.inputs, g)
class NoJvp(torch.autograd.Function):  # setup_context, but no jvp
    @staticmethod
    def forward(*inputs):
        return plain(*inputs)
    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.inputs = inputs
    @staticmethod
    def backward(ctx, g):
        return _grads(ctx.inputs, g)
def old_style(*args):
    return Old.apply(*args)
def no_jvp(*args):
    return NoJvp.apply(*args)
'''


@pytest.mark.parametrize("name, says", [("old_style", "setup_context"), ("no_jvp", "jvp(ctx, *tangents)")])
def test_torch_code_without_forward_mode_gets_a_clear_message(tmp_path, name, says):
    pytest.importorskip("torch")
    (tmp_path / "nofwd.py").write_text(NO_FORWARD_MODE)
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "backend": "torch",
                                                       "implementation": f"nofwd:{name}", **SHAPE}]}),
                        base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    row = next(c for c in result.checks if c.name == "jvp")
    assert row.verdict == "fail" and says in row.detail and "no forward-mode derivative" in row.detail
    assert "backward agrees with the reference" not in _failed(result)  # the VJP itself is fine


def test_a_tenth_of_a_percent_jvp_bug_in_float32_is_caught_by_the_reference_check(tmp_path):
    torch = pytest.importorskip("torch")  # noqa: F841
    (tmp_path / "scaled.py").write_text(
        "import torch\nimport torch_jvp\n"
        "class S(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(*a):\n        return torch_jvp.attention(*a)\n"
        "    @staticmethod\n    def setup_context(ctx, inputs, output):\n        ctx.inputs = inputs\n"
        "    @staticmethod\n    def jvp(ctx, dq, dk, dv, *_):\n"
        "        return torch.func.jvp(lambda q, k, v: torch_jvp.attention(q, k, v, *ctx.inputs[3:]),"
        " tuple(ctx.inputs[:3]), (dq, dk, dv))[1] * 1.001\n"
        "    @staticmethod\n    def backward(ctx, g):\n"
        "        q, k, v = (x.detach().requires_grad_() for x in ctx.inputs[:3])\n"
        "        with torch.enable_grad():\n            o = torch_jvp.attention(q, k, v, *ctx.inputs[3:])\n"
        "        return (*torch.autograd.grad(o, (q, k, v), g), None, None, None)\n"
        "def attention(*a):\n    return S.apply(*a)\n")
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "backend": "torch", "dtype": "float32",
                                                           "implementation": "scaled:attention", **SHAPE}]}),
                            base_dir=tmp_path)[0]
        result = checker.run_scenario(sc)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert "JVP agrees with the reference" in _failed(result), [(c.name, c.verdict) for c in result.checks]


def test_jax_jvp_passes_and_a_custom_vjp_function_is_reported(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "jx.py").write_text(JAX_ATTENTION + '''def _f(q, k, v, visible, scale, kv_map):
    out, pull = jax.vjp(lambda q, k, v: attention(q, k, v, visible, scale, kv_map), q, k, v)
    return out, pull
def _b(pull, g):
    return (*pull(g), None, None, None)
custom.defvjp(_f, _b)
''')
    scs = scenario.loads(yaml.safe_dump({"scenarios": [
        {"name": n, "backend": "jax", "implementation": f"jx:{n}", **SHAPE} for n in ("attention", "custom")]}),
        base_dir=tmp_path)
    good, custom = (checker.run_scenario(sc) for sc in scs)
    assert good.verdict == "pass", [(c.name, c.detail) for c in good.checks if not c.passed]
    row = next(c for c in custom.checks if c.name == "jvp")
    assert row.verdict == "fail" and "custom_jvp" in row.detail


def test_a_jvp_wrong_along_one_path_by_no_known_mistake_gets_the_path_hint(tmp_path):
    (tmp_path / "halfk.py").write_text(
        (ROOT / "examples/my_attention.py").read_text() + "\n\n"
        "class HalfK(Attention):\n"
        "    @staticmethod\n    def jvp(q, k, v, visible, scale, kv_map, dq, dk, dv):\n"
        "        return Attention.jvp(q, k, v, visible, scale, kv_map, dq, 1.5 * dk, dv)\n\n\n"
        "half_k = HalfK()\n")
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "implementation": "halfk:half_k", **SHAPE}]}),
                        base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    assert {"jvp k", "jvp (random tangent)"} <= _failed(result) and not {"jvp q", "jvp v"} & _failed(result)
    assert len(result.hints) == 1 and "tangent of k only" in result.hints[0]


VARIANTS = """

class Interleaved(Attention):  # the tangents of K and V repeated the other way round (kv_map is contiguous)
    @staticmethod
    def jvp(q, k, v, visible, scale, kv_map, dq, dk, dv):
        other = np.arange(q.shape[1]) % k.shape[1]
        p = _probabilities(q, k[:, kv_map], visible, scale)
        ds = scale * (dq @ np.swapaxes(k[:, kv_map], -1, -2) + q @ np.swapaxes(dk[:, other], -1, -2))
        ds = np.where(visible, ds, 0.0)
        ds -= np.sum(p * ds, axis=-1, keepdims=True)
        return (p * ds) @ v[:, kv_map] + p @ dv[:, other]


class Unmasked(Attention):  # mu from the softmax and dS over every key
    @staticmethod
    def jvp(q, k, v, visible, scale, kv_map, dq, dk, dv):
        p = _probabilities(q, k[:, kv_map], visible, scale)
        every = _probabilities(q, k[:, kv_map], np.ones_like(visible), scale)
        ds = scale * (dq @ np.swapaxes(k[:, kv_map], -1, -2) + q @ np.swapaxes(dk[:, kv_map], -1, -2))
        mu = np.sum(every * ds, axis=-1, keepdims=True)
        ds = np.where(visible, ds, 0.0)
        return (p * (ds - mu)) @ v[:, kv_map] + p @ dv[:, kv_map]


class NaN(Attention):
    @staticmethod
    def jvp(q, k, v, visible, scale, kv_map, dq, dk, dv):
        return np.full(q.shape[:-1] + (v.shape[-1],), np.nan)


class Float32(Attention):  # the tangent computed in float32 inside a float64 scenario
    @staticmethod
    def jvp(*args):
        low = [a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == np.float64 else a for a in args]
        return Attention.jvp(*low).astype(np.float64)


interleaved, unmasked, nan, float32 = Interleaved(), Unmasked(), NaN(), Float32()
"""


@pytest.mark.parametrize("name, named", [("interleaved", "different KV-head layout"),
                                         ("unmasked", "mu is taken over every key")])
def test_the_hint_names_a_gqa_layout_or_mask_mistake_of_the_tangent(tmp_path, name, named):
    (tmp_path / "variants.py").write_text((ROOT / "examples/my_attention.py").read_text() + VARIANTS)
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "implementation": f"variants:{name}",
                                                       **SHAPE}]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    assert result.verdict == "fail" and len(result.hints) == 1 and named in result.hints[0], result.hints


def test_a_jvp_returning_nan_is_one_failed_row_without_the_copies_hint(tmp_path):
    (tmp_path / "variants.py").write_text((ROOT / "examples/my_attention.py").read_text() + VARIANTS)
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "implementation": "variants:nan", **SHAPE}]}),
                        base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    row = next(c for c in result.checks if c.name == "jvp")
    assert row.verdict == "fail" and "non-finite" in row.detail and not result.hints


def test_a_float32_tangent_in_a_float64_scenario_fails_the_reference_check_which_says_so(tmp_path):
    (tmp_path / "variants.py").write_text((ROOT / "examples/my_attention.py").read_text() + VARIANTS)
    sc = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "x", "implementation": "variants:float32",
                                                       **SHAPE}]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    row = next(c for c in result.checks if c.name == "JVP agrees with the reference")
    assert row.verdict == "fail" and "computes in about float32" in row.detail
