"""Render the runtime templates (`templates/*.py`) into a script's own style.

A template is a real module: its imports, its module docstring and anything under
`if __name__ == "__main__":` are dropped, and what the template needs from other
templates comes from injecting those too (dependencies first). The bodies are then
cut to what this script's patch uses (patcher/render/cut.py: options no call site passes,
definitions nothing reaches), docstrings and comments are dropped (code bytes count
toward the artifact cap; the explanations stay in `templates/` and the README), and
the imports the kept code needs and the script lacks are emitted once, in front of
it, after one header line naming the tool, its version and the toggles. A minified
script gets the code as python-minifier writes it (`styled`); the indentation follows
the script's (libcst renders new blocks with the module's own indent, tabs included).
"""

from __future__ import annotations

import ast
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import python_minifier

import templates
from patcher.render.cut import PASSED, StripDocsAndComments, constant_value, fold, names_read, prune
from patcher.transforms.features import TEMPLATE_DEPENDENCIES

TEMPLATE_DIR = Path(templates.__file__).parent


MARKER = "# patch-prefetch {version}; toggles: {toggles}"


def tool_version() -> str:
    """The installed version of patch-prefetch ("dev" when run from a source tree only)."""
    try:
        return version("patch-prefetch")
    except PackageNotFoundError:
        return "dev"


@lru_cache(maxsize=None)
def _template_module(name: str) -> cst.Module:
    return cst.parse_module((TEMPLATE_DIR / f"{name}.py").read_text())


def template_imports(name: str) -> list[str]:
    """Top-level modules the template imports, other than `templates` itself."""
    found = []
    for stmt in _template_module(name).body:
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Import()])):
            for alias in stmt.body[0].names:
                found.append(cst.Module([]).code_for_node(alias.name))
    return found


def template_statements(name: str) -> list[cst.BaseStatement]:
    """The template's own statements (no imports, no module docstring, no `__main__` block), as written."""
    body = []
    for index, stmt in enumerate(_template_module(name).body):
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom)):
            continue
        if index == 0 and m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])):
            continue
        if m.matches(stmt, m.If(test=m.Comparison(left=m.Name("__name__")))):
            continue
        body.append(stmt)
    return body


def styled(body: list[cst.BaseStatement], minified: bool) -> list[cst.BaseStatement]:
    """Statements without docstrings or comments, in the script's style.

    A minified script gets them as python-minifier writes them with the flags the
    records count their code with (`pyminify --no-rename-locals --no-hoist-literals
    --remove-literal-statements`): names kept, no spaces around operators and commas,
    `;`-joined lines, one-line bodies. Every byte counts against the artifact cap.
    """
    body = [s.visit(StripDocsAndComments()) for s in body]
    if minified:
        code = python_minifier.minify(cst.Module(body).code, rename_locals=False, hoist_literals=False, remove_literal_statements=True)
        body = list(cst.parse_module(code).body)
    # No blank lines inside the block: every line of it counts in the script's diff.
    return [s.with_changes(leading_lines=[]) for s in body]


def _declared(name: str, variable: str) -> dict:
    """A template's `_CUT_OPTIONS` / `_CUT_HOOKS` dict literal, evaluated ({} when absent)."""
    for stmt in _template_module(name).body:
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name(variable))])])):
            return ast.literal_eval(cst.Module([]).code_for_node(stmt.body[0].value))
    return {}


def cut_facts(names: list[str], passed_keywords: set[str], always_passed: set[str] = frozenset()) -> dict:
    """The constants the cut may assume for templates `names` (dependencies included).

    An option (a template's `_CUT_OPTIONS`) that no call site passes as a keyword
    (`passed_keywords`) has its declared value; one that every call site passes as a
    literal other than None (`always_passed`, see `always_passed`) is `PASSED`; a hook
    (`_CUT_HOOKS`: name -> the template that fills it) is empty unless that template is
    injected.
    """
    ordered = with_dependencies(names)
    facts = {}
    for name in ordered:
        for option, value in _declared(name, "_CUT_OPTIONS").items():
            if option not in passed_keywords:
                facts[option] = value
            elif option in always_passed:
                facts[option] = PASSED
        for hook, filler in _declared(name, "_CUT_HOOKS").items():
            if filler not in ordered:
                facts[hook] = []
    return facts


def always_passed(names: list[str], calls: list[cst.Call]) -> set[str]:
    """Parameters of the templates' functions (templates `names`, dependencies included)
    that every call in `calls` (the script's calls) of a function taking them passes as
    a keyword with a literal value other than None (`assembly="_get_shard_memmap"`)."""
    signatures = {}
    for name in with_dependencies(names):
        for stmt in template_statements(name):
            if isinstance(stmt, cst.FunctionDef):
                signatures[stmt.name.value] = [p.name.value for p in (*stmt.params.params, *stmt.params.kwonly_params)]
    verdict: dict[str, bool] = {}
    for call in calls:
        if not isinstance(call.func, cst.Name) or call.func.value not in signatures:
            continue
        given = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        for param in signatures[call.func.value]:
            known, value = constant_value(given[param]) if param in given else (False, None)
            verdict[param] = verdict.get(param, True) and known and value is not None
    return {param for param, every in verdict.items() if every}


def with_dependencies(names: list[str]) -> list[str]:
    """Template names in injection order, dependencies first, each once."""
    ordered: list[str] = []

    def add(name: str) -> None:
        for dep in TEMPLATE_DEPENDENCIES.get(name, []):
            add(dep)
        if name not in ordered:
            ordered.append(name)

    for name in names:
        add(name)
    return ordered


def runtime_block(names: list[str], script_imports: set[str], minified: bool, toggles: list[str], facts: dict | None = None, roots: set[str] | None = None) -> list[cst.BaseStatement]:
    """Statements to insert at module level: one header line, missing imports, the templates.

    facts: option constants for the cut (`cut_facts`); roots: names and attribute
    names the rest of the patched script reads (None: keep every definition).
    """
    ordered = with_dependencies(names)
    body: list[cst.BaseStatement] = []
    for name in ordered:
        body.extend(template_statements(name))
    body = fold(body, facts or {})
    if roots is not None:
        body = prune(body, roots)
    read = set().union(*(names_read(stmt) for stmt in body))
    needed = []
    for name in ordered:
        for module in template_imports(name):
            if module not in script_imports and module not in needed and module.split(".")[0] in read:
                needed.append(module)
    sep = "," if minified else ", "
    statements: list[cst.BaseStatement] = []
    marker = cst.EmptyLine(comment=cst.Comment(MARKER.format(version=tool_version(), toggles=" ".join(toggles) or "none")))
    if needed:
        statements.append(cst.parse_statement(f"import {sep.join(needed)}\n"))
    statements.extend(styled(body, minified))
    first = statements[0]
    leading = [marker] if minified else [cst.EmptyLine(), marker]
    statements[0] = first.with_changes(leading_lines=leading)
    return statements
