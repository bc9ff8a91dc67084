"""Where a script builds its training data and draws from it: the records of loader
constructions, `next_batch` call sites and data generators, which `survey()` fills,
and whether an argument is a run constant: facts, the same for every family. The
verdicts (which family, the training data source or not, why not) are the families'
(`patcher/families/verdicts.py`), kept beside these records, never in them; this layer
never imports the families.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import dotted
from patcher.survey.index import Scope, ScriptIndex


@dataclass
class Construction:
    """`target = LoaderClass(...)`: node is the `Assign`, call its value.

    scope: the function (or None for the module) it is in; binding: the `Scope` that
    binds `target` there. candidate: its name and draws make it the training loader's
    construction (not named for other data, a `next_batch` call on it where it is
    built); why_not: why it is no candidate, else None. The final verdict, which also
    leaves out a loader built inside a data generator that runs ahead, is the
    families' (`ConstructionVerdict`).
    """

    target: str
    class_name: str
    node: cst.Assign
    call: cst.Call
    line: int
    scope: cst.CSTNode
    binding: object = None
    candidate: bool = False
    why_not: str | None = None


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
    sends: the `target.send(value)` calls. Whether it is a data source, and what it
    gets, is the families' verdict (`SiteVerdict`).
    """

    target: str
    function: str
    node: cst.Assign
    call: cst.Call
    line: int
    binding: object = None
    sends: list = field(default_factory=list)


def names_other_data(target: str) -> bool:
    """True for a variable named for validation or calibration data, not training data."""
    return "calib" in target.lower() or "val" in target.lower()


def is_run_constant(expr: cst.BaseExpression, scope: Scope, index: ScriptIndex, depth: int) -> bool:
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
        return is_run_constant(expr.expression, scope, index, depth + 1)
    if isinstance(expr, cst.BinaryOperation):
        return is_run_constant(expr.left, scope, index, depth + 1) and is_run_constant(expr.right, scope, index, depth + 1)
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
            return is_run_constant(value, owner, index, depth + 1)
        return False
    if isinstance(expr, cst.Call) and dotted(expr.func) in CONSTANT_CALLS:
        return all(is_run_constant(a.value, scope, index, depth + 1) for a in expr.args)
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
