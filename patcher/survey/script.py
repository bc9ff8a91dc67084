"""Facts about a script as a whole: its style (minified or readable), whether it uses
torch, the names it defines at module level, its Hyperparameters class and its log
function."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from patcher import cst_walk
from patcher.cst_walk import dotted, walk
from patcher.survey.index import ScriptIndex


@dataclass
class Hyperparameters:
    """The Hyperparameters class. style: "class" | "dataclass" | "oneline"."""

    name: str
    node: cst.ClassDef
    line: int
    style: str


# ----------------------------------------------------------------------------- style


def is_minified(module: cst.Module) -> bool:
    """Minified scripts indent with tabs or put several statements on one line."""
    if module.default_indent == "\t":
        return True
    lines = [s for s in module.body if isinstance(s, cst.SimpleStatementLine)]
    multi = sum(1 for s in lines if len(s.body) > 2)
    return bool(lines) and multi * 4 > len(lines)


def imports(module: cst.Module, top: str) -> bool:
    """Whether the module imports the package `top` (or a module of it) anywhere."""
    for node in walk(module):
        if isinstance(node, cst.Import):
            for alias in node.names:
                if dotted(alias.name).split(".")[0] == top:
                    return True
        if isinstance(node, cst.ImportFrom) and node.module is not None and dotted(node.module).split(".")[0] == top:
            return True
    return False


def module_level_names(module: cst.Module) -> set[str]:
    """The functions, classes and plainly assigned names defined at module level."""
    names = set()
    for stmt in cst_walk.small_statements(module.body):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.add(stmt.name.value)
        elif isinstance(stmt, cst.Assign):
            names.update(t.target.value for t in stmt.targets if isinstance(t.target, cst.Name))
    return names


# ----------------------------------------------------------------------------- hyperparameters


def find_hyperparameters(module: cst.Module, line_of) -> Hyperparameters | None:
    """The first module-level class named as the records name their hyperparameters, or None;
    line_of: node -> 1-based line (`Survey.line_of`)."""
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value in ("Hyperparameters", "Hyperparams", "HParams", "Config", "Args"):
            dataclass = any(dotted(d.decorator if not isinstance(d.decorator, cst.Call) else d.decorator.func).endswith("dataclass") for d in stmt.decorators)
            body = stmt.body
            style = "dataclass" if dataclass else ("oneline" if isinstance(body, cst.SimpleStatementSuite) or _single_line_body(body) else "class")
            return Hyperparameters(
                name=stmt.name.value,
                node=stmt,
                line=line_of(stmt),
                style=style,
            )
    return None


def _single_line_body(body: cst.BaseSuite) -> bool:
    return isinstance(body, cst.IndentedBlock) and len(body.body) == 1 and isinstance(body.body[0], cst.SimpleStatementLine) and len(body.body[0].body) > 3


# ----------------------------------------------------------------------------- logging


# The names a script's log function goes by, in order of preference.
LOG_FUNCTIONS = ("log0", "log", "print0", "log_print")


def find_log_function(index: ScriptIndex) -> tuple[str, cst.CSTNode] | None:
    """The script's log function and the scope that defines it: the first of `LOG_FUNCTIONS`
    defined as a function (a method of that name is not callable by its bare name)."""
    for name in LOG_FUNCTIONS:
        for fn in index.functions:
            if fn.name.value == name and fn not in index.methods:
                return name, fn
    return None
