"""The house's shape, held (docs/architecture.md): no import circle, at most two imports running back up a floor, no
product module over 600 lines. Measured by tests/import_graph.py over the product code (tests left out)."""

from __future__ import annotations

import pathlib
import re

import import_graph
from conftest import REPO

MAX_UPWARD = 2
MAX_MODULE_LINES = 600


def test_no_import_circle_and_floors_held():
    house = import_graph.measure()
    assert house["circles"] == [], f"import circles: {house['circles']}"
    assert len(house["upward"]) <= MAX_UPWARD, f"imports running back up a floor: {house['upward']}"


def test_no_product_module_over_600_lines():
    house = import_graph.measure()
    over = {m: n for m, n in house["module_lines"].items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_the_measure_sees_an_upward_import_and_a_circle(tmp_path):
    """The check can fail: a small tree with a lazy import up a floor and two modules importing each other."""
    (tmp_path / "parity" / "low").mkdir(parents=True)
    (tmp_path / "parity" / "__init__.py").write_text("")
    (tmp_path / "parity" / "low" / "__init__.py").write_text("")
    (tmp_path / "parity" / "low" / "a.py").write_text("from parity.low import b\n")
    (tmp_path / "parity" / "low" / "b.py").write_text("def f():\n    from parity.low import a\n    import top\n")
    (tmp_path / "top.py").write_text("from parity.low import a\n")
    house = import_graph.measure(str(tmp_path))
    assert house["circles"] == [["parity.low.a", "parity.low.b", "top"]]  # top imports a, b imports top
    assert house["upward"] == [("parity.low", "top")]
    assert house["floor"] == {"parity": 0, "parity.low": 0, "top": 1}


def test_no_sys_path_edit_anywhere():
    """A module is found because the project is installed, or loaded by its file path (importlib): no code of the
    house — product, tests, examples, tools, the scripts — puts a folder on sys.path."""
    edit = re.compile(r"sys\.path\.(insert|append|extend|remove|pop)\(|sys\.path(\[[^]]*\])? *\+?= ")
    edits = [f"{path.relative_to(REPO)}:{n}" for path in sorted(pathlib.Path(REPO).rglob("*.py"))
             if not any(part.startswith(".") for part in path.relative_to(REPO).parts)
             and path != pathlib.Path(__file__).resolve()  # (this check's own examples below)
             for n, line in enumerate(path.read_text().splitlines(), 1) if edit.search(line)]
    assert edits == []
    assert edit.search("sys.path.insert(0, here)") and edit.search("sys.path[:0] = [here]")  # the check can fail
