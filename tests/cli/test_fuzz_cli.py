"""The command line never shows a traceback, whatever arguments it gets: hypothesis-generated argument
lists over every command and option, with real, missing, wrong and hostile files. Every run ends with
exit 0, 1, 2 or 3 (never an uncaught exception), and usage errors say what was wrong."""
import json
import os

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradcheck_cli.cli import main
from gradcheck_cli.ops import FAULTS

from helpers import examples

TINY = ("scenarios:\n  - {name: a, n_q: 2, d_head: 2, mask: {causal: lower-right}}\n"
        "  - {name: b, n_q: 3, n_k: 4, d_head: 2, sweep: {batch: [1, 2]}}\n")
BAD = "scenarios:\n  - {name: a, n_q: 0, d_head: 2}\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-fuzz")
    (d / "tiny.yaml").write_text(TINY)
    (d / "bad.yaml").write_text(BAD)
    (d / "bin.yaml").write_bytes(b"\x00\xff\xfe")
    (d / "folder").mkdir()
    result = CliRunner().invoke(main, ["run", str(d / "tiny.yaml"), "--json", str(d / "report.json")])
    assert result.exit_code == 0, result.output
    (d / "notjson.json").write_text("{")
    (d / "other.json").write_text(json.dumps({"tool": "x"}))
    return d


FILES = ["tiny.yaml", "bad.yaml", "bin.yaml", "folder", "missing.yaml", "report.json", "notjson.json",
         "other.json", "", "-", "out/r.json", "tiny.yaml/x", "/dev/null", "a\nb", " "]
TOKENS = st.one_of(
    st.sampled_from(["run", "validate", "merge", "faults", "schema", "sweep-eps", "--help", "-h", "--version"]),
    st.sampled_from(["--fault", "--break-softmax-term", "--select", "--deselect", "--negative-controls",
                     "--jobs", "-j", "--shard", "--json", "--junit", "--save-arrays", "--memory-budget",
                     "--progress", "--no-progress", "--bogus", "-x", "--"]),
    st.sampled_from(FILES),
    st.sampled_from(list(FAULTS) + ["nofault", "a", "b*", "b[batch=2]", "[", "0", "1", "-1", "2/3", "3/2",
                                    "1/1", "0/0", "x/y", "99999999999999999999", "1e3", "nan"]),
    st.text(st.characters(blacklist_characters="\x00"), max_size=8),  # argv cannot carry NUL
)
ARGS = st.lists(TOKENS, max_size=7)
# Mostly well-formed option/value pairs, so runs get deep (checks, faults, reports), with noise mixed in.
PAIRS = st.lists(st.one_of(
    st.tuples(st.just("--fault"), st.sampled_from(list(FAULTS) + ["nofault"])),
    st.tuples(st.sampled_from(["--select", "--deselect"]), st.sampled_from(["a", "b*", "b[batch=2]", "[", "*", "z"])),
    st.tuples(st.just("--shard"), st.sampled_from(["1/2", "2/2", "3/3", "0/1", "2/1", "1/1"])),
    st.tuples(st.sampled_from(["--json", "--junit"]), st.sampled_from(["r1.json", "out/r2.xml", "tiny.yaml", "folder",
                                                                     "report.json", "/proc/x", "r1.json"])),
    st.tuples(st.just("--save-arrays"), st.sampled_from(["arrays", "tiny.yaml", "folder"])),
    st.tuples(st.just("--memory-budget"), st.sampled_from(["1", "0", "64", "-3", "big"])),
    st.tuples(st.sampled_from(["--negative-controls", "--break-softmax-term", "--no-progress"])),
    st.tuples(TOKENS),
), max_size=5).map(lambda pairs: [x for pair in pairs for x in pair])


@pytest.mark.slow  # a fuzzer: ~3-9 s in the dev profile, 3x in ci
@settings(max_examples=examples(25),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.one_of(st.tuples(st.just("run"), st.sampled_from(FILES)).map(list), st.just([])).flatmap(
        lambda head: ARGS.map(lambda rest: head + rest)),
    st.sampled_from(["tiny.yaml", "tiny.yaml", "bad.yaml", "missing.yaml"]).flatmap(
        lambda cfg: PAIRS.map(lambda rest: ["run", cfg] + rest)),
    st.lists(st.sampled_from(["report.json", "notjson.json", "other.json", "r1.json", "missing.json", "--json",
                              "merged.json"]), max_size=4).map(lambda xs: ["merge"] + xs),
))
def test_any_argument_list_exits_cleanly(workdir, args):
    # --jobs > 1 spawns processes: keep the fuzz in-process and quick (the parallel tests cover jobs)
    args = ["1" if prev in ("--jobs", "-j") else a for prev, a in zip([None] + args, args)]
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        result = CliRunner().invoke(main, args, catch_exceptions=True)
    finally:
        os.chdir(cwd)
    from hypothesis import event
    event(f"exit {result.exit_code}")
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    assert result.exit_code in (0, 1, 2, 3), (args, result.exit_code, result.output)
    assert "Traceback" not in result.output, args
    if result.exit_code == 2:
        assert result.stderr.strip(), (args, "exit 2 without a message")
