"""Transform `mlp_fusion`: `act(x).square()` becomes `h = act(x)` then `h * h`, switched.

Source: parameter-golf pull request #785 ("fusion-friendly LeakyReLU² MLP", a
non-record of 2026-03-26), which wrote the banked MLP as `h * h` with the weight
casts hoisted and measured 637.55 -> 636.73 ms a step with it on 1×H100 (one run
each, after its prefetch: within run-to-run noise).

The same numbers (`square` is `pow(x, 2)`, computed as `x * x`). Under
`torch.compile` it is expected to change nothing: Inductor lowers `pow(x, 2)` to a
multiply and fuses the activation, the square and the casts into the same kernel
either way (torch 2.13, Inductor's C++ backend on the banked form: the generated
kernels are identical but for their names). In eager mode one `pow` kernel becomes
one `mul` kernel. It is kept, switched, for a competitor who wants PR #785's form
and an A/B of it: `MLP_FUSION=0` runs the original operations in the original
order (the activation is only bound to a name first): `self.proj(h * h if
Hyperparameters.mlp_fusion else h.square())`. Without env_toggles the switch is
left out (`h * h`).

Forms seen in parameter-golf: `self.proj(x.square())` after `x =
torch.relu(self.fc(x))`, `self.proj(F.leaky_relu(self.fc(x),
negative_slope=.5).square())`, and the banked `F.leaky_relu(F.linear(x,
up_w.to(x.dtype)), negative_slope=0.5).square()`. A square after a statement
`if self.training ...: return ...` (the 2026-04-29 record returns
`FusedLeakyReLUSquareMLP(...)` there) or in the `else` of `if self.training` runs
only outside training: left unchanged, and said.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from dataclasses import dataclass

from patcher.cst_walk import dotted, walk
from patcher.survey.survey import Survey
from patcher.transforms.base import Context, Feature, Note, Toggle, Tracking, edit_tops

FEATURE = "mlp_fusion"

ACTIVATIONS = {"relu", "leaky_relu", "gelu", "silu", "relu6", "elu", "mish", "softplus"}
TRAINING = m.Attribute(value=m.Name("self"), attr=m.Name("training"))
NOT_IN_TRAINING = "not applied: the branch is not the one training runs"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Rewrite every surveyed `.square()` of an activation in a `forward`."""
    survey = ctx.survey
    squares = ctx.facts[FEATURE]
    if not squares:
        return module, [Note(FEATURE, False, "no `act(x).square()` in an MLP forward")]
    notes = []
    by_statement: dict[cst.CSTNode, list] = {}
    for site in squares:
        if not site.in_training:
            notes.append(Note(FEATURE, False, f"{NOT_IN_TRAINING} ({site.kind} square at line {site.line}, after `if self.training` returned)", site.line))
            continue
        statement = _small_statement_of(site.function, site.node)
        if statement is None:
            notes.append(Note(FEATURE, False, "square() inside a compound expression statement", site.line))
            continue
        by_statement.setdefault(statement, []).append(site)
    tops = set()
    plans = {}
    switch = ctx.toggle("MLP_FUSION") if by_statement and ctx.toggle_home != "literal" else None
    for statement, sites in by_statement.items():
        taken = _names_in(sites[0].function)
        plans[statement] = _plan(statement, sites, taken, ctx, switch)
        tops.add(survey.top_level_of(sites[0].node))
        for site in sites:
            notes.append(Note(FEATURE, True, f"{site.kind} square at line {site.line} -> h * h" + (" (MLP_FUSION)" if switch else ""), site.line))
    if not tops:
        return module, notes
    module = edit_tops(module, ctx, tops, _Rewrite(plans, ctx))
    return module, notes


@dataclass
class SquareSite:
    """A `.square()` of an activation in an MLP forward: kind "relu2" | "leaky_relu2" | "banked" | "act2".

    in_training: False where the forward returns earlier under `if self.training`
    (or the square sits under `if not self.training` / the `else` of `if self.training`).
    """

    node: cst.Call
    function: cst.FunctionDef
    line: int
    kind: str
    in_training: bool = True


