"""Undefined names anywhere in a script, found statically with pyflakes.

The import smoke runs definitions only; a name misspelt inside a function body, or in
training code that the smoke skips, would surface only when that line runs, minutes
into a paid run. pyflakes resolves every scope of the file without running it.
"""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass

from pyflakes import checker, messages

from patcher.transforms.py310_fstrings import requote

# pyflakes' findings that mean "this name is not defined where it is used".
_UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


@dataclass(frozen=True)
class UndefinedName:
    """One use of a name that no scope defines: `name`, 1-based `line`, 1-based `col`."""

    name: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"undefined name {self.name!r} at line {self.line}:{self.col}"

    def as_dict(self) -> dict:
        return {"name": self.name, "line": self.line, "col": self.col}


def undefined_names(source: str, filename: str = "<script>") -> list[UndefinedName] | None:
    """Every use of an undefined name in `source` (the payload for a wrapped script),
    in line order; None when the running Python cannot parse it (not even with its
    Python 3.12-only f-strings requoted, which keeps the same AST), or parses what only
    its compiler rejects and pyflakes asserts on (`from __future__` inside a function)."""
    code = source.removeprefix("\ufeff")
    tree = _parse(code, filename)
    if tree is None:
        requoted = requote(code)
        tree = _parse(requoted, filename) if requoted is not None else None
    if tree is None:
        return None
    try:
        found = checker.Checker(tree, filename=filename).messages
    except AssertionError:  # pyflakes asserts on what only the compiler rejects (`from __future__` in a function)
        return None
    out = {UndefinedName(m.message_args[0], m.lineno, m.col + 1) for m in found if isinstance(m, _UNDEFINED)}
    return sorted(out, key=lambda u: (u.line, u.col, u.name))


def _parse(code: str, filename: str) -> ast.Module | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(code, filename)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
