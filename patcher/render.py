"""Render the runtime templates (`templates/*.py`) into a script's own style.

A template is a real module: its imports, its module docstring and anything under
`if __name__ == "__main__":` are dropped, and what the template needs from other
templates comes from injecting those too (dependencies first). Imports the script
lacks are emitted once, in front of the injected code. In a minified script the
docstrings and comments are dropped as well (code bytes count toward the artifact
cap); the indentation follows the script's (libcst renders new blocks with the
module's own indent, tabs included).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import libcst as cst
import libcst.matchers as m

import templates

TEMPLATE_DIR = Path(templates.__file__).parent

# template name -> templates it uses, injected before it
DEPENDENCIES = {
    "copy_stream": [],
    "prefetch_loader": ["copy_stream"],
    "prefetch_iterator": ["prefetch_loader"],
    "prefetch_val": ["prefetch_loader"],
    "val_bytecount": [],
    "val_progress": [],
    "step_timing": ["copy_stream"],
    "ordered_handoff": ["prefetch_loader"],
    "shuffled_assembly": [],
}

MARKER = "# patch-prefetch runtime: {names}. Toggles: {toggles}."


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


def template_body(name: str, minified: bool) -> list[cst.BaseStatement]:
    """The template's statements to inject (no imports, no module docstring)."""
    body = []
    for index, stmt in enumerate(_template_module(name).body):
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom)):
            continue
        if index == 0 and m.matches(stmt, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())])):
            continue
        if m.matches(stmt, m.If(test=m.Comparison(left=m.Name("__name__")))):
            continue
        body.append(stmt)
    if minified:
        body = [s.visit(_StripDocsAndComments()).visit(_JoinSimpleLines()) for s in body]
        body = _join_runs(body)
    body = [s.with_changes(leading_lines=[]) for s in body]
    # one blank line between definitions, as the script's own code usually has
    return [s.with_changes(leading_lines=[cst.EmptyLine()]) if i and not minified else s for i, s in enumerate(body)]


def with_dependencies(names: list[str]) -> list[str]:
    """Template names in injection order, dependencies first, each once."""
    ordered: list[str] = []

    def add(name: str) -> None:
        for dep in DEPENDENCIES.get(name, []):
            add(dep)
        if name not in ordered:
            ordered.append(name)

    for name in names:
        add(name)
    return ordered


def runtime_block(names: list[str], script_imports: set[str], minified: bool, toggles: list[str]) -> list[cst.BaseStatement]:
    """Statements to insert at module level: missing imports, a marker comment, the templates."""
    ordered = with_dependencies(names)
    needed = []
    for name in ordered:
        for module in template_imports(name):
            if module not in script_imports and module not in needed:
                needed.append(module)
    sep = "," if minified else ", "
    statements: list[cst.BaseStatement] = []
    marker = cst.EmptyLine(comment=cst.Comment(MARKER.format(names=", ".join(ordered), toggles=", ".join(toggles) or "none")))
    if needed:
        statements.append(cst.parse_statement(f"import {sep.join(needed)}\n"))
    for name in ordered:
        statements.extend(template_body(name, minified))
    first = statements[0]
    leading = [marker] if minified else [cst.EmptyLine(), marker]
    statements[0] = first.with_changes(leading_lines=leading)
    return statements


class _StripDocsAndComments(cst.CSTTransformer):
    """Drop docstrings, comment lines and blank lines (minified scripts keep code bytes low)."""

    def leave_IndentedBlock(self, original_node, updated_node):
        body = list(updated_node.body)
        if len(body) > 1 and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])):
            body = body[1:]
        return updated_node.with_changes(body=body)

    def leave_EmptyLine(self, original_node, updated_node):
        return cst.RemovalSentinel.REMOVE

    def leave_TrailingWhitespace(self, original_node, updated_node):
        return updated_node.with_changes(comment=None, whitespace=cst.SimpleWhitespace(""))


_SEMICOLON = cst.Semicolon(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


def _join_runs(statements: list) -> list:
    """Merge each run of simple statement lines into one `;`-joined line."""
    out: list = []
    for stmt in statements:
        previous = out[-1] if out else None
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(previous, cst.SimpleStatementLine) and not stmt.leading_lines:
            body = list(previous.body[:-1]) + [previous.body[-1].with_changes(semicolon=_SEMICOLON)] + list(stmt.body)
            out[-1] = previous.with_changes(body=body, trailing_whitespace=stmt.trailing_whitespace)
        else:
            out.append(stmt)
    return out


class _JoinSimpleLines(cst.CSTTransformer):
    """Minified style: `a=1;b=2` on one line, and a one-line body after the colon."""

    def leave_IndentedBlock(self, original_node, updated_node):
        body = _join_runs(list(updated_node.body))
        if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and not body[0].leading_lines:
            return cst.SimpleStatementSuite(body=body[0].body, leading_whitespace=cst.SimpleWhitespace(""))
        return updated_node.with_changes(body=body)
