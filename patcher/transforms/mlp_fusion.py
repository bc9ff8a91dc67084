"""Transform `mlp_fusion`: `act(x).square()` becomes `h = act(x)` then `h * h`.

The same numbers (`square` is `x * x` in every backend), in a form that Inductor
fuses into the activation's epilogue; weight casts `w.to(x.dtype)` in the same
statement are hoisted into statements of their own. Forms seen in parameter-golf:
`self.proj(x.square())` after `x = torch.relu(self.fc(x))`,
`self.proj(F.leaky_relu(self.fc(x), negative_slope=.5).square())`, and the banked
`F.leaky_relu(F.linear(x, up_w.to(x.dtype)), negative_slope=0.5).square()`.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from dataclasses import dataclass

from patcher.cst_walk import dotted, walk
from patcher.survey.survey import Survey
from patcher.transforms.base import Context, Feature, Note, ReplaceNodes, Tracking, edit_tops, small_statement

FEATURE = "mlp_fusion"

ACTIVATIONS = {"relu", "leaky_relu", "gelu", "silu", "relu6", "elu", "mish", "softplus"}
CAST = m.Call(func=m.Attribute(attr=m.Name("to")), args=[m.Arg(value=m.Attribute(attr=m.Name("dtype")), keyword=None)])


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Rewrite every surveyed `.square()` of an activation in a `forward`."""
    survey = ctx.survey
    squares = ctx.facts[FEATURE]
    if not squares:
        return module, [Note(FEATURE, False, "no `act(x).square()` in an MLP forward")]
    notes = []
    by_statement: dict[cst.CSTNode, list] = {}
    for site in squares:
        statement = _small_statement_of(site.function, site.node)
        if statement is None:
            notes.append(Note(FEATURE, False, "square() inside a compound expression statement", site.line))
            continue
        by_statement.setdefault(statement, []).append(site)
    tops = set()
    plans = {}
    for statement, sites in by_statement.items():
        taken = _names_in(sites[0].function)
        plans[statement] = _plan(statement, sites, taken, ctx)
        tops.add(survey.top_level_of(sites[0].node))
        for site in sites:
            notes.append(Note(FEATURE, True, f"{site.kind} square at line {site.line} -> h * h", site.line))
    module = edit_tops(module, ctx, tops, _Rewrite(plans, ctx))
    return module, notes


@dataclass
class SquareSite:
    """A `.square()` of an activation in an MLP forward: kind "relu2" | "leaky_relu2" | "banked" | "act2"."""

    node: cst.Call
    function: cst.FunctionDef
    line: int
    kind: str


def find_squares(survey: Survey) -> list[SquareSite]:
    """Every `act(x).square()` (or `x.square()` of a name assigned from an activation) in a `forward`."""
    collector = survey.collector
    sites = []
    for fn in collector.functions:
        if fn.name.value != "forward":
            continue
        act_names = _names_assigned_from_activation(fn)
        for node in walk(fn.body):
            if not m.matches(node, m.Call(func=m.Attribute(attr=m.Name("square")), args=[])):
                continue
            receiver = node.func.value
            kind = None
            if _is_activation(receiver):
                kind = _activation_kind(receiver)
            elif isinstance(receiver, cst.Name) and receiver.value in act_names:
                kind = act_names[receiver.value]
            if kind is not None:
                sites.append(SquareSite(node=node, function=fn, line=survey.line_of(node), kind=kind))
    return sites


UNIT = Feature(name=FEATURE, apply=apply, order=30, analyse=find_squares)


def _is_activation(expr: cst.BaseExpression) -> bool:
    return isinstance(expr, cst.Call) and dotted(expr.func).split(".")[-1] in ACTIVATIONS


def _activation_kind(call: cst.Call) -> str:
    name = dotted(call.func).split(".")[-1]
    inner = call.args[0].value if call.args else None
    if inner is not None and dotted(getattr(inner, "func", cst.Name("x"))).endswith("linear"):
        return "banked"
    return {"relu": "relu2", "leaky_relu": "leaky_relu2"}.get(name, "act2")


def _names_assigned_from_activation(fn: cst.FunctionDef) -> dict[str, str]:
    found = {}
    for node in walk(fn.body):
        if isinstance(node, cst.Assign) and len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
            if _is_activation(node.value):
                found[node.targets[0].target.value] = _activation_kind(node.value)
            else:
                found.pop(node.targets[0].target.value, None)
    return found


