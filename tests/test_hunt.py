"""attn-gradcheck hunt: the space, the search and shrinking, what it writes, its CLI and its pytest item. The hunts here
are narrowed (``--space``) and short; the Done-when's measurements (every edge bug of examples/hunt_edges.py in the
default space, against a brute force) are in benchmarks/hunt/."""
import json
import shutil

import pytest
from click.testing import CliRunner

from gradcheck_cli import api, hunt
from gradcheck_cli.cli import main
from gradcheck_cli.errors import GradcheckError
from gradcheck_cli.exitcodes import ExitCode
from gradcheck_cli.hunt import entries
from gradcheck_cli.hunt.space import parse_overrides, scenario_values, space_of
from gradcheck_cli.hunt.start import elements, starting_point

#: A small space around examples/hunt.yaml's start: a hunt in it takes a few seconds.
SMALL = ("n_q=1..20", "n_k=1..40", "d_head=1..8", "batch=1..2", "heads_kv=1..2", "group=1..4", "dtype=float64")


@pytest.fixture
def folder(tmp_path, root):
    for name in ("hunt.yaml", "hunt_edges.py", "varlen_attention.py"):
        shutil.copy(root / "examples" / name, tmp_path / name)
    (tmp_path / "varlen.yaml").write_text(  # examples/varlen.yaml's NumPy scenario (its torch ones import torch)
        "scenarios:\n  - {name: mine-numpy, implementation: 'varlen_attention:numpy_attention', heads_q: 4,"
        " heads_kv: 2, d_head: 8, varlen: {seqlens_q: [3, 4, 1, 2], seqlens_k: [5, 4, 3, 5]},"
        " mask: {causal: lower-right}}\n")
    return tmp_path


def _hunt(folder, name, *space, **options):
    options.setdefault("database", None)
    return hunt.hunt(hunt.HuntOptions(str(folder / "hunt.yaml"), name, space=space or SMALL, **options))


def test_an_edge_bug_is_found_shrunk_to_its_smallest_scenario_and_written_as_a_file_that_fails(folder):
    outcome = _hunt(folder, "tail-block-dropped", examples=40, budget_s=60)
    found = outcome.hunt
    assert outcome.exit_code == ExitCode.FAILED and found.verdict == "fail"
    # the tail of n_k % 16 keys gets no gradient: one key of one head is the smallest scenario (3 input elements)
    assert found.smallest.elements == 3 and found.smallest.elements <= found.first.elements
    assert "gradient v" in found.smallest.signature[0]
    written = folder / "hunt-tail-block-dropped.yaml"
    assert outcome.written == str(written)
    text = written.read_text()
    assert text.startswith("# Found by: attn-gradcheck hunt ") and "--seed 0" in text
    assert "Reproduce: attn-gradcheck run" in text and "--select hunt-tail-block-dropped" in text
    rerun = api.run(api.RunOptions(str(written)))
    assert rerun.exit_code == ExitCode.FAILED and rerun.results[0].name == "hunt-tail-block-dropped"
    assert {c.name for c in rerun.results[0].checks if c.verdict == "fail"} == set(found.smallest.signature[0])
    record = outcome.record
    assert record["schema"] == "attn-gradcheck-hunt/1" and record["verdict"] == "fail"
    assert record["smallest"]["elements"] == 3 and record["report"]["verdict"] == "fail"
    assert record["space"]["n_k"] == "1..40" and record["tried"] == found.tried


@pytest.mark.slow  # ~2 s
def test_a_bug_only_for_four_query_heads_per_kv_head_shrinks_to_a_group_of_four(folder):
    outcome = _hunt(folder, "group-of-four-half-summed", budget_s=60, shrink_s=60)
    keys = outcome.hunt.smallest.mapping
    assert outcome.exit_code == ExitCode.FAILED
    assert keys["heads_q"] == 4 * keys["heads_kv"] and keys["heads_kv"] == 1
    assert keys["n_q"] == 1 and keys["d_head"] == 1 and keys.get("batch", 1) == 1


