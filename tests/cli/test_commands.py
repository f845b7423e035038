"""The command line (cli/): commands, options, exit codes and messages, through click's runner with stderr
kept separate. The reports themselves are tests/report/."""
import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradcheck_cli.cli import main
from gradcheck_cli.ops import FAULTS

from helpers import CONFIGS


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def test_quickstart_passes_and_softmax_fault_fails(root):
    ok = run("run", root / "configs/quickstart.yaml")
    assert ok.exit_code == 0, ok.output
    assert "all checks passed" in ok.stdout
    bad = run("run", root / "configs/quickstart.yaml", "--break-softmax-term")
    assert bad.exit_code == 1
    assert "FAIL gradient q" in bad.stdout and "worst at q[" in bad.stdout


def test_mask_fault_passes_gradients_but_fails_invariants(root, tmp_path):
    result = run("run", root / "configs/seed-causal-first-row.yaml", "--fault", "mask", "--json", tmp_path / "r.json")
    assert result.exit_code == 1
    assert json.loads((tmp_path / "r.json").read_text())["faults"] == ["mask"]
    lines = [l for l in result.stdout.splitlines() if l.startswith("gradient ")]
    assert lines and all(l.rstrip().endswith("pass") for l in lines)
    assert "FAIL unseen K/V rows get zero gradient" in result.stdout


def test_plain_output_without_a_terminal(root):
    result = run("run", root / "configs/quickstart.yaml", env={"NO_COLOR": "1"})
    assert "\x1b[" not in result.stdout


def test_faults_command_lists_every_fault():
    result = run("faults")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    for name, fault in FAULTS.items():
        # its own entry (a bare `name in stdout` matches "mask" inside "mask-backward"), with its whole record
        (at,) = [i for i, line in enumerate(lines) if line.split("  (op ")[0] == name]
        assert lines[at + 2] == "    caught by: " + "; ".join(fault.caught_by), (name, lines[at + 2])


@pytest.mark.parametrize("args", [[], ["run"], ["faults"], ["validate"], ["merge"], ["schema"], ["sweep-eps"]])
def test_help_everywhere(args):
    result = run(*args, "--help")
    assert result.exit_code == 0 and "Usage:" in result.stdout


def test_unknown_fault_is_a_usage_error(root):
    result = run("run", root / "configs/quickstart.yaml", "--fault", "nonsense")
    assert result.exit_code == 2 and "nonsense" in result.stderr


def test_fault_and_negative_controls_do_not_mix(root):
    result = run("run", root / "configs/quickstart.yaml", "--fault", "mask", "--negative-controls")
    assert result.exit_code == 2


def test_plain_output_ignores_a_narrow_columns_setting(root):
    result = run("run", root / "configs/quickstart.yaml", "--break-softmax-term", env={"COLUMNS": "40"})
    lines = result.stdout.splitlines()
    assert all(line == line.rstrip() for line in lines)
    row = next(line for line in lines if line.startswith("gradient q"))
    assert row.split()[-1] == "FAIL" and "e+00" in row and "\u2026" not in result.stdout


def test_negative_controls_exit_1_when_a_fault_is_missed(tmp_path):
    cfg = tmp_path / "weak.yaml"
    cfg.write_text("scenarios: [{name: weak, n_q: 8, d_head: 8, scale: 0.8, dtype: float32, epsilon: 1.0e-6}]\n")
    result = run("run", cfg, "--negative-controls")
    assert result.exit_code == 1
    assert "MISSED scale on weak" in result.stdout


def test_validate_runs_nothing(root):
    result = run("validate", root / "configs/gqa.yaml")
    assert result.exit_code == 0 and "4 scenario(s) valid" in result.stdout


def test_version():
    """The package's version (the program name alone is printed whatever the version is)."""
    from gradcheck_cli import __version__
    result = run("--version")
    assert result.exit_code == 0 and result.stdout == f"attn-gradcheck, version {__version__}\n"


