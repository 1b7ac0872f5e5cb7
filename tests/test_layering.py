"""The layers hold: the library (`posttrain/`) never reaches into orchestration (`flows/`,
Prefect), training never depends on evaluation, neither package has an import cycle, and no two
of its sub-packages import each other.

Every module is parsed with `ast` and every import counts, at top level or inside a function: a
lazy import that dodges a cycle at import time is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("posttrain", "flows")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


MODULES = _modules()


def _resolve(name: str) -> str:
    """`name` as the module it loads: `posttrain.hub` (a module) or, for
    `from posttrain.store.artifacts import verify`, the longest prefix that is one of ours."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path, module: str) -> set[str]:
    """Every module `path` imports, anywhere in the file (third-party names kept as written)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # `from posttrain import hub` imports the module posttrain.hub.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


IMPORTS = {name: _imports(path, name) for name, path in MODULES.items()}


def _graph(prefix: str) -> dict[str, set[str]]:
    """Module -> the modules under `prefix` it imports (itself left out)."""
    inside = lambda name: name == prefix or name.startswith(prefix + ".")  # noqa: E731
    graph: dict[str, set[str]] = {}
    for name, imported in IMPORTS.items():
        if inside(name):
            targets = {_resolve(i) for i in imported if inside(i)}
            graph[name] = {t for t in targets if t and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or None. Iterative DFS, colours white/grey/black."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt) and nxt in graph:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def _offenders(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    banned = lambda i: any(i == f or i.startswith(f + ".") for f in forbidden)  # noqa: E731
    # One line per imported module (`from prefect import task` reads as `prefect`).
    return sorted(
        {
            f"{name} imports {_resolve(i) or i.split('.')[0]}"
            for name, imported in IMPORTS.items()
            if name == prefix or name.startswith(prefix + ".")
            for i in imported
            if banned(i)
        }
    )


def test_the_modules_were_found() -> None:
    # Guards the other tests against passing on an empty graph (a moved folder, a bad ROOT).
    assert "posttrain.rl.rollout.sample" in MODULES and "flows.stage.task" in MODULES
    assert "posttrain.models.decoding" in IMPORTS["posttrain.rl.rollout.engine"]


def test_the_library_never_imports_orchestration() -> None:
    offenders = _offenders("posttrain", ("flows", "prefect"))
    assert not offenders, "posttrain/ must not import flows or prefect:\n" + "\n".join(offenders)


def test_training_never_imports_evaluation() -> None:
    offenders = _offenders("posttrain.train", ("posttrain.eval",))
    assert not offenders, "posttrain.train must not import posttrain.eval:\n" + "\n".join(offenders)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    cycle = find_cycle(_graph(package))
    assert cycle is None, f"import cycle in {package}/: " + " -> ".join(cycle or [])


def _unit(name: str) -> str:
    """The package-level unit of a module: `posttrain.config.schema` -> `posttrain.config`; a
    module at the top of the package (`posttrain.numerics`) is a unit of its own."""
    return ".".join(name.split(".")[:2])


def mutual_pairs(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Pairs of units (sorted) each of which imports the other, through any of their modules."""
    edges = {(_unit(a), _unit(b)) for a, bs in graph.items() for b in bs}
    return {(a, b) for a, b in edges if a < b and (b, a) in edges}


# Pairs allowed to stay mutual, each with the edges that keep it so. None are left: the last
# three (agents <-> train, config <-> kinds, eval <-> rl) went with the online-RL move into
# posttrain/rl/ (issue 40). The test fails on a pair that is gone as well as on a new one, so an
# entry never outlives its reason.
KNOWN_PAIRS: dict[str, set[tuple[str, str]]] = {"posttrain": set(), "flows": set()}


def _edges_between(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    return sorted(
        f"{m} -> {i}" for m, out in graph.items() for i in out if {_unit(m), _unit(i)} == {a, b}
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_no_two_packages_import_each_other(package: str) -> None:
    # Sub-packages import in one direction: a pair importing each other is one job split in two,
    # or a piece of code living in the wrong one. Function-level imports count.
    graph = _graph(package)
    pairs = mutual_pairs(graph)
    new = sorted(pairs - KNOWN_PAIRS[package])
    assert not new, "packages importing each other:\n" + "\n".join(
        f"{a} <-> {b}: " + "; ".join(_edges_between(graph, a, b)) for a, b in new
    )
    gone = sorted(KNOWN_PAIRS[package] - pairs)
    assert not gone, f"no longer mutual, drop from KNOWN_PAIRS: {gone}"


def test_mutual_pairs_finds_the_pair() -> None:
    graph = {"p.a.x": {"p.b.y"}, "p.b.y": {"p.c"}, "p.b.z": {"p.a"}, "p.c": set()}
    assert mutual_pairs(graph) == {("p.a", "p.b")}


def test_find_cycle_names_the_cycle() -> None:
    # The checker itself: a cycle is found and named in order; a diamond is not a cycle.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