def test_a_correct_implementation_gives_no_finding_and_says_what_it_covered(folder):
    outcome = _hunt(folder, "correct", examples=12, budget_s=60, seed=3)
    found = outcome.hunt
    assert outcome.exit_code == ExitCode.OK and found.smallest is None and found.tried > 0
    assert outcome.written is None and not list(folder.glob("hunt-correct*"))
    covered = outcome.record["covered"]
    assert {"n_q", "n_k", "d_head", "group", "mask.causal"} <= set(covered)
    assert 1 <= covered["n_k"]["min"] <= covered["n_k"]["max"] <= 40


@pytest.mark.slow  # two hunts: ~3 s
def test_the_database_starts_a_rerun_from_the_last_failure(folder, tmp_path):
    db = str(tmp_path / "db")
    first = _hunt(folder, "decode-causal-offset", database=db, budget_s=60, seed=5)
    again = _hunt(folder, "decode-causal-offset", database=db, budget_s=60, seed=5)
    assert first.hunt.smallest is not None and again.hunt.smallest is not None
    # the first scenario of the rerun is the stored failure
    assert again.hunt.first.elements == first.hunt.smallest.elements
    assert again.hunt.smallest.elements <= first.hunt.smallest.elements


def test_a_sweep_case_is_a_starting_point_and_its_file_name_loses_the_brackets(tmp_path, root):
    shutil.copy(root / "configs" / "sweep.yaml", tmp_path / "sweep.yaml")
    name = "causal[n_q=1,mask.causal=upper-left]"
    outcome = hunt.hunt(hunt.HuntOptions(str(tmp_path / "sweep.yaml"), name, examples=4, database=None,
                                         space=("dtype=float64", "n_k=1..20", "d_head=1..4")))
    assert outcome.plan.start.mapping["n_q"] == 1 and outcome.plan.start.mapping["mask"] == {"causal": "upper-left"}
    assert outcome.exit_code == ExitCode.OK and outcome.hunt.tried == 4
    assert outcome.plan.out.endswith("hunt-causal_n_q_1_mask.causal_upper-left_.yaml")


def test_the_space_declares_its_axes_and_narrows_or_widens_them(folder):
    start = starting_point(str(folder / "hunt.yaml"), "correct")
    space = space_of(start, parse_overrides(("n_k=1..33", "d_head=16,64,160", "mask.causal=none,lower-right")), 100)
    axes = {a.key: a for a in space.axes}
    assert (axes["n_k"].low, axes["n_k"].high) == (1, 33) and set(axes["n_k"].edges) <= set(range(1, 34))
    assert axes["d_head"].choices == (16, 64, 160)
    assert axes["mask.causal"].choices == (None, "lower-right")
    assert "d_value" not in axes and "softcap" not in axes  # optional axes: only where the scenario sets them
    assert space.ranges()["n_k"] == "1..33"
    # a packed batch fixes the sizes its documents give
    varlen = space_of(starting_point(str(folder / "varlen.yaml"), "mine-numpy"), {}, 100)
    assert dict(varlen.fixed)["n_q"] == "fixed by varlen" and "n_q" not in {a.key for a in varlen.axes}
    with pytest.raises(GradcheckError, match="fixes it"):
        space_of(starting_point(str(folder / "varlen.yaml"), "mine-numpy"), {"n_k": "1..9"}, 100)
    assert elements(start.scenario) == 4 * 16 * 8 + 2 * 2 * 16 * 8


