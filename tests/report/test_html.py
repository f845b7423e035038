"""The HTML report (``--html``): one self-contained file (no script, nothing fetched), per scenario its checks,
the heat map of where a failed check is wrong as an inline SVG, hints and the reproduce command, and the
negative-control matrix coloured; parsed here with the standard library's HTML parser."""
import json
import re
from html.parser import HTMLParser

from click.testing import CliRunner

from gradcheck_cli.cli import main
from gradcheck_cli.report import write_reports
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
    detected = next(line for line in out.output.splitlines() if "applicable fault(s) detected" in line)
    assert detected in page.text  # the terminal's count under the matrix


class Drawn(HTMLParser):
    """The rows of each table, the text of each paragraph and list item, by class (an item by its list's)."""

    def __init__(self):
        super().__init__()
        self.tables, self.paragraphs, self.items, self.open, self.list = [], [], [], None, ""

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class", "")
        if tag == "table":
            self.tables.append((cls, []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self.tables[-1][1][-1].append("")
            self.open = "cell"
        elif tag == "ul":
            self.list = cls
        elif tag in ("p", "li"):  # an item has its list's class
            (self.paragraphs if tag == "p" else self.items).append((cls if tag == "p" else self.list, ""))
            self.open = tag

    def handle_endtag(self, tag):
        if tag in ("td", "th", "p", "li"):
            self.open = None

    def handle_data(self, data):
        if self.open == "cell":
            self.tables[-1][1][-1][-1] += data
        elif self.open in ("p", "li"):
            where = self.paragraphs if self.open == "p" else self.items
            where[-1] = (where[-1][0], where[-1][1] + data)


def _terminal_rows(text: str) -> list[list[str]]:
    """The cells of each table row the terminal printed (plain text: names and tensors left-aligned, numbers
    right-aligned under their header, so each number's cell ends where its header does)."""
    numbers = ["max abs err", "rel err", "rel tol", "noise floor", "allowed", "detects"]
    lines, rows = text.splitlines(), []
    for i, header in enumerate(lines):
        if not header.startswith("check "):
            continue
        ends = [header.index(n) + len(n) for n in numbers]
        starts = [ends[0] - len(numbers[0])] + ends[:-1]  # "max abs err" is its column's widest cell
        for line in lines[i + 1:]:
            if not line or line.startswith("  "):
                break
            rows.append([line[:header.index("tensor")].strip(), line[header.index("tensor"):starts[0]].strip(),
                         *(line[a:b].strip() for a, b in zip(starts, ends)), line[ends[-1]:].strip()])
    return rows


def test_the_page_shows_what_the_terminal_prints(root, tmp_path):
    """Issue 22 item 13: the table's cells, blank where the terminal's are; each failed check's message, where,
    classes of rows (none without a checked element: no "0 of 0"), heat map and worst elements; the hints and the
    power line."""
    html, js = tmp_path / "r.html", tmp_path / "r.json"
    out = CliRunner().invoke(main, ["run", str(root / "configs/quickstart.yaml"), "--break-softmax-term",
                                    "--html", str(html), "--json", str(js)])
    assert out.exit_code == 1, out.output
    report, terminal = json.loads(js.read_text()), out.output
    page = Drawn()
    page.feed(html.read_text())
    # the checks tables, row by row, cell by cell, against the terminal's
    drawn = [row for cls, rows in page.tables if cls == "checks" for row in rows[1:]]
    printed = _terminal_rows(terminal)
    assert len(drawn) == len(printed) == report["summary"]["checks"]
    for d, p in zip(drawn, printed):
        assert [d[0], " ".join(d[1].split()), *d[2:]] == p
    assert any(row[3] == "" and row[2] == "0.00e+00" for row in drawn)  # an invariant: no rel err, as printed
    # the worst elements, as a table
    worst = [tuple(row) for cls, rows in page.tables if cls == "worst" for row in rows[1:]]
    listed = [tuple(re.fullmatch(r"(.+) analytic (\S+) numeric (\S+)", item).groups())
              for line in terminal.splitlines() if line.startswith("    worst: ")
              for item in line[len("    worst: "):].split("; ")]
    assert worst == listed and len(worst) >= 5
    # the where and power lines and the classes of rows, as printed
    assert [t for c, t in page.paragraphs if c == "where"] == [line.strip() for line in terminal.splitlines()
                                                              if line.startswith("    where: ")]
    assert [t for c, t in page.paragraphs if c == "power"] == [line.strip() for line in terminal.splitlines()
                                                              if line.startswith("  power: ")]
    assert len([t for c, t in page.paragraphs if c == "power"]) == len(report["scenarios"])
    classes = [t for c, t in page.items if c == "classes"]
    assert classes == [line.strip() for line in terminal.splitlines() if line.startswith("      ")
                       and "out of tolerance" in line]
    empty = [cls for s in report["scenarios"] for c in s["checks"] for cls in (c["diagnosis"] or {}).get("classes", [])
             if cls["checked"] == 0]
    assert empty and not any(" of 0 " in t for t in classes)  # classes with nothing checked are left out


def test_text_is_escaped_and_the_html_reporter_writes_it(tmp_path):
    report = {"config": "a<b>.yaml", "verdict": "fail", "summary": {"scenarios": 1}, "run_id": "x",
              "scenarios": [{"name": "n<&>", "verdict": "fail", "passed": False, "op": "attention", "checks": [
                  {"name": "gradient q", "tensor": "q", "shape": [1], "max_abs_error": 1.0, "relative_error": 1.0,
                   "tolerance": 1e-6, "noise_floor": 0.0, "verdict": "fail", "detail": "<script>alert(1)</script>",
                   "diagnosis": None, "detectable": None}], "hints": ["use </pre> & co"],
                  "reproduce": "attn-gradcheck run 'a<b>.yaml'"}], "negative_controls": None}
    data = html_report(report)
    assert b"<script>" not in data and b"&lt;script&gt;" in data and b"n&lt;&amp;&gt;" in data
    write_reports(html_path=tmp_path / "r.html", json_data=report)  # what --html writes, by the registry's name
    assert (tmp_path / "r.html").read_bytes() == data


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
