"""The documentation's links hold without mkdocs: every relative link of README.md and docs/*.md reaches an
existing file, and every ``#anchor`` a heading of its target (GitHub's slugs); the README stays short and
starts with its two set-up commands. (CI also builds the docs with ``mkdocs build --strict``, mkdocs.yml.)"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

SETUP = """```bash
# 1. install and run the main job on a shipped config (every check passes, exit 0)
python3 -m venv .venv && . .venv/bin/activate && pip install . && attn-gradcheck run configs/quickstart.yaml

# 2. install the test extra and run the tests
python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && python -m pytest -q
```"""

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    out, fence = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fence = not fence
            out.append("")
            continue
        out.append("" if fence else _CODE_SPAN.sub("", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, markup and punctuation dropped except '-' and '_',
    spaces to '-'."""
    text = _CODE_SPAN.sub(lambda m: m.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fence = not fence
            continue
        m = None if fence else _HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    return [(i, m.group(1)) for i, line in enumerate(_prose(path.read_text(encoding="utf-8")), 1)
            for m in _LINK.finditer(line)]


def test_pages_exist():
    assert (ROOT / "docs" / "index.md").is_file()
    assert len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    bad = []
    for line, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if file.startswith("/"):
            bad.append(f"{page.name}:{line}: absolute link {target}")
        elif not dest.exists():
            bad.append(f"{page.name}:{line}: {target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{page.name}:{line}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme():
    readme = {target.partition("#")[0] for _, target in links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"README.md does not link {missing}"


def test_readme_is_short_and_starts_with_the_setup_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 260
    head = text.split("\n## ", 1)[0]
    assert SETUP in head, "the two set-up commands must be the README's first code block, before any section"
    assert head.index(SETUP) == head.index("```"), "the set-up commands must be the first code block"


def test_slugs_are_githubs():
    assert slug("The tiled engine (`engine: tiled`)") == "the-tiled-engine-engine-tiled"
    assert slug("JSON report (`--json PATH`, schema_version 2)") == "json-report---json-path-schema_version-2"
    assert slug("Two classic bugs") == "two-classic-bugs"
