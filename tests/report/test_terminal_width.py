"""Terminal output that fits: at 80 and 160 columns every line of a failing scenario's report fits the width,
nothing is lost or split (every number and word of the unwrapped report is there, whole), the table goes to two
lines per check under 100 columns, and off a terminal nothing is wrapped at all."""
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
    words = {w for w in whole.split() if len(w) > 3 and not set(w) <= set("-━─")}
    assert words <= set(text.split()) | {w for w in words if "|" in w}  # every word (heat-map rows aside)


def test_under_100_columns_a_check_takes_two_lines_and_over_it_one(failing):
    sc, result = failing
    narrow, wide = _render(result, sc.describe(), 80), _render(result, sc.describe(), 160)
    name_line = next(line for line in narrow.splitlines() if line.startswith("gradient q"))
    assert name_line.rstrip().endswith("FAIL") and NUMBER.search(name_line) is None  # the numbers go below it
    wide_line = next(line for line in wide.splitlines() if line.startswith("gradient q"))
    assert NUMBER.search(wide_line) and wide_line.rstrip().endswith("FAIL")


def test_off_a_terminal_lines_are_never_wrapped(failing):
    sc, result = failing
    text = _render(result, sc.describe(), 80, terminal=False)
    assert any(len(line) > 120 for line in text.splitlines())  # a hint or a worst: line, whole


SNAPSHOT_80 = """\
demo (B=1 Hq=1 Hkv=1 n_q=2 n_k=2 d=2/2 float64 full)
check                                                                  status
    tensor     max abs err   rel err  tolerance  noise floor  detects
gradient q                                                             FAIL
    q 1x1x2x2     5.00e-01  2.50e-01   1.00e-06     1.00e-12
implementation runs                                                    FAIL
    -          did not run
  FAIL gradient q (q): worst at q[0, 0, 1, 1]: analytic 1.5, numeric 2.0; 4
      elements checked; the number 123456789.123456789e+10 is never split
  FAIL implementation runs (-): backward raised ValueError: a long message that
      the tool wraps at a word boundary so that the terminal never has to
  hint: the analytic gradient is off by a constant factor of 0.75 everywhere:
        look at the scale (a hint long enough to wrap onto a second line)
  demo: FAILED in 0.00 s
"""


def test_a_snapshot_at_80_columns():
    checks = (
        Check(kind=Kind.GRADIENT, name="gradient q", tensor="q", shape=(1, 1, 2, 2), max_abs_error=0.5,
              relative_error=0.25, tolerance=1e-6, noise_floor=1e-12, worst_index=(0, 0, 1, 1), passed=False,
              detail="worst at q[0, 0, 1, 1]: analytic 1.5, numeric 2.0; 4 elements checked; the number "
                     "123456789.123456789e+10 is never split"),
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