@pytest.mark.parametrize("args, message", [
    (["--space", "n_kk=1..9"], "has no such axis"),
    (["--space", "n_k"], "expected KEY=RANGE"),
    (["--space", "n_k=9..1"], "expected 1 <= lo <= hi"),
    (["--space", "mask.causal=1..3"], "takes a list of values"),
    (["--space", "mask.key_lengths=3"], "can only be turned off"),
    (["--select", "*"], "chooses 6 scenarios"),
    (["--select", "nothing-here"], "no scenario is left"),
    (["--out", "/tmp/elsewhere/x.yaml"], "must go in"),
    pytest.param(["--max-elements", "2"], "could be loaded", marks=pytest.mark.slow),  # none that small: ~3 s
    (["--space", "dtype=float16"], "dtype float16 needs backend: torch or backend: jax"),
    (["--space", "mask.causal=sideways"], "mask.causal: expected one of none, upper-left, lower-right"),
    (["--space", "scale=0"], "scale: must be non-zero"),
    (["--space", "n_k=1..9", "--space", "n_k=3"], "n_k is given twice"),
    (["--space", "softcap=30"], "its code does not run with one (softcap=30: forward raised TypeError"),
])
def test_bad_input_is_one_line_and_exit_2(folder, args, message):
    argv = ["hunt", str(folder / "hunt.yaml"), "--no-database"] + (
        args if "--select" in args else ["--select", "correct"] + args)
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1


def test_a_rerun_replaces_its_own_scenario_file_but_never_another_yaml(folder):
    cli = CliRunner()
    argv = ["hunt", str(folder / "hunt.yaml"), "--select", "tail-block-dropped", "--no-database", "--examples", "5"]
    argv += [f"--space={s}" for s in SMALL]
    assert cli.invoke(main, argv).exit_code == 1
    assert cli.invoke(main, argv).exit_code == 1  # its own file: replaced
    other = folder / "mine.yaml"
    other.write_text("scenarios: []\n")
    refused = cli.invoke(main, argv + ["--out", str(other)])
    assert refused.exit_code == 2 and "never replaces" in refused.output
    assert other.read_text() == "scenarios: []\n"


def test_the_cli_prints_the_shrunk_scenario_its_checks_and_the_reproduce_line(folder):
    argv = ["hunt", str(folder / "hunt.yaml"), "--select", "decode-causal-offset", "--no-database",
            "--json", str(folder / "record.json")] + [f"--space={s}" for s in SMALL]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 1, result.output
    assert "FAILED first at" in result.output and "shrunk to 5" in result.output
    assert "gradient k" in result.output and "reproduce: attn-gradcheck run" in result.output
    assert json.loads((folder / "record.json").read_text())["smallest"]["elements"] == 5


def test_hunt_entries_are_read_with_their_line_and_bad_ones_are_refused(tmp_path):
    path = tmp_path / "h.gradcheck.yaml"
    path.write_text("scenarios:\n  - {name: a, n_q: 2, d_head: 2}\n"
                    "hunt:\n  - {select: a, budget: 5, seed: 2, space: {n_k: 1..9, d_head: [1, 2]}}\n")
    (entry,) = entries.read(str(path))
    assert entry.options.seed == 2 and entry.options.space == ("n_k=1..9", "d_head=1,2") and entry.line == 4
    path.write_text("scenarios:\n  - {name: a, n_q: 2, d_head: 2}\nhunt:\n  - {select: a, budget: 0}\n")
    with pytest.raises(GradcheckError, match=r":4: hunt\[0\]\.budget: expected a number > 0"):
        entries.read(str(path))
    path.write_text("scenarios:\n  - {name: a, n_q: 2, d_head: 2}\nhunt:\n  - {select: a, seeds: 1}\n")
    with pytest.raises(GradcheckError, match="unknown key 'seeds'"):
        entries.read(str(path))