def find_squares(survey: Survey) -> list[SquareSite]:
    """Every `act(x).square()` (or `x.square()` of a name assigned from an activation) in a `forward`."""
    collector = survey.collector
    sites = []
    for fn in collector.functions:
        if fn.name.value != "forward":
            continue
        act_names = _names_assigned_from_activation(fn)
        switched = {id(n.orelse) for n in walk(fn.body) if isinstance(n, cst.IfExp) and m.matches(n.body, m.BinaryOperation(operator=m.Multiply()))}
        for node in walk(fn.body):
            if not m.matches(node, m.Call(func=m.Attribute(attr=m.Name("square")), args=[])):
                continue
            if id(node) in switched:
                continue  # the original side of a switch this transform wrote: already patched
            receiver = node.func.value
            kind = None
            if _is_activation(receiver):
                kind = _activation_kind(receiver)
            elif isinstance(receiver, cst.Name) and receiver.value in act_names:
                kind = act_names[receiver.value]
            if kind is not None:
                sites.append(SquareSite(node=node, function=fn, line=survey.line_of(node), kind=kind, in_training=_runs_in_training(fn, node)))
    return sites


UNIT = Feature(
    name=FEATURE,
    apply=apply,
    order=30,
    analyse=find_squares,
    toggles=(Toggle("MLP_FUSION", 1, "an MLP's `act(x).square()` computed as `h * h` (parameter-golf PR #785; under `torch.compile` Inductor makes the same kernels either way: expect no change; 0: the original square)", position=13),),
)


def _mentions_training(test: cst.BaseExpression) -> str | None:
    """"yes" for `self.training` (alone or in an `and`), "no" for `not self.training`, else None."""
    if m.matches(test, TRAINING):
        return "yes"
    if m.matches(test, m.UnaryOperation(operator=m.Not(), expression=TRAINING)):
        return "no"
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return "yes" if "yes" in (_mentions_training(test.left), _mentions_training(test.right)) else None
    return None


def _runs_in_training(fn: cst.FunctionDef, node: cst.CSTNode) -> bool:
    """False where `node` runs only outside training: after an `if self.training…:` whose
    body ends in `return`, in the `else` of `if self.training`, or under `if not self.training`.
    """
    body = fn.body.body if isinstance(fn.body, cst.IndentedBlock) else []
    for stmt in body:
        inside = any(n is node for n in walk(stmt))
        if isinstance(stmt, cst.If):
            says = _mentions_training(stmt.test)
            in_body = any(n is node for n in walk(stmt.body))
            in_else = inside and not in_body
            if inside:
                return not (says == "yes" and in_else or says == "no" and in_body)
            last = stmt.body.body[-1] if stmt.body.body else None
            returns = isinstance(last, cst.SimpleStatementLine) and isinstance(last.body[-1], cst.Return)
            if says == "yes" and returns:
                return False
        elif inside:
            return True
    return True


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


def _plan(statement, sites, taken, ctx: Context, switch: str | None):
    """(statements to insert before, {old node: new node}) for one small statement.

    The activation is bound to a fresh name (`h = act(x)`, unless the square's receiver
    already is such a name) and the square becomes `h * h if <switch> else h.square()`
    (`h * h` without a switch), parenthesised unless it is a whole argument or value.
    """
    before, replace = [], {}
    mul = ctx.code(" * ", "*")
    whole = {id(n.value) for n in walk(statement) if isinstance(n, (cst.Arg, cst.Assign, cst.Return, cst.AugAssign)) and n.value is not None}
    for site in sites:
        receiver = site.node.func.value
        if isinstance(receiver, cst.Name):
            h = receiver.value
        else:
            h = _fresh("h", taken)
            before.append(cst.Assign(targets=[cst.AssignTarget(cst.Name(h), whitespace_before_equal=cst.SimpleWhitespace(ctx.code(" ", "")), whitespace_after_equal=cst.SimpleWhitespace(ctx.code(" ", "")))], value=receiver))
        code = f"{h}{mul}{h}" if switch is None else f"{h}{mul}{h} if {switch} else {h}.square()"
        if switch is not None and id(site.node) not in whole:
            code = f"({code})"
        replace[site.node] = cst.parse_expression(code)
    return before, replace


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
