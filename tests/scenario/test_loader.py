"""Bad input: every class is rejected before anything runs, naming the file, line and key."""
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

from gradcheck_cli import scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError

from helpers import ROOT, assert_rejected

BASE = """\
scenarios:
  - name: s
    n_q: 4
    d_head: 4
"""

# (extra lines appended to the scenario at line 5 on, expected line, key, words in the message)
BAD = [
    ("    bogus: 1\n", 5, "scenarios[0].bogus", "unknown key"),
    ("    batch: -1\n", 5, "scenarios[0].batch", "must be >= 1"),
    ("    batch: two\n", 5, "scenarios[0].batch", "expected an integer"),
    ("    heads_q: 1.5\n", 5, "scenarios[0].heads_q", "expected an integer"),
    ("    heads_q: 8\n    heads_kv: 3\n", 6, "scenarios[0].heads_kv", "does not divide"),
    ("    heads_q: 2\n    kv_map: [0, 2]\n    heads_kv: 2\n", 6, "scenarios[0].kv_map[1]", "out of range"),
    ("    heads_q: 2\n    kv_map: [0]\n", 6, "scenarios[0].kv_map", "has 1 entries"),
    ("    batch: 2\n    mask:\n      key_lengths: [4, 4, 4]\n", 7, "scenarios[0].mask.key_lengths", "batch is 2"),
    ("    mask:\n      key_lengths: [5]\n", 6, "scenarios[0].mask.key_lengths[0]", "out of range"),
    ("    mask:\n      key_lengths: [0]\n", 6, "scenarios[0].mask.key_lengths",
     "query row 0 of batch 0, head 0 sees no key"),
    ("    mask:\n      visible: [[true, false], [true, true]]\n", 6, "scenarios[0].mask.visible", "does not broadcast"),
    ("    mask:\n      causal: sideways\n", 6, "scenarios[0].mask.causal", "expected one of"),
    ("    mask:\n      window: [1]\n", 6, "scenarios[0].mask.window", "expected [left, right]"),
    ("    mask:\n      wnidow: [1, 1]\n", 6, "scenarios[0].mask.wnidow", "did you mean 'window'"),
    ("    epsilon: 0\n", 5, "scenarios[0].epsilon", "must be > 0"),
    ("    tolerance: -1.0e-6\n", 5, "scenarios[0].tolerance", "must be > 0"),
    ("    epsilon: .nan\n", 5, "scenarios[0].epsilon", "finite number"),
    ("    dtype: float8\n", 5, "scenarios[0].dtype", "expected one of"),
    ("    dtype: float16\n", 5, "scenarios[0].dtype", "needs backend: torch"),
    ("    device: cuda\n", 5, "scenarios[0].device", "needs backend: torch"),
    ("    backend: tensorflow\n", 5, "scenarios[0].backend", "expected one of"),
    ("    backend: jax\n", 5, "scenarios[0].backend", "backend: jax applies to an implementation of yours"),
    ("    check:\n      directions: 1000000000\n", 6, "scenarios[0].check.directions", "at most 100,000"),
    ("    loss_rows: [4]\n", 5, "scenarios[0].loss_rows[0]", "out of range"),
    ("    check:\n      mode: everything\n", 6, "scenarios[0].check.mode", "expected one of"),
    ("    check:\n      samples: 0\n", 6, "scenarios[0].check.samples", "must be >= 1"),
    ("    check:\n      colouring: yes please\n", 6, "scenarios[0].check.colouring", "expected true or false"),
    ("    check:\n      mode: sample\n      colouring: true\n", 7, "scenarios[0].check.colouring", "mode full only"),
    ("    op: convolution\n", 5, "scenarios[0].op", "expected one of"),
    ("    n_k: 4000000\n    batch: 4000000\n", 2, "scenarios[0]", "GiB"),
    ("  - name: s\n    n_q: 2\n    d_head: 2\n", 5, "scenarios[1].name", "duplicate scenario name"),
    ("    scale: 0\n", 5, "scenarios[0].scale", "must be non-zero"),
    ("    scale: 1.7e308\n", 5, "scenarios[0].scale", "within +-1e+06"),
]


@pytest.mark.parametrize("extra,line,key,words", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_bad_input_names_file_line_and_key(tmp_path, extra, line, key, words):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE + extra)
    with pytest.raises(ScenarioError) as err:
        scenario.load(path)
    e = err.value
    assert (e.file, e.line, e.key) == (str(path), line, key), str(e)
    assert words in str(e)
    # the CLI: exit 2, one message on stderr with file:line and key, no traceback, nothing on stdout
    result = CliRunner().invoke(main, ["run", str(path)])
    assert result.exit_code == 2
    assert f"{path}:{line}: {key}: " in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("text,line,words", [
    ("scenarios: [\n", 2, "not valid YAML"),
    ("- a\n- b\n", 1, "expected a mapping"),
    ("scenarios: []\n", 1, "non-empty list"),
    ("defaults: {name: x}\nscenarios: [{name: a, n_q: 2, d_head: 2}]\n", 1, "unknown key 'name'"),
    ("scenario: []\n", 1, "unknown top-level key"),
    ("scenarios:\n  - {name: a, n_q: 2}\n", 2, "is required"),
    ("scenarios:\n  - {name: 'a b', n_q: 2, d_head: 2}\n", 2, "expected a name"),
    ("scenarios:\n  - {name: a, n_q: 2, d_head: 2, n_q: 3}\n", 2, "duplicate key"),
])
def test_document_level_errors(text, line, words):
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="x.yaml")
    assert err.value.line == line and words in str(err.value), str(err.value)


