"""Hostile inputs, second round (issue 22, items 7 to 11): input nested deep enough to break a recursive
reader, modules with frozen parameters that cannot be reduced, merged reports that repeat a key or whose
shards are missing, SIGTERM outside 'run', a recipe whose library is absent and array files whose names
the file system cannot hold. Each is bad input with one message (exit 2) or a pass, never a traceback."""
import fcntl
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from click.testing import CliRunner

from gradcheck_cli import checker, scenario
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.implementation import install_line, modules

from helpers import ROOT

SWIGLU = {"name": "m", "op": "swiglu", "n": 3, "d_model": 4, "d_ff": 6}

FROZEN_TORCH = '''
import torch
import torch.nn.functional as F


class SwiGLU(torch.nn.Module):
    def __init__(self, d_model, d_ff, extra):
        super().__init__()
        self.gate = torch.nn.Linear(d_model, d_ff, bias=False)
        self.up = torch.nn.Linear(d_model, d_ff, bias=False)
        self.down = torch.nn.Linear(d_ff, d_model, bias=False)
        if "empty" in extra:
            self.unused = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        if "sparse" in extra:
            self.table = torch.nn.Parameter(torch.eye(3).to_sparse(), requires_grad=False)
        if "csr" in extra:
            self.csr = torch.nn.Parameter(torch.eye(3).to_sparse_csr(), requires_grad=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def empty(d_model, d_ff):
    return SwiGLU(d_model, d_ff, ("empty",))


def sparse(d_model, d_ff):
    return SwiGLU(d_model, d_ff, ("sparse", "csr"))


def both(d_model, d_ff):
    return SwiGLU(d_model, d_ff, ("empty", "sparse"))
'''


def _module_row(result):
    (row,) = [c for c in result.checks if c.name == "module parameters"]
    return row.detail


@pytest.mark.parametrize("factory, listed", [
    ("empty", ["unused (empty, [0])"]),
    ("sparse", ["table (sparse_coo, [3, 3], not inspected)", "csr (sparse_csr, [3, 3], not inspected)"]),
    ("both", ["unused (empty, [0])", "table (sparse_coo, [3, 3], not inspected)"]),
])
def test_a_correct_torch_module_with_frozen_empty_or_sparse_parameters_passes_and_lists_them(
        tmp_path, factory, listed):
    pytest.importorskip("torch")
    (tmp_path / "frozen_mods.py").write_text(FROZEN_TORCH)
    doc = {**SWIGLU, "backend": "torch", "implementation": {
        "factory": f"frozen_mods:{factory}", "weights": {"gate.weight": "w1.T", "up.weight": "w3.T",
                                                         "down.weight": "w2.T"}}}
    sc = scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    detail = _module_row(result)
    assert detail.endswith("frozen (kept as the factory built them, not checked): " + ", ".join(listed)), detail
    assert not result.hints


FROZEN_JAX = '''
import jax.numpy as jnp
from jax.experimental import sparse


def swiglu(x, w1, w3, w2):
    import jax
    return (jax.nn.silu(x @ w1) * (x @ w3)) @ w2


def with_params(d_model, d_ff):
    params = {"mlp": {"gate": jnp.zeros((d_model, d_ff)), "up": jnp.zeros((d_model, d_ff)),
                      "down": jnp.zeros((d_ff, d_model))},
              "unused": jnp.zeros((0, 4)), "table": sparse.BCOO.fromdense(jnp.eye(3)), "name": "mlp"}
    return (lambda p, x: swiglu(x, p["mlp"]["gate"], p["mlp"]["up"], p["mlp"]["down"])), params
'''


@pytest.mark.slow  # JAX compiles the module: the same listing (modules.frozen) runs by default on the torch module
def test_a_jax_params_pytree_with_empty_sparse_and_non_array_leaves_passes_and_lists_them(tmp_path):
    pytest.importorskip("jax")
    (tmp_path / "frozen_jax.py").write_text(FROZEN_JAX)
    doc = {**SWIGLU, "backend": "jax", "implementation": {
        "factory": "frozen_jax:with_params", "weights": {"mlp.gate": "w1", "mlp.up": "w3", "mlp.down": "w2"}}}
    sc = scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0]
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert _module_row(result).endswith(
        "frozen (kept as the factory built them, not checked): unused (empty, [0, 4]), "
        "table (BCOO, not inspected), name (str, not inspected)"), _module_row(result)
    assert not result.hints


