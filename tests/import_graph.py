"""The house's import graph, measured: rooms, floors, arrows, arrows running back up a floor, import circles.

A room is a top-level script or module of the repository, a module directly in `parity/`, or a package under
`parity/` (its modules together). An arrow is a room importing another (at module level or inside a function). A
room's floor is one above the highest room it imports at module level (a room importing nothing of the project's is
on floor 0); an arrow runs back up when it reaches a room on the same or a higher floor, which only an import inside
a function can do. A circle is a cycle among modules' imports (either kind). Tests are not product code and are left
out. `python tests/import_graph.py` prints the figures docs/architecture.md quotes.
"""

from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def product_files(root: str = ROOT) -> list[str]:
    """The product's .py files, relative to `root`: the top-level scripts and modules, and everything in parity/."""
    files = [f for f in os.listdir(root) if f.endswith(".py") and f != "setup.py"]  # setup.py only packages
    for folder, dirs, names in os.walk(os.path.join(root, "parity")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [os.path.relpath(os.path.join(folder, n), root) for n in names if n.endswith(".py")]
    return sorted(files)


def module_name(path: str) -> str:
    name = path[:-3].replace(os.sep, ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def room_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "parity" and len(parts) > 1 else parts[0]


def imports(path: str, known: set[str], root: str = ROOT) -> list[tuple[str, bool]]:
    """(module imported, whether at module level) for each import of a project module in `path`."""
    tree = ast.parse(open(os.path.join(root, path)).read())
    found = []

    def visit(node, top: bool):
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                subs = [f"{child.module}.{a.name}" for a in child.names if f"{child.module}.{a.name}" in known]
                found.extend((m, top) for m in subs)
                if len(subs) < len(child.names):
                    found.append((child.module, top))
            visit(child, inner)

    visit(tree, True)
    return [(m, top) for m, top in found if m in known]


def measure(root: str = ROOT) -> dict:
    files = product_files(root)
    modules = {module_name(f): f for f in files}
    known = set(modules)
    edges = {m: imports(f, known, root) for m, f in modules.items()}
    lines = {m: sum(1 for _ in open(os.path.join(root, f))) for m, f in modules.items()}
    rooms: dict[str, set[str]] = {}
    for m in modules:
        rooms.setdefault(room_of(m), set()).add(m)
    arrows: dict[tuple[str, str], bool] = {}  # (from room, to room) -> any module-level import
    for m, targets in edges.items():
        for t, top in targets:
            a, b = room_of(m), room_of(t)
            if a != b:
                arrows[(a, b)] = arrows.get((a, b), False) or top
    floor: dict[str, int] = {}

    def floor_of(room: str, seen=()) -> int:
        if room in seen:
            return 0  # a circle among rooms: counted below
        if room not in floor:
            below = [b for (a, b), top in arrows.items() if a == room and top]
            floor[room] = 1 + max((floor_of(b, seen + (room,)) for b in below), default=-1)
        return floor[room]

    for room in rooms:
        floor_of(room)
    upward = sorted((a, b) for (a, b) in arrows if floor[b] >= floor[a])
    circles = module_circles({m: [t for t, _ in targets if t != m] for m, targets in edges.items()})
    training = [m for m in modules if m.startswith("parity.training")]
    total = sum(lines.values())
    return {"rooms": len(rooms), "floors": 1 + max(floor.values()), "arrows": len(arrows), "upward": upward,
            "circles": circles, "largest": max(lines.items(), key=lambda kv: kv[1]), "lines": total,
            "training_share": sum(lines[m] for m in training) / total, "training_files": len(training),
            "floor": floor, "module_lines": lines}


def module_circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            connect(v)
    return found


if __name__ == "__main__":
    m = measure(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    print(f"{m['lines']} lines in {m['rooms']} rooms on {m['floors']} floors, {m['arrows']} arrows, "
          f"{len(m['upward'])} running up, {len(m['circles'])} circles; largest {m['largest'][0]} "
          f"({m['largest'][1]} lines); parity.training {100 * m['training_share']:.0f} % in {m['training_files']} files")
    for a, b in m["upward"]:
        print(f"  up: {a} (floor {m['floor'][a]}) -> {b} (floor {m['floor'][b]})")
    for c in m["circles"]:
        print("  circle:", " -> ".join(c))
    for room, f in sorted(m["floor"].items(), key=lambda kv: (kv[1], kv[0])):
        print(f"  floor {f}: {room}")
