"""Where a script builds its training data and draws from it: loader constructions,
`next_batch` call sites (with whether each argument is a run constant), and data
generators. The families say which generator functions are theirs and why a site of
theirs is not prefetched; the rest is the same for every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import dotted
from patcher.families.registry import generator_family
from patcher.survey.index import Scope, ScriptIndex

if TYPE_CHECKING:
    from patcher.survey.survey import Survey


@dataclass
class Construction:
    """`target = LoaderClass(...)`: node is the `Assign`, call its value.

    scope: the function (or None for the module) it is in; binding: the `Scope` that
    binds `target` there. training: it builds the training loader; reason: why not.
    """

    target: str
    class_name: str
    node: cst.Assign
    call: cst.Call
    line: int
    scope: cst.CSTNode
    binding: object = None
    training: bool = False
    reason: str | None = None


@dataclass
class CallSite:
    """`receiver.next_batch(args…)`; constant[i] says whether argument i is a run constant."""

    receiver: str
    node: cst.Call
    line: int
    scope: cst.CSTNode
    args: list[str]
    constant: list[bool]
    binding: object = None


@dataclass
class IteratorSite:
    """`target = generator_function(...)`: a data generator built in the script.

    function: the generator function's name; node: the `Assign`; call: its value.
    family: the name of the generator function's family unit.
    training: the training data source (advanced with `next(target)` or
    `target.send(value)`, named for training); sends: the `target.send(value)` calls;
    reason: why it is not prefetched, or None. staged: not prefetched, but the
    training data source whose own H2D copies get pinned staging (`Family.stages`).
    """

    target: str
    function: str
    node: cst.Assign
    call: cst.Call
    line: int
    binding: object = None
    training: bool = False
    reason: str | None = None
    sends: list = field(default_factory=list)
    family: str = ""
    staged: bool = False


def find_constructions_and_calls(index: ScriptIndex, result: Survey) -> None:
    """Fill `result.constructions` (`name = LoaderClass(...)` of a surveyed loader class)
    and `result.calls` (their `next_batch` calls), and say which construction builds
    the training loader."""
    module = result.module
    loader_names = set(result.loader_classes)
    for assign, scope in index.call_assigns:
        func, target = assign.value.func, assign.targets[0].target
        if len(assign.targets) == 1 and isinstance(func, cst.Name) and func.value in loader_names and isinstance(target, cst.Name):
            result.constructions.append(
                Construction(
                    target=target.value,
                    class_name=func.value,
                    node=assign,
                    call=assign.value,
                    line=result.line_of(assign),
                    scope=scope.node,
                    binding=scope.resolve(target.value),
                )
            )
    for call, scope in index.calls:
        receiver = call.func.value.value
        binding = scope.resolve(receiver)
        if not any(c.binding is binding and c.target == receiver for c in result.constructions):
            continue  # not a loader this script builds here (e.g. a parameter of a helper)
        result.calls.append(
            CallSite(
                receiver=receiver,
                node=call,
                line=result.line_of(call),
                scope=scope.node,
                args=[module.code_for_node(a.value) for a in call.args],
                constant=[_is_run_constant(a.value, scope, index, depth=0) for a in call.args],
                binding=binding,
            )
        )
    for c in result.constructions:
        if _names_other_data(c.target):
            c.reason = f"`{c.target}` is not the training loader"
        elif not result.calls_on(c):
            c.reason = f"`{c.target}` has no next_batch call where it is built"
        else:
            c.training = True


def _names_other_data(target: str) -> bool:
    """True for a variable named for validation or calibration data, not training data."""
    return "calib" in target.lower() or "val" in target.lower()


def find_iterators(index: ScriptIndex, result: Survey) -> None:
    """Fill `result.iterators`: `name = gen(...)` for a module-level generator function
    `gen` that a generator family recognises; the family says why a site is not the
    training data source (`Family.refuse`)."""
    generators = {f.name.value: (f, generator_family(f)) for f in result.module.body if f in index.generator_functions}
    for assign, scope in index.call_assigns:
        func, target = assign.value.func, assign.targets[0].target
        if len(assign.targets) != 1 or not isinstance(func, cst.Name) or not isinstance(target, cst.Name):
            continue
        function, family = generators.get(func.value, (None, None))
        if family is None:
            continue
        binding = scope.resolve(target.value)
        site = IteratorSite(target.value, func.value, assign, assign.value, result.line_of(assign), binding, family=family.name)
        site.sends = [c for c, sc in index.send_calls if c.func.value.value == target.value and sc.resolve(target.value) is binding]
        if _names_other_data(site.target):
            site.reason = f"`{site.target}` is not the training data source"
        else:
            site.reason = family.refuse(site, function, index)
            site.training = site.reason is None
            site.staged = family.stages is not None and family.stages(site, function, index)
        result.iterators.append(site)


def inside_training_generators(result: Survey) -> None:
    """A loader built inside a data generator that runs ahead as a whole (modded-nanogpt's
    `BOSFinder` in `distributed_data_generator`) is not wrapped a second time, nor is one
    built inside a generator whose copies are staged (its `Shard`)."""
    generators = {i.function: "stays on the training thread, its H2D copies staged" for i in result.iterators if i.staged}
    generators.update({i.function: "runs ahead as a whole" for i in result.iterators if i.training})
    for construction in result.constructions:
        scope = construction.scope
        if construction.training and isinstance(scope, cst.FunctionDef) and scope.name.value in generators:
            construction.training = False
            construction.reason = f"`{construction.target}` is built inside the data generator {scope.name.value}, which {generators[scope.name.value]}"


def _is_run_constant(expr: cst.BaseExpression, scope: Scope, index: ScriptIndex, depth: int) -> bool:
    """True when `expr` has the same value every time the statement holding it runs.

    Literals; attributes `a.b` never assigned anywhere in the script (the
    Hyperparameters idiom `args.train_seq_len`); names bound once in their scope
    (a parameter, or one plain assignment of a run constant, not a loop target);
    arithmetic and int/float/min/max of those.
    """
    if depth > 8:
        return False
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return _is_run_constant(expr.expression, scope, index, depth + 1)
    if isinstance(expr, cst.BinaryOperation):
        return _is_run_constant(expr.left, scope, index, depth + 1) and _is_run_constant(expr.right, scope, index, depth + 1)
    if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name):
        return (expr.value.value, expr.attr.value) not in index.assigned_attributes
    if isinstance(expr, cst.Name):
        owner = scope.resolve(expr.value)
        if owner is None:
            return False
        bindings = owner.bindings[expr.value]
        if len(bindings) != 1:
            return False
        kind, value = bindings[0]
        if kind == "param":
            return True
        if kind == "assign" and value is not None:
            return _is_run_constant(value, owner, index, depth + 1)
        return False
    if isinstance(expr, cst.Call) and dotted(expr.func) in CONSTANT_CALLS:
        return all(_is_run_constant(a.value, scope, index, depth + 1) for a in expr.args)
    if m.matches(expr, m.Subscript(value=m.Attribute(value=m.Name("os"), attr=m.Name("environ")))):
        return True
    return False


# Calls whose result is fixed for the whole run when their arguments are.
CONSTANT_CALLS = {
    "int", "float", "bool", "str", "max", "min", "len", "abs", "round",
    "os.environ.get", "os.getenv", "math.ceil", "math.floor",
    "dist.get_world_size", "dist.get_rank", "torch.distributed.get_world_size", "torch.distributed.get_rank",
    "torch.cuda.device_count",
}