def test_a_frozen_nonzero_parameter_beside_an_empty_one_is_still_named_in_the_hint(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "frozen_bias.py").write_text(FROZEN_TORCH + textwrap.dedent('''
        def biased(d_model, d_ff):
            m = SwiGLU(d_model, d_ff, ("empty", "sparse"))
            m.down = torch.nn.Linear(d_ff, d_model, bias=True)
            return m
        '''))
    doc = {**SWIGLU, "backend": "torch", "implementation": {
        "factory": "frozen_bias:biased", "weights": {"gate.weight": "w1.T", "up.weight": "w3.T",
                                                     "down.weight": "w2.T"}}}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0])
    assert "forward agrees with the reference" in {c.name for c in result.checks if not c.passed}
    (hint,) = [h for h in result.hints if "not zero" in h]
    assert "(down.bias)" in hint


# -- item 7: input nested deep enough to break a recursive reader: bad input, with file, line and key

MLP_YAML = """scenarios:
  - name: m
    op: swiglu
    n: 3
    d_model: 4
    d_ff: 6
    backend: torch
    implementation:
      factory: "torch_ops:SwiGLU"
      weights:
        gate.weight: "{gate}"
        up.weight: w3.T
        down.weight: w2.T
"""


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _error(result) -> str:
    """The one error line of a command (stderr may also hold warnings of libraries other tests imported)."""
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    return line


@pytest.mark.parametrize("depth", [33, 3000])
def test_a_weights_expression_nested_deep_is_bad_input_naming_file_line_and_key(tmp_path, depth):
    pytest.importorskip("torch")
    (tmp_path / "torch_ops.py").write_text((ROOT / "examples" / "torch_ops.py").read_text())
    cfg = tmp_path / "deep.yaml"
    cfg.write_text(MLP_YAML.format(gate="concat(" * depth + "w1.T" + ")" * depth))
    for command in ("validate", "run"):
        result = _cli(command, cfg)
        assert result.exit_code == 2, result.output
        line = _error(result)
        assert line.startswith(f"error: {cfg}:11: scenarios[0].implementation.weights.gate.weight: concat( is "
                               "nested more than 32 deep in 'concat(concat("), line
        assert len(line) < 400  # the expression is not repeated back whole
    with pytest.raises(ScenarioError) as err:
        scenario.load(cfg)
    assert (err.value.line, err.value.key) == (11, "scenarios[0].implementation.weights.gate.weight")


def test_an_expression_nested_within_the_bound_still_parses():
    e = modules.parse_expr("concat(" * modules.MAX_DEPTH + "w1" + ")" * modules.MAX_DEPTH + ".T")
    assert e.tensors() == ("w1",) and e.transpose


@pytest.mark.parametrize("depth", [65, 900, 990])
def test_yaml_nested_deeper_than_the_bound_is_refused_at_its_line_and_key(depth):
    text = "scenarios:\n  - name: a\n    n_q: 3\n    d_head: 2\n    x-junk: " + "[" * depth + "]" * depth + "\n"
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="deep.yaml")
    assert (err.value.file, err.value.line) == ("deep.yaml", 5)
    assert err.value.key == "scenarios[0].x-junk[0][0][0][0][0]..."
    assert "nested more than 64 levels deep" in err.value.message


def test_yaml_nested_by_block_mappings_is_refused_at_the_line_that_goes_too_deep():
    text = "scenarios:\n  - name: a\n    n_q: 3\n    d_head: 2\n    x-junk:\n" + "".join(
        "  " * (i + 3) + "k:\n" for i in range(70)) + "  " * 73 + "1\n"
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="deep.yaml")
    assert err.value.line == 5 + 63 and err.value.key == "scenarios[0].x-junk.k.k.k.k.k..."


def test_yaml_deeper_than_libyamls_own_bound_says_the_same():
    text = "scenarios:\n  - name: a\n    n_q: 3\n    d_head: 2\n    x-junk: " + "[" * 3000 + "]" * 3000 + "\n"
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="deep.yaml")
    assert err.value.line == 5 and "nested more than 64 levels deep" in err.value.message


def test_deep_yaml_without_libyaml_is_refused_with_its_line(monkeypatch):
    """PyYAML's pure-Python composer recurses per level: its RecursionError is bad input, at the line
    where the document first nests too deep."""
    monkeypatch.delattr(yaml, "CSafeLoader", raising=False)
    text = "scenarios:\n  - name: a\n    n_q: 3\n    d_head: 2\n    x-junk:\n      " + "[" * 5000 + "]" * 5000 + "\n"
    with pytest.raises(ScenarioError) as err:
        scenario.loads(text, file="deep.yaml")
    assert err.value.line == 6 and "nested more than 64 levels deep" in err.value.message


