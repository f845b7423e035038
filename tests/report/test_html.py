"""The HTML report (``--html``): one self-contained file (no script, nothing fetched), per scenario its checks,
the heat map of where a failed check is wrong as an inline SVG, hints and the reproduce command, and the
negative-control matrix coloured; parsed here with the standard library's HTML parser."""
import json
from html.parser import HTMLParser

from click.testing import CliRunner

from gradcheck_cli.cli import main
from gradcheck_cli.report import REPORTER_BY_NAME
from gradcheck_cli.report.html import html_report


class Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(data: bytes) -> Tags:
    parser = Tags()
    parser.feed(data.decode("utf-8"))
    return parser


def test_a_broken_run_s_report_shows_where_and_the_controls(root, tmp_path):
    html, js = tmp_path / "r.html", tmp_path / "r.json"
    out = CliRunner().invoke(main, ["run", str(root / "examples/broken.yaml"), "--negative-controls",
                                    "--html", str(html), "--json", str(js)])
    assert out.exit_code == 1, out.output
    page, report = _parse(html.read_bytes()), json.loads(js.read_text())
    tags = [t for t, _ in page.tags]
    text = " ".join(page.text)
    assert "script" not in tags and "link" not in tags and "img" not in tags  # nothing runs, nothing fetched
    assert all(a.get("href", "#").startswith("#") for t, a in page.tags if t == "a")
    for s in report["scenarios"]:  # a section per scenario, its failed checks and reproduce command
        assert ("h2", {"id": s["name"]}) in page.tags and s["reproduce"] in text
    heat = next(c["diagnosis"]["heat"] for s in report["scenarios"] for c in s["checks"]
                if c.get("diagnosis") and c["diagnosis"].get("heat"))
    assert tags.count("svg") >= 1
    assert tags.count("rect") >= sum(len(row) for row in heat["levels"])  # a square per cell of the heat map
    assert any("hint:" in t for t in page.text)
    statuses = [a.get("class") for t, a in page.tags if t == "td" and a.get("class") in ("detected", "missed", "na")]
    assert len(statuses) == len(report["negative_controls"]["cells"]) and "detected" in statuses


def test_text_is_escaped_and_the_reporter_is_registered():
    report = {"config": "a<b>.yaml", "verdict": "fail", "summary": {"scenarios": 1}, "run_id": "x",
              "scenarios": [{"name": "n<&>", "verdict": "fail", "passed": False, "op": "attention", "checks": [
                  {"name": "gradient q", "tensor": "q", "shape": [1], "max_abs_error": 1.0, "relative_error": 1.0,
                   "tolerance": 1e-6, "noise_floor": 0.0, "verdict": "fail", "detail": "<script>alert(1)</script>",
                   "diagnosis": None, "detectable": None}], "hints": ["use </pre> & co"],
                  "reproduce": "attn-gradcheck run 'a<b>.yaml'"}], "negative_controls": None}
    data = html_report(report)
    assert b"<script>" not in data and b"&lt;script&gt;" in data and b"n&lt;&amp;&gt;" in data
    assert REPORTER_BY_NAME["html"] is html_report


def test_merge_writes_the_html_of_the_merged_report(root, tmp_path):
    parts = []
    for i in (1, 2):
        path = tmp_path / f"s{i}.json"
        CliRunner().invoke(main, ["run", str(root / "configs/gqa.yaml"), "--shard", f"{i}/2", "--json", str(path)])
        parts.append(str(path))
    html, js = tmp_path / "m.html", tmp_path / "m.json"
    out = CliRunner().invoke(main, ["merge", *parts, "--html", str(html), "--json", str(js)])
    assert out.exit_code == 0, out.output
    merged = json.loads(js.read_text())
    assert sum(1 for t, _ in _parse(html.read_bytes()).tags if t == "h2") == len(merged["scenarios"]) > 1


def test_sweep_eps_writes_its_v_curves_as_html(root, tmp_path):
    html, js = tmp_path / "s.html", tmp_path / "s.json"
    out = CliRunner().invoke(main, ["sweep-eps", str(root / "configs/quickstart.yaml"), "--select", "causal-self",
                                    "--steps", "1e-2:1e-10", "--html", str(html), "--json", str(js)])
    assert out.exit_code == 0, out.output
    page, data = _parse(html.read_bytes()), json.loads(js.read_text())
    sweep = data["sweeps"][0]
    tags = [t for t, _ in page.tags]
    assert "script" not in tags and tags.count("polyline") == len(sweep["errors"])  # a curve per tensor
    assert tags.count("tr") == 1 + len(sweep["steps"])  # the header and a row per step
    assert any("run" in t for t in page.text) and ("h2", {"id": sweep["name"]}) in page.tags
