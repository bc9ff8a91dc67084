"""Render the runtime templates (`templates/*.py`) into a script's own style.

A template is a real module: its imports, its module docstring and anything under
`if __name__ == "__main__":` are dropped, and what the template needs from other
templates comes from injecting those too (dependencies first). The bodies are then
cut to what this script's patch uses (patcher/render/cut.py: options no call site passes,
definitions nothing reaches), docstrings and comments are dropped (code bytes count
toward the artifact cap; the explanations stay in `templates/` and docs/), and
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
from typing import Mapping

import libcst as cst
import libcst.matchers as m
import python_minifier

from patcher import templates
from patcher.render.cut import PASSED, CutError, StripDocsAndComments, constant_value, fold, names_read, prune
from patcher.transforms.base import Code
from patcher.transforms.features import TEMPLATE_DEPENDENCIES, TEMPLATE_OPTIONS

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
    """Top-level modules the template imports, other than `patcher.templates` itself."""
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


def _hooks(name: str) -> dict:
    """A template's `_CUT_HOOKS` dict literal (hook -> the template that fills it), evaluated ({} when absent)."""
    for stmt in _template_module(name).body:
        if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("_CUT_HOOKS"))])])):
            return ast.literal_eval(cst.Module([]).code_for_node(stmt.body[0].value))
    return {}


@lru_cache(maxsize=None)
def option_default(template: str, option: str) -> tuple[str, object]:
    """(entry function, default) of option `option` of template `template`: the
    template's module-level function that takes that parameter, and its default.

    Raises CutError unless exactly one such function exists and the default is a literal.
    """
    found = []
    for stmt in template_statements(template):
        if isinstance(stmt, cst.FunctionDef):
            found += [(stmt.name.value, p.default) for p in (*stmt.params.params, *stmt.params.kwonly_params) if p.name.value == option]
    known, value = constant_value(found[0][1]) if len(found) == 1 and found[0][1] is not None else (False, None)
    if not known:
        raise CutError(f"option {option} of templates/{template}.py: no single module-level function takes it with a literal default")
    return found[0][0], value


def cut_facts(names: list[str], calls: Mapping[str, list[Mapping[str, object]]]) -> dict:
    """The constants the cut may assume for templates `names` (dependencies included).

    calls: runtime function -> the options of each call the patch writes, {keyword:
    value} (`Context.runtime_calls`). An option of a template (`Feature.options`) that
    no call of its entry function passes has the default of that function's parameter;
    one that every call passes as a literal other than None is `PASSED` (a `Code`
    value may be anything at run time). A hook (`_CUT_HOOKS`: name -> the template that
    fills it) is empty unless that template is injected.
    """
    ordered = with_dependencies(names)
    facts = {}
    for name in ordered:
        for option in TEMPLATE_OPTIONS.get(name, ()):
            entry, default = option_default(name, option)
            given = [options[option] for options in calls.get(entry, []) if option in options]
            if not given:
                facts[option] = default
            elif len(given) == len(calls[entry]) and not any(isinstance(v, Code) or v is None for v in given):
                facts[option] = PASSED
        for hook, filler in _hooks(name).items():
            if filler not in ordered:
                facts[hook] = []
    return facts


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
