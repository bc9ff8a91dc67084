"""Cut a runtime template down to the code paths one script's patch uses.

The templates (`templates/*.py`) are complete, tested modules: every option of the
runtime (a per-step argument rolled back, settling on attribute reads, ...) is a
keyword parameter of an entry function such as `_make_train_loader`, stored on the
instance as `self._<option>` and tested where it matters. A script whose patch never
passes an option gets the code without it:

1. **Facts** (`render.cut_facts`, from the options each call site was written with:
   `Context.runtime_call` records them). An option that no call site passes has the
   default of the entry function's parameter; `fold` replaces each read of it
   (`rollback`, `self._rollback`) with that constant. An option every call site passes
   as a literal other than None is `PASSED`: only its tests against None
   (`self._reshape_arg is not None`) are folded.
2. **Folding.** `not`, `is None`, `and`/`or`, conditional expressions and `if`
   statements over constants are evaluated; the branch that cannot run is dropped,
   with parameters, keyword arguments and assignments of the option itself, and the
   statements after a `return` or `raise`.
3. **Reachability.** `prune` keeps the top-level definitions reachable from the
   names the script uses (and statements with effects, like `atexit.register`), and
   in each kept class the methods some kept code or the script reads by name (plus
   `__init__`, `__del__`, ...); API used only by tests and benchmarks goes.
4. Docstrings and comments are dropped: they stay in `templates/`.

Everything is done on libcst trees; the result is still ordinary Python that the
check compiles and verify runs.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk

class _Passed:
    """The fact of an option every call site passes as a literal other than None."""

    def __repr__(self) -> str:
        return "PASSED"


PASSED = _Passed()


class CutError(Exception):
    """A template breaks the conventions the cut relies on (a bug in the template)."""


# Dunder methods Python calls implicitly: kept in every kept class.
_IMPLICIT = {"__init__", "__del__", "__iter__", "__next__", "__len__", "__getattr__", "__enter__", "__exit__", "__call__", "__slots__"}


def _literal(value) -> cst.BaseExpression:
    if value is None or isinstance(value, bool):
        return cst.Name(repr(value))
    if value == []:
        return cst.List([])
    return cst.parse_expression(repr(value))


def constant_value(node: cst.CSTNode):
    """(True, value) for a literal True/False/None/int/str node, else (False, None)."""
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return True, {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, (cst.Integer, cst.SimpleString)):
        return True, node.evaluated_value
    if isinstance(node, cst.List) and not node.elements:
        return True, []
    return False, None


def _option_of(node: cst.CSTNode, facts: dict) -> str | None:
    """The option a read refers to: `name`, `self.name` or `self._name`, when its fact
    is a constant (not `PASSED`)."""
    option = _any_option_of(node, facts)
    return None if option is None or facts[option] is PASSED else option


def _any_option_of(node: cst.CSTNode, facts: dict) -> str | None:
    """`_option_of`, `PASSED` facts included."""
    if isinstance(node, cst.Name) and node.value in facts:
        return node.value
    if m.matches(node, m.Attribute(value=m.Name("self"), attr=m.Name())):
        attr = node.attr.value
        for name in (attr, attr[1:] if attr.startswith("_") else None):
            if name in facts:
                return name
    return None


# Builtins a folded option may reach (`max(1, int(queue_depth))`): over integer
# literals they are evaluated.
_PURE_BUILTINS = {"int": int, "max": max, "min": min}


def _fold_builtin(call: cst.Call) -> cst.BaseExpression | None:
    """The integer literal `call` evaluates to, where it is `int` of one, or `max` or
    `min` of several, integer literals passed positionally; else None."""
    if not isinstance(call.func, cst.Name) or call.func.value not in _PURE_BUILTINS or not call.args:
        return None
    values = []
    for arg in call.args:
        known, value = constant_value(arg.value)
        if arg.keyword is not None or arg.star or not known or type(value) is not int:
            return None
        values.append(value)
    if call.func.value != "int" and len(values) < 2:
        return None  # max(5) raises at run time: left as it is
    return _literal(_PURE_BUILTINS[call.func.value](*values))


class _Fold(cst.CSTTransformer):
    """Steps 1 and 2 of the module docstring, for one statement."""

    def __init__(self, facts: dict, signatures: dict):
        super().__init__()
        self.facts = facts
        self.signatures = signatures  # function or method name -> its parameter names (None: several differ)
        self.not_reads: set[int] = set()  # Name nodes that name, not read: attributes, keywords, parameters

    # Options as constants; their parameters, keyword arguments and stores removed.

    def _constant(self, option: str) -> bool:
        """`option` is a fact with a constant value (not `PASSED`): its parameter and
        keyword arguments go."""
        return option in self.facts and self.facts[option] is not PASSED

    def visit_Attribute(self, node):
        self.not_reads.add(id(node.attr))

    def visit_Arg(self, node):
        if node.keyword is not None:
            self.not_reads.add(id(node.keyword))

    def visit_Param(self, node):
        self.not_reads.add(id(node.name))

    def visit_FunctionDef(self, node):
        self.not_reads.add(id(node.name))

    def visit_ClassDef(self, node):
        self.not_reads.add(id(node.name))

    def leave_Name(self, original_node, updated_node):
        if id(original_node) in self.not_reads:
            return updated_node
        option = _option_of(original_node, self.facts)
        return _literal(self.facts[option]) if option else updated_node

    def leave_Attribute(self, original_node, updated_node):
        option = _option_of(original_node, self.facts)
        return _literal(self.facts[option]) if option else updated_node

    def leave_Param(self, original_node, updated_node):
        return cst.RemoveFromParent() if self._constant(original_node.name.value) else updated_node

    def leave_Parameters(self, original_node, updated_node):
        return _strip_trailing_comma(updated_node)

    def leave_Arg(self, original_node, updated_node):
        keyword = original_node.keyword
        if keyword is None or not self._constant(keyword.value):
            return updated_node
        known, value = constant_value(updated_node.value)
        if _option_of(original_node.value, self.facts) != keyword.value and not (known and value == self.facts[keyword.value]):
            raise CutError(f"the template passes {keyword.value}={cst.Module([]).code_for_node(original_node.value)}, not the option's own value")
        return cst.RemoveFromParent()

    def leave_Call(self, original_node, updated_node):
        updated_node = self._drop_positional_options(original_node, updated_node)
        folded = _fold_builtin(updated_node)
        if folded is not None:
            return folded
        # A dropped last argument leaves the comma before it: only then is one removed.
        if len(updated_node.args) < len(original_node.args) and updated_node.args and updated_node.args[-1].comma is not cst.MaybeSentinel.DEFAULT:
            args = list(updated_node.args)
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated_node.with_changes(args=args)
        return updated_node

    def _drop_positional_options(self, original_node, updated_node):
        """A positional argument for a parameter that is a fact goes with the parameter."""
        func = original_node.func
        name = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
        params = self.signatures.get(name, ())
        if isinstance(func, cst.Attribute) and params and params[0] == "self":
            params = params[1:]
        kept, dropped = [], False
        for index, (before, after) in enumerate(zip(original_node.args, updated_node.args)):
            positional = before.keyword is None and not before.star
            if positional and params is None and _option_of(before.value, self.facts):
                raise CutError(f"{name}(...) is defined with different parameters; pass option {_option_of(before.value, self.facts)} by keyword")
            if positional and params and index < len(params) and self._constant(params[index]):
                dropped = True
                continue
            kept.append(after)
        return updated_node.with_changes(args=kept) if dropped else updated_node

    def leave_Assign(self, original_node, updated_node):
        if all(_option_of(t.target, self.facts) for t in original_node.targets):
            return cst.RemoveFromParent()
        target, value = original_node.targets[0].target, updated_node.value
        if len(original_node.targets) == 1 and isinstance(target, cst.Tuple) and isinstance(value, cst.Tuple) and len(target.elements) == len(value.elements):
            # `self.a, self.rollback = a, rollback`: the option's pair goes.
            pairs = [(t, v) for t, v in zip(target.elements, value.elements) if not _option_of(t.value, self.facts)]
            if len(pairs) == len(target.elements):
                return updated_node
            if not pairs:
                return cst.RemoveFromParent()
            targets = [t.with_changes(comma=cst.MaybeSentinel.DEFAULT) if i == len(pairs) - 1 else t for i, (t, _) in enumerate(pairs)]
            values = [v.with_changes(comma=cst.MaybeSentinel.DEFAULT) if i == len(pairs) - 1 else v for i, (_, v) in enumerate(pairs)]
            if len(pairs) == 1:
                return updated_node.with_changes(targets=[cst.AssignTarget(targets[0].value)], value=values[0].value)
            return updated_node.with_changes(targets=[cst.AssignTarget(target.with_changes(elements=targets))], value=value.with_changes(elements=values))
        return updated_node

    def leave_AnnAssign(self, original_node, updated_node):
        return cst.RemoveFromParent() if _option_of(original_node.target, self.facts) else updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        return updated_node if updated_node.body else cst.RemoveFromParent()

    def leave_SimpleStatementSuite(self, original_node, updated_node):
        return updated_node if updated_node.body else cst.SimpleStatementSuite(body=[cst.Pass()])

    # Constant expressions.

    def leave_UnaryOperation(self, original_node, updated_node):
        value = _truth(updated_node.expression)
        if value is not None and isinstance(updated_node.operator, cst.Not):
            return _literal(not value)
        return updated_node

    def leave_Comparison(self, original_node, updated_node):
        if len(updated_node.comparisons) != 1:
            return updated_node
        left_known, left = constant_value(updated_node.left)
        target = updated_node.comparisons[0]
        passed = _any_option_of(updated_node.left, self.facts)
        if passed is not None and self.facts[passed] is PASSED and m.matches(target.comparator, m.Name("None")) and isinstance(target.operator, (cst.Is, cst.IsNot)):
            return _literal(isinstance(target.operator, cst.IsNot))
        right_known, right = constant_value(target.comparator)
        if not (left_known and right_known):
            return updated_node
        operator = type(target.operator)
        results = {cst.Is: left is right, cst.IsNot: left is not right, cst.Equal: left == right, cst.NotEqual: left != right}
        if operator in results:
            return _literal(results[operator])
        if isinstance(left, int) and isinstance(right, int):
            ordered = {cst.GreaterThan: left > right, cst.LessThan: left < right, cst.GreaterThanEqual: left >= right, cst.LessThanEqual: left <= right}
            if operator in ordered:
                return _literal(ordered[operator])
        return updated_node

    def leave_BooleanOperation(self, original_node, updated_node):
        known, value = constant_value(updated_node.left)
        if not known:
            return updated_node
        if isinstance(updated_node.operator, cst.And):
            return updated_node.right if value else updated_node.left
        return updated_node.left if value else updated_node.right

    def leave_IfExp(self, original_node, updated_node):
        value = _truth(updated_node.test)
        if value is None:
            return updated_node
        return updated_node.body if value else updated_node.orelse

    # Dead branches and dead code.

    def leave_If(self, original_node, updated_node):
        value = _truth(updated_node.test)
        if value is None:
            return updated_node
        if value:
            return _flatten(updated_node.body)
        orelse = updated_node.orelse
        if orelse is None:
            return cst.RemoveFromParent()
        if isinstance(orelse, cst.If):
            return orelse.with_changes(leading_lines=updated_node.leading_lines)
        return _flatten(orelse.body)

    def leave_IndentedBlock(self, original_node, updated_node):
        body = []
        for stmt in updated_node.body:
            body.append(stmt)
            if m.matches(stmt, m.SimpleStatementLine(body=[m.ZeroOrMore(), m.Return() | m.Raise()])):
                break  # what follows cannot run
        if not body:
            body = [cst.SimpleStatementLine(body=[cst.Pass()])]
        return updated_node.with_changes(body=body)


def _pure(node: cst.CSTNode) -> bool:
    """A read without effects: a constant, a name, or attributes of a name."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name) or constant_value(node)[0]


