"""Evaluate a script's own expressions outside the function that runs them.

`evaluate_script_code` evaluates an expression in a namespace standing in for the
enclosing function; a name it lacks is evaluated first from its one assignment (or its
one unconditional assignment) where the script's scopes resolve it, or bound by the
script's own import statement. `verdicts_of` surveys and judges a source text once;
`survey_of` gives its facts.
"""

from __future__ import annotations

import functools
import sys

import libcst as cst

from patcher.families import registry
from patcher.families.verdicts import Verdicts
from patcher.proof.harness import HarnessError
from patcher.survey.survey import Survey


@functools.lru_cache(maxsize=4)
def verdicts_of(source: str) -> Verdicts:
    """The families' verdicts on `source` (str), parsed, surveyed and judged once per
    source text: both are read-only, so verify's recipes and validation pairs share them."""
    return registry.judge(cst.parse_module(source))


def survey_of(source: str) -> Survey:
    """The survey (facts) of `source` (str), from `verdicts_of`."""
    return verdicts_of(source).survey


def evaluate_script_code(surveyed: Survey, code: str, ns: dict, scope, depth: int = 0, assumed: list[str] | None = None):
    """Evaluate the script's `code` in `ns`. A name missing from `ns` that has exactly one
    assignment where `scope` resolves it is evaluated first, from that assignment (and
    stored in `ns`); of several assignments, the one unconditional assignment is taken,
    and `assumed` (when given) gets "`name` = <code> (line N)". Raises HarnessError when
    a name cannot be found that way."""
    try:
        return eval(code, ns)
    except NameError as error:
        name = getattr(error, "name", None)
        owner = scope.resolve(name) if name and scope is not None else None
        if owner is None and name and depth <= 8 and _import_binding(surveyed, scope, name, ns):
            return evaluate_script_code(surveyed, code, ns, scope, depth + 1, assumed)
        bindings = owner.bindings.get(name, []) if owner is not None else []
        if len(bindings) > 1:
            # the one assignment that runs unconditionally, directly in the module or
            # function body: a fresh run's value (a top-level script's `bs =
            # args.schedule[0]` before the loop that reassigns it; `resume_tokens_consumed
            # = 0` before `if args.resume_from:` changes it)
            bindings = [b for b in bindings if b[0] == "assign" and b[1] is not None and _is_unconditional_assignment(surveyed, owner, b[1])]
            if len(bindings) == 1 and assumed is not None:
                value = bindings[0][1]
                assumed.append(f"`{name}` = {surveyed.module.code_for_node(value)} (line {surveyed.line_of(value)}), its unconditional assignment")
        if depth > 8 or len(bindings) != 1 or bindings[0][1] is None:
            raise HarnessError(f"cannot evaluate `{code}` outside the script: {error}") from None
        ns[name] = evaluate_script_code(surveyed, surveyed.module.code_for_node(bindings[0][1]), ns, owner, depth + 1, assumed)
        if owner is surveyed.collector.module_scope:
            _module_globals(ns).setdefault(name, ns[name])  # the script's functions read it there
        return evaluate_script_code(surveyed, code, ns, scope, depth + 1, assumed)


def _module_globals(ns: dict) -> dict:
    """The globals of the module `ns` was copied from (its `__name__` in sys.modules), else `ns`."""
    module = sys.modules.get(ns.get("__name__", ""))
    return module.__dict__ if module is not None else ns


def _import_binding(surveyed: Survey, scope, name: str, ns: dict) -> bool:
    """Bind `name` in `ns` by running the script's own import statement that binds it,
    where Python would find it from `scope`: an import in the enclosing function bodies
    (innermost first; `import numpy as np` inside `main()`, under a `try:` or an `if`),
    else one at module level that the import of the module did not run (under `if
    __name__ == "__main__":` or another guard). An import that raises ImportError is
    skipped for the next one (the guard's fallback). Returns True when `name` is bound."""
    owners, missing = [], None
    while scope is not None:
        owners.append(scope.node if scope.node is not None else surveyed.module)
        scope = scope.parent
    for owner in owners or [surveyed.module]:
        for statement in _imports_in_body(owner):
            if name not in names_imported(statement):
                continue
            try:
                exec(compile(cst.Module([cst.SimpleStatementLine([statement])]).code, "<script import>", "exec"), ns)
            except ImportError as error:
                missing = missing or error
                continue
            if name in ns:
                if owner is surveyed.module:
                    _module_globals(ns).setdefault(name, ns[name])  # a module-level import the import did not run
                return True
    if missing is not None:
        raise missing
    return False


class _BodyImports(cst.CSTVisitor):
    """Import statements of one body, in source order, not those of nested functions or classes."""

    def __init__(self, root: cst.CSTNode):
        self.root, self.found = root, []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.root

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return node is self.root

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Import(self, node: cst.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not isinstance(node.names, cst.ImportStar):
            self.found.append(node)


def _imports_in_body(owner: cst.CSTNode) -> list:
    visitor = _BodyImports(owner)
    owner.visit(visitor)
    return visitor.found


def names_imported(statement) -> set[str]:
    """The names an `import` / `from ... import` statement binds."""
    names = set()
    for alias in statement.names:
        if alias.asname is not None:
            names.add(alias.asname.name.value)
        elif isinstance(statement, cst.Import):
            names.add(cst.Module([]).code_for_node(alias.name).split(".")[0])
        else:
            names.add(alias.name.value)
    return names


def _is_unconditional_assignment(surveyed: Survey, owner, value: cst.CSTNode) -> bool:
    """True when `value` is assigned by a statement directly in the body of `owner`, the
    scope holding the name (the module, or a function: not inside an if, loop or with)."""
    if owner is surveyed.collector.module_scope:
        statements = [surveyed.top_level_of(value)]
    elif isinstance(owner.node, cst.FunctionDef) and isinstance(owner.node.body, cst.IndentedBlock):
        statements = owner.node.body.body
    else:
        return False
    return any(isinstance(top, cst.SimpleStatementLine) and any(getattr(small, "value", None) is value for small in top.body) for top in statements)
