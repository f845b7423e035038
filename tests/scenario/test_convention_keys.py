"""The loader's side of the ``convention:`` keys and of ``kv_map: contiguous | interleaved``: values,
defaults, and every bad input refused naming its file, line and key (no traceback; the CLI exits 2)."""
import subprocess
import sys
from pathlib import Path

import pytest

from gradcheck_cli.ops.convention import Convention

from helpers import ROOT, assert_rejected, make

TESTS = str(Path(__file__).resolve().parent.parent)
IMPL = "convention_attention:bnhd"


def _yaml(*lines: str, implementation: bool = True) -> str:
    head = ["scenarios:", "  - name: s", "    n_q: 4", "    d_head: 4", "    heads_q: 4", "    heads_kv: 2"]
    if implementation:
        head.append(f"    implementation: {IMPL}")
    return "\n".join(head + list(lines)) + "\n"


def test_the_defaults_are_the_tools_own_convention():
    sc = make(n_q=4, d_head=4, implementation=IMPL)
    assert sc.convention == Convention() == Convention("bhnd", "keep", "per-head", "passed")
    assert sc.convention.changes() == {}


def test_each_key_is_read():
    sc = make(n_q=4, d_head=4, heads_q=4, heads_kv=2, implementation=IMPL,
              convention={"layout": "bnhd", "mask": "additive-min", "mask_heads": "shared", "scale": "omitted"})
    assert sc.convention == Convention("bnhd", "additive-min", "shared", "omitted")
    assert sc.convention.names() == ("q", "k", "v", "visible", "kv_map")
    assert sc.convention.shape((2, 4, 5, 8)) == (2, 5, 4, 8)


@pytest.mark.parametrize("value,expected", [("interleaved", (0, 1, 0, 1)), ("contiguous", (0, 0, 1, 1))])
def test_kv_map_by_name(value, expected):
    sc = make(n_q=4, d_head=4, heads_q=4, heads_kv=2, kv_map=value)
    assert sc.kv_map == expected and sc.heads_kv == 2


def test_kv_map_by_name_needs_heads_kv_to_divide_heads_q():
    assert_rejected("scenarios:\n  - name: s\n    n_q: 4\n    d_head: 4\n    heads_q: 4\n    heads_kv: 3\n"
                    "    kv_map: interleaved\n", 6, "scenarios[0].heads_kv", "3 does not divide heads_q=4")


def test_a_misspelled_kv_map_name_is_refused():
    assert_rejected("scenarios:\n  - name: s\n    n_q: 4\n    d_head: 4\n    kv_map: interleave\n", 5,
                    "scenarios[0].kv_map", "expected a list of KV head indices or one of contiguous, interleaved")


@pytest.mark.parametrize("key,value,words", [
    ("layout", "bshd", "expected one of bhnd, bnhd; got 'bshd'"),
    ("mask", "bool", "expected one of keep, drop, additive, additive-min; got 'bool'"),
    ("mask_heads", "per_head", "did you mean 'per-head'?"),
    ("scale", True, "expected one of passed, omitted; got True"),
])
def test_a_bad_value_names_its_key(key, value, words):
    shown = "true" if value is True else value
    assert_rejected(_yaml("    convention:", f"      {key}: {shown}"), 9, f"scenarios[0].convention.{key}", words)


def test_an_unknown_convention_key_gets_a_suggestion():
    assert_rejected(_yaml("    convention: {layuot: bnhd}"), 8, "scenarios[0].convention.layuot",
                    "unknown key 'layuot'")


def test_convention_needs_an_implementation():
    assert_rejected(_yaml("    convention: {layout: bnhd}", implementation=False), 7,
                    "scenarios[0].convention.layout", "applies to a scenario with an implementation")


def test_convention_in_defaults_applies_only_where_there_is_an_implementation():
    text = ("defaults:\n  convention: {mask: drop}\nscenarios:\n  - name: a\n    n_q: 4\n    d_head: 4\n"
            f"  - name: b\n    n_q: 4\n    d_head: 4\n    implementation: {IMPL}\n")
    from gradcheck_cli import scenario
    a, b = scenario.loads(text, base_dir=TESTS)
    assert a.convention == Convention() and b.convention.mask == "drop"


def test_convention_is_a_key_of_attention_and_the_layers_only():
    assert_rejected("scenarios:\n  - name: s\n    op: rmsnorm\n    batch: 2\n    n: 3\n    d_model: 4\n"
                    "    convention: {layout: bnhd}\n", 7, "scenarios[0].convention.layout",
                    "does not apply to op rmsnorm (it is a key of attention, attention-projections, block)")


def test_a_shared_mask_needs_every_head_to_see_the_same_keys():
    visible = [[[[True] * 4] * 4, [[True, True, True, False]] * 4]]  # [1, 2, 4, 4]: head 1 hides key 3
    text = ("scenarios:\n  - name: s\n    n_q: 4\n    d_head: 4\n    heads_q: 2\n"
            f"    implementation: {IMPL}\n    mask: {{visible: {visible}}}\n"
            "    convention: {mask_heads: shared}\n").replace("True", "true").replace("False", "false")
    assert_rejected(text, 8, "scenarios[0].convention.mask_heads",
                    "the visible set differs between heads (batch 0, head 1, query row 0")
    ok = text.replace(", false]", ", true]")
    from gradcheck_cli import scenario
    assert scenario.loads(ok, base_dir=TESTS)[0].convention.mask_heads == "shared"


def test_an_omitted_scale_must_be_the_default_one():
    assert_rejected(_yaml("    scale: 0.25", "    convention: {scale: omitted}"), 9,
                    "scenarios[0].convention.scale", "uses 1/sqrt(d_head) = 0.5 itself, but the scenario's scale is "
                    "0.25")
    sc = make(n_q=4, d_head=4, scale=0.5, implementation=IMPL, convention={"scale": "omitted"})
    assert sc.convention.scale == "omitted" and sc.scale == 0.5


def test_the_cli_reports_a_bad_key_without_a_traceback_and_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(_yaml("    convention: {mask: bool}").replace(f"implementation: {IMPL}",
                                                                      "implementation: my_attention:attention"))
    (tmp_path / "my_attention.py").write_text((ROOT / "examples" / "my_attention.py").read_text())
    run = subprocess.run([sys.executable, "-m", "gradcheck_cli", "run", str(path)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2, run.stderr
    assert "bad.yaml:8" in run.stderr and "convention.mask" in run.stderr and "Traceback" not in run.stderr
