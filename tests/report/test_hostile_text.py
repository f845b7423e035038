"""Text from outside the tool (issue 22, item 6): a config path, a scenario name (a report read by ``merge`` holds
any), a call keyword and a message raised by user code holding NUL, ESC/OSC sequences (window title, screen clear),
C1 controls, backspace, DEL, bidi controls and lone surrogates. No such character reaches the terminal, the HTML or
the JUnit report raw: each shows as its escape (``\\x1b``), JUnit parses as XML 1.0 and the HTML with the standard
library's parser, and the JSON report keeps the exact text."""
import json
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from click.testing import CliRunner
from rich.console import Console

from gradcheck_cli.cli import main
from gradcheck_cli.report import render_controls, render_scenario
from gradcheck_cli.result import Check, ControlCell, Kind, ScenarioResult
from gradcheck_cli.text import shell_word, text_only, visible, visible_all

#: A window title (OSC), a screen clear (CSI), C0, C1 (CSI 0x9b, NEL 0x85), backspace, DEL and three bidi controls.
HOSTILE = "\x00\x1b]0;pwned\x07\x1b[2J\x9b\x85\x08\x7f\u202e\u2066\u200f"
SHOWN = "\\x00\\x1b]0;pwned\\x07\\x1b[2J\\x9b\\x85\\x08\\x7f\\u202e\\u2066\\u200f"
IN_PATH = HOSTILE.replace("\x00", "") + "\udcff"  # a file name holds no NUL; \udcff: the byte 0xff, not UTF-8
PATH_SHOWN = SHOWN.replace("\\x00", "") + "\\udcff"
MESSAGE = "bad" + HOSTILE + "\ud800"  # an exception's message may hold a lone surrogate too


def _raw(text: str) -> list[str]:
    """The characters of ``text`` that are not printable, newlines aside (every line of every report is
    printable)."""
    return sorted({c for c in text if not c.isprintable() and c != "\n"})


