"""The docs a reader finishes (issue 83): every relative link in README.md and docs/ names a file that is there and, with
an #anchor, a heading of that page; the README within 200 lines of at most 160 characters; each page of your own
trainer's docs (docs/own_trainer/) within 300 lines."""

from __future__ import annotations

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