def test_out_of_memory_is_exit_2_without_a_traceback(root, monkeypatch):
    from gradcheck_cli import checker

    def exhausted(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(checker, "run_scenario", exhausted)
    result = run("run", root / "configs/quickstart.yaml")
    assert result.exit_code == 2 and "ran out of memory" in result.stderr and "Traceback" not in result.stderr


def test_select_deselect_and_the_reproduce_line(root, tmp_path):
    config = str(root / "configs/quickstart.yaml")
    result = run("run", config, "--select", "c*", "--deselect", "cross-*", "--fault", "scale",
                 "--json", tmp_path / "r.json")
    names = [s["name"] for s in json.loads((tmp_path / "r.json").read_text())["scenarios"]]
    assert names == ["causal-self", "cache-gqa"] and result.exit_code == 1
    line = next(l for l in result.stdout.splitlines() if "reproduce:" in l and "cache-gqa" in l)
    again = run(*line.split("reproduce: attn-gradcheck ")[1].split())  # the line runs just that scenario
    assert again.exit_code == 1 and "1 scenario(s)" in again.stdout and "cache-gqa" in again.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["scenarios"][1]["reproduce"].endswith("--select cache-gqa --fault scale")
    none = run("run", config, "--select", "nothing*")
    assert none.exit_code == 2 and "no scenario is left by --select" in none.stderr


def test_validate_takes_several_files_and_reports_each_bad_one(root, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scenarios: [{name: a, n_q: 0, d_head: 2}]\n")
    result = run("validate", root / "configs/gqa.yaml", bad, root / "configs/quickstart.yaml")
    assert result.exit_code == 2 and "4 scenario(s) valid" in result.stdout and "3 scenario(s) valid" in result.stdout
    assert "bad.yaml:1" in result.stderr


def test_pre_commit_hooks_are_well_formed(root):
    import yaml
    hooks = yaml.safe_load((root / ".pre-commit-hooks.yaml").read_text())
    assert {h["id"] for h in hooks} == {"attn-gradcheck-validate", "attn-gradcheck-run"}
    assert all(h["entry"].split()[0] == "attn-gradcheck" and h["language"] == "python" for h in hooks)


# the context-parallel config starts ranks for each of its scenarios (about 30 s here): in the slow set
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if "distributed:" in p.read_text() else p
                                  for p in CONFIGS], ids=lambda p: p.name)
def test_every_shipped_config_writes_its_reports(path, tmp_path):
    """Every shipped config runs through the whole CLI with every report (JSON that parses, JUnit, arrays)."""
    if "backend: torch" in path.read_text() or "distributed:" in path.read_text():
        pytest.importorskip("torch")
    result = run("run", path, "--json", tmp_path / "r.json", "--junit", tmp_path / "r.xml",
                 "--save-arrays", tmp_path / "arrays")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "pass" and data["summary"]["failed"] == 0
    ET.fromstring((tmp_path / "r.xml").read_bytes())
    assert len(list((tmp_path / "arrays").glob("*.npz"))) == len(data["scenarios"])