def test_a_shipped_inline_mask_in_a_sweep_is_well_within_the_bound():
    text = ("scenarios:\n  - name: a\n    n_q: 2\n    d_head: 2\n    sweep:\n      mask.visible:\n"
            "        - [[[[true, true], [true, true]]]]\n        - [[[[true, false], [true, true]]]]\n")
    assert len(scenario.loads(text)) == 2


# -- item 9: merge refuses duplicate keys and deep nesting, and names the shards that are missing

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Both shards of configs/quickstart.yaml (1/2, 2/2) and shard 1/2 of a copy under another name."""
    folder = tmp_path_factory.mktemp("shards")
    configs = folder / "configs"
    configs.mkdir()
    for name in ("quickstart.yaml", "other.yaml"):
        (configs / name).write_text((ROOT / "configs" / "quickstart.yaml").read_text())
    out = {}
    for config, shard in (("quickstart", 1), ("quickstart", 2), ("other", 1)):
        path = folder / f"{config}-{shard}.json"
        result = _cli("run", configs / f"{config}.yaml", "--shard", f"{shard}/2", "--json", path)
        assert result.exit_code == 0, result.output
        out[config, shard] = path
    return out


def test_merging_both_shards_passes(shards):
    result = _cli("merge", shards["quickstart", 1], shards["quickstart", 2])
    assert result.exit_code == 0, result.output


def test_a_key_given_twice_is_refused_naming_the_key_the_file_and_the_line(shards, tmp_path):
    text = shards["quickstart", 1].read_text()
    data = json.loads(text)
    assert data["verdict"] == "pass"
    at = text.index('"verdict": "pass"')  # the run's verdict, at the top level
    forged = text[:at] + '"verdict": "fail",\n  ' + text[at:]
    (tmp_path / "dup.json").write_text(forged)
    result = _cli("merge", tmp_path / "dup.json", shards["quickstart", 2])
    assert result.exit_code == 2
    line = forged[:at].count("\n") + 2  # the second "verdict", on the line after the forged one
    assert _error(result) == (f"error: {tmp_path / 'dup.json'}:{line}: the key \"verdict\" is given twice in one "
                              "object: a report never repeats a key (readers differ on which value wins); use the "
                              "report the run wrote")


def test_a_key_given_twice_inside_a_check_names_the_check(shards, tmp_path):
    text = shards["quickstart", 1].read_text()
    first_check = text.index('"kind"')
    at = text.index('"passed"', first_check)
    (tmp_path / "dup.json").write_text(text[:at] + '"passed": false, ' + text[at:])
    result = _cli("merge", tmp_path / "dup.json")
    assert result.exit_code == 2 and "Traceback" not in result.output
    name = json.loads(text)["scenarios"][0]["checks"][0]["name"]
    assert f"the key \"passed\" is given twice in one object (in the object named \"{name}\")" in result.stderr


@pytest.mark.parametrize("depth", [33, 985, 5000])
def test_a_report_nested_deep_is_one_line_and_exit_2(shards, tmp_path, depth):
    data = json.loads(shards["quickstart", 1].read_text())
    data["scenarios"][0]["checks"][0]["diagnosis"] = None
    text = json.dumps(data).replace('"diagnosis": null', '"diagnosis": ' + "[" * depth + "]" * depth, 1)
    (tmp_path / "deep.json").write_text(text)
    result = _cli("merge", tmp_path / "deep.json")
    assert result.exit_code == 2
    line = _error(result)
    assert line.startswith(f"error: {tmp_path / 'deep.json'}: not an attn-gradcheck JSON report (nested more than "
                           "32 levels deep"), line
    if depth < 900:  # decoded, then measured: the place is named
        assert "at scenarios[0].checks[0].diagnosis[0]..." in line


def test_a_missing_shard_is_named_within_n(shards):
    result = _cli("merge", shards["quickstart", 1])
    assert result.exit_code == 2
    config = json.loads(shards["quickstart", 1].read_text())["config"]
    assert _error(result) == f"error: shard 2/2 of {config} missing (given: 1/2); merge every shard of the run"


def test_shards_of_different_configs_say_so(shards):
    result = _cli("merge", shards["quickstart", 1], shards["other", 1])
    assert result.exit_code == 2
    assert "3/2" not in result.stderr and result.stderr.startswith("error: shard 2/2 of ")
    assert "the reports are of 2 configs" in result.stderr and "the shards of one run share its config" in result.stderr
    assert str(shards["quickstart", 1]) in result.stderr and str(shards["other", 1]) in result.stderr


def test_many_missing_shards_are_counted_not_listed(shards, tmp_path):
    data = json.loads(shards["quickstart", 1].read_text())
    data["shard"]["count"] = 10**9
    (tmp_path / "wide.json").write_text(json.dumps(data))
    result = _cli("merge", tmp_path / "wide.json")
    assert result.exit_code == 2
    assert (f"shards 2/{10**9}, 3/{10**9}, 4/{10**9}, 5/{10**9}, 6/{10**9} and 999,999,994 more of "
            in result.stderr), result.stderr
    data["shard"]["index"] = 3
    data["shard"]["count"] = 2
    (tmp_path / "above.json").write_text(json.dumps(data))
    result = _cli("merge", tmp_path / "above.json")
    assert result.exit_code == 2 and "shard 3/2: there is no such shard (index above count)" in result.stderr


# -- item 10: SIGTERM ends merge and sweep-eps with 143, as it ends run

F_SETPIPE_SZ = 1031  # Linux's fcntl: the pipe's capacity


def _sigterm_while_writing_to_a_fifo(tmp_path, *args):
    """Run the command with ``--json`` a FIFO whose reader holds it open with a one-page buffer and never
    reads: once the first bytes arrive the command is demonstrably writing, and cannot finish (its output
    is longer than the buffer) until it is signalled."""
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, F_SETPIPE_SZ, 4096)
        proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", *map(str, args), "--json", str(fifo)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            ready, _, _ = select.select([reader], [], [], 300)
            assert ready, "the command never started writing"
            proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=120)[1]
        finally:
            proc.kill()
            proc.wait()
    finally:
        os.close(reader)
    return proc.returncode, err


@pytest.mark.slow  # subprocesses, signalled
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_sigterm_while_merge_writes_exits_143(shards, tmp_path):
    code, err = _sigterm_while_writing_to_a_fifo(tmp_path, "merge", shards["quickstart", 1], shards["quickstart", 2])
    assert code == 143 and "Traceback" not in err, err
    assert err.startswith("terminated while writing the reports; "), err


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_sigterm_while_sweep_eps_writes_exits_143(tmp_path):
    code, err = _sigterm_while_writing_to_a_fifo(tmp_path, "sweep-eps", ROOT / "configs" / "quickstart.yaml",
                                                 "--select", "causal-self", "--steps", "1e-1:1e-12:4")
    assert code == 143 and "Traceback" not in err, err
    assert err.startswith("terminated while writing the outputs; "), err


HANGS = '''
import os, sys, time
sys.path.insert(0, {examples!r})
from my_attention import Attention


class Impl(Attention):
    @staticmethod
    def forward(*args):
        with open({marker!r} + ".tmp", "w") as fh:
            fh.write(str(os.getpid()))
        os.replace({marker!r} + ".tmp", {marker!r})
        while True:
            time.sleep(0.05)


impl = Impl()
'''


@pytest.mark.slow
def test_sigterm_while_sweep_eps_sweeps_exits_143(tmp_path):
    """The implementation writes a file once it runs (in its worker), then hangs: sweep-eps is then
    demonstrably sweeping, and SIGTERM ends it with 143."""
    marker = tmp_path / "started"
    (tmp_path / "hangs.py").write_text(HANGS.format(examples=str(ROOT / "examples"), marker=str(marker)))
    (tmp_path / "h.yaml").write_text('scenarios:\n  - {name: h, n_q: 2, d_head: 2, implementation: "hangs:impl"}\n')
    proc = subprocess.Popen([sys.executable, "-m", "gradcheck_cli", "sweep-eps", str(tmp_path / "h.yaml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(6000):  # polls for the file (at most 10 minutes: never a verdict on time)
            if marker.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert marker.exists(), proc.communicate()[1]
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "terminated"


def test_every_way_sigterm_reaches_the_console_is_143(monkeypatch, capsys):
    """Terminated as itself, wrapped in click's Abort (what click makes of a KeyboardInterrupt outside
    'run'), or as the cause of the reports' writer's ReportsInterrupted; a plain Ctrl-C stays 130."""
    import click

    from gradcheck_cli import console
    from gradcheck_cli.errors import ReportsInterrupted, Terminated
    codes = []
    monkeypatch.setattr(console.os, "_exit", lambda code: codes.append(code))

    def wrapped(inner):
        try:
            raise inner
        except KeyboardInterrupt as e:
            abort = click.exceptions.Abort()
            abort.__context__ = e
            return abort
    for exc in (Terminated(), wrapped(Terminated()), wrapped(ReportsInterrupted([], [], True)),
                KeyboardInterrupt(), wrapped(KeyboardInterrupt()), click.exceptions.Abort()):
        console._stopped(exc)
    assert codes == [143, 143, 143, 130, 130, 130]


# -- item 11: a recipe whose library is absent names it and its install line; over-long array names

def test_a_module_importing_an_absent_library_names_it_and_its_pip_line(tmp_path):
    (tmp_path / "needs_lib.py").write_text("import definitely_absent_lib_22\n")
    (tmp_path / "fallback_lib.py").write_text(textwrap.dedent('''
        import importlib.util
        try:
            from definitely_absent_lib_22.layers import Attention
        except ImportError:  # a fallback that assumes the library is there (timm_vit.py's, before)
            Attention = importlib.util.find_spec("definitely_absent_lib_22").submodule_search_locations
        '''))
    for module, then in (("needs_lib", ""), ("fallback_lib", " (the module then raised AttributeError: 'NoneType' "
                                                            "object has no attribute 'submodule_search_locations')")):
        (tmp_path / f"{module}.yaml").write_text(f'scenarios:\n  - {{name: a, n_q: 2, d_head: 2, '
                                                 f'implementation: "{module}:impl"}}\n')
        result = _cli("run", tmp_path / f"{module}.yaml")
        assert result.exit_code == 2
        assert _error(result) == (f"error: {tmp_path / f'{module}.yaml'}:2: scenarios[0].implementation: cannot "
                                  f"import '{module}': it needs the library definitely_absent_lib_22, which is not "
                                  f"installed here: pip install definitely-absent-lib-22{then}")


@pytest.mark.parametrize("library, line", [("timm", "pip install timm"), ("sklearn", "pip install scikit-learn"),
                                           ("cv2", "pip install opencv-python"), ("PIL", "pip install Pillow"),
                                           ("x_transformers", "pip install x-transformers"),
                                           ("torch", "pip install 'attn-gradcheck[torch]'")])
def test_import_names_map_to_their_pip_names(library, line):
    assert install_line(library) == line


def test_the_timm_recipe_without_timm_names_timm_and_its_pip_line():
    if importlib.util.find_spec("timm") is not None:
        pytest.skip("timm is installed")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the recipe needs torch")  # refused before its module is imported
    result = _cli("run", ROOT / "examples" / "recipes" / "timm_vit.yaml")
    assert result.exit_code == 2
    line = _error(result)
    assert line.endswith("cannot import 'timm_vit': it needs the library timm, which is not installed here: "
                         "pip install timm"), line


@pytest.mark.parametrize("sweep", [False, True])
def test_save_arrays_with_a_scenario_name_too_long_for_the_file_system_is_refused_before_the_run(tmp_path, sweep):
    name = "a" * (200 if sweep else 252)  # 252 + ".npz": one byte over NAME_MAX (255); a sweep adds its case
    doc = {"scenarios": [{"name": name, "n_q": 2, "d_head": 2,
                          **({"sweep": {"seed": [10**60, 10**60 + 1]}} if sweep else {})}]}
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(doc))
    result = _cli("run", tmp_path / "long.yaml", "--save-arrays", tmp_path / "arrays", "--json", tmp_path / "r.json")
    assert result.exit_code == 2, result.output
    line = _error(result)
    assert line.startswith("error: --save-arrays (aaaaaaaaaa") and "Traceback" not in result.output
    assert "the file name is" in line and "this file system allows 255" in line and "nothing has run" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.yaml"]  # nothing written, no folder made


def test_a_report_path_longer_than_the_system_allows_is_refused_before_the_run(tmp_path):
    deep = tmp_path.joinpath(*["d"] * 2100) / "r.json"
    result = _cli("run", ROOT / "configs" / "quickstart.yaml", "--json", deep)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "the path is" in result.stderr and "this system allows 4095" in result.stderr
