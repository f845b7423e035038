"""Checking a user's own NumPy implementation: the shipped examples, and every way it can misbehave."""
import textwrap

import pytest
from click.testing import CliRunner

from gradcheck_cli import checker, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError

SHAPES = """\
defaults:
  batch: 2
  heads_q: 4
  heads_kv: 2
  n_q: 5
  n_k: 7
  d_head: 4
  mask: {causal: lower-right, key_lengths: [7, 6]}
scenarios:
"""


def failed(result):
    return {(c.kind, c.name, c.tensor) for c in result.checks if not c.passed}


def write_impl(tmp_path, body, name="impl"):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


def run_yaml(tmp_path, scenarios_text):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(SHAPES + textwrap.indent(textwrap.dedent(scenarios_text), "  "))
    return [checker.run_scenario(sc) for sc in scenario.load(cfg)], cfg


def test_the_shipped_correct_example_passes(root):
    result = CliRunner().invoke(main, ["run", str(root / "examples/attention.yaml")])
    assert result.exit_code == 0, result.stdout
    assert "forward agrees with the reference" in result.stdout


def test_the_shipped_broken_examples_fail_where_they_should(root):
    results = {r.name: r for r in (checker.run_scenario(sc) for sc in scenario.load(root / "examples/broken.yaml"))}
    gqa = failed(results["gqa-overwrite"])
    assert ("gradient", "gradient v", "v") in gqa and ("reference", "backward agrees with the reference", "v") in gqa
    assert not any(kind == "gradient" and t in "qk" for kind, _, t in gqa)
    padding = failed(results["ignores-padding"])
    assert not any(kind == "gradient" for kind, _, _ in padding)  # its gradients match its own forward
    assert ("reference", "forward agrees with the reference", "o") in padding
    assert ("invariant", "hidden K/V rows do not change O", "o") in padding
    result = CliRunner().invoke(main, ["run", str(root / "examples/broken.yaml")])
    assert result.exit_code == 1 and "Traceback" not in result.output


CORRECT = "from my_attention import Attention, attention\n"


@pytest.mark.parametrize("body,check,words", [
    ("""
     class Impl:
         def forward(self, q, k, v, visible, scale, kv_map):
             raise RuntimeError("kernel not compiled")
         def backward(self, *args):
             raise RuntimeError("no")
     impl = Impl()
     """, "implementation runs", "forward raised RuntimeError: kernel not compiled"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             return Attention.forward(q, k, v, visible, scale, kv_map)[..., :-1]
     impl = Impl()
     """, "implementation runs", "returned o of shape"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             return Attention.forward(q, k, v, visible, scale, kv_map).astype("float32")
     impl = Impl()
     """, "implementation runs", "dtype float32, expected float64"),
    ("""
     import numpy as np
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def backward(q, k, v, visible, scale, kv_map, grad_o):
             dq, dk, dv = Attention.backward(q, k, v, visible, scale, kv_map, grad_o)
             dk[0, 1, 2, 3] = np.nan
             return dq, dk, dv
     impl = Impl()
     """, "implementation runs", "non-finite dk: nan at dk[0, 1, 2, 3]"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def backward(q, k, v, visible, scale, kv_map, grad_o):
             return Attention.backward(q, k, v, visible, scale, kv_map, grad_o)[:2]
     impl = Impl()
     """, "implementation runs", "must return (dq, dk, dv)"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             if q.shape[0] > 2:
                 raise ValueError("batch too large for my kernel")
             return Attention.forward(q, k, v, visible, scale, kv_map)
     impl = Impl()
     """, "gradient q", "while differencing its forward: forward raised ValueError: batch too large"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             o = Attention.forward(q, k, v, visible, scale, kv_map)
             return o + 1e-3 * o.mean(axis=0, keepdims=True)   # batch elements interact
     impl = Impl()
     """, "perturbations stay in their block", "changed by"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             return Attention.forward(q, k, v, visible, scale, kv_map).tolist()
     impl = Impl()
     """, "implementation runs", "must return numpy arrays; o is a list"),
    ("""
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             raise SystemExit(0)
     impl = Impl()
     """, "implementation runs", "forward raised SystemExit: 0"),
    ("""
     import numpy as np
     from my_attention import Attention
     class Impl(Attention):
         @staticmethod
         def forward(q, k, v, visible, scale, kv_map):
             o = Attention.forward(q, k, v, visible, scale, kv_map)
             if q.shape[0] > 2:
                 o[-1, 1, 2, 3] = np.nan
             return o
     impl = Impl()
     """, "gradient q", "nan at o[1, 1, 2, 3] of perturbed copy"),
])
def test_misbehaving_implementations_fail_with_a_message(root, tmp_path, monkeypatch, body, check, words):
    monkeypatch.syspath_prepend(str(root / "examples"))
    write_impl(tmp_path, body, name=f"impl_{abs(hash(body)) % 10**8}")
    module = next(tmp_path.glob("impl_*.py")).stem
    (result,), cfg = run_yaml(tmp_path, f"- {{name: t, implementation: '{module}:impl'}}\n")
    bad = [c for c in result.checks if not c.passed]
    assert any(c.name == check and words in c.detail for c in bad), [(c.name, c.detail) for c in bad]
    if check != "implementation runs" or "SystemExit" in words:  # a few through the command's worker too
        cli = CliRunner().invoke(main, ["run", str(cfg), "--json", str(tmp_path / "r.json")])
        assert cli.exit_code == 1 and "Traceback" not in cli.output and words in cli.stdout