def _truth(node: cst.CSTNode) -> bool | None:
    """The truth value of `node` where a test reads it (`if`, `not`, `... if ... else`), or None when unknown."""
    known, value = constant_value(node)
    if known:
        return bool(value)
    if isinstance(node, cst.BooleanOperation):
        left, right = _truth(node.left), _truth(node.right)
        decisive = isinstance(node.operator, cst.Or)  # True decides an `or`, False an `and`
        if left is decisive or (right is decisive and _pure(node.left)):
            return decisive
        if left is not None and right is not None:
            return right
    return None


def _strip_trailing_comma(params: cst.Parameters) -> cst.Parameters:
    groups = ("params", "kwonly_params", "posonly_params")
    for group in reversed(groups):
        items = list(getattr(params, group))
        if items:
            if isinstance(params.star_kwarg, cst.Param) or (group != "kwonly_params" and params.kwonly_params):
                return params
            items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return params.with_changes(**{group: items})
    return params


def _flatten(block: cst.BaseSuite):
    if isinstance(block, cst.SimpleStatementSuite):
        return cst.SimpleStatementLine(body=block.body)
    return cst.FlattenSentinel(block.body)


def _signatures(statements: list[cst.BaseStatement]) -> dict:
    """Function and method name -> parameter names, and class name -> its `__init__`'s
    after `self` (a call of the class); None where one name has several signatures."""
    found: dict = {}

    def record(name: str, params: list[str]) -> None:
        found[name] = params if found.get(name, params) == params else None

    for stmt in statements:
        for node in walk(stmt):
            if isinstance(node, cst.FunctionDef):
                record(node.name.value, [p.name.value for p in (*node.params.posonly_params, *node.params.params)])
            elif isinstance(node, cst.ClassDef):
                for init in (s for s in node.body.body if isinstance(s, cst.FunctionDef) and s.name.value == "__init__"):
                    record(node.name.value, [p.name.value for p in (*init.params.posonly_params, *init.params.params)][1:])
    return found


