"""sweep-eps: the V-shaped curve, the run's step marked, JSON and a PNG."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from gradcheck_cli import stepsweep
from gradcheck_cli.cli import main

from helpers import make


def test_the_curve_is_v_shaped_in_float64():
    sweep = stepsweep.sweep(make(n_q=6, d_head=4, mask={"causal": "lower-right"}), samples=12)
    q = np.asarray(sweep.errors["q"])
    best = int(np.argmin(q))
    assert 0 < best < len(q) - 1                      # both sides rise
    assert q[0] > 100 * q[best] and q[-1] > 100 * q[best]
    assert q[0] / q[1] > 30                            # truncation ~ h^2 on the right: 100x per decade
    assert sweep.chosen == 1e-6 and 1e-6 in sweep.steps
    assert 1e-6 <= sweep.best("q") <= 1e-4


def test_steps_lost_to_rounding_are_infinite_in_float32():
    sweep = stepsweep.sweep(make(n_q=4, d_head=4, dtype="float32"), steps=(1e-2, 1e-9), samples=4)
    assert np.isfinite(sweep.errors["q"][0]) and np.isinf(sweep.errors["q"][-1])
    assert sweep.to_json()["errors"]["q"][-1] is None


def test_cli_table_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - {name: a, n_q: 4, d_head: 4}\n  - {name: r, op: rmsnorm, d_model: 4}\n")
    out = CliRunner().invoke(main, ["sweep-eps", str(cfg), "--steps", "1e-2:1e-8:2", "--samples", "4",
                                    "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    assert out.exit_code == 0, out.output
    assert "<- run" in out.output and out.output.count("relative error against epsilon") == 2
    data = json.loads((tmp_path / "s.json").read_text())
    assert [s["name"] for s in data["sweeps"]] == ["a", "r"] and len(data["sweeps"][0]["steps"]) == 13
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("steps", ["1e-1", "1e-12:1e-1", "x:y", "1e-1:1e-3:0", "1e-1:1e-3:1.5", "1:1e-300:9",
                                   "inf:1e-3", "1e300:1e-300", "1e-1:1e-2:1e400", "nan:1e-3"])
def test_bad_steps_are_usage_errors(tmp_path, steps):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - {name: a, n_q: 4, d_head: 4}\n")
    out = CliRunner().invoke(main, ["sweep-eps", str(cfg), "--steps", steps])
    assert out.exit_code == 2 and "--steps" in out.stderr


def test_an_experiment_has_nothing_to_sweep(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - {name: a, op: logit-scale}\n")
    out = CliRunner().invoke(main, ["sweep-eps", str(cfg)])
    assert out.exit_code == 2 and "no selected scenario has gradients" in out.stderr


def test_both_ends_of_the_steps_are_kept_and_plots_take_their_format(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - {name: a, n_q: 4, d_head: 4}\n")
    out = CliRunner().invoke(main, ["sweep-eps", str(cfg), "--steps", "1e-1:9e-2", "--samples", "2",
                                    "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.pdf")])
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "s.json").read_text())["sweeps"][0]["steps"][:2] == [0.1, 0.09]
    assert (tmp_path / "s.pdf").read_bytes()[:4] == b"%PDF"
    bad = CliRunner().invoke(main, ["sweep-eps", str(cfg), "--plot", str(tmp_path / "s.jpeg")])
    assert bad.exit_code == 2 and ".png, .pdf or .svg" in bad.stderr


def test_errors_are_relative_to_the_whole_input():
    """As the run reports them: max |a - n| over the samples over the largest analytic value anywhere."""
    sc = make(n_q=6, d_head=4)
    few = stepsweep.sweep(sc, steps=(1e-2,), samples=2)
    many = stepsweep.sweep(sc, steps=(1e-2,), samples=400)
    assert few.errors["q"][0] <= many.errors["q"][0] * (1 + 1e-12)
