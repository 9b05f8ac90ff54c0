"""The test harness (e2e/vramshare_e2e) is a library without import cycles, and only the control plane
touches its own components and clean-ups (others go through `add_component` and `on_cleanup`)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "e2e" / "vramshare_e2e"


def imports_of(path: pathlib.Path) -> set[str]:
    """Every vramshare_e2e module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vramshare_e2e"):
            if node.module == "vramshare_e2e":
                found |= {f"vramshare_e2e.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vramshare_e2e.")}
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"vramshare_e2e.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {name: imports_of(path) & modules.keys() for name, path in modules.items()}


def cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it; empty when there is none."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(edges):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_the_harness_has_no_import_cycle() -> None:
    edges = graph()
    assert "vramshare_e2e.cluster" in edges
    assert cycle(edges) == []


def test_only_the_control_plane_touches_its_components_and_clean_ups() -> None:
    reaching = sorted(
        p.name
        for p in PACKAGE.glob("*.py")
        if p.name != "cluster.py" and any(k in p.read_text() for k in ("._components", "._cleanups"))
    )
    assert reaching == []
