"""Transform `step_timing`: per-step timing of the training loop, switched at run time.

Finds one training step in a parameter-golf script:

- the batch: `x, y = train_loader.next_batch(...)` on the training loader;
- the forward: the first `loss = <call>(x, ...)` after it that takes the batch;
- the backward: the first `<expr>.backward()` after the forward;
- the optimizer step: `opt.step()` in `for opt in optimizers:` (or `optimizers.step()`)
  after the micro-step loop;
- the training loop: the loop around the micro-step loop, or, where the step lives
  in its own function (`def step_fn(...)`), the last loop that calls that function;
- the validation: `eval_val(...)` calls in the training loop (optional).

Each of those calls `c` becomes `_step_timer.time("<phase>", lambda: c)`, and the
training loop's body starts with `_step_timer.next_step(<TRAINING_TIMING_BREAKDOWN>,
<TRAINING_TIMING_EVERY>, <log function>)` (runtime: `templates/step_timing.py`). With
`TRAINING_TIMING_BREAKDOWN=0` (default) each wrapped call runs as before. Of several
training steps (warm-up and main loop), the last complete one in the source is timed.
Skipped, with the reason and line, where a part is missing or the script's log
function is not visible in the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from patcher import cst_walk
from patcher.transforms.base import Context, Feature, Note, ReplaceNodes, Toggle, edit_tops, replace_nodes

FEATURE = "step_timing"
LOOPS = (cst.For, cst.While)
NESTED = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


@dataclass
class TrainingStep:
    """The parts of one training step, as nodes of the surveyed module.

    batch, forward, backward: the calls of the micro-step; optimizer: the `.step()`
    calls; val: `eval_val(...)` calls in the loop; loop: the training loop (For/While)
    whose body gets `next_step`; function: the FunctionDef holding the loop, or None
    at module level.
    """

    batch: cst.Call
    forward: cst.Call
    backward: cst.Call
    optimizer: list[cst.Call]
    loop: cst.CSTNode
    function: cst.FunctionDef | None
    val: list[cst.Call] = field(default_factory=list)


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Wrap the training step's parts in `_step_timer.time(...)`. Returns (module, notes)."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    step, reason, line = find_training_step(ctx.verdicts)
    if step is None:
        return module, [Note(FEATURE, False, reason, line)]
    if ctx.toggle_home != "class":
        # Module constants are read before the runtime could switch prefetch off for the breakdown.
        why = "env_toggles is off" if ctx.toggle_home == "literal" else "no Hyperparameters class with an env line to add TRAINING_TIMING_BREAKDOWN to"
        return module, [Note(FEATURE, False, f"{why}: the timing could not be switched at run time", survey.line_of(step.loop))]
    log_name, log_fn = survey.log_function or (None, None)
    if log_name is None or not _visible(survey, log_fn, step.function):
        return module, [Note(FEATURE, False, f"no log function (log0, log) visible in the training loop at line {survey.line_of(step.loop)}", survey.line_of(step.loop))]
    parts = [("batch", step.batch), ("forward", step.forward), ("backward", step.backward)]
    parts += [("optimizer", c) for c in step.optimizer] + [("val", c) for c in step.val]
    module = replace_nodes(module, {call: _timed(phase, ctx.resolve(call), ctx) for phase, call in parts}, ctx)
    first = cst.Expr(ctx.runtime_call("_step_timer.next_step", [ctx.toggle("TRAINING_TIMING_BREAKDOWN"), ctx.toggle("TRAINING_TIMING_EVERY"), log_name]))
    loop = ctx.resolve(step.loop)
    module = edit_tops(module, ctx, {survey.top_level_of(step.loop)}, ReplaceNodes({step.loop: _prepend(loop, first)}))
    ctx.need("step_timing")
    lines = {phase: survey.line_of(call) for phase, call in reversed(parts)}
    where = ", ".join(f"{phase} line {lines[phase]}" for phase in ("batch", "forward", "backward", "optimizer", "val") if phase in lines)
    extra = "" if step.val else "; no eval_val(...) in the loop, val_ms stays 0"
    return module, [Note(FEATURE, True, f"training loop at line {survey.line_of(step.loop)} timed per step ({where}), logged through {log_name}{extra}", survey.line_of(step.loop))]


# order 40: times the calls the training-loader rewrites left in the loop
UNIT = Feature(FEATURE, apply, order=40, diagnostic=True, injected="_step_timer", runtime={"step_timing": ("copy_stream",)}, toggles=(
    Toggle("TRAINING_TIMING_BREAKDOWN", 0, "log the time of each training-step phase (batch, forward, backward, optimizer)", position=3),
    Toggle("TRAINING_TIMING_EVERY", 200, "steps between two timing lines", position=4),
))


def find_training_step(verdicts) -> tuple[TrainingStep | None, str | None, int | None]:
    """The last complete training step in the script, else (None, reason, line).

    Takes the script's `Verdicts`. Returns (TrainingStep, None, None) or (None, why, line number).
    """
    survey = verdicts.survey
    calls = sorted({id(c.node): c for con in verdicts.training_constructions() for c in survey.calls_on(con)}.values(), key=lambda c: c.line)
    if not calls:
        return None, "no `next_batch` call on the training loader", None
    trees = _Trees(survey)
    reason, line = None, None
    for site in reversed(calls):
        step, why = _step_at(site.node, trees)
        if step is not None:
            return step, None, None
        if reason is None:
            reason, line = why, site.line
    return None, reason, line


class _Trees:
    """Parents and source order of the top-level statements walked so far."""

    def __init__(self, survey):
        self.survey = survey
        self.parent: dict = {}
        self.order: dict = {}
        self.walked: set = set()

    def walk(self, top: cst.CSTNode) -> None:
        if top in self.walked:
            return
        self.walked.add(top)
        stack = [(top, None)]
        while stack:
            node, parent = stack.pop()
            self.parent[node] = parent
            self.order[node] = len(self.order)
            stack.extend((child, node) for child in reversed(cst_walk.children(node)))

    def ancestors(self, node: cst.CSTNode):
        self.walk(self.survey.top_level_of(node))
        node = self.parent.get(node)
        while node is not None:
            yield node
            node = self.parent.get(node)


def _step_at(call: cst.Call, trees: _Trees) -> tuple[TrainingStep | None, str | None]:
    """The training step around one `next_batch` call, else (None, why)."""
    statement, function, loops = None, None, []
    for node in trees.ancestors(call):
        if isinstance(node, NESTED[1:]) or isinstance(node, cst.FormattedString):
            return None, "the training `next_batch` call sits in a lambda, class or f-string"
        if isinstance(node, cst.FunctionDef):
            function = node
            break
        if statement is None and isinstance(node, cst.BaseSmallStatement):
            statement = node
        if isinstance(node, LOOPS):
            loops.append(node)
    if not (m.matches(statement, m.Assign(targets=[m.AssignTarget()])) and statement.value is call):
        return None, "the training `next_batch` call is not a plain `x, y = train_loader.next_batch(...)`"
    names = _target_names(statement.targets[0].target)
    if not loops:
        micro, driver = None, _caller_loop(function, trees)
    elif len(loops) == 1:
        caller = _caller_loop(function, trees)
        micro, driver = (loops[0], caller) if caller is not None else (None, loops[0])
    else:
        micro, driver = loops[0], loops[1]
    if driver is None:
        return None, "the training `next_batch` call is not inside a training loop"
    region = driver if _contains(driver, statement, trees) else function
    after_batch = _after(micro if micro is not None else region, statement, trees)
    forward = next((s for s in after_batch if _is_forward(s, names)), None)
    if forward is None:
        return None, f"no forward `loss = model({', '.join(names[:2])})` after the batch"
    after_forward = [s for s in after_batch if trees.order[s] > trees.order[forward]]
    backward = next((s for s in after_forward if m.matches(s, m.Expr(m.Call(func=m.Attribute(attr=m.Name("backward")))))), None)
    if backward is None:
        return None, "no `.backward()` after the forward"
    anchor = micro if micro is not None else statement
    optimizer = [s.value for s in _after(region, anchor, trees) if _is_optimizer_step(s, trees)]
    if not optimizer:
        return None, "no optimizer step (`for opt in optimizers: opt.step()` or `optimizers.step()`) after the micro-step"
    val = [n for n in _inside(driver, trees) if isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value.startswith("eval_val") and not _in_fstring(n, driver, trees)]
    owner = next((a for a in trees.ancestors(driver) if isinstance(a, cst.FunctionDef)), None)
    return TrainingStep(call, forward.value, backward.value, optimizer, driver, owner, val), None


def _caller_loop(function: cst.FunctionDef | None, trees: _Trees) -> cst.CSTNode | None:
    """The innermost loop around the last call of `function` by name (a step function)."""
    if function is None:
        return None
    top = trees.survey.top_level_of(function)
    # only the statements that call it by name (the survey lists those calls)
    calls = trees.survey.collector.calls_by_name.get(function.name.value, [])
    holding = dict.fromkeys(trees.survey.top_level_of(call) for call in calls)
    tops = [top] if top is not function else list(trees.survey.module.body)
    found = None
    for candidate in (t for t in tops if t in holding):
        trees.walk(candidate)
        for node in _inside(candidate, trees):
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == function.name.value:
                loop = next((a for a in trees.ancestors(node) if isinstance(a, LOOPS + (cst.FunctionDef,))), None)
                if isinstance(loop, LOOPS) and (found is None or trees.order[node] > trees.order[found[0]]):
                    found = (node, loop)
    return found[1] if found else None


def _inside(root: cst.CSTNode, trees: _Trees) -> list[cst.CSTNode]:
    """Nodes under `root` in source order, not entering nested functions, classes, lambdas."""
    out, stack = [], list(reversed(cst_walk.children(root)))
    while stack:
        node = stack.pop()
        out.append(node)
        if not isinstance(node, NESTED):
            stack.extend(reversed(cst_walk.children(node)))
    return out


def _after(root: cst.CSTNode, anchor: cst.CSTNode, trees: _Trees) -> list[cst.BaseSmallStatement]:
    """Small statements under `root` that come after `anchor` (and outside it), in source order."""
    inside_anchor = set(map(id, _inside(anchor, trees))) | {id(anchor)}
    start = trees.order[anchor]
    return [n for n in _inside(root, trees) if isinstance(n, cst.BaseSmallStatement) and trees.order[n] > start and id(n) not in inside_anchor]


def _contains(outer: cst.CSTNode, inner: cst.CSTNode, trees: _Trees) -> bool:
    return any(a is outer for a in trees.ancestors(inner))


def _target_names(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [e.value.value for e in target.elements if isinstance(e.value, cst.Name)]
    return []


def _is_forward(statement: cst.BaseSmallStatement, batch_names: list[str]) -> bool:
    """`loss = f(x, ...)`: a call that takes a batch tensor and is not a method of it."""
    if not isinstance(statement, cst.Assign) or not isinstance(statement.value, cst.Call):
        return False
    call = statement.value
    if m.matches(call.func, m.Attribute(value=m.Name())) and call.func.value.value in batch_names:
        return False
    return any(isinstance(arg.value, cst.Name) and arg.value.value in batch_names for arg in call.args)


def _is_optimizer_step(statement: cst.BaseSmallStatement, trees: _Trees) -> bool:
    """`opt.step()` where `opt` loops over `optimizers`, or `optimizer*.step()` itself."""
    if not m.matches(statement, m.Expr(m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("step"))))):
        return False
    name = statement.value.func.value.value
    if name.startswith("opt"):
        return True
    loop = next((a for a in trees.ancestors(statement) if isinstance(a, LOOPS + NESTED)), None)
    return m.matches(loop, m.For(target=m.Name(name), iter=m.Name())) and loop.iter.value.startswith("opt")


def _in_fstring(node: cst.CSTNode, root: cst.CSTNode, trees: _Trees) -> bool:
    for a in trees.ancestors(node):
        if a is root:
            return False
        if isinstance(a, cst.FormattedString):
            return True
    return False


def _visible(survey, log_fn: cst.FunctionDef, function: cst.FunctionDef | None) -> bool:
    """Whether the log function defined as `log_fn` can be called inside `function`."""
    collector = survey.collector
    defined_in = collector.scope_of[log_fn].parent
    scope = collector.scope_of.get(function) if function is not None else collector.module_scope
    while scope is not None and scope is not defined_in:
        scope = scope.parent
    return scope is not None


def _timed(phase: str, call: cst.BaseExpression, ctx: Context) -> cst.Call:
    """`_step_timer.time("<phase>", lambda: <call>)`, keeping `call`'s own nodes."""
    ctx.uses_runtime("_step_timer", "time")
    space = cst.SimpleWhitespace(ctx.code(" ", ""))
    return cst.Call(
        func=cst.Attribute(value=cst.Name("_step_timer"), attr=cst.Name("time")),
        args=[
            cst.Arg(cst.SimpleString(f'"{phase}"'), comma=cst.Comma(whitespace_after=space)),
            cst.Arg(cst.Lambda(params=cst.Parameters(), body=call, colon=cst.Colon(whitespace_after=space))),
        ],
    )


def _prepend(loop: cst.CSTNode, small: cst.BaseSmallStatement) -> cst.CSTNode:
    """`loop` with `small` as the first statement of its body."""
    body = loop.body
    if isinstance(body, cst.SimpleStatementSuite):
        semicolon = cst.Semicolon(whitespace_after=cst.SimpleWhitespace(""))
        return loop.with_changes(body=body.with_changes(body=[small.with_changes(semicolon=semicolon), *body.body]))
    return loop.with_changes(body=body.with_changes(body=[cst.SimpleStatementLine(body=[small]), *body.body]))
