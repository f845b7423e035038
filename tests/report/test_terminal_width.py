"""Terminal output that fits: at 80 and 160 columns every line of a failing scenario's report fits the width,
nothing is lost or split (every number and word of the unwrapped report is there, whole), the table goes to two
lines per check, each number labelled, where it would not fit on one, every column means one thing on every row,
and off a terminal nothing is wrapped at all."""
import re

import pytest
from rich.console import Console

from gradcheck_cli import checker
from gradcheck_cli.report import render_scenario
from gradcheck_cli.result import Check, Kind, ScenarioResult

from helpers import make

NUMBER = re.compile(r"-?\d+\.\d+e[+-]\d+")


@pytest.fixture(scope="module")
def failing():
    sc = make(batch=2, heads_q=4, heads_kv=2, n_q=6, n_k=9, d_head=8, mask={"causal": "lower-right",
                                                                            "key_lengths": [9, 7]})
    return sc, checker.run_scenario(sc, ("softmax-term",))


def _render(result, description, width, terminal=True):
    console = Console(width=width, record=True, force_terminal=terminal, color_system=None)
    render_scenario(console, result, description, "attn-gradcheck run configs/some-long-folder-name/gqa.yaml "
                                                  "--select causal-gqa-with-a-long-name --fault softmax-term")
    return console.export_text()


@pytest.mark.parametrize("width", [80, 160])
def test_every_line_fits_and_nothing_is_lost_or_split(failing, width):
    sc, result = failing
    text = _render(result, sc.describe(), width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    whole = _render(result, sc.describe(), 1000, terminal=False)  # one line per item, as in a log
    assert sorted(NUMBER.findall(text)) == sorted(NUMBER.findall(whole))  # every number, whole
    # and every element index, e.g. v[1, 1, 3, 2]: never split over two lines
    assert all(line.count("[") == line.count("]") for line in lines if "|" not in line and "heat map" not in line)
    assert sorted(re.findall(r"\w\[[\d, ]+\]", text)) == sorted(re.findall(r"\w\[[\d, ]+\]", whole))
    header = next(line for line in whole.splitlines() if line.startswith("check "))  # narrow: a label per number
    words = {w for w in whole.split() if len(w) > 3 and not set(w) <= set("-━─")} - set(header.split())
    assert words <= set(text.split()) | {w for w in words if "|" in w}  # every word (heat-map rows aside)


def test_a_table_too_wide_for_the_terminal_takes_two_lines_per_check_each_number_labelled(failing):
    sc, result = failing
    narrow, wide = _render(result, sc.describe(), 80), _render(result, sc.describe(), 160)
    lines = narrow.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("gradient q"))
    assert lines[at].rstrip().endswith("FAIL") and NUMBER.search(lines[at]) is None  # the numbers go below it
    c = result.checks[0]
    assert lines[at + 1] == (f"    abs {c.max_abs_error:.2e}  rel {c.relative_error:.2e}  rtol {c.tolerance:.2e}  "
                             f"floor {c.noise_floor:.2e}")  # failed: no power
    invariant = next(i for i, line in enumerate(lines) if line.startswith("score-gradient rows sum to 0"))
    assert re.fullmatch(r"    abs \S+  allowed \S+", lines[invariant + 1])  # no rel err: it would repeat abs
    table = lines[1:lines.index(next(line for line in lines if line.startswith("  FAIL")))]
    for line in table[1::2]:  # every number has its label before it
        assert re.fullmatch(r"    (abs|did not run)( \S+)?(  (rel|rtol|floor|allowed|detects) \S+)*", line), line
    wide_line = next(line for line in wide.splitlines() if line.startswith("gradient q"))
    assert NUMBER.search(wide_line) and wide_line.rstrip().endswith("FAIL")


def test_every_column_means_one_thing_on_every_row():
    """rel tol only where the tolerance is relative (gradient rows, nondet_tol), allowed only where it is an
    absolute allowance (reference and invariant rows), rel err blank where it would repeat max abs err."""
    from gradcheck_cli.report.common import COLUMNS, number_cells

    def check(kind, **keys):
        base = dict(tensor="o", shape=(2,), max_abs_error=1e-3, relative_error=2e-3, tolerance=3e-3, noise_floor=4e-3,
                    worst_index=None, passed=True, detectable=5e-3)
        return Check(kind=kind, name=kind, **{**base, **keys})

    assert [h for h, _ in COLUMNS] == ["max abs err", "rel err", "rel tol", "noise floor", "allowed", "detects"]
    assert number_cells(check(Kind.GRADIENT)) == ["1.00e-03", "2.00e-03", "3.00e-03", "4.00e-03", "", "5.00e-03"]
    assert number_cells(check(Kind.REFERENCE, noise_floor=0.0)) == ["1.00e-03", "2.00e-03", "", "", "3.00e-03",
                                                                    "5.00e-03"]
    assert number_cells(check(Kind.INVARIANT, relative_error=1e-3, noise_floor=0.0, detectable=None)) == [
        "1.00e-03", "", "", "", "3.00e-03", ""]
    deterministic = check(Kind.IMPLEMENTATION, relative_error=1e-3, noise_floor=0.0, detectable=None)
    assert number_cells(deterministic) == ["1.00e-03", "", "3.00e-03", "", "", ""]  # nondet_tol is relative
    raised = check(Kind.IMPLEMENTATION, shape=None, max_abs_error=float("inf"), passed=False, detectable=None)
    assert number_cells(raised) == ["did not run", "", "", "", "", ""]
    assert number_cells(check(Kind.IMPLEMENTATION, shape=None, max_abs_error=0.0, detectable=None)) == [""] * 6
    nan = check(Kind.GRADIENT, max_abs_error=float("nan"), relative_error=float("inf"), passed=False, detectable=None)
    assert number_cells(nan) == ["non-finite", "non-finite", "3.00e-03", "4.00e-03", "", ""]
    result = ScenarioResult(name="demo", op="attention", dtype="float64", epsilon=1e-6, tolerance=1e-6, mode="full",
                            faults=(), checks=(check(Kind.GRADIENT), check(Kind.INVARIANT, detectable=None)),
                            elapsed_s=0.0)
    plain = _render(result, "d", 200, terminal=False).splitlines()
    assert plain[1].split() == ["check", "tensor", "max", "abs", "err", "rel", "err", "rel", "tol", "noise", "floor",
                                "allowed", "detects", "status"]
    assert plain[3].split() == ["invariant", "o", "2", "1.00e-03", "3.00e-03", "pass"]
    assert plain[3].index("3.00e-03") > plain[2].index("4.00e-03")  # under allowed, not under rel tol


