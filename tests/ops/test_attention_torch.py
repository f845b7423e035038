"""backend: torch: the engine's formulas on torch tensors, autograd and SDPA as second and third
opinions, and the low-precision policy. Skips cleanly where torch is not installed."""
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import assume, given, settings

from gradcheck_cli import checker
from gradcheck_cli.cli import main
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops import attention as engine
from gradcheck_cli.scenario import load as load_file

from helpers import examples, make
from strategies import scenarios, valid_or_none

torch = pytest.importorskip("torch")
from gradcheck_cli.ops.attention import torch_engine as torch_backend  # noqa: E402

GQA = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=8, d_head=8, scale=0.4,
           mask={"causal": "lower-right", "key_lengths": [8, 6]})


@settings(max_examples=examples(0.6))
@given(scenarios())
def test_torch_formulas_match_the_numpy_engine_and_every_check_passes(keys):
    sc = valid_or_none({**keys, "backend": "torch"})
    assume(sc is not None)
    inputs, g = engine.seeded_inputs(sc)
    kv = np.array(sc.kv_map)
    ref = engine.backward(*(inputs[t] for t in "qkv"), sc.visible, sc.scale, kv, g)
    t = [torch.from_numpy(inputs[n]) for n in "qkv"]
    got = torch_backend.backward(*t, torch.from_numpy(sc.visible), sc.scale, torch.tensor(sc.kv_map),
                                 torch.from_numpy(g))
    for mine, theirs in zip(got, (ref.q, ref.k, ref.v)):
        np.testing.assert_allclose(mine.numpy(), theirs, rtol=1e-10, atol=1e-12)
    result = checker.run_scenario(sc)
    names = {c.name for c in result.checks}
    assert {"autograd agrees", "SDPA agrees"} <= names
    assert result.passed, [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_policy_reports_both_errors_and_the_factor(dtype):
    sc = make(**GQA, backend="torch", dtype=dtype, check={"factor": 2.0})
    all_checks = checker.run_scenario(sc).checks
    checks = [c for c in all_checks if c.kind == "reference"]
    assert [c.tensor for c in checks] == ["o", "q", "k", "v"]
    assert {c.name for c in all_checks if c.kind == "invariant"} >= {"unseen K/V rows get zero gradient",
                                                                       "hidden K/V rows do not change O"}
    assert all(c.passed for c in all_checks)
    for c in checks:
        assert c.name == "low-precision error within factor of plain" and c.passed
        assert "plain" in c.detail and "2 x plain" in c.detail
    # a factor below 1 demands beating the plain implementation: some tensor then fails
    strict = make(**GQA, backend="torch", dtype=dtype, check={"factor": 0.01, "slack": 0.0})
    assert not checker.run_scenario(strict).passed


def test_ml_dtypes_missing_is_found_at_load_before_anything_runs(monkeypatch, tmp_path):
    """bfloat16 with a torch implementation needs ml_dtypes: ``validate`` and ``run`` refuse the file at once (exit
    2, the scenario's dtype key), not after the scenarios before it ran, and no report is written."""
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    examples = Path(__file__).resolve().parents[2] / "examples"
    cfg = tmp_path / "t.yaml"
    cfg.write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2}\n"
                   "  - {name: b, n_q: 3, d_head: 2, backend: torch, dtype: bfloat16, implementation: "
                   "'torch_attention:attention'}\n")
    monkeypatch.syspath_prepend(str(examples))
    for command in (["validate", str(cfg)], ["run", str(cfg), "--json", str(tmp_path / "r.json")]):
        result = CliRunner().invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "scenarios[1].dtype" in result.stderr and "ml_dtypes" in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "r.json").exists()


def test_torch_missing_is_input_error_with_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    cfg = tmp_path / "t.yaml"
    cfg.write_text("scenarios:\n  - {name: a, n_q: 3, d_head: 2, backend: torch}\n")
    with pytest.raises(ScenarioError, match="pip install 'attn-gradcheck\\[torch\\]'"):
        make(n_q=3, d_head=2, backend="torch")
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2 and "not installed" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ScenarioError, match="no CUDA device"):
        make(n_q=3, d_head=2, backend="torch", device="cuda")




def test_the_shipped_torch_examples(root):
    from gradcheck_cli import scenario
    results = {r.name: r for r in (checker.run_scenario(sc) for sc in scenario.load(root / "examples/torch.yaml"))}
    for name in ("torch-mine-float64", "torch-mine-float32", "torch-mine-bfloat16"):
        assert results[name].passed, [(c.name, c.detail) for c in results[name].checks if not c.passed]
    broken64 = {(c.name, c.tensor) for c in results["torch-broken-float64"].checks if not c.passed}
    assert {("gradient q", "q"), ("gradient k", "k")} <= broken64 and ("gradient v", "v") not in broken64
    broken16 = {(c.name, c.tensor) for c in results["torch-broken-float16"].checks if not c.passed}
    assert ("low-precision error within factor of plain", "q") in broken16