def test_a_reader_that_goes_away_ends_with_141_not_1(root):
    """`attn-gradcheck run ... | head -1`: 1 would read as "a check failed"; 141 is 128 + SIGPIPE."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "run", str(root / "configs/sweep.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err


def test_ops_lists_every_op_with_the_code_it_accepts_and_an_example_that_runs():
    import yaml

    from gradcheck_cli import checker, scenario
    from gradcheck_cli.ops import OPS
    result = run("ops")
    assert result.exit_code == 0, result.output
    for name, op in OPS.items():
        assert f"\n{name}  {op.summary}" in "\n" + result.stdout
    lines = result.stdout.splitlines()
    accepted = {lines[i - 4].split()[0] for i, line in enumerate(lines) if line.startswith("    your code:")
                and "not accepted" not in line}
    assert accepted == {name for name, op in OPS.items() if op.implementation is not None}
    examples = [line.split("example:", 1)[1].strip() for line in lines if line.startswith("    example:")]
    assert len(examples) == len(OPS)
    for text in examples:  # each printed example is a scenario that loads and passes
        keys = yaml.safe_load(text)
        [sc] = scenario.loads(yaml.safe_dump({"scenarios": [{"name": "ex", **keys}]}))
        assert checker.run_scenario(sc).verdict == "pass", keys


def test_ops_lists_the_attention_variants_with_the_keyword_your_code_is_passed():
    result = run("ops")
    variants = [line for line in result.stdout.splitlines() if line.startswith("    variant:")]
    assert [line.split()[1] for line in variants] == ["softcap:", "bias:", "relative_bias:", "alibi:", "sinks:",
                                                           "dropout:", "varlen:", "outputs:"]
    for line, keyword in zip(variants, ("softcap=", "attn_bias=", "relative_attention_bias=", "alibi_slopes=",
                                        "sinks=", "keep_mask=", "cu_seqlens_q=", "return_lse=True")):
        assert f"your code is passed {keyword}" in line


def test_ops_lists_what_is_not_checked_yet_and_the_loader_refuses_it():
    """Each 'not yet' line of attention is a limit the loader enforces: a bias gradient in half precision, along
    mode jvp, on the torch closed forms, and a stage key on another op, are refused with their key."""
    from gradcheck_cli.errors import ScenarioError
    from gradcheck_cli.scenario import loads
    result = run("ops")
    limits = [line for line in result.stdout.splitlines() if line.startswith("    not yet:")]
    assert len(limits) == 5 and "half precision" in limits[0] and "attention-projections" in limits[1]
    assert "sinks.grad" in limits[0] and "outputs: [o, lse]" in limits[2] and "dropout" in limits[3]
    assert "distributed" in limits[4]
    base = "scenarios:\n  - {name: a, n_q: 3, d_head: 2, bias: {grad: true}, "
    for extra, says in (("check: {mode: jvp}}", "JVP along a bias is not built"),
                        ("backend: torch}", "not the torch closed forms"),
                        ("backend: jax, dtype: bfloat16, implementation: 'jax_attention:attention'}",
                         "checked in float64 and float32, not bfloat16")):
        if any(lib in extra and importlib.util.find_spec(lib) is None for lib in ("jax", "torch")):
            continue  # a backend's scenario is refused first where it is not installed
        with pytest.raises(ScenarioError, match=says):
            loads(base + extra + "\n", base_dir=Path(__file__).resolve().parents[2] / "examples")
    with pytest.raises(ScenarioError, match="does not apply to op attention-projections"):
        loads("scenarios:\n  - {name: p, op: attention-projections, n_q: 3, d_head: 2, d_model: 4, softcap: 2}\n")
    sinks = "scenarios:\n  - {name: a, n_q: 3, d_head: 2, sinks: {grad: true}, "
    for extra, says in (("check: {mode: hvp}}", "HVP along the sinks is not built"),
                        ("backend: torch}", "not the torch closed forms"),
                        ("backend: jax, dtype: float16, implementation: 'jax_attention:attention'}",
                         "not float16 yet")):
        if any(lib in extra and importlib.util.find_spec(lib) is None for lib in ("jax", "torch")):
            continue
        with pytest.raises(ScenarioError, match=says) as caught:
            loads(sinks + extra + "\n", base_dir=Path(__file__).resolve().parents[2] / "examples")
        assert caught.value.key.endswith("sinks.grad")
        fixed = sinks.replace("grad: true", "grad: false")  # fixed sinks: accepted there
        if importlib.util.find_spec("torch") is not None:
            loads(fixed + extra + "\n", base_dir=Path(__file__).resolve().parents[2] / "examples")



def test_a_scenario_left_out_by_select_is_not_refused_for_a_library_this_machine_lacks(monkeypatch, tmp_path):
    """Without torch, --select/--deselect run the NumPy scenarios of a file that also has torch ones; a selected
    scenario that needs it is still refused (exit 2), and so is any other problem of a scenario left out."""
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    cfg = tmp_path / "t.yaml"
    cfg.write_text("scenarios:\n  - {name: mine, n_q: 3, d_head: 2}\n  - {name: mine-torch, n_q: 3, d_head: 2, "
                   "backend: torch}\n  - {name: mine-half, n_q: 3, d_head: 2, backend: torch, dtype: float16}\n")
    for args, code in ((["--select", "mine"], 0), (["--deselect", "mine-*"], 0), ([], 2),
                       (["--select", "mine-torch"], 2), (["--select", "mine*"], 2)):
        result = run("run", str(cfg), *args)
        assert result.exit_code == code, (args, result.output)
        assert "Traceback" not in result.output
    assert "scenarios[1].backend: this scenario needs torch" in run("run", str(cfg), "--select", "mine*").stderr
    cfg.write_text("scenarios:\n  - {name: mine, n_q: 3, d_head: 2}\n  - {name: other, n_q: 3, d_head: 2, "
                   "batch: -1}\n")
    result = run("run", str(cfg), "--select", "mine")
    assert result.exit_code == 2 and "scenarios[1].batch" in result.stderr


def test_a_cuda_scenario_left_out_by_select_is_not_refused_on_a_machine_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = tmp_path / "t.yaml"
    cfg.write_text("scenarios:\n  - {name: mine, n_q: 3, d_head: 2, backend: torch}\n"
                   "  - {name: gpu, n_q: 3, d_head: 2, backend: torch, device: cuda}\n")
    for args, code in ((["--select", "mine"], 0), (["--deselect", "gpu"], 0), ([], 2), (["--select", "gpu"], 2)):
        result = run("run", str(cfg), *args)
        assert result.exit_code == code, (args, result.output)
        assert "Traceback" not in result.output
    assert "no CUDA device" in run("run", str(cfg)).output
