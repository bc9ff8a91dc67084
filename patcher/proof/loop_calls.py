"""What of a hand-edited training loop and its seeding `verify` drives, and what it cannot.

verify drives a loader phase by phase (the warm-up build, then the rebuild) with one
`next_batch` call's arguments per phase. A hand edit to the loop can change the
arguments of that call (driven: the phase uses the edited call's arguments, and a
difference names its line), or the calls themselves (a call added under `if step ==
5:`, one moved into another branch): not driven, so the verdict says that the training
loop was not compared. The script's own global seeding before it builds its loader
(`np.random.seed(SEED)`) is read too, so that a loader drawing from the global random
state draws what it would in the script (`script_seeding`).
"""

from __future__ import annotations

import dataclasses
import random

import libcst as cst
import numpy as np
import torch

from patcher.cst_walk import walk

# The global seeding calls a script makes, by their dotted name, and what they seed here.
SEEDERS = {
    "random.seed": random.seed,
    "np.random.seed": np.random.seed,
    "numpy.random.seed": np.random.seed,
    "torch.manual_seed": torch.manual_seed,
    "torch.random.manual_seed": torch.manual_seed,
}


@dataclasses.dataclass
class LoopCalls:
    """The edited loop read against the original's. phases: construction index -> the
    recipe whose arguments drive that phase (the edited call's, where only its arguments
    changed); where: construction index -> "line N: next_batch(...), the original's
    next_batch(...)" for those; not_compared: why the training loop was not compared
    (calls added, removed or moved), empty where it was."""

    phases: dict
    where: dict
    not_compared: list


def _dotted(node) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr.value}" if inner else ""
    return ""


def _parents(survey) -> dict:
    def compute():
        parents = {}
        for node in walk(survey.module):
            for child in node.children:
                parents[id(child)] = node
        return parents

    return survey.shared("loop_calls.parents", compute)


def _control(survey, node) -> tuple[str, ...]:
    """The loop and branch headers around `node` inside its function, outermost first
    (`for step in range(...)`, `if step == 5`)."""
    parents, code, headers = _parents(survey), survey.module.code_for_node, []
    child, parent = node, _parents(survey).get(id(node))
    while parent is not None and not isinstance(parent, (cst.FunctionDef, cst.Module)):
        if isinstance(parent, cst.For):
            headers.append(f"for {code(parent.target)} in {code(parent.iter)}" + (" (else)" if child is parent.orelse else ""))
        elif isinstance(parent, cst.While):
            headers.append(f"while {code(parent.test)}")
        elif isinstance(parent, cst.If):
            headers.append(f"if {code(parent.test)}" + (" (else)" if child is parent.orelse else ""))
        child, parent = parent, parents.get(id(parent))
    return tuple(reversed(headers))


def _phase_calls(recipe) -> list[list]:
    """The surveyed `next_batch` calls on each construction (by index): those between it and the next."""
    sites = recipe.constructions
    calls = recipe.survey.calls_on(sites[0])
    out = []
    for index, site in enumerate(sites):
        end = sites[index + 1].line if index + 1 < len(sites) else float("inf")
        out.append([c for c in calls if site.line < c.line < end])
    return out


def _shown(call, survey) -> str:
    under = _control(survey, call.node)
    return f"line {call.line}: next_batch({', '.join(call.args)})" + (f" under `{under[-1]}`" if under else "")


def loop_calls(original, edited) -> LoopCalls:
    """Read the edited script's `next_batch` calls (`edited`: its `LoaderRecipe`) against
    the original's (`original`), phase by phase (the calls between a construction and
    the next). A phase whose calls match in number and in the loops and branches around
    them, with one call's arguments changed, is driven with that call's arguments; any
    other change of its calls is not driven (`not_compared` says which lines)."""
    phases, where, not_compared = {}, {}, []
    mine, theirs = _phase_calls(original), _phase_calls(edited)
    for index, (o_calls, e_calls) in enumerate(zip(mine, theirs)):
        o_shape = [(_control(original.survey, c.node), tuple(c.args)) for c in o_calls]
        e_shape = [(_control(edited.survey, c.node), tuple(c.args)) for c in e_calls]
        # A call before the loop that fetches the first batch, the loop fetching each next
        # one after its use (`x, y = next_batch(...)`, then in the loop `loss = model(x,
        # y)` and `x, y = next_batch(...)`): the same calls in the same order.
        primed = [i for i, (control, args) in enumerate(e_shape) if not control and (control, args) not in o_shape and any(c and c[0].startswith("for ") and a == args for c, a in e_shape)]
        e_calls, e_shape = [c for i, c in enumerate(e_calls) if i not in primed], [s for i, s in enumerate(e_shape) if i not in primed]
        if o_shape == e_shape:
            continue
        changed = [i for i, (a, b) in enumerate(zip(o_shape, e_shape)) if a != b]
        if len(o_shape) == len(e_shape) and len(changed) == 1 and o_shape[changed[0]][0] == e_shape[changed[0]][0]:
            call, before = e_calls[changed[0]], o_calls[changed[0]]
            scope = edited.survey.collector.scope_of.get(call.scope, edited.survey.collector.module_scope)
            phases[index] = dataclasses.replace(edited, call_args=list(call.args), varying=[i for i, const in enumerate(call.constant) if not const], call_scope=scope)
            where[index] = f"the edited script's call at line {call.line}: next_batch({', '.join(call.args)}), the original's at line {before.line}: next_batch({', '.join(before.args)})"
            continue
        extra = [_shown(c, edited.survey) for c, s in zip(e_calls, e_shape) if s not in o_shape]
        gone = [_shown(c, original.survey) for c, s in zip(o_calls, o_shape) if s not in e_shape]
        what = "; ".join(([f"the edited script calls {'; '.join(extra)}"] if extra else []) + ([f"the original calls {'; '.join(gone)}, the edited script does not"] if gone else []))
        not_compared.append(f"the training loop was not compared: its next_batch calls on `{edited.constructions[index].target}` changed ({what or 'their order'}), and verify drives one call per build")
    return LoopCalls(phases, where, not_compared)


def seeding_calls(recipe) -> list[tuple[int, str, str]]:
    """(line, dotted name, argument code) of each global seeding call (`SEEDERS`) the
    script makes before it builds its loader, in the function that builds it or at
    module level, in source order."""
    survey, site = recipe.survey, recipe.constructions[0]
    home = _function_of(survey, site.call)
    found = []
    for node in walk(survey.module):
        if not isinstance(node, cst.Call) or _dotted(node.func) not in SEEDERS or len(node.args) != 1:
            continue
        line = survey.line_of(node)
        if line < site.line and _function_of(survey, node) in (home, None):
            found.append((line, _dotted(node.func), survey.module.code_for_node(node.args[0].value)))
    return sorted(found)


def _function_of(survey, node):
    parents = _parents(survey)
    parent = parents.get(id(node))
    while parent is not None and not isinstance(parent, cst.FunctionDef):
        parent = parents.get(id(parent))
    return parent


def script_seeding(recipe, ns: dict) -> list[tuple[str, object]]:
    """The script's global seeding before its loader is built (`seeding_calls`), each
    argument evaluated in `ns` as the script would: [(dotted name, value)]. Raises
    what evaluating an argument raises."""
    scope = recipe.constructions[0].binding
    return [(name, recipe.evaluate(code, ns, scope)) for _line, name, code in seeding_calls(recipe)]


def seed(seeding: list[tuple[str, object]]) -> None:
    """Make the calls `script_seeding` read, in order."""
    for name, value in seeding:
        SEEDERS[name](value)
