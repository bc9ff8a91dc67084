"""Read-only traversal of libcst trees without rebuilding them.

`node.visit(visitor)` and `node.children` both go through libcst's
`_visit_and_replace_children`, which constructs (and validates) a new copy of every
node on the way, even for a visitor that changes nothing. On a 60-160 KB training
script that copy is most of the survey's time. `visit` and `children` here read the
same fields in the same order (taken once from libcst's own
`_visit_and_replace_children` of each node class) and build nothing, so a
`cst.CSTVisitor` sees exactly the calls `node.visit(visitor)` would make.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache
from operator import attrgetter

import libcst as cst

# libcst's helpers that visit one field: visit_required(node, "field", value, visitor), ...
_FIELD_VISITORS = {"visit_required", "visit_optional", "visit_sentinel", "visit_sequence", "visit_body_sequence", "visit_iterable", "visit_body_iterable"}


@lru_cache(maxsize=None)
def field_order(node_type: type) -> tuple[str, ...] | None:
    """The fields of `node_type` in the order libcst visits them, or None where that
    order cannot be read from its `_visit_and_replace_children` (then `children` falls
    back to libcst's own)."""
    try:
        source = textwrap.dedent(inspect.getsource(node_type._visit_and_replace_children))
    except (OSError, TypeError):
        return None
    calls = [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _FIELD_VISITORS
        and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
    ]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return tuple(dict.fromkeys(n.args[1].value for n in calls)) or None


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """`node.children` without rebuilding `node`: its child nodes in visit order."""
    try:
        fields = _FIELDS[type(node)]
    except KeyError:
        fields = _FIELDS[type(node)] = _field_getter(type(node))
    if fields is None:
        return list(node.children)
    out: list[cst.CSTNode] = []
    for value in fields(node):
        if isinstance(value, cst.CSTNode):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, cst.CSTNode))
    return out


# node type -> a function giving the values of its fields in visit order (a tuple), or None
_FIELDS: dict = {}


def _field_getter(node_type: type):
    order = field_order(node_type)
    if order is None:
        return None
    if len(order) == 1:
        name = order[0]
        return lambda node: (getattr(node, name),)
    return attrgetter(*order)


def visit(node: cst.CSTNode, visitor: cst.CSTVisitor) -> None:
    """Run a read-only `visitor` over `node` as `node.visit(visitor)` would (on_visit,
    children when it returns true, on_leave), without rebuilding the tree and without
    recursion (deeply nested expressions stay within Python's recursion limit).
    Attribute hooks (`visit_Call_func`, ...) are not called."""
    stack: list[tuple[cst.CSTNode, bool]] = [(node, False)]
    while stack:
        current, leaving = stack.pop()
        if leaving:
            visitor.on_leave(current)
            continue
        stack.append((current, True))
        if visitor.on_visit(current):
            stack.extend((child, False) for child in reversed(children(current)))


def walk(node: cst.CSTNode):
    """Every node below `node` (pre-order), `node` included."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(children(current)))


def walk_own(node: cst.CSTNode):
    """Nodes under `node` (pre-order, `node` included), not entering the function, class
    or lambda definitions below it: what runs in `node`'s own scope."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if isinstance(current, (cst.FunctionDef, cst.ClassDef, cst.Lambda)) and current is not node:
            continue
        stack.extend(reversed(children(current)))


def dotted(node: cst.BaseExpression, partial: bool = True) -> str | None:
    """"a.b.c" for a Name/Attribute chain.

    With `partial` a part that is not a name reads as "" (`f().x` gives ".x") and a node
    that is neither a Name nor an Attribute gives ""; without it, both give None.
    """
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value, partial)
        return None if base is None or (not partial and not base) else f"{base}.{node.attr.value}"
    return "" if partial else None


def dotted_reads(expr: cst.CSTNode) -> list[str]:
    """Names an expression reads in its own scope: plain names and dotted attribute
    chains (`args.train_seq_len` gives "args", "train_seq_len" and "args.train_seq_len")."""
    out = []
    for n in walk_own(expr):
        if isinstance(n, cst.Name):
            out.append(n.value)
        if isinstance(n, cst.Attribute) and dotted(n):
            out.append(dotted(n))
    return out


def small_statements(statements) -> list[cst.CSTNode]:
    """`statements` (a block's or a module's body) with each simple statement line
    replaced by its small statements (`a = 1; b = 2` gives two), compound ones as they are."""
    out: list[cst.CSTNode] = []
    for stmt in statements:
        if isinstance(stmt, cst.SimpleStatementLine):
            out.extend(stmt.body)
        else:
            out.append(stmt)
    return out