class _Page(HTMLParser):
    """Every text and attribute value of a page, character references decoded (so ``&#27;`` counts as ESC)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.strings = []

    def handle_starttag(self, tag, attrs):
        self.strings += [v for _, v in attrs if v]

    def handle_data(self, data):
        self.strings.append(data)


def _page_text(data: bytes) -> str:
    page = _Page()
    page.feed(data.decode("utf-8"))
    page.close()
    return "\n".join(page.strings)


def _junit_text(data: bytes) -> str:
    root = ET.fromstring(data)  # raises on anything XML 1.0 does not allow
    return "\n".join([*(e.text or "" for e in root.iter()), *(v for e in root.iter() for v in e.attrib.values())])


def test_visible_escapes_exactly_what_is_not_printable():
    assert visible(HOSTILE) == SHOWN
    assert visible("a\tb\nc\r\ud800\udcff\ufffe\u2028\xa0") == "a\\tb\\nc\\r\\ud800\\udcff\\ufffe\\u2028\\xa0"
    kept = "plain ASCII, C:\\path\\x1b, ünïcödé, 注意, emoji \U0001f600, Arabic \u0627\u0644"
    assert visible(kept) is kept  # printable text (a literal backslash too) is returned as it is
    assert visible_all({"k\x1b": ["v\x1b", ("t\x9b",), 1.5, None, True]}) == {"k\\x1b": ["v\\x1b", ("t\\x9b",), 1.5,
                                                                                         None, True]}


@pytest.mark.parametrize("word", ["plain/c.yaml", "it's here/c.yaml", "dir" + IN_PATH + "/c.yaml", "a\\b\tc\n"])
def test_the_reproduce_command_quotes_a_path_visibly_and_exactly(tmp_path, word):
    """``$'...'`` types back, in bash, to the very bytes of the path (0xff included), and is printable."""
    quoted = shell_word(word)
    assert quoted.isprintable() and visible(quoted) == quoted
    out = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, env={"LC_ALL": "C.UTF-8"},
                         check=True).stdout
    assert out == word.encode("utf-8", "surrogateescape")


def _report_texts(tmp_path, prefix: str, terminal: str) -> dict[str, str]:
    """What a run or merge showed and wrote, each parsed: terminal, JUnit (xml.etree), HTML (html.parser)."""
    return {"terminal": terminal, "junit": _junit_text((tmp_path / f"{prefix}.xml").read_bytes()),
            "html": _page_text((tmp_path / f"{prefix}.html").read_bytes())}


def test_a_hostile_run_and_its_merge_show_every_outside_text_escaped(root, tmp_path):
    folder = tmp_path / ("cfg" + IN_PATH)
    folder.mkdir()
    (folder / "evil.py").write_text(
        f"import sys\nsys.path.insert(0, {str(root / 'examples')!r})\nfrom my_attention import Attention\n"
        "from broken_attention import gqa_overwrite\n"
        "class Impl(Attention):\n    @staticmethod\n    def backward(*args):\n"
        f"        raise ValueError({MESSAGE!r})\nimpl = Impl()\n", encoding="utf-8")
    (folder / "c.yaml").write_text(
        "defaults: {batch: 2, heads_q: 2, heads_kv: 1, n_q: 3, n_k: 4, d_head: 2, mask: {key_lengths: [4, 3]}}\n"
        "scenarios:\n  - {name: mine, implementation: 'evil:impl'}\n"
        "  - {name: gqa, implementation: 'evil:gqa_overwrite'}\n")
    config = str(folder / "c.yaml")
    out = CliRunner().invoke(main, ["run", config, "--no-progress", "--json", str(tmp_path / "r.json"),
                                    "--junit", str(tmp_path / "r.xml"), "--html", str(tmp_path / "r.html")])
    assert out.exit_code == 1, (out.output, out.exception)
    report = json.loads((tmp_path / "r.json").read_text())
    # exact in JSON, but for lone surrogates, which are no text (merge refuses them): written as their escapes
    assert report["config"] == text_only(config) == config.replace("\udcff", "\\udcff")
    assert "bad" + HOSTILE + "\\ud800" in report["scenarios"][0]["checks"][0]["detail"]
    assert report["scenarios"][1]["checks"][2]["diagnosis"]  # a failed gradient: where, heat map, worst, hint
    texts = _report_texts(tmp_path, "r", out.output)
    for where, text in texts.items():
        assert not _raw(text), (where, _raw(text))
        assert "bad" + SHOWN + "\\ud800" in text, where  # the message, escaped
        assert PATH_SHOWN in text, where  # the config path, escaped (in the reproduce command and the title)
    # the reproduce command, in the terminal and in JUnit, is the exact path written visibly
    assert f"attn-gradcheck run {shell_word(config)} --select mine" in texts["terminal"]
    assert f"attn-gradcheck run {shell_word(config)} --select mine" in texts["junit"]

    # a report read by merge may hold any name: "mine" renamed, in its checks and its negative controls
    for sc in report["scenarios"]:
        sc["name"] += HOSTILE
    report["negative_controls"] = {"passed": True, "verdict": "pass", "powerless": [], "cells": [
        {"fault": "gqa-sum", "scenario": report["scenarios"][1]["name"], "status": "detected", "effect": 1.0,
         "caught_by": ["gradient v" + HOSTILE]}]}
    (tmp_path / "hostile.json").write_text(json.dumps(report))
    out = CliRunner().invoke(main, ["merge", str(tmp_path / "hostile.json"), "--json", str(tmp_path / "m.json"),
                                    "--junit", str(tmp_path / "m.xml"), "--html", str(tmp_path / "m.html")])
    assert out.exit_code == 1, (out.output, out.exception)
    assert json.loads((tmp_path / "m.json").read_text())["scenarios"][1]["name"] == "gqa" + HOSTILE
    for where, text in _report_texts(tmp_path, "m", out.output).items():
        assert not _raw(text), (where, _raw(text))
        assert "gqa" + SHOWN in text and "bad" + SHOWN in text, where
        if where == "html":  # the checks that caught a fault: the matrix cell's tooltip
            assert "gradient v" + SHOWN in text, where


@pytest.mark.parametrize("width", [80, 160])
def test_on_a_terminal_every_outside_text_is_escaped(width):
    """A result whose every text came from outside, drawn on a terminal (both layouts), and its controls."""
    diagnosis = {"checked": 4, "out_of_tolerance": 1, "axes": {"head" + HOSTILE: {"max_abs_error": [1.0, 0.0],
                                                                                 "out_of_tolerance": [1, 0]}},
                 "classes": [{"label": "rows" + HOSTILE, "checked": 4, "out_of_tolerance": 1, "max_abs_error": 1.0}],
                 "heat": None, "worst": [{"index": [0], "analytic": 1.0, "numeric": 2.0}]}
    checks = (Check(kind=Kind.GRADIENT, name="gradient q" + HOSTILE, tensor="q" + HOSTILE, shape=(4,),
                    max_abs_error=1.0, relative_error=0.5, tolerance=1e-6, noise_floor=1e-12, worst_index=(0,),
                    passed=False, detail=MESSAGE, diagnosis=diagnosis),)
    result = ScenarioResult(name="n" + HOSTILE, op="attention", dtype="float64", epsilon=1e-6, tolerance=1e-6,
                            mode="full", faults=(), checks=checks, elapsed_s=0.0, hints=("hint" + HOSTILE,))
    console = Console(width=width, record=True, force_terminal=True, color_system=None)
    render_scenario(console, result, "B=1" + HOSTILE, "attn-gradcheck run " + shell_word("c" + HOSTILE + ".yaml"))
    render_controls(console, [ControlCell(fault="f" + HOSTILE, scenario="n" + HOSTILE, status="not applicable",
                                          effect=0.0, caught_by=(), reason="why" + HOSTILE)])
    text = console.export_text()
    assert not _raw(text), _raw(text)
    for word in ("n", "B=1", "(q", "bad", "head", "rows", "hint", "f", "why"):  # (q: the tensor, in the FAIL line
        assert word + SHOWN in text, word


@pytest.mark.slow  # torch, and a module through its worker
def test_a_call_keyword_reaches_the_reports_escaped(root, tmp_path):
    """``call: {keyword: tensor}``: a keyword the module does not take is a failed check whose message quotes it."""
    pytest.importorskip("torch")
    (tmp_path / "torch_nn.py").write_text((root / "examples/recipes/torch_nn.py").read_text())
    (tmp_path / "c.yaml").write_text(
        "defaults: {backend: torch}\nscenarios:\n  - name: kw\n    op: attention-projections\n    batch: 1\n"
        "    heads_q: 2\n    n_q: 3\n    d_head: 2\n    d_model: 4\n    implementation:\n"
        "      factory: 'torch_nn:multihead_attention'\n"
        "      weights: {in_proj_weight: 'concat(w_q.T, w_k.T, w_v.T)', out_proj.weight: w_o.T}\n"
        '      call: {"x\\e]0;pwned\\a\\u202e": x, visible: visible}\n')
    out = CliRunner().invoke(main, ["run", str(tmp_path / "c.yaml"), "--no-progress", "--json",
                                    str(tmp_path / "r.json"), "--junit", str(tmp_path / "r.xml"), "--html",
                                    str(tmp_path / "r.html")])
    assert out.exit_code == 1, (out.output, out.exception)
    detail = json.loads((tmp_path / "r.json").read_text())["scenarios"][0]["checks"][0]["detail"]
    assert "'x\x1b]0;pwned\x07\u202e'" in detail  # exact in the JSON report
    for where, text in _report_texts(tmp_path, "r", out.output).items():
        assert not _raw(text), (where, _raw(text))
        assert "'x\\x1b]0;pwned\\x07\\u202e'" in text, where
