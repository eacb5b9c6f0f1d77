"""The package's import structure, read statically: no cycles, imports only point down the layers, short modules.

Every module of autopp is parsed with `ast` (nothing is imported); every `import` statement counts, at module level,
inside functions and under `if TYPE_CHECKING:` alike. The layer order is docs/architecture.md's:
utilities < schedule < data < costmodel < solve < predict/export < model < measure < run < cli.
A new module must be given a layer in LAYERS below (longest matching prefix wins).
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autopp"
MAX_LINES = 400

#: Module name (or package prefix) -> layer rank. A module may import its own rank or lower ones, never higher.
LAYERS: dict[str, int] = {
    # 0 leaf utilities
    "autopp.errors": 0, "autopp.jsonio": 0, "autopp.sizes": 0, "autopp.relpaths": 0,
    "autopp.preflight": 0, "autopp.spawn": 0, "autopp.cores": 0, "autopp.progress": 0,
    # 1 schedule IR, descriptors, simulator (below data: the typed Plan holds the ScheduleName enum)
    "autopp.schedule": 1,
    # 2 torch-free data types
    "autopp.data": 2,
    # 3 the only code turning (profile, cluster, stage) into seconds and bytes
    "autopp.costmodel": 3,
    # 4 DP, CP-SAT partition / placement / synthesis, search
    "autopp.solve": 4,
    # 5 consumers of a plan
    "autopp.predict": 5, "autopp.export": 5, "autopp.display": 5,
    # 6-8 the torch side: model-file contract and splitting, measuring, running
    "autopp.model": 6, "autopp.measure": 7, "autopp.run": 8,
    # 9 the command line (and `python -m autopp`)
    "autopp.cli": 9, "autopp.__main__": 9,
}
#: The package facade `autopp/__init__.py` (its names are imported lazily, by string): the top layer, but not a prefix.
ROOT_LAYER = 9
LAYER_NAMES = ["utilities", "schedule", "data", "costmodel", "solve", "predict/export", "model", "measure", "run",
               "cli"]
#: Layers that import no torch (directly or through anything they import): fast to test, immune to torch's API.
PLANNING_CORE = ("autopp.schedule", "autopp.data", "autopp.costmodel", "autopp.solve", "autopp.predict",
                 "autopp.export")
#: `import autopp.schedule` must not load OR-Tools (CP-SAT synthesis belongs in solve/).
NO_ORTOOLS = ("autopp.schedule",)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, from its __init__.py)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> int | None:
    """The rank of the longest prefix in LAYERS that `name` falls under, or None."""
    if name == "autopp":
        return ROOT_LAYER
    matches = [p for p in LAYERS if _within(name, p)]
    return LAYERS[max(matches, key=len)] if matches else None


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names (relative levels resolved against `module`'s package)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """(autopp modules `module` imports, top-level names of the other packages it imports)."""
    ours: set[str] = set()
    theirs: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node)
            # `from autopp.solve import dp` names the module autopp.solve.dp; `from autopp.solve import x`, the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if _within(target, "autopp"):
                while target not in known and "." in target:  # `import autopp.solve.dp.x` is not a thing, but be safe
                    target = target.rsplit(".", 1)[0]
                if target != module:
                    ours.add(target)
            else:
                theirs.add(target.split(".")[0])
    return ours, theirs


def import_graph() -> tuple[nx.DiGraph, dict[str, set[str]]]:
    """The module graph (edge a -> b: a imports b) and each module's third-party top-level imports."""
    found = modules()
    graph: nx.DiGraph = nx.DiGraph()
    external: dict[str, set[str]] = {}
    for name, path in found.items():
        graph.add_node(name)
        ours, external[name] = imports_of(name, path, set(found))
        graph.add_edges_from((name, target) for target in ours)
    return graph, external


GRAPH, EXTERNAL = import_graph()


def test_walker_sees_the_package() -> None:
    """Guards the checks below against passing vacuously: the walk finds modules, edges and torch imports."""
    assert len(GRAPH) > 40 and GRAPH.number_of_edges() > 100
    assert any("torch" in names for names in EXTERNAL.values())
    assert "autopp.errors" in GRAPH and "autopp.solve" in GRAPH


def test_no_import_cycles() -> None:
    """Five cycles were held together by imports inside functions; those count here too."""
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, "import cycles (break them by moving the shared code down a layer): " + "; ".join(
        " <-> ".join(c) for c in sorted(cycles))


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in GRAPH if layer_of(m) is None)
    assert not missing, f"modules in no layer (move them, or add them to LAYERS in {Path(__file__).name}): {missing}"


def test_imports_point_down() -> None:
    upward = []
    for a, b in sorted(GRAPH.edges):
        la, lb = layer_of(a), layer_of(b)
        if la is not None and lb is not None and lb > la:
            upward.append(f"{a} ({LAYER_NAMES[la]}) imports {b} ({LAYER_NAMES[lb]})")
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_modules_are_short() -> None:
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _reaching(roots: tuple[str, ...], package: str) -> list[str]:
    """'module (via start)' for every module that imports `package` and is imported, at any depth, from `roots`."""
    hits = []
    for start in sorted(m for m in GRAPH if any(_within(m, r) for r in roots)):
        for m in sorted({start} | nx.descendants(GRAPH, start)):
            if package in EXTERNAL[m]:
                hits.append(m if m == start else f"{m} (via {start})")
    return sorted(set(hits))


@pytest.mark.parametrize(("roots", "package"), [(PLANNING_CORE, "torch"), (NO_ORTOOLS, "ortools")])
def test_core_imports_no_heavy_packages(roots: tuple[str, ...], package: str) -> None:
    hits = _reaching(roots, package)
    assert not hits, f"{package} is imported by {', '.join(roots)} or what they import: {hits}"


def test_walker_reads_every_kind_of_import(tmp_path: Path) -> None:
    """Relative and absolute, module level, inside functions and under TYPE_CHECKING; a name is not a module."""
    source = tmp_path / "judge.py"
    source.write_text("from typing import TYPE_CHECKING\nimport torch.distributed as dist\nfrom . import dp\n"
                      "from .dp import best\nfrom ..schedule import simulate\nif TYPE_CHECKING:\n"
                      "    from autopp.data.plan import Plan\n"
                      "def f() -> None:\n    import autopp.run.worker\n    from ortools.sat.python import cp_model\n")
    known = {"autopp", "autopp.solve", "autopp.solve.dp", "autopp.solve.judge", "autopp.schedule",
             "autopp.data", "autopp.data.plan", "autopp.run", "autopp.run.worker"}
    ours, theirs = imports_of("autopp.solve.judge", source, known)
    assert ours == {"autopp.solve.dp", "autopp.schedule", "autopp.data.plan", "autopp.run.worker"}
    assert theirs == {"typing", "torch", "ortools"}
    assert layer_of("autopp.run.worker") == 8 and layer_of("autopp") == 9 and layer_of("autopp.runner") is None