def fold(statements: list[cst.BaseStatement], facts: dict) -> list[cst.BaseStatement]:
    """Steps 1 and 2: `statements` with every option in `facts` ({name: value}) constant.

    Raises CutError where a template breaks the cut's conventions (an option passed
    positionally to a name defined with several signatures, or with another value).
    """
    if not facts:
        return list(statements)
    signatures = _signatures(statements)
    out: list[cst.BaseStatement] = []
    for stmt in statements:
        new = stmt.visit(_Fold(facts, signatures))
        if isinstance(new, cst.FlattenSentinel):
            out.extend(new.nodes)
        elif isinstance(new, cst.CSTNode):
            out.append(new)
    return out


def _defined(stmt: cst.BaseStatement) -> set[str]:
    """Module-level names a top-level statement binds."""
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return {stmt.name.value}
    names = set()
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            if isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                names |= {t.value for t in targets if isinstance(t, cst.Name)}
    return names


def names_read(node: cst.CSTNode) -> set[str]:
    """Every name and attribute name that `node` mentions."""
    found = set()
    for child in walk(node):
        if isinstance(child, cst.Name):
            found.add(child.value)
        elif isinstance(child, cst.Attribute):
            found.add(child.attr.value)
    return found


def _members(cls: cst.ClassDef) -> list[tuple[set[str], cst.BaseStatement]]:
    """(names bound, statement) for each statement of a class body."""
    if not isinstance(cls.body, cst.IndentedBlock):
        return []
    return [(_defined(s), s) for s in cls.body.body]


