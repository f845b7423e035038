"""Helpers the test modules import (``from helpers import make``): tests/ is on pytest's ``pythonpath``
(pyproject.toml), so modules in tests/ops/, tests/scenario/, ... import them the same way."""
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from gradcheck_cli import scenario

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def load_config(path):
    """A shipped config's scenarios; skips the test when it needs torch and torch is not installed."""
    from gradcheck_cli.errors import ScenarioError
    try:
        return scenario.load(path)
    except ScenarioError as exc:
        if "not installed" in str(exc):
            pytest.skip(f"{path.name} needs torch")
        raise


def make(**keys) -> scenario.Scenario:
    """One scenario from keyword arguments, through the same YAML loader users go through."""
    keys.setdefault("name", "t")
    return scenario.loads(yaml.safe_dump({"scenarios": [keys]}))[0]


def with_examples(**keys) -> scenario.Scenario:
    """One scenario whose ``implementation`` is found in examples/ (as a YAML there would find it)."""
    keys.setdefault("name", "mine")
    return scenario.loads(yaml.safe_dump({"scenarios": [keys]}), base_dir=ROOT / "examples")[0]


def with_code(tmp_path, source: str, function: str, **keys) -> scenario.Scenario:
    """One scenario whose implementation is ``function`` of ``source``, written as a module of its own in
    ``tmp_path`` (a name no other test uses), loaded as a YAML beside it would be."""
    module = "mine_" + re.sub(r"\W", "_", tmp_path.name)
    (tmp_path / f"{module}.py").write_text(source)
    keys.setdefault("name", "t")
    keys["implementation"] = f"{module}:{function}"
    return scenario.loads(yaml.safe_dump({"scenarios": [keys]}), base_dir=tmp_path)[0]


def random_inputs(sc, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_head))
    k = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_head))
    v = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_value))
    g = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_value))
    return q, k, v, g


def assert_rejected(text: str, line: int, key: str, words: str) -> None:
    """The loader refuses ``text`` naming this line and key, with ``words`` in the message."""
    from gradcheck_cli.errors import ScenarioError
    with pytest.raises(ScenarioError) as info:
        scenario.loads(text, file="bad.yaml")
    err = info.value
    assert (err.file, err.line, err.key) == ("bad.yaml", line, key), str(err)
    assert words in str(err)


def assert_close(mine: dict, ref: dict, rtol=1e-10):
    """Each named array of ``mine`` equals ``ref``'s to ``rtol`` of that array's size (at least 1)."""
    for name, value in ref.items():
        scale = max(np.abs(value).max(), 1.0)
        assert np.abs(mine[name] - value).max() <= rtol * scale, name


def examples(factor: float) -> int:
    """``factor`` times the hypothesis profile's max_examples (tests/conftest.py: dev 40, ci 120): the
    example count of a test that needs more (a fuzzer) or fewer (an expensive property) than the default,
    scaling with the profile instead of fixed."""
    from hypothesis import settings
    return max(1, round(factor * settings.default.max_examples))


#: The masks the closed-form JVP and HVP tests run on (tests/ops/test_attention_jvp.py, test_attention_hvp.py).
DERIVATIVE_MASKS = {
    "none": {},
    "causal-lower-right": dict(causal="lower-right"),
    "padding": dict(key_lengths=[10, 6]),
    "window": dict(window=(2, 1)),
    "causal+padding": dict(causal="lower-right", key_lengths=[10, 7]),
}


def derivative_case(mask, dtype=np.float64, heads=(4, 2), seed=0):
    """(q, k, v, visible, scale, kv_map, rng) of a small attention problem (B=2, n_q=5, n_k=10, d=8, d_value=6) with
    ``mask`` (a DERIVATIVE_MASKS entry); ``rng`` draws what a test needs next (tangents, an upstream gradient)."""
    from gradcheck_cli import masks
    rng = np.random.default_rng(seed)
    b, (hq, hkv), nq, nk, d, dv = 2, heads, 5, 10, 8, 6
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in
               ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    visible = masks.build_visible(b, hq, nq, nk, causal=mask.get("causal", "none"), window=mask.get("window"),
                                  key_lengths=mask.get("key_lengths"), explicit=None)
    return q, k, v, visible, 0.37, np.arange(hq) // (hq // hkv), rng


#: The source of a plain JAX attention ``attention`` and a ``custom`` one whose rule the test adds: a
#: ``jax.custom_vjp`` wrapper of it (``custom.defvjp(_f, _b)`` follows), for the JAX flavour's JVP/HVP tests.
JAX_ATTENTION = """
import jax, jax.numpy as jnp
def attention(q, k, v, visible, scale, kv_map):
    s = scale * q @ jnp.swapaxes(k[:, kv_map], -1, -2)
    return jax.nn.softmax(jnp.where(visible, s, -jnp.inf), -1) @ v[:, kv_map]
@jax.custom_vjp
def custom(q, k, v, visible, scale, kv_map):
    return attention(q, k, v, visible, scale, kv_map)
"""
