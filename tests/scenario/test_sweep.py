"""Sweeps: a scenario's `sweep:` lists expand to the cartesian product with readable names, and
bad sweeps are rejected with the file, line and key."""
import textwrap

import pytest
from click.testing import CliRunner

from gradcheck_cli import checker, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import GradcheckError, ScenarioError

from helpers import assert_rejected


def load(text):
    return scenario.loads(textwrap.dedent(text), file="s.yaml")


def test_cartesian_product_with_readable_names():
    scs = load("""\
        defaults: {n_k: 16, d_head: 4}
        scenarios:
          - name: causal
            sweep:
              n_q: [1, 5, 16]
              mask.causal: [upper-left, lower-right]
        """)
    assert [sc.name for sc in scs] == [f"causal[n_q={n},mask.causal={c}]" for n in (1, 5, 16)
                                       for c in ("upper-left", "lower-right")]
    assert [(sc.n_q, sc.causal) for sc in scs] == [(n, c) for n in (1, 5, 16) for c in ("upper-left", "lower-right")]
    # the masks really differ: lower-right with n_q=1 sees every key, upper-left only key 0
    assert scs[0].visible.sum() == 1 and scs[1].visible.sum() == 16
    assert all(sc.line == 3 for sc in scs)


def test_whole_mapping_sweep_replaces_the_mask_and_defaults_sweep_applies_to_all():
    scs = load("""\
        defaults:
          d_head: 2
          mask: {causal: lower-right}
          sweep: {dtype: [float64, float32]}
        scenarios:
          - name: a
            n_q: 6
            sweep:
              mask: [{key_lengths: [3]}, {window: [1, 1]}]
          - name: b
            n_q: 2
            sweep: {dtype: [float32]}
        """)
    names = [sc.name for sc in scs]
    assert names == ["a[dtype=float64,mask={key_lengths:[3]}]", "a[dtype=float64,mask={window:[1,1]}]",
                     "a[dtype=float32,mask={key_lengths:[3]}]", "a[dtype=float32,mask={window:[1,1]}]",
                     "b[dtype=float32]"]
    padded = scs[0]
    assert padded.causal == "none" and padded.key_lengths == (3,) and padded.visible[..., 3:].sum() == 0
    assert scs[1].window == (1, 1) and scs[1].causal == "none"
    assert scs[2].dtype == "float32" and scs[2].tolerance == 2e-3  # per-dtype defaults follow the sweep


@pytest.mark.parametrize("sweep, line, key, words", [
    ("sweep: {bogus: [1]}", 5, "scenarios[0].sweep.bogus", "cannot sweep"),
    ("sweep: {name: [a, b]}", 5, "scenarios[0].sweep.name", "cannot sweep"),
    ("sweep: {mask.wnidow: [[1, 1]]}", 5, "scenarios[0].sweep.mask.wnidow", "did you mean 'mask.window'"),
    ("sweep: {n_q: 3}", 5, "scenarios[0].sweep.n_q", "non-empty list"),
    ("sweep: {n_q: []}", 5, "scenarios[0].sweep.n_q", "non-empty list"),
    ("sweep: [n_q]", 5, "scenarios[0].sweep", "expected a mapping"),
    ("sweep:\n      n_q: [2, 0]", 6, "scenarios[0].sweep.n_q[1]", "in the sweep case s[n_q=0]"),
    ("sweep:\n      mask: [{causal: upper-left}, {caual: x}]", 6, "scenarios[0].sweep.mask[1].caual", "unknown key"),
    ("sweep:\n      mask: [3]", 6, "scenarios[0].sweep.mask[0]", "expected a mapping"),
    ("sweep:\n      n_q: [2, 2]", 6, "scenarios[0].sweep.n_q[1]", "2 is listed twice"),
    ("sweep:\n      epsilon: [1e-6, 1.0e-6]", 5, "scenarios[0].sweep", "are the same scenario"),
    ("sweep:\n      n_k: [true, 4]", 6, "scenarios[0].sweep.n_k[0]", "expected an integer, got True"),
    ("sweep:\n      mask.causal: [upper-left]\n      mask: [{causal: lower-right}]", 7, "scenarios[0].sweep.mask",
     "at once"),
    ("sweep:\n      mask: [{causal: lower-right}, {key_lengths: [0]}]", 6, "scenarios[0].sweep.mask[1].key_lengths",
     "sees no key"),
])
def test_bad_sweeps(sweep, line, key, words):
    assert_rejected(f"scenarios:\n  - name: s\n    n_q: 4\n    d_head: 2\n    {sweep}\n", line, key, words)


def test_too_many_cases_is_refused():
    values = list(range(1, 20))
    text = (f"scenarios:\n  - name: s\n    d_head: 2\n    sweep:\n      n_q: {values}\n      n_k: {values}\n"
            f"      batch: {values}\n")
    with pytest.raises(ScenarioError, match="more than 4096 scenarios"):
        scenario.loads(text, file="s.yaml")


def test_exact_generated_name_selects_despite_brackets():
    scs = load("""\
        scenarios:
          - {name: s, d_head: 2, sweep: {n_q: [1, 2, 3]}}
        """)
    assert [sc.name for sc in scenario.select(scs, ("s[n_q=2]",))] == ["s[n_q=2]"]
    assert len(scenario.select(scs, ("s*",), ("s[n_q=1]",))) == 2
    with pytest.raises(GradcheckError):
        scenario.select(scs, ("t*",))


def test_cli_runs_and_reproduces_a_generated_scenario(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("scenarios:\n  - {name: s, d_head: 4, n_k: 6, sweep: {n_q: [2, 6], mask.causal: [lower-right]}}\n")
    out = CliRunner().invoke(main, ["run", str(cfg), "--fault", "scale"])
    assert out.exit_code == 1
    assert "s[n_q=6,mask.causal=lower-right] (B=1" in out.output  # printed as written, not as rich markup
    line = next(x for x in out.output.splitlines() if "reproduce:" in x and "n_q=6" in x)
    assert line.endswith("--select 's[n_q=6,mask.causal=lower-right]' --fault scale")
    again = CliRunner().invoke(main, ["run", str(cfg), "--select", "s[n_q=6,mask.causal=lower-right]",
                                      "--fault", "scale"])
    assert again.exit_code == 1 and "1 scenario(s)" in again.output
    results = [checker.run_scenario(sc) for sc in scenario.load(cfg)]
    assert all(r.passed for r in results)
