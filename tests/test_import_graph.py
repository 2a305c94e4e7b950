"""The import graph of platform/apiary: no import circle between modules, no private name
imported from another module, and no store session opened outside the unit of work.

The graph is grimp's (the library import-linter builds ``make contracts`` on): every
``import``/``from ... import`` of an ``apiary`` module, at module level or inside a function.
A circle is a strongly connected component of more than one module (Tarjan's algorithm). Imports
under ``if TYPE_CHECKING:`` never run, so they cannot form a circle at import time; circles they
close are listed apart and must be named in :data:`TYPE_ONLY_CIRCLES` with the reason they stay.
The layers between packages are import-linter's contract in pyproject.toml, not this test's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1] / "platform"

#: Circles closed only by ``TYPE_CHECKING`` imports, each with why it stays.
TYPE_ONLY_CIRCLES: dict[frozenset[str], str] = {}


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (node -> successors) with more than one
    node, each sorted, in sorted order. Iterative Tarjan, so a deep graph cannot overflow."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _circles(exclude_type_checking: bool) -> list[list[str]]:
    graph = grimp.build_graph("apiary", exclude_type_checking_imports=exclude_type_checking, cache_dir=None)
    return strongly_connected({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})


def _show(circles: list[list[str]]) -> str:
    return "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_circles_and_only_circles() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["f", "a"], "g": []}
    assert strongly_connected(graph) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"x": ["y"], "y": []}) == []


def test_no_import_circle_between_modules() -> None:
    circles = _circles(exclude_type_checking=True)
    print(f"{len(circles)} import circles:\n{_show(circles)}")
    assert circles == [], f"import circles between modules of apiary:\n{_show(circles)}"


def test_circles_through_type_checking_imports_are_the_known_ones() -> None:
    runtime = {frozenset(c) for c in _circles(exclude_type_checking=True)}
    type_only = [c for c in _circles(exclude_type_checking=False) if frozenset(c) not in runtime]
    print(f"{len(type_only)} circles closed by TYPE_CHECKING imports:\n{_show(type_only)}")
    assert {frozenset(c) for c in type_only} == set(TYPE_ONLY_CIRCLES), (
        f"circles closed by TYPE_CHECKING imports (name each in TYPE_ONLY_CIRCLES with its reason, "
        f"or remove it from there when it is gone):\n{_show(type_only)}")


def private_imports(root: Path) -> list[str]:
    """``path:line: what`` for each import under ``root/apiary`` of a private name (``_x``, not a
    dunder) from another module, or of a private module (``pkg._mod``) from outside ``pkg``."""
    found = []
    for path in sorted((root / "apiary").rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        importer = ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
                if node.module.split(".")[0] == "apiary":
                    found += [f"{rel}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                segments = module.split(".")
                if segments[0] != "apiary":
                    continue
                for i, segment in enumerate(segments):
                    owner = ".".join(segments[:i])
                    if (segment.startswith("_") and not segment.startswith("__")
                            and not (importer == owner or importer.startswith(owner + "."))):
                        found.append(f"{rel}:{node.lineno}: private module {module}")
    return found


def test_the_private_import_finder_sees_names_and_modules(tmp_path: Path) -> None:
    pkg = tmp_path / "apiary" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "_common.py").write_text("")
    (pkg / "ok.py").write_text("from apiary.pkg._common import helper\nfrom apiary.pkg.ok import __all__\n")
    (tmp_path / "apiary" / "other.py").write_text(
        "from apiary.pkg import _common\nimport apiary.pkg._common\nfrom apiary.pkg.ok import _hidden\n")
    assert private_imports(tmp_path) == [
        "apiary/other.py:1: apiary.pkg._common",
        "apiary/other.py:2: private module apiary.pkg._common",
        "apiary/other.py:3: apiary.pkg.ok._hidden",
    ]


def test_no_module_imports_a_private_name_of_another() -> None:
    found = private_imports(ROOT)
    print("\n".join(found))
    assert found == [], "private names imported across modules:\n" + "\n".join(found)


#: The modules that may open a store session: the unit of work, and the engine's factory of them.
SESSION_OPENERS = {"apiary/store/unit.py", "apiary/store/engine.py"}


def sessions_opened(root: Path) -> list[str]:
    """``path:line: call`` for each call under ``root/apiary`` that opens a store session outside
    :data:`SESSION_OPENERS`: ``sessions()`` / ``x.sessions()`` / ``x._sessions()`` (a session
    factory called), ``Session(...)`` or ``sessionmaker(...)``."""
    found = []
    for path in sorted((root / "apiary").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in SESSION_OPENERS or "/migrations/" in rel:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in {"Session", "sessionmaker"} or (name in {"sessions", "_sessions"} and not node.args):
                found.append(f"{rel}:{node.lineno}: {name}(...)")
    return found


def test_the_session_finder_sees_factories_and_sessions(tmp_path: Path) -> None:
    (tmp_path / "apiary" / "store").mkdir(parents=True)
    (tmp_path / "apiary" / "store" / "unit.py").write_text("s = sessions()\n")
    (tmp_path / "apiary" / "x.py").write_text(
        "a = self.sessions()\nb = Session(engine)\nc = self._sessions()\nd = reading(self.sessions)\n")
    assert sessions_opened(tmp_path) == [
        "apiary/x.py:1: sessions(...)", "apiary/x.py:2: Session(...)", "apiary/x.py:3: _sessions(...)"]


def test_no_store_session_is_opened_outside_the_unit_of_work() -> None:
    found = sessions_opened(ROOT)
    print("\n".join(found))
    assert found == [], ("store sessions opened outside apiary.store.unit (use UnitOfWork or reading):\n"
                         + "\n".join(found))
