"""Ops own their scenario keys: the loader reads the common keys and hands the rest to the op (its ``Param``s and
the key group it shares, ``Op.shared_keys``). These tests pin who owns what, and that the scenario package
names none of attention's keys itself."""
from __future__ import annotations

import ast
import dataclasses
import tokenize
from pathlib import Path

import pytest

from gradcheck_cli import scenario
from gradcheck_cli.ops import OPS
from gradcheck_cli.ops.attention import scenario_keys
from gradcheck_cli.scenario import BACKEND_KEYS, COMMON_KEYS, SCENARIO_KEYS, json_schema, loads

PACKAGE = Path(scenario.__file__).parent


def test_every_scenario_key_is_the_loaders_or_the_ops():
    """A key is common (the loader reads it) or an op's (a Param, or its key group: ops may share a name, as rope's
    d_head), never both."""
    groups = {k for op in OPS.values() if op.shared_keys for k in op.shared_keys.keys}
    params = {k for op in OPS.values() for k in op.keys}
    for key in SCENARIO_KEYS:
        common, ops = key in COMMON_KEYS or key in BACKEND_KEYS, key in groups or key in params
        assert common != ops, key
    assert set(scenario_keys.KEYS) <= groups and "mask" in groups and "convention" in groups


def test_the_ops_with_attention_blocks_share_one_key_group():
    sharing = sorted(name for name, op in OPS.items() if op.shared_keys is scenario_keys.KEY_GROUP)
    assert sharing == ["attention", "attention-projections", "block"]
    assert all(OPS[name].shared_keys is None for name in OPS if name not in sharing)


def test_the_schema_takes_the_groups_fragment_as_is():
    properties = json_schema()["properties"]["scenarios"]["items"]["properties"]
    for key, fragment in scenario_keys.schema().items():
        assert properties[key] == fragment, key


def test_the_scenario_package_names_no_attention_key():
    """The loader's modules hand attention's keys to the op: no literal heads_q, n_q, mask.causal, ... there."""
    names = set(scenario_keys.KEYS) | {f"mask.{k}" for k in scenario_keys.MASK_KEYS} | {"mask", "convention"}
    hits = []
    for path in sorted(PACKAGE.glob("*.py")):
        with path.open("rb") as fh:
            for tok in tokenize.tokenize(fh.readline):
                if tok.type == tokenize.STRING and tok.string[0] in "'\"" and ast.literal_eval(tok.string) in names:
                    hits.append((path.name, tok.start[0], tok.string))
    assert hits == []


def test_what_the_group_builds_is_the_scenario_it_loads(tmp_path):
    text = ("scenarios:\n  - {name: g, batch: 2, heads_q: 4, heads_kv: 2, kv_map: interleaved, n_q: 3, n_k: 5,"
            " d_head: 4, d_value: 6, scale: 0.5, loss_rows: [0, 2],"
            " mask: {causal: lower-right, key_lengths: [5, 4]}}\n")
    (sc,) = loads(text, base_dir=tmp_path)
    assert (sc.heads_q, sc.heads_kv, sc.kv_map, sc.n_q, sc.n_k, sc.d_head, sc.d_value) == (4, 2, (0, 1, 0, 1), 3, 5,
                                                                                          4, 6)
    assert (sc.scale, sc.causal, sc.key_lengths, sc.loss_rows) == (0.5, "lower-right", (5, 4), (0, 2))
    assert sc.visible.shape == (2, 4, 3, 5)
    # lower-right causal with n_k - n_q = 2, the second batch element sees its first 4 keys only
    assert sc.visible[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                         [True] * 5]
    assert not sc.visible[1, :, :, 4].any()
    fields = {f.name for f in dataclasses.fields(sc)}
    from gradcheck_cli.keys import Fields

    class _Doc:
        file = "t.yaml"

        def error(self, path, message, hint=None):
            raise AssertionError(message)

    f = Fields(_Doc(), {"n_q": (3, ("n_q",)), "d_head": (4, ("d_head",))}, ())
    read = scenario_keys.read(f, 1)
    built = scenario_keys.build(f, read, 1, tmp_path, OPS["attention"])
    assert set(built) <= fields, set(built) - fields


def test_a_plain_op_takes_none_of_attentions_keys(tmp_path):
    with pytest.raises(Exception, match="does not apply to op rmsnorm.*it is a key of attention"):
        loads("scenarios:\n  - {name: r, op: rmsnorm, d_model: 4, n: 3, heads_q: 2}\n", base_dir=tmp_path)
