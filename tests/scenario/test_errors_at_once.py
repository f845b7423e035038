"""Every problem of a scenario file at once: the first of each scenario, every unknown key of one, a bad key of
``defaults`` once, capped and counted; on the command line one ``error:`` line each, exit 2."""
import pytest
import yaml
from click.testing import CliRunner

from gradcheck_cli import scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError, ScenarioErrors

from helpers import ROOT

BAD = """\
scenarios:
  - {name: a, n_q: 4, d_head: 4, dtyp: float32, mask: {causl: none}}
  - {name: b, n_q: 4, d_head: 4}
  - {name: c, n_q: 4, d_head: 0}
  - {name: d, n_q: 4, d_head: 4, mask: {causal: sideways}}
  - {name: b, n_q: 4, d_head: 4}
"""


def test_every_scenario_s_problem_is_reported_with_its_line_and_key():
    with pytest.raises(ScenarioErrors) as info:
        scenario.loads(BAD, file="bad.yaml")
    found = [(e.line, e.key) for e in info.value.errors]
    assert found == [(2, "scenarios[0].dtyp"), (2, "scenarios[0].mask.causl"), (4, "scenarios[2].d_head"),
                     (5, "scenarios[3].mask.causal"), (6, "scenarios[4].name")]
    assert isinstance(info.value, ScenarioError) and info.value.key == "scenarios[0].dtyp"  # the first one's place
    assert "did you mean 'dtype'" in str(info.value) and "did you mean 'causal'" in str(info.value)


def test_one_problem_is_a_plain_scenario_error_and_a_bad_default_is_reported_once():
    with pytest.raises(ScenarioError) as info:
        scenario.loads("scenarios:\n  - {name: a, n_q: 4, d_head: 0}\n")
    assert not isinstance(info.value, ScenarioErrors)
    with pytest.raises(ScenarioError) as info:
        scenario.loads("defaults: {toleranc: 0.001}\nscenarios:\n  - {name: a, n_q: 4, d_head: 4}\n"
                       "  - {name: b, n_q: 4, d_head: 4}\n")
    assert not isinstance(info.value, ScenarioErrors) and info.value.key == "defaults.toleranc"


def test_many_problems_are_capped_and_counted():
    items = [{"name": f"s{i}", "n_q": 4, "d_head": 0} for i in range(ScenarioErrors.SHOWN + 7)]
    with pytest.raises(ScenarioErrors) as info:
        scenario.loads(yaml.safe_dump({"scenarios": items}), file="many.yaml")
    lines = str(info.value).splitlines()
    assert len(info.value.errors) == ScenarioErrors.SHOWN + 7 and len(lines) == ScenarioErrors.SHOWN + 1
    assert lines[-1] == "... and 7 more problem(s) in many.yaml"


@pytest.mark.parametrize("command", ["validate", "run"])
def test_the_command_prints_one_error_line_each_and_exits_2(tmp_path, command):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(BAD)
    out = CliRunner().invoke(main, [command, str(cfg)])
    assert out.exit_code == 2
    errors = [line for line in out.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 5 and all(str(cfg) in line for line in errors), out.output
    assert "Traceback" not in out.output


def test_a_misspelt_implementation_attribute_gets_a_did_you_mean_and_the_interface_is_stated():
    base = ROOT / "examples"
    def load(spec):
        return scenario.loads(f"scenarios:\n  - {{name: a, n_q: 4, d_head: 4, implementation: '{spec}'}}\n",
                              base_dir=base)[0].implementation_object

    with pytest.raises(ScenarioError, match="has no attribute 'atention' .did you mean 'attention'"):
        load("my_attention:atention")
    with pytest.raises(ScenarioError, match="is a function without callable forward and backward: the NumPy "
                                            "interface is an object with forward"):
        load("my_attention:_probabilities")


def test_an_implementation_that_did_not_run_reads_as_one_clear_row(tmp_path):
    (tmp_path / "raises.py").write_text("class A:\n    @staticmethod\n    def forward(*a):\n"
                                        "        raise ValueError('no')\n    backward = forward\nattention = A()\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - {name: a, n_q: 4, d_head: 4, implementation: 'raises:attention'}\n")
    out = CliRunner().invoke(main, ["run", str(cfg)])
    row = next(line for line in out.output.splitlines() if line.startswith("implementation runs"))
    assert "did not run" in row and "inf" not in row and row.rstrip().endswith("FAIL"), out.output
    assert "forward raised ValueError: no" in out.output


@pytest.mark.parametrize("mask, extra, key, says, remedy", [
    ({"causal": "lower-right"}, {"n_k": 2}, "mask.causal", "lower-right alone hides every key",
     "use causal: upper-left"),
    ({"key_lengths": [0]}, {}, "mask.key_lengths", "key_lengths[0] = 0 alone hides every key", "raise it to 1"),
    ({"causal": "upper-left", "window": [0, 0], "key_lengths": [2]}, {}, None,
     "not the same one (causal: upper-left allows keys 0-2; window: [0, 0] allows key 2; key_lengths[0] = 2 allows "
     "keys 0-1)", "make them overlap"),
])
def test_an_empty_row_names_the_constraints_that_hide_it(mask, extra, key, says, remedy):
    with pytest.raises(ScenarioError) as info:
        scenario.loads(yaml.safe_dump({"scenarios": [{"name": "a", "n_q": 4, "d_head": 2, "mask": mask, **extra}]}))
    assert says in info.value.message and remedy in info.value.hint, str(info.value)
    if key:
        assert info.value.key == f"scenarios[0].{key}"


def test_an_explicit_visible_array_with_an_empty_row_gets_its_own_remedy(tmp_path):
    import numpy as np
    visible = np.ones((1, 1, 3, 3), dtype=bool)
    visible[0, 0, 1] = False
    np.save(tmp_path / "v.npy", visible)
    with pytest.raises(ScenarioError) as info:
        scenario.loads("scenarios:\n  - {name: a, n_q: 3, d_head: 2, mask: {visible: v.npy, causal: upper-left}}\n",
                       base_dir=tmp_path)
    assert "query row 1" in info.value.message and "visible (the explicit array) has no True" in info.value.message
    assert "at least one True in every query row" in info.value.hint and info.value.key.endswith("mask.visible")