def test_yaml_anchors_and_merge_keys(tmp_path):
    text = textwrap.dedent("""\
        x-shape: &shape {n_q: 4, d_head: 2, batch: 2}
        scenarios:
          - {name: a, <<: *shape}
          - {name: b, <<: *shape, batch: 3}
    """)
    a, b = scenario.loads(text)
    assert (a.n_q, a.batch, b.batch) == (4, 2, 3)


@pytest.mark.parametrize("text,line,words", [
    ("scenarios: [{name: a, n_q: !foo 4, d_head: 2}]\n", 1, "tag '!foo'"),
    ("scenarios: [{name: a, heads_q: 2, kv_map: [0, 2], n_q: 2, d_head: 2}]\n", 1, "out of range"),
    ("scenarios: [{name: a, heads_q: 2, kv_map: [0, -1], n_q: 2, d_head: 2}]\n", 1, "must be in [0, 1]"),
    ("scenarios: [{name: a, n_q: 4, d_head: 100000000000}]\n", 1, "GiB"),
    ("scenarios: [{name: a, n_q: 4, d_head: 2, loss_rows: [0, 0]}]\n", 1, "listed twice"),
    ("scenarios:\n  - name: a\x00\n", 2, "unacceptable character"),
    ("[" * 5000, 1, "nested more than 64 levels deep"),
    ("x-a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nx-b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "x-c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nx-d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "x-e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nx-f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
     "x-g: [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]\nscenarios: []\n", 1, "more than 1,000,000 values"),
    # falsy non-mappings are not an empty 'defaults'; a name may not end in a newline; a sweep key with a
    # trailing dot is no key; a tolerance that accepts a zero gradient is no check
    ("defaults: []\nscenarios: [{name: a, n_q: 3, d_head: 2}]\n", 1, "defaults: expected a mapping"),
    ("defaults: 0\nscenarios: [{name: a, n_q: 3, d_head: 2}]\n", 1, "defaults: expected a mapping"),
    ("defaults: false\nscenarios: [{name: a, n_q: 3, d_head: 2}]\n", 1, "defaults: expected a mapping"),
    ('scenarios: [{name: "a\\n", n_q: 3, d_head: 2}]\n', 1, "expected a name of letters"),
    ("scenarios: [{name: a, n_q: 3, d_head: 2, sweep: {'n_q.': [5]}}]\n", 1, "cannot sweep 'n_q.'"),
    ("scenarios: [{name: a, n_q: 3, d_head: 2, sweep: {'mask.': [{causal: upper-left}]}}]\n", 1, "cannot sweep"),
    ("scenarios: [{name: a, n_q: 3, d_head: 2, tolerance: 1.0e+20}]\n", 1, "at most 0.25"),
    ("scenarios: [{name: a, op: layernorm, n: 2, d_model: 1, eps: 0}]\n", 1, "eps 0 divides zero by zero"),
])
def test_more_bad_input(text, line, words):
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="x.yaml")
    assert err.value.line == line and words in str(err.value), str(err.value)