def prune(statements: list[cst.BaseStatement], roots: set[str]) -> list[cst.BaseStatement]:
    """Step 3: the top-level statements and class members reachable from `roots`.

    roots: names the script (the rest of the patched file) reads, module-level and
    attribute names alike. A statement that binds no name (an effect) is a root too.
    """
    live = set(roots)
    kept: set[int] = set()
    members: dict[int, set[int]] = {}
    changed = True
    while changed:
        changed = False
        for index, stmt in enumerate(statements):
            names = _defined(stmt)
            if index not in kept and (not names or names & live):
                kept.add(index)
                changed = True
                if isinstance(stmt, cst.ClassDef):
                    live |= names_read(stmt.with_changes(body=cst.IndentedBlock(body=[]))) | _read_bases(stmt)
                else:
                    live |= names_read(stmt)
            if index in kept and isinstance(stmt, cst.ClassDef):
                alive = members.setdefault(index, set())
                for position, (bound, member) in enumerate(_members(stmt)):
                    if position in alive:
                        continue
                    if not bound or bound & (live | _IMPLICIT):
                        alive.add(position)
                        live |= names_read(member)
                        changed = True
    out = []
    for index, stmt in enumerate(statements):
        if index not in kept:
            continue
        if isinstance(stmt, cst.ClassDef) and isinstance(stmt.body, cst.IndentedBlock):
            body = [s for position, s in enumerate(stmt.body.body) if position in members.get(index, set())]
            stmt = stmt.with_changes(body=stmt.body.with_changes(body=body or [cst.SimpleStatementLine(body=[cst.Pass()])]))
        out.append(stmt)
    return out


def _read_bases(cls: cst.ClassDef) -> set[str]:
    found = set()
    for arg in cls.bases:
        found |= names_read(arg.value)
    for decorator in cls.decorators:
        found |= names_read(decorator.decorator)
    return found


class StripDocsAndComments(cst.CSTTransformer):
    """Step 4: drop docstrings, comment lines, trailing comments and blank lines."""

    def leave_IndentedBlock(self, original_node, updated_node):
        body = list(updated_node.body)
        if len(body) > 1 and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])):
            body = body[1:]
        return updated_node.with_changes(body=body)

    def leave_EmptyLine(self, original_node, updated_node):
        return cst.RemovalSentinel.REMOVE

    def leave_TrailingWhitespace(self, original_node, updated_node):
        return updated_node.with_changes(comment=None, whitespace=cst.SimpleWhitespace(""))

    def leave_ParenthesizedWhitespace(self, original_node, updated_node):
        return updated_node.with_changes(empty_lines=[], last_line=cst.SimpleWhitespace(updated_node.last_line.value))