def test_off_a_terminal_lines_are_never_wrapped(failing):
    sc, result = failing
    text = _render(result, sc.describe(), 80, terminal=False)
    assert any(len(line) > 120 for line in text.splitlines())  # a hint or a worst: line, whole


SNAPSHOT_80 = """\
demo (B=1 Hq=1 Hkv=1 n_q=2 n_k=2 d=2/2 float64 full)
gradient q                          q 1x1x2x2  FAIL
    abs 5.00e-01  rel 2.50e-01  rtol 1.00e-06  floor 1.00e-12
backward agrees with the reference  q 1x1x2x2  pass
    abs 2.00e-16  rel 1.00e-16  allowed 3.00e-14  detects 1.00e-14
hidden K/V rows do not change O     o 1x1x2x2  pass
    abs 0.00e+00  allowed 8.00e-15
implementation runs                 -          FAIL
    did not run
  FAIL gradient q (q): worst at q[0, 0, 1, 1]: analytic 1.5, numeric 2.0; 4
      elements checked; the number 123456789.123456789e+10 is never split
  FAIL implementation runs (-): backward raised ValueError: a long message that
      the tool wraps at a word boundary so that the terminal never has to
  hint: the analytic gradient is off by a constant factor of 0.75 everywhere:
        look at the scale (a hint long enough to wrap onto a second line)
  power: would have caught uniform relative errors above 1.00e-14 in dq
  demo: FAILED in 0.00 s
"""


def test_a_snapshot_at_80_columns():
    checks = (
        Check(kind=Kind.GRADIENT, name="gradient q", tensor="q", shape=(1, 1, 2, 2), max_abs_error=0.5,
              relative_error=0.25, tolerance=1e-6, noise_floor=1e-12, worst_index=(0, 0, 1, 1), passed=False,
              detail="worst at q[0, 0, 1, 1]: analytic 1.5, numeric 2.0; 4 elements checked; the number "
                     "123456789.123456789e+10 is never split"),
        Check(kind=Kind.REFERENCE, name="backward agrees with the reference", tensor="q", shape=(1, 1, 2, 2),
              max_abs_error=2e-16, relative_error=1e-16, tolerance=3e-14, noise_floor=0.0, worst_index=(0, 0, 0, 0),
              passed=True, detectable=1e-14),
        Check(kind=Kind.INVARIANT, name="hidden K/V rows do not change O", tensor="o", shape=(1, 1, 2, 2),
              max_abs_error=0.0, relative_error=0.0, tolerance=8e-15, noise_floor=0.0, worst_index=None, passed=True),
        Check(kind=Kind.IMPLEMENTATION, name="implementation runs", tensor="-", shape=None,
              max_abs_error=float("inf"), relative_error=float("inf"), tolerance=0.0, noise_floor=0.0,
              worst_index=None, passed=False, detail="backward raised ValueError: a long message that the tool "
                                                     "wraps at a word boundary so that the terminal never has to"))
    result = ScenarioResult(name="demo", op="attention", dtype="float64", epsilon=1e-6, tolerance=1e-6,
                            mode="full", faults=(), checks=checks, elapsed_s=0.0,
                            hints=("the analytic gradient is off by a constant factor of 0.75 everywhere: look at "
                                   "the scale (a hint long enough to wrap onto a second line)",))
    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    render_scenario(console, result, "B=1 Hq=1 Hkv=1 n_q=2 n_k=2 d=2/2 float64 full")
    assert console.export_text() == SNAPSHOT_80 + "\n"


@pytest.mark.parametrize("width", [80, 160])
def test_the_negative_control_matrix_fits_too(width):
    """Ten faults of a user's implementation: a table at 160 columns, a line per scenario (its faults by
    outcome) at 80, every fault named either way."""
    from gradcheck_cli.report import render_controls

    from helpers import with_examples
    sc = with_examples(implementation="my_attention:attention", batch=2, heads_q=4, heads_kv=2, n_q=6, n_k=9,
                       d_head=8, mask={"causal": "lower-right", "key_lengths": [9, 7]})
    cells = checker.negative_controls([sc])
    assert len({c.fault for c in cells}) >= 8
    console = Console(width=width, record=True, force_terminal=True, color_system=None)
    render_controls(console, cells)
    text = console.export_text()
    assert all(len(line) <= width for line in text.splitlines()), text
    assert all(c.fault in text for c in cells)
    assert ("scenario: faults by outcome" in text) == (width == 80), text
