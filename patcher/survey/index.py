"""`ScriptIndex`: one read-only pass over a script that the survey and the transforms look things up in.

The pass records scopes and their bindings (for the run-constant analysis and for the
names a transform may use), the calls the survey and the features ask about
(`next_batch`, `next`, `.send`, calls by name), `name = Call(...)` assignments, the
functions and generator functions, attribute reads and writes, the f-strings, and the
module-level statement that holds every node. Nodes are kept by identity: they belong
to the surveyed `Module`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import libcst as cst
import libcst.matchers as m


@dataclass
class AttributeUse:
    """`base.attr` read or written in `scope` (`base` a plain name other than `self`)."""

    base: str
    attr: str
    scope: "Scope"


class Scope:
    """A function, a class body, or the module (node None): the names bound in it.

    node: the `FunctionDef` / `ClassDef`, None for the module. parent: the scope its
    names resolve in next (a method's parent skips its class, as Python does).
    bindings: name -> every binding of it here, in source order, as (kind, value):
    kind "param" | "assign" (one plain `name = value`) | "loop" | "aug" | "other";
    value the assigned expression for "assign", else None.
    """

    def __init__(self, node: cst.CSTNode | None, parent: "Scope | None"):
        self.node = node
        self.parent = parent
        self.bindings: dict[str, list[tuple[str, cst.BaseExpression | None]]] = {}

    def bind(self, name: str, kind: str, value: cst.BaseExpression | None = None) -> None:
        self.bindings.setdefault(name, []).append((kind, value))

    def resolve(self, name: str) -> "Scope | None":
        """The scope whose binding of `name` a use here sees (this one or an enclosing one), or None."""
        scope = self
        while scope is not None:
            if name in scope.bindings:
                return scope
            scope = scope.parent
        return None


class ScriptIndex(cst.CSTVisitor):
    """What one pass over a module finds; read-only once the pass is over (`Survey.collector`).

    Public attributes, all filled by `patcher.cst_walk.visit(module, index)`:

    module_scope: the module's `Scope`. scope_of: `FunctionDef` -> its `Scope`.
    top_of: every node of the module -> the statement of `module.body` that holds it (a
    read-only mapping; `Survey.top_level_of` is the lookup to use).
    assigned_attributes: every `(base, attr)` assigned anywhere (`base.attr = ...`,
    `+=`, annotated, `setattr(base, "attr", ...)`).
    calls: every `name.next_batch(...)` call, with its scope. call_assigns: every
    `target = f(...)` assignment, with its scope. next_calls: every `next(name, ...)`;
    send_calls: every `name.send(value)`; each with its scope.
    calls_by_name: for a call of a plain name `f(...)`, every such call by `f`.
    functions: every `FunctionDef`, in source order. generator_functions: those that yield.
    methods: those defined directly in a class body (not callable by their bare name).
    attribute_uses: every `AttributeUse`, in source order.
    fstrings: every f-string, with the f-strings it sits in (outermost first).
    loops: every `for` statement, in source order. imports: every `import` statement
    (not `from ... import`), in source order. strings: every simple string literal, with
    the outermost function it sits in (None at module or class level), in source order.
    """

    def __init__(self) -> None:
        self.module_scope = Scope(None, None)
        self.scope_of: dict[cst.CSTNode, Scope] = {}
        self._top_of: dict[cst.CSTNode, cst.CSTNode] = {}
        self.top_of = MappingProxyType(self._top_of)
        self.assigned_attributes: set[tuple[str, str]] = set()
        self.calls: list[tuple[cst.Call, Scope]] = []
        self.call_assigns: list[tuple[cst.Assign, Scope]] = []
        self.functions: list[cst.FunctionDef] = []
        self.attribute_uses: list[AttributeUse] = []
        self.next_calls: list[tuple[cst.Call, Scope]] = []
        self.send_calls: list[tuple[cst.Call, Scope]] = []
        self.generator_functions: set[cst.FunctionDef] = set()
        self.methods: set[cst.FunctionDef] = set()
        self.calls_by_name: dict[str, list[cst.Call]] = {}
        self.fstrings: list[tuple[cst.FormattedString, tuple]] = []
        self.loops: list[cst.For] = []
        self.imports: list[cst.Import] = []
        self.strings: list[tuple[cst.SimpleString, cst.FunctionDef | None]] = []
        # the pass's own state
        self._scope = self.module_scope
        self._stack = [self.module_scope]
        self._top: cst.CSTNode | None = None
        self._fstring_stack: list[cst.FormattedString] = []
        self._outer_function: cst.FunctionDef | None = None
        self._visits: dict[type, object] = {}  # node type -> its bound visit_/leave_ method, or None
        self._leaves: dict[type, object] = {}

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._top is None:
            self._top = node if not isinstance(node, cst.Module) else None
        self._top_of[node] = self._top
        # CSTVisitor.on_visit, with its `visit_<Type>` lookup made once per node type
        kind = type(node)
        try:
            visit = self._visits[kind]
        except KeyError:
            visit = self._visits[kind] = getattr(self, f"visit_{kind.__name__}", None)
        return visit is None or visit(node) is not False

    def on_leave(self, original_node: cst.CSTNode) -> None:
        kind = type(original_node)
        try:
            leave = self._leaves[kind]
        except KeyError:
            leave = self._leaves[kind] = getattr(self, f"leave_{kind.__name__}", None)
        if leave is not None:
            leave(original_node)
        if original_node is self._top:
            self._top = None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._scope.bind(node.name.value, "other")
        if self._outer_function is None:
            self._outer_function = node
        self.functions.append(node)
        if isinstance(self._scope.node, cst.ClassDef):
            self.methods.add(node)
        # Python resolves names in a method past the class body, to the enclosing function.
        parent = self._scope
        while parent.node is not None and isinstance(parent.node, cst.ClassDef):
            parent = parent.parent
        self._push(Scope(node, parent))
        self.scope_of[node] = self._scope
        for p in list(node.params.posonly_params) + list(node.params.params) + list(node.params.kwonly_params):
            self._scope.bind(p.name.value, "param")
        for star in (node.params.star_arg, node.params.star_kwarg):
            if isinstance(star, cst.Param):
                self._scope.bind(star.name.value, "param")

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._pop()
        if original_node is self._outer_function:
            self._outer_function = None

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._scope.bind(node.name.value, "other")
        self._push(Scope(node, self._scope))

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self._pop()

    def _push(self, scope: Scope) -> None:
        self._stack.append(scope)
        self._scope = scope

    def _pop(self) -> None:
        self._stack.pop()
        self._scope = self._stack[-1]

    def visit_Import(self, node: cst.Import) -> None:
        self.imports.append(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        self.strings.append((node, self._outer_function))

    def visit_For(self, node: cst.For) -> None:
        self.loops.append(node)
        for name in _target_names(node.target):
            self._scope.bind(name, "loop")

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            if len(node.targets) == 1 and _parallel_assignment(t.target, node.value):
                # `B, T = args.batch_size, args.seq_len`: each name has its own value
                for target, value in zip(t.target.elements, node.value.elements):
                    self._scope.bind(target.value.value, "assign", value.value)
                continue
            names = _target_names(t.target)
            for name in names:
                kind = "assign" if isinstance(t.target, cst.Name) and len(node.targets) == 1 else "other"
                self._scope.bind(name, kind, node.value if kind == "assign" else None)
            self._note_attribute(t.target)
        if isinstance(node.value, cst.Call):
            self.call_assigns.append((node, self._scope))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        for name in _target_names(node.target):
            self._scope.bind(name, "assign" if node.value is not None else "other", node.value)
        self._note_attribute(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        for name in _target_names(node.target):
            self._scope.bind(name, "aug")
        self._note_attribute(node.target)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        for name in _target_names(node.target):
            self._scope.bind(name, "other")

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            for name in _target_names(node.asname.name):
                self._scope.bind(name, "other")

    def visit_CompFor(self, node: cst.CompFor) -> None:
        for name in _target_names(node.target):
            self._scope.bind(name, "loop")

    def visit_Global(self, node: cst.Global) -> None:
        for item in node.names:
            self._scope.bind(item.name.value, "other")

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        for item in node.names:
            self._scope.bind(item.name.value, "other")

    def visit_Call(self, node: cst.Call) -> None:
        # The callee's last name first: a script has thousands of calls, matchers are slow.
        func = node.func
        if isinstance(func, cst.Name):
            self.calls_by_name.setdefault(func.value, []).append(node)
        callee = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
        if callee not in ("next", "send", "next_batch", "setattr"):
            return
        if m.matches(node, m.Call(func=m.Name("next"), args=[m.Arg(m.Name()), m.ZeroOrMore()])):
            self.next_calls.append((node, self._scope))
        if m.matches(node, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("send")), args=[m.Arg(keyword=None)])):
            self.send_calls.append((node, self._scope))
        if m.matches(node, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("next_batch")))):
            self.calls.append((node, self._scope))
        if m.matches(node, m.Call(func=m.Name("setattr"), args=[m.Arg(m.Name()), m.Arg(m.SimpleString()), m.ZeroOrMore()])):
            self.assigned_attributes.add((node.args[0].value.value, node.args[1].value.evaluated_value))

    def visit_Yield(self, node: cst.Yield) -> None:
        if isinstance(self._scope.node, cst.FunctionDef):
            self.generator_functions.add(self._scope.node)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        self.fstrings.append((node, tuple(self._fstring_stack)))
        self._fstring_stack.append(node)

    def leave_FormattedString(self, original_node: cst.FormattedString) -> None:
        self._fstring_stack.pop()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value != "self":
            self.attribute_uses.append(AttributeUse(node.value.value, node.attr.value, self._scope))

    def _note_attribute(self, target: cst.BaseExpression) -> None:
        for element in _flatten_targets(target):
            if isinstance(element, cst.Attribute) and isinstance(element.value, cst.Name):
                self.assigned_attributes.add((element.value.value, element.attr.value))


def _parallel_assignment(target: cst.BaseExpression, value: cst.BaseExpression) -> bool:
    """`a, b = x, y`: names on the left, as many plain (unstarred) values on the right."""
    return (
        isinstance(target, (cst.Tuple, cst.List))
        and isinstance(value, (cst.Tuple, cst.List))
        and len(target.elements) == len(value.elements)
        and all(isinstance(e, cst.Element) and isinstance(e.value, cst.Name) for e in target.elements)
        and all(isinstance(e, cst.Element) for e in value.elements)
    )


def _flatten_targets(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(target, (cst.Tuple, cst.List)):
        out = []
        for e in target.elements:
            out.extend(_flatten_targets(e.value))
        return out
    if isinstance(target, cst.StarredElement):
        return _flatten_targets(target.value)
    return [target]


def _target_names(target: cst.BaseExpression) -> list[str]:
    return [t.value for t in _flatten_targets(target) if isinstance(t, cst.Name)]
