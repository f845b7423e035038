"""Writing the reports (report/outputs.py): folders created, unwritable or clashing paths refused before the run,
and all-or-nothing writes, through the command line."""
import os

import pytest
from click.testing import CliRunner

from gradcheck_cli.cli import main


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_report_folders_are_created(root, tmp_path):
    result = run("run", root / "configs/quickstart.yaml", "--json", tmp_path / "a" / "r.json",
                 "--junit", tmp_path / "b" / "r.xml", "--save-arrays", tmp_path / "c" / "d")
    assert result.exit_code == 0
    assert (tmp_path / "a" / "r.json").is_file() and (tmp_path / "b" / "r.xml").is_file()
    assert len(list((tmp_path / "c" / "d").glob("*.npz"))) == 3
    mode = (tmp_path / "a" / "r.json").stat().st_mode & 0o777
    assert mode & 0o044 == 0o044  # readable by group and others, like any CI artifact (not mkstemp's 0600)


@pytest.mark.parametrize("args,words", [
    (["--json", "/proc/no/r.json"], "cannot write there"),
    (["--json", "{t}/same", "--junit", "{t}/same"], "would overwrite"),
    (["--json", "{t}/a/causal-self.npz", "--save-arrays", "{t}/a"], "would overwrite"),
    (["--json", "{root}/configs/quickstart.yaml"], "would overwrite the input"),
    (["--json", "{t}"], "is a folder"),
])
def test_unwritable_or_clashing_reports_fail_before_running(root, tmp_path, args, words):
    args = [a.format(t=tmp_path, root=root) for a in args]
    result = run("run", root / "configs/quickstart.yaml", *args)
    assert result.exit_code == 2 and words in result.stderr and result.stdout == ""


def test_a_report_that_cannot_be_written_leaves_none(root, tmp_path, monkeypatch):
    """The third rename fails at the end of the run (a full or vanished disk): none is written."""
    from gradcheck_cli.report import outputs
    calls, real = {"n": 0}, os.replace

    def replace(a, b):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(outputs.os, "replace", replace)
    result = run("run", root / "configs/quickstart.yaml", "--json", tmp_path / "r.json",
                 "--save-arrays", tmp_path / "arrays")
    assert result.exit_code == 2 and "cannot write the reports" in result.stderr and "none written" in result.stderr
    assert not (tmp_path / "r.json").exists()
    assert list((tmp_path / "arrays").iterdir()) == []


def test_report_paths_that_clash_with_a_folder_are_refused_before_running(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    same = run("run", root / "configs/quickstart.yaml", "--json", "r.json", "--save-arrays", "r.json")
    assert same.exit_code == 2 and "--save-arrays folder" in same.stderr and "causal-self" not in same.stdout
    assert not (tmp_path / "r.json").exists()
    folder = run("run", root / "configs/quickstart.yaml", "--json", "outdir/")
    assert folder.exit_code == 2 and "names a folder" in folder.stderr and not (tmp_path / "outdir").exists()
