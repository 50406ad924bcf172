"""The README and docs/ hold together.

* Every relative link in README.md and docs/*.md resolves: the file or folder exists, and a ``#anchor`` into a
  Markdown file names one of its headings (GitHub's rule for heading anchors).
* README.md teaches in one screen (at most 250 lines), and its first code block is the install, demo and test
  commands that CI runs.
* README.md's "Layout" names every room of ``memsched/`` and every module at its top level.
* docs/architecture.md's generated blocks (the stage table, the picture, the note index) are what
  docs/make_architecture.py generates from the code now.
"""

from __future__ import annotations

import difflib
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

FIRST_BLOCK_COMMANDS = ['pip install "torch==2.13.0" -e ".[test]"', "memsched demo", "python -m pytest -q"]
DOC_PAGES = ["architecture", "semantics", "stand-in", "zero", "elastic", "host-memory", "cli", "benchmarks",
             "limitations"]
STAGES = ["trace", "plan", "chunk", "fetch/evict", "gradient offload", "update", "report"]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            slug = _slug(m.group(2))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: pathlib.Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in _prose_lines(page.read_text()) for m in _LINK.finditer(line)]


def test_the_pages_exist():
    missing = [p for p in DOC_PAGES if not (DOCS / f"{p}.md").is_file()]
    assert not missing, f"docs/ lacks {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for n, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"line {n}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"line {n}: {target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(broken)


def test_the_link_check_sees_links_and_skips_code():
    text = "a [x](one.md) `[y](two.md)` ![img](p.png)\n```\n[z](three.md)\n```\n[w](four.md#a-b)"
    found = [m.group(1) for _, line in _prose_lines(text) for m in _LINK.finditer(line)]
    assert found == ["one.md", "p.png", "four.md#a-b"]
    assert _slug("`memsched plan`: predicting, 2026-11-27") == "memsched-plan-predicting-2026-11-27"


def test_readme_is_one_screen():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; the rest belongs in docs/"


def test_readmes_first_code_block_is_install_demo_and_tests():
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if _FENCE.match(line))
    end = next(i for i in range(start + 1, len(lines)) if _FENCE.match(lines[i]))
    commands = [line.split("  #")[0].strip() for line in lines[start + 1:end] if line.strip()]
    assert commands == FIRST_BLOCK_COMMANDS


def test_readme_layout_names_every_room_and_top_level_module():
    text = README.read_text()
    section = text[text.index("\n## Layout"):]
    section = section[:section.find("\n## ", 1)]
    rooms = sorted(p.name + "/" for p in (ROOT / "memsched").iterdir() if (p / "__init__.py").is_file())
    modules = sorted(p.name for p in (ROOT / "memsched").glob("*.py") if p.name != "__init__.py")
    missing = [name for name in rooms + modules + ["tracer/", "policies/"]
               if not re.search(rf"(?<![\w/]){re.escape(name)}", section)]
    assert not missing, f"README.md's Layout does not name {missing}"


def test_the_replaceable_sections_keep_their_headings():
    assert "\n## What a parameter reads as between steps\n" in (DOCS / "semantics.md").read_text()
    assert "\n## Load order\n" in (DOCS / "stand-in.md").read_text()


def _make_architecture():
    spec = importlib.util.spec_from_file_location("make_architecture", DOCS / "make_architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_names_a_module_for_each_stage():
    names = [stage.name for stage in _make_architecture().STAGES]
    assert [s for s in STAGES if s not in names] == []


def test_architecture_generated_blocks_are_current():
    make = _make_architecture()
    committed = make.committed((DOCS / "architecture.md").read_text())
    stale = {}
    for name, now in make.generate().items():
        if committed[name] != now:
            stale[name] = "".join(difflib.unified_diff(committed[name].splitlines(True), now.splitlines(True),
                                                       "docs/architecture.md", "generated now", n=1))
    assert not stale, ("docs/architecture.md is stale; run `python docs/make_architecture.py`:\n"
                       + "\n".join(stale.values()))