def _small_statement_of(function: cst.FunctionDef, node: cst.CSTNode):
    """The Assign/Return/Expr small statement of `function` that holds `node`, if simple."""
    for stmt in walk(function.body):
        if isinstance(stmt, (cst.Assign, cst.Return, cst.Expr, cst.AugAssign)):
            if any(n is node for n in walk(stmt)):
                if any(isinstance(n, (cst.Lambda, cst.ListComp, cst.GeneratorExp, cst.IfExp)) for n in walk(stmt)):
                    return None
                return stmt
    return None


def _names_in(function: cst.FunctionDef) -> set[str]:
    return {n.value for n in walk(function) if isinstance(n, cst.Name)}


def _fresh(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}{i}"
    taken.add(name)
    return name


def _plan(statement, sites, taken, ctx: Context):
    """(statements to insert before, {old node: new node}) for one small statement."""
    module = ctx.survey.module
    before, replace = [], {}
    eq = ctx.code(" = ", "=")
    mul = ctx.code(" * ", "*")
    for site in sites:
        receiver = site.node.func.value
        for cast in (n for n in walk(statement) if isinstance(n, cst.Call) and m.matches(n, CAST)):
            if cast in replace:
                continue
            name = _fresh(_cast_name(cast), taken)
            before.append(small_statement(f"{name}{eq}{module.code_for_node(cast)}"))
            replace[cast] = cst.Name(name)
        if isinstance(receiver, cst.Name):
            replace[site.node] = cst.parse_expression(f"{receiver.value}{mul}{receiver.value}")
            continue
        h = _fresh("h", taken)
        activation = receiver.visit(ReplaceNodes(replace))
        before.append(cst.Assign(targets=[cst.AssignTarget(cst.Name(h), whitespace_before_equal=cst.SimpleWhitespace(ctx.code(" ", "")), whitespace_after_equal=cst.SimpleWhitespace(ctx.code(" ", "")))], value=activation))
        replace[site.node] = cst.parse_expression(f"{h}{mul}{h}")
    return before, replace


def _cast_name(cast: cst.Call) -> str:
    base = cast.func.value
    return f"{base.value}_cast" if isinstance(base, cst.Name) else "w_cast"


class _Rewrite(Tracking):
    """Insert the hoisted statements before each planned statement and swap nodes."""

    def __init__(self, plans, ctx: Context):
        super().__init__()
        self.plans = plans
        self.swaps = {}
        for _, replace in plans.values():
            self.swaps.update(replace)
        self.own_line = not ctx.minified

    def prepare(self, ctx: Context) -> None:
        super().prepare(ctx)
        self.plans = {ctx.resolve(k): v for k, v in self.plans.items()}
        self.swaps = {ctx.resolve(k): v for k, v in self.swaps.items()}

    def targets(self) -> list[cst.CSTNode]:
        return [*self.plans, *self.swaps]

    def on_leave(self, original_node, updated_node):
        if original_node in self.swaps and not isinstance(original_node, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            return self.swaps[original_node]
        return super().on_leave(original_node, updated_node)

    def _insert(self, original_node, updated_node):
        body = list(updated_node.body)
        out = []
        changed = False
        for original, updated in zip(original_node.body, body):
            plan = self.plans.get(original)
            if plan is not None:
                changed = True
                semicolon = cst.Semicolon(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(" " if self.own_line else ""))
                out.extend(s.with_changes(semicolon=semicolon) for s in plan[0])
            out.append(updated)
        if not changed:
            return updated_node
        if self.own_line and isinstance(updated_node, cst.SimpleStatementLine) and len(out) > 1 and len(original_node.body) == 1:
            lines = [cst.SimpleStatementLine(body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]) for s in out[:-1]]
            lines[0] = lines[0].with_changes(leading_lines=updated_node.leading_lines)
            return cst.FlattenSentinel(lines + [updated_node.with_changes(leading_lines=[], body=[out[-1]])])
        return updated_node.with_changes(body=out)

    def leave_SimpleStatementLine(self, original_node, updated_node):
        return self._insert(original_node, updated_node)

    def leave_SimpleStatementSuite(self, original_node, updated_node):
        return self._insert(original_node, updated_node)