def test_non_utf8_and_folder(tmp_path):
    (tmp_path / "l.yaml").write_bytes(b"scenarios:\n  - name: \xff\n")
    with pytest.raises(ScenarioError, match="not UTF-8") as err:
        scenario.load(tmp_path / "l.yaml")
    assert err.value.line == 2
    result = CliRunner().invoke(main, ["run", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in result.stderr


def test_missing_file_is_exit_2(tmp_path):
    result = CliRunner().invoke(main, ["run", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "cannot read the file" in result.stderr


def test_defaults_are_inherited_and_overridden(tmp_path):
    text = textwrap.dedent("""\
        defaults:
          dtype: float32
          d_head: 8
          mask: {causal: lower-right}
          check: {mode: sample, samples: 7}
        scenarios:
          - {name: a, n_q: 3}
          - {name: b, n_q: 3, dtype: float64, check: {samples: 9}, mask: {key_lengths: [2]}}
    """)
    a, b = scenario.loads(text)
    assert ((a.dtype, a.d_head, a.causal, a.mode, a.samples, a.epsilon)
            == ("float32", 8, "lower-right", "sample", 7, 3e-3))
    assert ((b.dtype, b.mode, b.samples, b.causal, b.key_lengths, b.epsilon)
            == ("float64", "sample", 9, "lower-right", (2,), 1e-6))


def test_shape_defaults():
    (sc,) = scenario.loads("scenarios: [{name: a, heads_q: 6, kv_map: [0, 1, 2, 0, 1, 2], n_q: 3, d_head: 16}]")
    assert (sc.heads_kv, sc.n_k, sc.d_value, sc.scale, sc.batch) == (3, 3, 16, 0.25, 1)
    (sc,) = scenario.loads("scenarios: [{name: a, heads_q: 6, heads_kv: 2, n_q: 3, d_head: 4}]")
    assert sc.kv_map == (0, 0, 0, 1, 1, 1)


def test_exponent_without_dot_is_accepted():
    # YAML 1.1 reads 1e-6 as a string; people write it anyway
    (sc,) = scenario.loads("scenarios: [{name: a, n_q: 2, d_head: 2, epsilon: 1e-5}]")
    assert sc.epsilon == 1e-5


def test_visible_from_npy_relative_to_the_yaml(tmp_path):
    (tmp_path / "m").mkdir()
    np.save(tmp_path / "m" / "v.npy", np.tril(np.ones((3, 3), dtype=bool)))
    (tmp_path / "c.yaml").write_text("scenarios: [{name: a, n_q: 3, d_head: 2, mask: {visible: m/v.npy}}]\n")
    (sc,) = scenario.load(tmp_path / "c.yaml")
    np.testing.assert_array_equal(sc.visible[0, 0], np.tril(np.ones((3, 3), dtype=bool)))
    (tmp_path / "d.yaml").write_text("scenarios: [{name: a, n_q: 3, d_head: 2, mask: {visible: m/none.npy}}]\n")
    with pytest.raises(ScenarioError, match="cannot read"):
        scenario.load(tmp_path / "d.yaml")
    np.save(tmp_path / "m" / "f.npy", np.ones((3, 3)) * 0.5)
    (tmp_path / "e.yaml").write_text("scenarios: [{name: a, n_q: 3, d_head: 2, mask: {visible: m/f.npy}}]\n")
    with pytest.raises(ScenarioError, match="not booleans"):
        scenario.load(tmp_path / "e.yaml")


def test_memory_estimate_uses_the_limit():
    text = "scenarios: [{name: a, n_q: 64, d_head: 4}]"
    scenario.loads(text, memory_limit=10**9)
    with pytest.raises(ScenarioError, match="needs about"):
        scenario.loads(text, memory_limit=1000)


def test_a_mask_or_check_key_at_scenario_level_says_where_it_belongs():
    assert_rejected("scenarios:\n  - name: a\n    n_q: 4\n    d_head: 4\n    causal: lower-right\n", 5,
                    "scenarios[0].causal", "'causal' belongs under 'mask:'")
    assert_rejected("scenarios:\n  - name: a\n    n_q: 4\n    d_head: 4\n    mode: sample\n", 5, "scenarios[0].mode",
                    "'mode' belongs under 'check:'")


def test_a_misspelled_choice_gets_a_suggestion():
    assert_rejected("scenarios:\n  - name: a\n    op: attension\n    n_q: 4\n    d_head: 4\n", 3, "scenarios[0].op",
                    "did you mean 'attention'?")
    assert_rejected("scenarios:\n  - name: a\n    n_q: 4\n    d_head: 4\n    check: {mode: ful}\n", 5,
                    "scenarios[0].check.mode", "did you mean 'full'?")


@pytest.mark.parametrize("check, key, words", [
    ("{factor: 1.0e+308}", "check.factor", "at most 10"),
    ("{factor: 11}", "check.factor", "11 times as wrong as a plain computation"),
    ("{slack: 1.0e+308}", "check.slack", "at most 0.01"),
    ("{slack: 0.5}", "check.slack", "at most 0.01"),
    ("{nondet_tol: 1.0e+308}", "check.nondet_tol", "at most 0.25"),
])
def test_the_agreement_rule_s_settings_are_bounded_as_tolerance_is(check, key, words):
    """A factor of 1e308 made the reference check pass at a relative error of 1.07 (issue 22)."""
    text = f"scenarios:\n  - {{name: a, n_q: 3, d_head: 2, implementation: 'my_attention:attention', check: {check}}}\n"
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="x.yaml", base_dir=ROOT / "examples")
    assert (err.value.line, err.value.key) == (2, f"scenarios[0].{key}") and words in str(err.value), str(err.value)


@pytest.mark.parametrize("check", ["{factor: 10}", "{slack: 0.01}", "{nondet_tol: 0.25}"])
def test_the_bounds_themselves_are_accepted(check):
    text = f"scenarios:\n  - {{name: a, n_q: 3, d_head: 2, implementation: 'my_attention:attention', check: {check}}}\n"
    assert scenario.loads(text, base_dir=ROOT / "examples")[0].name == "a"