@pytest.mark.parametrize("body,words", [
    ("def f(q, k, v, visible, scale, kv_map):\n    raise RuntimeError('no kernel')\n",
     "forward raised RuntimeError: no kernel"),
    ("def f(q, k, v, visible, scale, kv_map):\n    return attention(q, k, v, visible, scale, kv_map)[..., :1]\n",
     "of shape"),
    ("def f(q, k, v, visible, scale, kv_map):\n    return attention(q, k, v, visible, scale, kv_map).float()\n",
     "dtype torch.float32, expected torch.float64"),
    ("def f(q, k, v, visible, scale, kv_map):\n    return attention(q, k, v, visible, scale, kv_map).detach()\n",
     "does not require grad"),
    ("def f(q, k, v, visible, scale, kv_map):\n    o = attention(q, k, v, visible, scale, kv_map)\n"
     "    return o * float('nan') if o.shape[0] > 2 else o\n",
     "while differencing its forward: forward returned a non-finite o"),  # NaN only on stacked copies
    ("def f(q, k, v, visible, scale, kv_map):\n    o = attention(q, k, v, visible, scale, kv_map).clone()\n"
     "    o[0, 0, 0, 0] = float('inf')\n    return o\n", "non-finite o: inf at o[0, 0, 0, 0]"),
    ("def f(q, k, v, visible, scale, kv_map):\n    return [attention(q, k, v, visible, scale, kv_map)]\n",
     "must return a torch.Tensor"),
    ("def f(q, k, v, visible, scale, kv_map):\n    raise SystemExit(3)\n", "forward raised SystemExit: 3"),
    # in place on stacked copies only: the unmoved inputs and the mask are stacked for the call without a
    # clone and checked against what they were stacked from; the moved input is cloned and compared
    ("def f(q, k, v, visible, scale, kv_map):\n    o = attention(q, k, v, visible, scale, kv_map)\n"
     "    if q.shape[0] > 2:\n        k.mul_(1.001)\n    return o\n", "forward changed its argument k in place"),
    ("def f(q, k, v, visible, scale, kv_map):\n    o = attention(q, k, v, visible, scale, kv_map)\n"
     "    if q.shape[0] > 2:\n        visible[-1].fill_(False)\n    return o\n",
     "forward changed its argument visible in place"),
    ("def f(q, k, v, visible, scale, kv_map):\n    o = attention(q, k, v, visible, scale, kv_map)\n"
     "    if q.shape[0] > 2:\n        q[-1].zero_()\n    return o\n", "forward changed its argument q in place"),
    ("def f(q, k, v, visible, scale, kv_map):\n    return attention(q, k, v, visible, scale, kv_map).to('meta')\n",
     "returned o as a torch.strided tensor on meta; expected a dense (strided) tensor on cpu"),
    ("def f(q, k, v, visible, scale, kv_map):\n    return attention(q, k, v, visible, scale, kv_map).to_sparse()\n",
     "returned o as a torch.sparse_coo tensor"),
])
def test_misbehaving_torch_implementations(root, tmp_path, monkeypatch, body, words):
    monkeypatch.syspath_prepend(str(root / "examples"))
    module = f"timpl_{abs(hash(body)) % 10**8}"
    (tmp_path / f"{module}.py").write_text("from torch_attention import attention\n" + body)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"scenarios:\n  - {{name: t, backend: torch, n_q: 4, d_head: 3, batch: 2, "
                   f"implementation: '{module}:f'}}\n")
    (sc,) = load_file(cfg)
    result = checker.run_scenario(sc)
    assert result.verdict == "fail" and any(words in c.detail for c in result.checks), \
        [(c.name, c.detail) for c in result.checks if not c.passed]
    # the hints read what the checks found (Check.facts), not their text: NaN on the stacked copies alone
    assert any("only on perturbed copies" in h for h in result.hints) == ("o.shape[0] > 2" in body), result.hints
    if "no kernel" in body:  # and once through the command, in its worker process
        cli = CliRunner().invoke(main, ["run", str(cfg)])
        assert "Traceback" not in cli.output and cli.exit_code == 1 and words in cli.stdout, cli.stdout


def test_a_torch_implementation_must_be_callable(root, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(root / "examples"))  # my_attention on the import path, the YAML elsewhere
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenarios:\n  - name: t\n    backend: torch\n    n_q: 3\n    d_head: 2\n"
                   "    implementation: my_attention:attention\n")
    result = CliRunner().invoke(main, ["run", str(cfg)])
    assert result.exit_code == 2 and "must be callable" in result.stderr and ":6:" in result.stderr