@pytest.mark.parametrize("spec,words,at_load", [
    ("not a spec", "expected 'module:attribute'", True),
    ("no_such_module_xyz:impl", "cannot find module 'no_such_module_xyz'", True),
    ("my_attention:nothing_here", "has no attribute 'nothing_here'", False),
    ("my_attention:_probabilities", "without callable forward and backward: the NumPy interface is an object", False),
])
def test_bad_implementation_specs_are_input_errors(root, tmp_path, monkeypatch, spec, words, at_load):
    """Spelling and a missing module are found when the file loads (without running any user code);
    the rest when the implementation is imported to be checked. Both are bad input with the key."""
    monkeypatch.syspath_prepend(str(root / "examples"))  # my_attention on the import path, the YAML elsewhere
    cfg = tmp_path / "c.yaml"
    cfg.write_text(SHAPES + f"  - name: t\n    implementation: '{spec}'\n")
    with pytest.raises(ScenarioError) as err:
        (sc,) = scenario.load(cfg)
        _ = sc.implementation_object  # imported on first use: the error comes from there
    assert err.value.key == "scenarios[0].implementation" and err.value.line == 11 and words in str(err.value)
    if not at_load:
        assert len(scenario.load(cfg)) == 1
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2 and words in result.stderr and "Traceback" not in result.stderr
    assert "scenarios[0].implementation" in result.stderr and ":11:" in result.stderr


def test_negative_controls_on_a_user_implementation_are_a_real_matrix(root):
    """Interface-level faults need no access to the implementation's internals, and each is caught."""
    (sc,) = scenario.load(root / "examples/attention.yaml")[:1]
    cells = {c.fault: c for c in checker.negative_controls([sc])}
    assert set(cells) == set(checker.applicable_faults(sc)) >= {"softmax-term", "mask", "scale-dk", "leak-hidden-key"}
    applicable = [c for c in cells.values() if c.status != "not applicable"]
    assert len(applicable) >= 8 and all(c.status == "detected" for c in applicable), cells
    for c in cells.values():
        assert c.status != "not applicable" or c.reason, c
    assert "backward agrees with the reference" in cells["softmax-term"].caught_by
    assert "forward agrees with the reference" in cells["leak-hidden-key"].caught_by


def test_a_named_fault_on_a_user_implementation_is_its_interface_variant(root):
    (sc,) = scenario.load(root / "examples/attention.yaml")[:1]
    result = checker.run_scenario(sc, ("softmax-term",))
    assert result.faults == ("softmax-term",) and result.verdict == "fail"
    assert ({"gradient q", "backward agrees with the reference"}
            <= {c.name for c in result.checks if c.verdict == "fail"})
    assert checker.run_scenario(sc).verdict == "pass"


def test_an_implementation_that_changes_its_inputs_in_place_is_reported(root, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(root / "examples"))
    write_impl(tmp_path, """
        from my_attention import Attention
        class Impl(Attention):
            @staticmethod
            def forward(q, k, v, visible, scale, kv_map):
                q *= scale                      # in place
                return Attention.forward(q, k, v, visible, 1.0, kv_map)
        impl = Impl()
        """, name="inplace_impl")
    (result,), _ = run_yaml(tmp_path, "- {name: t, implementation: 'inplace_impl:impl'}\n")
    (bad,) = [c for c in result.checks if not c.passed]
    assert result.verdict == "fail" and bad.tensor == "q" and "changed its argument q in place" in bad.detail


def test_a_module_that_exits_on_import_is_bad_input(tmp_path):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(SHAPES + "  - {name: t, implementation: 'exits:impl'}\n")
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2 and "SystemExit" in result.stderr
