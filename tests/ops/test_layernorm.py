"""The layernorm op: its closed forms against torch autograd, and a user's LayerNorm checked through the same
door as attention's (examples/my_layernorm.py). Its faults are in the fault contract (test_fault_contract.py)."""
import numpy as np
import pytest
import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops import layernorm

from helpers import with_examples


def test_closed_forms_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((2, 3, 7)), rng.standard_normal((2, 3, 7))
    gamma, beta = 1 + 0.5 * rng.standard_normal(7), rng.standard_normal(7)
    t = [torch.tensor(a, requires_grad=True) for a in (x, gamma, beta)]
    y = torch.nn.functional.layer_norm(t[0], (7,), t[1], t[2], eps=1e-3)
    y.backward(torch.tensor(g))
    np.testing.assert_allclose(layernorm.forward(x, gamma, beta, 1e-3), y.detach().numpy(), rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(layernorm.backward(x, gamma, beta, 1e-3, g), t):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), rtol=1e-10, atol=1e-12)


def _user(spec: str, **keys):
    return with_examples(op="layernorm", batch=2, n=4, d_model=8, implementation=spec, **keys)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_correct_user_layernorm_passes_and_every_fault_is_caught_on_it(dtype):
    sc = _user("my_layernorm:layernorm", dtype=dtype)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {c.name for c in result.checks} >= {"forward agrees with the reference", "deterministic",
                                                "G_x rows sum to 0"}
    assert {c.status for c in checker.negative_controls([sc])} == {"detected"}


def test_a_user_layernorm_with_a_wrong_variance_term_fails_where_it_is_wrong():
    result = checker.run_scenario(_user("my_layernorm:broken", eps=0.0))
    failed = {(c.name, c.tensor) for c in result.checks if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x"),
                      ("<G_x, x> = d eps mean(g xhat) / s^2", "g_x")}, failed


def test_implementation_applies_to_the_ops_that_declare_an_interface_only():
    import re

    from gradcheck_cli.ops import OPS
    owners = ", ".join(name for name, op in OPS.items() if op.implementation is not None)
    assert "layernorm" in owners and "infonce" in owners and "logit-scale" not in owners
    with pytest.raises(ScenarioError, match=re.escape(f"does not apply to op logit-scale (it is a key of {owners})")):
        scenario.loads(yaml.safe_dump({"scenarios": [{"name": "r", "op": "logit-scale",
                                                      "implementation": "my_layernorm:layernorm"}]}))
