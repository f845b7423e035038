"""Hostile inputs, second round (issue 22, items 7 to 11): input nested deep enough to break a recursive
reader, modules with frozen parameters that cannot be reduced, merged reports that repeat a key or whose
shards are missing, SIGTERM outside 'run', a recipe whose library is absent and array files whose names
the file system cannot hold. Each is bad input with one message (exit 2) or a pass, never a traceback."""
import textwrap

import pytest
import yaml

from gradcheck_cli import checker, scenario

SWIGLU = {"name": "m", "op": "swiglu", "n": 3, "d_model": 4, "d_ff": 6}

FROZEN_TORCH = '''
import torch
import torch.nn.functional as F


class SwiGLU(torch.nn.Module):
    def __init__(self, d_model, d_ff, extra):
        super().__init__()
        self.gate = torch.nn.Linear(d_model, d_ff, bias=False)
        self.up = torch.nn.Linear(d_model, d_ff, bias=False)
        self.down = torch.nn.Linear(d_ff, d_model, bias=False)
        if "empty" in extra:
            self.unused = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        if "sparse" in extra:
            self.table = torch.nn.Parameter(torch.eye(3).to_sparse(), requires_grad=False)
        if "csr" in extra:
            self.csr = torch.nn.Parameter(torch.eye(3).to_sparse_csr(), requires_grad=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def empty(d_model, d_ff):
    return SwiGLU(d_model, d_ff, ("empty",))


def sparse(d_model, d_ff):
    return SwiGLU(d_model, d_ff, ("sparse", "csr"))


def both(d_model, d_ff):
    return SwiGLU(d_model, d_ff, ("empty", "sparse"))
'''


def _module_row(result):
    (row,) = [c for c in result.checks if c.name == "module parameters"]
    return row.detail


@pytest.mark.parametrize("factory, listed", [
    ("empty", ["unused (empty, [0])"]),
    ("sparse", ["table (sparse_coo, [3, 3], not inspected)", "csr (sparse_csr, [3, 3], not inspected)"]),
    ("both", ["unused (empty, [0])", "table (sparse_coo, [3, 3], not inspected)"]),
])
def test_a_correct_torch_module_with_frozen_empty_or_sparse_parameters_passes_and_lists_them(
        tmp_path, factory, listed):
    pytest.importorskip("torch")
    (tmp_path / "frozen_mods.py").write_text(FROZEN_TORCH)
    doc = {**SWIGLU, "backend": "torch", "implementation": {
        "factory": f"frozen_mods:{factory}", "weights": {"gate.weight": "w1.T", "up.weight": "w3.T",
                                                         "down.weight": "w2.T"}}}
    sc = scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    detail = _module_row(result)
    assert detail.endswith("frozen (kept as the factory built them, not checked): " + ", ".join(listed)), detail
    assert not result.hints


FROZEN_JAX = '''
import jax.numpy as jnp
from jax.experimental import sparse


def swiglu(x, w1, w3, w2):
    import jax
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def with_params(d_model, d_ff):
    params = {"mlp": {"gate": jnp.zeros((d_model, d_ff)), "up": jnp.zeros((d_model, d_ff)),
                      "down": jnp.zeros((d_ff, d_model))},
              "unused": jnp.zeros((0, 4)), "table": sparse.BCOO.fromdense(jnp.eye(3)), "name": "mlp"}
    return (lambda p, x: swiglu(x, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"])), params
'''


def test_a_jax_params_pytree_with_empty_sparse_and_non_array_leaves_passes_and_lists_them(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "frozen_jax.py").write_text(FROZEN_JAX)
    doc = {**SWIGLU, "backend": "jax", "implementation": {
        "factory": "frozen_jax:with_params", "weights": {"mlp.gate": "w1", "mlp.up": "w3", "mlp.down": "w2"}}}
    sc = scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert _module_row(result).endswith(
        "frozen (kept as the factory built them, not checked): unused (empty, [0, 4]), "
        "table (BCOO, not inspected), name (str, not inspected)"), _module_row(result)
    assert not result.hints


def test_a_frozen_nonzero_parameter_beside_an_empty_one_is_still_named_in_the_hint(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "frozen_bias.py").write_text(FROZEN_TORCH + textwrap.dedent('''
        def biased(d_model, d_ff):
            m = SwiGLU(d_model, d_ff, ("empty", "sparse"))
            m.down = torch.nn.Linear(d_ff, d_model, bias=True)
            return m
        '''))
    doc = {**SWIGLU, "backend": "torch", "implementation": {
        "factory": "frozen_bias:biased", "weights": {"gate.weight": "w1.T", "up.weight": "w3.T",
                                                     "down.weight": "w2.T"}}}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0])
    assert "forward agrees with the reference" in {c.name for c in result.checks if not c.passed}
    (hint,) = [h for h in result.hints if "not zero" in h]
    assert "(down.bias)" in hint
