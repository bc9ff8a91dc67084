"""The `patcher` package imports one way: each layer imports only the layers below it.

    cli | hooks > tree | demo > patch_file : review : expect > check : proof > code_size > patch > render
        > transforms > families > survey > read > the shared helpers and the runtime (patcher.templates)

The runtime lives at the top of the repository (`templates/`) and installs as
`patcher.templates`; grimp walks `patcher/` on disk, so its modules and their imports are
added to the graph from `templates/` (`add_runtime`).

(`a | b`: siblings that never import each other; `a : b`: siblings that may.) A
type-only import (`if TYPE_CHECKING:`) counts, for the layers and for cycles: a family
typed against the transforms' `Context` is still a family that needs the transforms.
Cycles are looked for module by module, inside a layer too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

RUNTIME = Path(__file__).resolve().parent.parent / "templates"

LAYERS = (
    grimp.Layer("patcher.cli", "patcher.hooks", independent=True),
    grimp.Layer("patcher.tree", "patcher.demo", independent=True),
    grimp.Layer("patcher.patch_file", "patcher.review", "patcher.expect", independent=False),
    grimp.Layer("patcher.check", "patcher.proof", independent=False),
    "patcher.code_size",
    "patcher.patch",
    "patcher.render",
    "patcher.transforms",
    "patcher.families",
    "patcher.survey",
    "patcher.read",
    grimp.Layer(
        "patcher.cst_walk", "patcher.cst_lines", "patcher.colour", "patcher.progress", "patcher.suggest", "patcher.ab", "patcher.minify_worker", "patcher.templates",
        independent=False,
    ),
)

# Known and pending: the only imports allowed against the order, each (importer, imported).
KNOWN: set[tuple[str, str]] = set()  # (importer, imported) allowed against the layers: none


def add_runtime(g: grimp.ImportGraph) -> None:
    """Add `templates/*.py` to `g` as `patcher.templates.<name>`, each with the `patcher`
    modules it imports (what grimp would record, were the folder inside `patcher/`)."""
    for path in sorted(RUNTIME.glob("*.py")):
        module = "patcher.templates" if path.stem == "__init__" else f"patcher.templates.{path.stem}"
        g.add_module(module)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name == "patcher" or name.startswith("patcher."):
                    g.add_import(importer=module, imported=name, line_number=node.lineno, line_contents="")


def graph() -> grimp.ImportGraph:
    """The import graph of `patcher`, the runtime included, type-only imports included,
    the `KNOWN` ones taken out."""
    g = grimp.build_graph("patcher", cache_dir=None)
    add_runtime(g)
    for importer, imported in sorted(KNOWN):
        # An exception that no longer exists leaves the list, so that it cannot come back unseen.
        assert g.direct_import_exists(importer=importer, imported=imported), f"{importer} no longer imports {imported}: drop it from KNOWN"
        g.remove_import(importer=importer, imported=imported)
    return g


def upward_imports(g: grimp.ImportGraph) -> list[str]:
    """Each import against `LAYERS`, as "importer -> imported" (the first module of each
    chain), sorted; empty when every import points down."""
    found = []
    for dependency in g.find_illegal_dependencies_for_layers(layers=LAYERS):
        for route in dependency.routes:
            found += [f"{head} -> {' -> '.join(route.middle)}{' -> ' if route.middle else ''}{tail}" for head in route.heads for tail in route.tails]
    return sorted(found)


def cycles(g: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles of `g`: its strongly connected sets of more than one module
    (or a module that imports itself), each sorted, in sorted order."""
    edges = {m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in order:
            continue
        # Tarjan's algorithm, iterative: (module, index of its next import).
        work = [(root, 0)]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, i = work[-1]
            if i < len(edges[node]):
                work[-1] = (node, i + 1)
                nxt = edges[node][i]
                if nxt not in order:
                    order[nxt] = low[nxt] = len(order)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], order[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges[node]:
                    found.append(sorted(component))
    return sorted(found)


@pytest.fixture(scope="module")
def imports() -> grimp.ImportGraph:
    return graph()


def test_every_import_points_down_the_layers(imports):
    assert upward_imports(imports) == []


def test_no_import_cycles(imports):
    assert cycles(imports) == []


def test_the_runtime_is_in_the_graph(imports):
    """`templates/` is walked: its modules and the imports between them are there."""
    assert "patcher.templates.prefetch_lean" in imports.modules
    assert imports.direct_import_exists(importer="patcher.templates.prefetch_lean", imported="patcher.templates.staging")


def test_an_upward_import_or_a_cycle_is_found(imports):
    """A survey module that imports a transform goes against the layers; two proof
    modules of one layer that import each other make a cycle; a runtime module that
    imports the proof goes against the layers too."""
    planted = [("patcher.survey.index", "patcher.transforms.base"), ("patcher.proof.compare", "patcher.proof.verify"), ("patcher.templates.staging", "patcher.proof.compare")]
    for importer, imported in planted:
        imports.add_import(importer=importer, imported=imported)
    try:
        assert upward_imports(imports) == ["patcher.survey.index -> patcher.transforms.base", "patcher.templates.staging -> patcher.proof.compare"]
        assert [c for c in cycles(imports) if "patcher.proof.compare" in c] != []
    finally:
        for importer, imported in planted:
            imports.remove_import(importer=importer, imported=imported)
