"""What the fork server imports once for the workers it forks (workers.preload): a fresh worker per
implementation then starts without the imports of its backend (JAX's own, sympy behind torch's first backward)."""
import pytest
import yaml

from gradcheck_cli import scenario, workers

from helpers import ROOT


def _scenario(**keys):
    doc = {"scenarios": [{"name": "t", "heads_q": 2, "n_q": 3, "d_head": 4, **keys}]}
    return scenario.loads(yaml.safe_dump(doc), base_dir=ROOT / "examples")[0]


def test_the_fork_server_preloads_each_scenarios_engine_and_backend():
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    jax_sc = _scenario(backend="jax", implementation="jax_attention:attention")
    torch_sc = _scenario(backend="torch")
    built_in = _scenario(engine="tiled")
    modules = workers.preload([jax_sc, torch_sc, built_in])
    assert modules[:2] == ["gradcheck_cli.worker_process", "gradcheck_cli.ops"]
    assert {"jax", "jax.numpy", "gradcheck_cli.flavours.jax", "gradcheck_cli.ops.attention.user_engine"} <= set(modules)
    assert {"torch", "torch.fx.experimental.symbolic_shapes",
            "gradcheck_cli.ops.attention.torch_engine"} <= set(modules)
    assert "gradcheck_cli.ops.attention.tiled_engine" in modules
    assert len(modules) == len(set(modules))
    assert not {"jax", "torch"} & set(workers.preload([built_in]))  # a framework only where a scenario uses it
