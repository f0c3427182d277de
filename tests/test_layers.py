"""The import graph of the rlhf_lightning package, read with ast (nothing is imported): no circle, and
every import points down these layers (an import inside a function counts: a lazy import hides a
circle, it does not remove it). An import under ``if TYPE_CHECKING:`` names a type for the annotations and
never runs: it counts for the layers, not for the circle (checks.py annotates with args.py's groups, which
import checks.py's ``require``).

    layer  modules                                 may import
    3      rlhf_lightning.cli (the command)        every layer
    2      rlhf_lightning.exact.* (the lab)        layers 1 and 2
    1      every other module (the framework)      layer 1

So the framework never imports the lab; the command imports it for ``class_path: KLToOptimum``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlhf_lightning"


def layer(module: str) -> int:
    return 3 if module == "rlhf_lightning.cli" else 2 if module.startswith("rlhf_lightning.exact") else 1


def type_checking_blocks(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:`` (imports for the annotations alone)."""
    blocks = [node for node in ast.walk(tree) if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")]
    return {inner for block in blocks for statement in block.body for inner in ast.walk(statement)}


def import_graph(root: Path = PACKAGE, annotations: bool = True) -> dict[str, set[str]]:
    """Each module's imports of the package's modules (a package stands for its ``__init__``); importing
    ``p.q.m`` from outside ``p.q`` runs ``p.q`` first, so it counts as an import of ``p.q`` too. Without
    ``annotations``: only the imports that run (not those under ``if TYPE_CHECKING:``)."""
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        tree = ast.parse(path.read_text())
        skipped = set() if annotations else type_checking_blocks(tree)
        for node in (node for node in ast.walk(tree) if node not in skipped):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:  # `from p import m` imports p.m where m is a module
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names}
        targets = {t for t in targets if t in files and t != name}
        parents = {p for t in targets for p in files if t.startswith(f"{p}.") and p != root.name and not f"{name}.".startswith(f"{p}.")}
        graph[name] = targets | parents
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports, as the modules along it, or [] (a depth-first search)."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        cycle = [] if node in done else next(filter(None, (visit(t, [*path, node]) for t in sorted(graph[node]))), [])
        done.add(node)
        return cycle

    return next(filter(None, (visit(node, []) for node in sorted(graph))), [])


def test_the_package_imports_in_no_circle():
    assert find_cycle(import_graph(annotations=False)) == []


def test_every_import_points_down_the_layers():
    upward = sorted((m, t) for m, targets in import_graph().items() for t in targets if layer(t) > layer(m))
    assert upward == [], "a lower layer imports a higher one (module docstring)"


def test_the_command_loads_of_the_lab_the_meter_and_the_math_it_reads():
    """The command imports the lab for ``class_path: KLToOptimum`` alone: the meter and what it reads (the package's
    ``__init__`` re-exports nothing), not the tasks and the training harness that import the module."""
    graph = import_graph(annotations=False)
    imported = {t for t in graph["rlhf_lightning.cli"] if layer(t) == 2}
    assert imported == {"rlhf_lightning.exact", "rlhf_lightning.exact.meter"}
    loaded, todo = set(), list(imported)
    while todo:
        name = todo.pop()
        if name not in loaded:
            loaded.add(name)
            todo.extend(graph[name])
    lab = {f"rlhf_lightning.exact.{name}" for name in ("meter", "frontier", "closed_form", "f_divergence", "tabular")}
    assert {name for name in loaded if layer(name) == 2} == {"rlhf_lightning.exact", *lab}
