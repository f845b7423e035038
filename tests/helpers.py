import numpy as np
import yaml

from gradcheck_cli import scenario


def make(**keys) -> scenario.Scenario:
    """One scenario from keyword arguments, through the same YAML loader users go through."""
    keys.setdefault("name", "t")
    return scenario.loads(yaml.safe_dump({"scenarios": [keys]}))[0]


def random_inputs(sc, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_head))
    k = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_head))
    v = rng.standard_normal((sc.batch, sc.heads_kv, sc.n_k, sc.d_value))
    g = rng.standard_normal((sc.batch, sc.heads_q, sc.n_q, sc.d_value))
    return q, k, v, g


def assert_rejected(text: str, line: int, key: str, words: str) -> None:
    """The loader refuses ``text`` naming this line and key, with ``words`` in the message."""
    import pytest
    from gradcheck_cli.errors import ScenarioError
    with pytest.raises(ScenarioError) as info:
        scenario.loads(text, file="bad.yaml")
    err = info.value
    assert (err.file, err.line, err.key) == ("bad.yaml", line, key), str(err)
    assert words in str(err)
