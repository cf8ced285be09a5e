"""The docs a reader finishes (issue 83): every relative link in README.md and docs/ names a file that is there and, with
an #anchor, a heading of that page; the README within 200 lines of at most 160 characters; each page of your own
trainer's docs (docs/own_trainer/) within 300 lines; docs/refusals.md's cited tests exist and its counts are its rows."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent  # (no conftest import: nothing here needs torch)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: pathlib.Path) -> set[str]:
    """A page's headings as GitHub anchors them: lower case, punctuation but - and _ dropped, spaces as -."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def broken_links(page: pathlib.Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        found = (page.parent / path).resolve() if path else page
        if not found.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and found.suffix == ".md" and anchor not in anchors(found):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return broken


def test_every_link_in_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert [b for page in pages for b in broken_links(page)] == []


def test_the_checker_sees_a_broken_link():
    """A missing page and a missing heading are both seen; a heading of the page itself is found."""
    page = ROOT / "docs" / "_link_probe.md"
    try:
        page.write_text("# A page\n\n## Its part\n\n[here](#its-part) [b](b.md) [c](_link_probe.md#no-part)\n")
        found = broken_links(page)
    finally:
        page.unlink()
    assert found == ["docs/_link_probe.md: b.md (no such file)",
                     "docs/_link_probe.md: _link_probe.md#no-part (no such heading)"]


def test_the_readme_and_the_pages_keep_their_size():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200 and max(map(len, readme)) <= 160, (len(readme), max(map(len, readme)))
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "docs" / "own_trainer").glob("*.md")}
    assert sizes and max(sizes.values()) <= 300, sizes


def refusal_rows(text: str) -> dict[str, list[list[str]]]:
    """docs/refusals.md's table rows (their cells) by section: each `## ` heading's table, header and rule left out."""
    rows, section = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section and line.startswith("| ") and not line.startswith("| the line"):
            rows.setdefault(section, []).append([c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


# docs/refusals.md's column since: the start, the issue, or the commit (or day) that turned a crash into the line
SINCE = ("f0c0d33", "issue 80", "issue 81", "issue 82", "414b0ec", "205b2d7", "2026-11-29", "2026-11-30", "2026-12-01")


def test_the_refusals_page_cites_real_tests_and_counts_its_rows():
    """Every tests/test_*.py::name cited names a module that defines that function (read with ast, nothing imported);
    'Before: N refusals. After: M refusals.' is the table: M its rows left, N those there since f0c0d33 and the lifted."""
    text = (ROOT / "docs" / "refusals.md").read_text()
    cited = set(re.findall(r"tests/(test_\w+\.py)::(\w+)", text))
    defined = {}
    for module in {m for m, _ in cited}:
        path = ROOT / "tests" / module
        defined[module] = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)} \
            if path.exists() else set()
    assert cited and sorted(f"{m}::{n}" for m, n in cited if n not in defined[m]) == []
    rows = refusal_rows(text)
    lifted = rows.pop("Lifted by issue 80")
    left = [r for section, found in rows.items() if section != "No asserting test" for r in found]
    assert all(len(r) == 5 and r[3] in SINCE for r in left), \
        [r[:1] for r in left if len(r) != 5 or r[3] not in SINCE]
    before, after = map(int, re.search(r"Before: (\d+) refusals\. After: (\d+) refusals\.", text).groups())
    assert (before, after) == (sum(r[3] == "f0c0d33" for r in left) + len(lifted), len(left))
    unasserted = [line for line in text.split("## No asserting test", 1)[1].splitlines() if line.startswith("- ")]
    assert len(unasserted) == sum(r[4] == "none" for r in left) + sum(r[2] == "none" for r in lifted)
