"""The Python API of a run (``gradcheck_cli.api``), the exit-code table, and the CLI package's layout."""
import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import gradcheck_cli
from gradcheck_cli import api
from gradcheck_cli.cli import main
from gradcheck_cli.errors import GradcheckError
from gradcheck_cli.exitcodes import EPILOG, EPILOG_INFO, ExitCode


def test_run_returns_the_outcome_and_writes_the_reports_without_printing(root, tmp_path, capsys):
    options = gradcheck_cli.RunOptions(str(root / "configs/quickstart.yaml"), selects=("causal-self",),
                                       json_path=str(tmp_path / "r.json"))
    outcome = gradcheck_cli.run(options)
    assert capsys.readouterr() == ("", "")
    assert outcome.exit_code is ExitCode.OK and not outcome.interrupted and outcome.cells is None
    assert [r.name for r in outcome.results] == ["causal-self"]
    assert json.loads((tmp_path / "r.json").read_text()) == outcome.report
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.jobs = 2


def test_the_outcome_is_what_the_command_exits_with(root):
    options = api.RunOptions(str(root / "configs/quickstart.yaml"), ("softmax-term",), selects=("causal-self",))
    plan = api.prepare(options)
    seen = []
    outcome = api.execute(plan, on_result=lambda sc, result: seen.append((sc.name, result.verdict)))
    assert seen == [("causal-self", "fail")] and outcome.exit_code is ExitCode.FAILED
    cli = CliRunner().invoke(main, ["run", options.config, "--select", "causal-self", "--fault", "softmax-term"])
    assert cli.exit_code == outcome.exit_code == 1


def test_prepare_refuses_faults_with_negative_controls_before_loading(tmp_path):
    options = api.RunOptions(str(tmp_path / "missing.yaml"), ("softmax-term",), negative_controls=True)
    with pytest.raises(GradcheckError, match="do not combine it with --fault"):
        api.prepare(options)


def test_one_exit_code_table_and_the_epilogs_written_from_it():
    assert {c.name: int(c) for c in ExitCode} == {"OK": 0, "FAILED": 1, "BAD_INPUT": 2, "INCONCLUSIVE": 3,
                                                  "INTERRUPTED": 130, "BROKEN_PIPE": 141, "TERMINATED": 143}
    assert [ExitCode.of_verdict(v) for v in ("pass", "fail", "inconclusive")] == [0, 1, 3]
    assert EPILOG == ("Exit codes: 0 all checks passed, 1 a check failed, 2 bad input or usage, 3 inconclusive "
                      "(no failure, but some check could not decide; each says why), 130 interrupted.")
    assert EPILOG_INFO == "Exit codes: 0 ok, 2 bad input or usage."
    assert main.epilog == EPILOG and main.commands["run"].epilog == EPILOG
    assert main.commands["validate"].epilog == EPILOG_INFO


def test_only_the_console_script_imports_the_cli_package():
    package = Path(gradcheck_cli.__file__).parent
    for path in package.rglob("*.py"):
        if path.parent.name == "cli" or path.name == "console.py":
            continue
        assert not re.search(r"^\s*(from\s+(\.+|gradcheck_cli\.)cli\b|import\s+gradcheck_cli\.cli\b)",
                             path.read_text(), re.M), path