def test_a_hunt_entry_is_a_pytest_item_that_fails_with_the_shrunk_scenario(pytester, root):
    for name in ("hunt_edges.py",):
        shutil.copy(root / "examples" / name, pytester.path / name)
    space = "{n_q: 1..8, n_k: 1..20, d_head: 1..4, batch: 1..2, heads_kv: 1..2, group: 1..4, dtype: float64}"
    (pytester.path / "edges.gradcheck.yaml").write_text(
        "defaults: {heads_q: 4, heads_kv: 2, n_q: 16, n_k: 16, d_head: 8, mask: {causal: lower-right}}\n"
        "scenarios:\n"
        "  - {name: correct, implementation: 'hunt_edges:correct'}\n"
        "  - {name: tail, implementation: 'hunt_edges:tail_block_dropped'}\n"
        "hunt:\n"
        f"  - {{select: correct, examples: 8, space: {space}}}\n"
        f"  - {{select: tail, examples: 8, space: {space}}}\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    out = result.stdout.str()
    assert result.parseoutcomes() == {"passed": 3, "failed": 1}, out
    assert "hunt[tail]" in out and "name: hunt-tail" in out and "repeat: attn-gradcheck hunt" in out
    assert "FAIL gradient v" in out


def test_what_a_hunt_found_in_a_correct_infonce_is_no_longer_a_false_fail(tmp_path, root):
    """A hunt from examples/infonce.yaml found a correct InfoNCE (l = lse - z_pos, as most code writes it) FAILED
    with one query: the positive dominates, the true gradient of the hard negative is ~1e-23, the code's l cancels
    it to 0, and the noise floor was the built-in forward's (which keeps it with log1p). The floor now charges the
    code's own forward its distance from the built-in one, up to rounding of the loss's parts."""
    shutil.copy(root / "examples" / "my_infonce.py", tmp_path / "my_infonce.py")
    (tmp_path / "found.yaml").write_text(
        "scenarios:\n  - {name: found, op: infonce, batch: 1, dim: 16, hard_negatives: 1, "
        "implementation: 'my_infonce:infonce'}\n")
    outcome = api.run(api.RunOptions(str(tmp_path / "found.yaml")))
    checks = {c.name + (c.tensor or ""): c.verdict for c in outcome.results[0].checks}
    assert outcome.exit_code != ExitCode.FAILED and checks["gradient nn"] != "fail", checks
    assert checks["gradient qq"] == "pass" and checks["gradient pp"] == "pass", checks  # the floor stays low there


#: The smallest failing scenario of each edge bug of examples/hunt.yaml in the default space, in input elements, as
#: benchmarks/hunt/edges.py's brute force found it (large-head-unscaled: nothing fails below 323; its smallest, d_head
#: 129 with two keys, has 645).
BRUTE_SMALLEST = {"tail-block-dropped": 3, "large-head-unscaled": 323, "group-of-four-half-summed": 6,
                  "decode-causal-offset": 5, "unstable-exp": 7}


@pytest.mark.slow  # the shipped hunts in the default space: ~40 s together
@pytest.mark.parametrize("name", sorted(BRUTE_SMALLEST))
def test_each_shipped_edge_bug_is_found_in_the_default_space_and_shrunk_within_2x(folder, name):
    outcome = hunt.hunt(hunt.HuntOptions(str(folder / "hunt.yaml"), name, examples=600, budget_s=300, seed=0,
                                         database=None))
    assert outcome.exit_code == ExitCode.FAILED, outcome.record["stopped"]
    assert outcome.hunt.smallest.elements <= 2 * BRUTE_SMALLEST[name], outcome.hunt.smallest.mapping


@pytest.mark.slow  # short hunts from correct shipped examples: no finding
@pytest.mark.parametrize("config, name", [("hunt.yaml", "correct"), ("attention.yaml", "mine"),
                                          ("rmsnorm.yaml", "my-rmsnorm"), ("infonce.yaml", "my-infonce"),
                                          ("rope.yaml", "my-rope")])
def test_short_hunts_from_correct_shipped_examples_find_nothing(tmp_path, root, config, name):
    for f in (root / "examples").iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    outcome = hunt.hunt(hunt.HuntOptions(str(tmp_path / config), name, examples=30, budget_s=120, seed=1,
                                         database=None))
    assert outcome.exit_code in (ExitCode.OK, ExitCode.INCONCLUSIVE), outcome.record["smallest"]
    assert outcome.hunt.tried > 0


def test_a_dtype_the_code_does_not_run_in_is_left_out_with_the_reason(tmp_path, root):
    """Code that returns float64 whatever it is given does not run in float32: the hunt tries each dtype on the
    starting scenario first and leaves such a dtype out (the example's ALiBi code did; it was a finding before)."""
    (tmp_path / "upcast.py").write_text(
        "import numpy as np\nfrom my_attention import attention as inner\n\n\nclass Upcast:\n"
        "    def forward(self, q, k, v, visible, scale, kv_map):\n"
        "        return inner.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), visible,"
        " scale, kv_map)\n\n"
        "    def backward(self, q, k, v, visible, scale, kv_map, grad_o):\n"
        "        return inner.backward(*(x.astype(np.float64) for x in (q, k, v)), visible, scale, kv_map,"
        " grad_o.astype(np.float64))\n\n\nupcast = Upcast()\n")
    shutil.copy(root / "examples" / "my_attention.py", tmp_path / "my_attention.py")
    (tmp_path / "up.yaml").write_text(
        "scenarios:\n  - {name: up, implementation: 'upcast:upcast', n_q: 4, d_head: 4}\n")
    outcome = hunt.hunt(hunt.HuntOptions(str(tmp_path / "up.yaml"), "up", examples=3, database=None,
                                         space=("n_q=1..8", "n_k=1..8", "d_head=1..4")))
    assert outcome.exit_code == ExitCode.OK, outcome.record["smallest"]
    assert "o of dtype float64, expected float32" in outcome.record["left_out"]["dtype=float32"]
    assert outcome.record["covered"]["dtype"] == {"values": ["float64"]}


def test_every_draw_stays_inside_each_axis_range_and_lists_fit_their_sizes(folder):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    start = starting_point(str(folder / "hunt.yaml"), "correct")
    space = space_of(start, parse_overrides(("n_k=3..40", "group=1,4", "mask.causal=none,lower-right")), 4096)
    axes = {a.key: a for a in space.axes}

    @settings(max_examples=60, suppress_health_check=list(HealthCheck), deadline=None)
    @given(st.data())
    def check(data):
        values = data.draw(space.strategy(start))
        for key, axis in axes.items():
            v = values[key]
            if axis.kind == "int":
                assert axis.low <= v <= axis.high, (key, v)
            elif axis.kind == "choice":
                assert v in axis.choices, (key, v)
        lengths = values["mask.key_lengths"]
        assert lengths is None or (len(lengths) == values["batch"] and all(1 <= n <= values["n_k"] for n in lengths))
        window = values["mask.window"]
        assert window is None or (len(window) == 2 and window != [None, None]
                                  and all(w is None or 0 <= w <= values["n_k"] for w in window))
        keys = scenario_values(values, start)
        assert keys["heads_q"] == keys["heads_kv"] * values["group"] and "group" not in keys
    check()


def test_a_cause_is_the_same_cause_whatever_size_its_name_carries():
    """A cold trial's key-tail bug was named backward-skips-key-tail-96 at n_k = 109 and ...-16 at n_k = 17: one
    cause, whose size is in its name; the shrinking compared them as two and stopped at 195 elements, not 35."""
    from types import SimpleNamespace

    from gradcheck_cli.hunt.search import _signature
    check = SimpleNamespace(name="gradient k", verdict="fail")
    big = SimpleNamespace(checks=[check], hints=["dk equals ... a known mistake (`backward-skips-key-tail-96`)"])
    small = SimpleNamespace(checks=[check], hints=["dk equals ... a known mistake (`backward-skips-key-tail-16`)"])
    other = SimpleNamespace(checks=[check], hints=["... (`lse-saved-float16`) ... (`softmax-term`)"])
    assert _signature(big) == _signature(small) == (frozenset({"gradient k"}), frozenset({"backward-skips-key-tail"}))
    assert _signature(other)[1] == {"lse-saved-float16", "softmax-term"}  # a dtype in a name is no size
