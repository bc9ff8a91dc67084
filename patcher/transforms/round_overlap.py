"""Transform `round_overlap` (opt-in, `--with round_overlap`): overlap a round-loop
trainer's next data round with the current round's training.

Recognises, in a class, the update step of a round loop (DeepXube's
`Train._update_step` at e534cb4, `Train.update_step` at 4262fe3):

- the round's buffer is cleared: `self.<db>.clear()`;
- the update is started: `<x>.start_update(...)`;
- the two-phase branch `if not <x>.sync_main:` whose body is exactly
  `self.<collect>(...)` (blocking collection of the round's data),
  `self.<end>(...)` (end of the update), `<loss> = self.<train>(...)` (training);
  its `else:` (the `sync_main` path) is left as it is;
- the target copy after training: `shutil.copy(<network file>, <target file>)`;
- the collection method `<collect>`: a `while` loop that calls `.get_update_data(...)`
  and fills `self.<db>`;
- the training method `<train>`: a `for _ in range(<n>)` loop that advances the
  iteration counter (`<counter> += 1`), and the loop bound: a `while <counter> <
  <bound>:` loop in the class around the update step, else `self.train_args.max_itrs`
  where the module declares a `max_itrs` field (the round loop then lives in another
  file, as `train_loop.py` at 4262fe3).

The update step gets one guard at its top: with `ROUND_OVERLAP` on and not
`sync_main`, it returns `self._round_overlap_update_step(...)`, a copy of itself in
which the collection is received from the round dispatched in the background, the
next round is dispatched after the end-update (only when the loop will run it), the
training runs `<train>` unchanged (a failed collection is raised when its round is
received, after this round is trained and saved, as in the original) and the target
copy is staged until the round in flight has ended. `_round_overlap_collect` is a copy
of `<collect>` that fills the buffer it is given. The original methods are unchanged, so `ROUND_OVERLAP=0` runs the
original code call for call. Runtime: `templates/round_overlap.py`. Idea: DeepXube
pull request #11 (timing-dependent there; see the runtime's docstring).
Refused, with the reason and line, where any part is missing or shaped otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk
from patcher.transforms.base import Context, Feature, Note, Toggle, replace_nodes

FEATURE = "round_overlap"
NESTED = (cst.FunctionDef, cst.ClassDef, cst.Lambda)

SELF_CALL = m.Call(func=m.Attribute(value=m.Name("self")))
SELF_CALL_ASSIGN = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name())], value=SELF_CALL) | m.AnnAssign(target=m.Name(), value=SELF_CALL)])
SELF_CALL_STMT = m.SimpleStatementLine(body=[m.Expr(value=SELF_CALL)])
SYNC_MAIN_TEST = m.UnaryOperation(operator=m.Not(), expression=m.Attribute(attr=m.Name("sync_main")))
START_UPDATE = m.Expr(value=m.Call(func=m.Attribute(attr=m.Name("start_update"))))
TARGET_COPY = m.Call(func=m.Attribute(value=m.Name("shutil"), attr=m.Name("copy")), args=[m.Arg(), m.Arg()])


@dataclass
class RoundLoop:
    """The parts of one round loop, as nodes of the surveyed module.

    cls: the trainer class; step: its update-step method; branch: the `if not
    ….sync_main:` statement; collect, end, train: the three statements of its body;
    clear: the `self.<db>.clear()` statement; start: the `start_update(...)` call
    statement; copy: the `shutil.copy(...)` call; db: the buffer attribute name;
    collect_fn, train_fn: the methods called; more: source of "another round follows",
    evaluated after the end-update (`self.status.itr + self.updater.up_args.up_itrs <
    self.train_args.max_itrs`); bound_note: where the loop bound came from.
    """

    cls: cst.ClassDef
    step: cst.FunctionDef
    branch: cst.If
    collect: cst.SimpleStatementLine
    end: cst.SimpleStatementLine
    train: cst.SimpleStatementLine
    clear: cst.BaseSmallStatement
    start: cst.Expr
    copy: cst.Call
    db: str
    collect_fn: cst.FunctionDef
    train_fn: cst.FunctionDef
    more: str
    bound_note: str


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Add the overlapped round to the trainer's update step. Returns (module, notes)."""
    survey = ctx.survey
    loop, reason, line = find_round_loop(survey)
    if loop is None:
        return module, [Note(FEATURE, False, reason, line)]
    toggle = ctx.toggle("ROUND_OVERLAP")
    new_methods = [_overlapped_step(loop, survey.module), _collect_copy(loop)]
    guarded = _guarded_step(loop, toggle, survey.module)
    body = []
    for stmt in loop.cls.body.body:
        if stmt is loop.step:
            body.extend([guarded, *new_methods])
        else:
            body.append(stmt)
    new_cls = loop.cls.with_changes(body=loop.cls.body.with_changes(body=body))
    module = replace_nodes(module, {loop.cls: new_cls}, ctx)
    ctx.need("round_overlap")
    ctx.uses_runtime("_round_overlap_of", "_round_overlap_close_all", "start", "clear", "receive", "publish", "dispatch", "copy_target", "close", "stop_point")
    name = loop.step.name.value
    lines = f"start line {survey.line_of(loop.start)}, collection line {survey.line_of(loop.collect)}, end line {survey.line_of(loop.end)}, training line {survey.line_of(loop.train)}, target copy line {survey.line_of(loop.copy)}"
    return module, [Note(FEATURE, True, f"round loop in {loop.cls.name.value}.{name} at line {survey.line_of(loop.step)} ({lines}): the next round is collected while this one trains, one round stale (switch: ROUND_OVERLAP); the sync_main path is unchanged; {loop.bound_note}", survey.line_of(loop.step))]


# order 80: a trainer has no training loader, so nothing before it touches the class
UNIT = Feature(FEATURE, apply, order=80, opt_in=True, injected="_round_overlap_of", runtime={"round_overlap": ()}, toggles=(
    Toggle("ROUND_OVERLAP", 1, "collect the next round's data while this round trains (one round stale; 0: the original order)", position=31),
))


def find_round_loop(survey) -> tuple[RoundLoop | None, str | None, int | None]:
    """The first round loop in the module, else (None, reason, line).

    Takes a `Survey`. Returns (RoundLoop, None, None) or (None, why, line number or None).
    The reason is that of the candidate that came closest (had a `sync_main` branch).
    """
    reason, line = "no round loop: no method with `start_update(...)` and an `if not ….sync_main:` branch", None
    for cls in survey.module.body:
        if not isinstance(cls, cst.ClassDef) or not isinstance(cls.body, cst.IndentedBlock):
            continue
        methods = {s.name.value: s for s in cls.body.body if isinstance(s, cst.FunctionDef)}
        for step in methods.values():
            branch = next((s for s in _statements(step) if m.matches(s, m.If(test=SYNC_MAIN_TEST))), None)
            if branch is None:
                continue
            loop, why = _round_loop_at(survey, cls, methods, step, branch)
            if loop is not None:
                return loop, None, None
            reason, line = f"round loop in {cls.name.value}.{step.name.value}: {why}", survey.line_of(branch)
    return None, reason, line


def _round_loop_at(survey, cls, methods, step, branch) -> tuple[RoundLoop | None, str | None]:
    if branch.orelse is None or not isinstance(branch.orelse, cst.Else):
        return None, "the `sync_main` branch has no else (the sync_main path) to leave as it is"
    body = list(branch.body.body) if isinstance(branch.body, cst.IndentedBlock) else []
    if len(body) != 3 or not (m.matches(body[0], SELF_CALL_STMT) and m.matches(body[1], SELF_CALL_STMT) and m.matches(body[2], SELF_CALL_ASSIGN)):
        return None, "the non-sync_main branch is not `self.<collect>(...)`, `self.<end>(...)`, `<loss> = self.<train>(...)` (start, blocking collection, end, train)"
    collect_name, end_name, train_name = (_self_method(s) for s in body)
    top = _statements(step)
    start = next((s.body[0] for s in top[: top.index(branch)] if m.matches(s, m.SimpleStatementLine(body=[START_UPDATE]))), None)
    if start is None:
        return None, "no `….start_update(...)` statement before the collection in the update step"
    clears = [s.body[0] for s in top[: top.index(branch)] if m.matches(s, m.SimpleStatementLine(body=[m.Expr(value=m.Call(func=m.Attribute(value=m.Attribute(value=m.Name("self")), attr=m.Name("clear")), args=[]))]))]
    if not clears:
        return None, "no `self.<buffer>.clear()` before the collection: the round's buffer is not known"
    clear = clears[0]
    db = clear.value.func.value.attr.value
    copies = [n for n in walk(step) if m.matches(n, TARGET_COPY)]
    after = [c for c in copies if survey.line_of(c) > survey.line_of(branch)]
    if len(after) != 1:
        return None, f"expected one `shutil.copy(<network file>, <target file>)` after training, found {len(after)}: the target file the workers read is not known"
    for name in (collect_name, end_name, train_name):
        if name not in methods:
            return None, f"`self.{name}` is not a method of {cls.name.value}"
    collect_fn, train_fn = methods[collect_name], methods[train_name]
    why = _check_collect(collect_fn, db)
    if why:
        return None, why
    more, why, bound_note = _another_round(cls, methods, train_fn, step)
    if more is None:
        return None, why
    return RoundLoop(cls, step, branch, body[0], body[1], body[2], clear, start, after[0], db, collect_fn, train_fn, more, bound_note), None


def _check_collect(fn: cst.FunctionDef, db: str) -> str | None:
    """Why `fn` is not a blocking collection into `self.<db>`, or None."""
    loops = [n for n in walk(fn) if isinstance(n, cst.While)]
    if not loops or not any(m.matches(n, m.Call(func=m.Attribute(attr=m.Name("get_update_data")))) for n in walk(loops[0])):
        return f"the collection method {fn.name.value} has no `while` loop calling `.get_update_data(...)`"
    if not any(m.matches(n, m.Attribute(value=m.Name("self"), attr=m.Name(db))) for n in walk(fn)):
        return f"the collection method {fn.name.value} does not fill self.{db}"
    if "times" not in {p.name.value for p in fn.params.params}:
        return f"the collection method {fn.name.value} has no `times` parameter for the collection thread's own timings"
    return None


def _another_round(cls, methods, train_fn, step) -> tuple[str | None, str | None, str]:
    """Source of "another round follows" after this round's training, or (None, why, "")."""
    module = cst.Module([])
    fors = [n for n in walk(train_fn) if isinstance(n, cst.For)]
    loop = fors[0] if fors else None
    if loop is None or not m.matches(loop.iter, m.Call(func=m.Name("range"), args=[m.Arg()])):
        return None, f"the training method {train_fn.name.value} has no `for _ in range(<iterations>)` loop", ""
    counters = [n.target for n in walk(loop.body) if m.matches(n, m.AugAssign(operator=m.AddAssign(), value=m.Integer("1")))]
    if len(counters) != 1:
        return None, f"the training loop of {train_fn.name.value} does not advance one iteration counter (`<counter> += 1`)", ""
    counter, iterations = module.code_for_node(counters[0]), module.code_for_node(loop.iter.args[0].value)
    step_name = step.name.value
    for fn in methods.values():
        for node in walk(fn):
            if isinstance(node, cst.While) and m.matches(node.test, m.Comparison(comparisons=[m.ComparisonTarget(operator=m.LessThan())])):
                if module.code_for_node(node.test.left) == counter and any(m.matches(c, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(step_name)))) for c in walk(node.body)):
                    bound = module.code_for_node(node.test.comparisons[0].comparator)
                    return f"{counter} + {iterations} < {bound}", None, f"rounds follow while {counter} < {bound} (the loop in {fn.name.value})"
    if counter.startswith("self.") and _holds_train_args(cls):
        return f"{counter} + {iterations} < self.train_args.max_itrs", None, f"the round loop is not in this file: rounds are assumed to follow while {counter} < self.train_args.max_itrs"
    return None, f"no loop `while {counter} < <bound>:` around self.{step_name}(...) and no train_args.max_itrs: when the last round comes is not known", ""


def _holds_train_args(cls: cst.ClassDef) -> bool:
    return any(m.matches(n, m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name("train_args")))) for n in walk(cls))


def _statements(fn: cst.FunctionDef) -> list[cst.BaseStatement]:
    return list(fn.body.body) if isinstance(fn.body, cst.IndentedBlock) else []


def _self_method(stmt: cst.SimpleStatementLine) -> str:
    small = stmt.body[0]
    return small.value.func.attr.value


def _params_source(fn: cst.FunctionDef) -> str:
    """The call arguments that forward `fn`'s parameters (after self)."""
    out = []
    for p in fn.params.params[1:]:
        out.append(p.name.value)
    if fn.params.star_arg is not None and isinstance(fn.params.star_arg, cst.Param):
        out.append("*" + fn.params.star_arg.name.value)
    out += [f"{p.name.value}={p.name.value}" for p in fn.params.kwonly_params]
    if fn.params.star_kwarg is not None:
        out.append("**" + fn.params.star_kwarg.name.value)
    return ", ".join(out)


def _guarded_step(loop: RoundLoop, toggle: str, module: cst.Module) -> cst.FunctionDef:
    """The original update step with one guard in front: overlapped when switched on and not sync_main."""
    test = module.code_for_node(loop.branch.test)
    guard = cst.parse_statement(f"if {toggle} and {test}:\n    return self._round_overlap_update_step({_params_source(loop.step)})\n")
    body = _statements(loop.step)
    at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])) else 0
    first = body[at]
    guard = guard.with_changes(leading_lines=first.leading_lines)
    body = body[:at] + [guard, first.with_changes(leading_lines=[])] + body[at + 1:]
    return loop.step.with_changes(body=loop.step.body.with_changes(body=body))


def _overlapped_step(loop: RoundLoop, module: cst.Module) -> cst.FunctionDef:
    """`_round_overlap_update_step`: the update step with the round dispatched ahead."""
    code = module.code_for_node
    start_call = code(loop.start.value)
    collect_call = loop.collect.body[0].value
    collect_args = ", ".join(code(a.value) if a.keyword is None else f"{a.keyword.value}={code(a.value)}" for a in collect_call.args)
    thread_args = ", ".join("t" if m.matches(a.value, m.Name("times")) else code(a.value) for a in collect_call.args)
    times = "times"
    new_branch = [
        cst.parse_statement(f"self.{loop.db} = _ro.receive(self.{loop.db}, lambda: self.{loop.collect_fn.name.value}({collect_args}), {times})\n").with_changes(leading_lines=loop.branch.leading_lines),
        loop.end,
        cst.parse_statement("_ro.publish()\n"),
        cst.parse_statement(
            f"_ro.dispatch(self.{loop.db}, lambda: {start_call}, lambda db, t: self._round_overlap_collect(db, {thread_args}), "
            f"lambda: self.updater.from_q.put(None), {times}, {loop.more})\n"
        ),
        loop.train,
    ]
    replacements = {
        loop.clear: cst.Expr(cst.parse_expression(f"_ro.clear(self.{loop.db}.clear)")),
        loop.start: cst.Expr(cst.parse_expression(f"_ro.start(lambda: {start_call})")),
        loop.copy: loop.copy.with_changes(func=cst.parse_expression("_ro.copy_target")),
        loop.branch: cst.FlattenSentinel(new_branch),
    }
    fn = loop.step.visit(_Replace(replacements))
    body = _statements(fn)
    at = 1 if body and m.matches(body[0], m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])) else 0
    body = body[at:]
    body[0] = body[0].with_changes(leading_lines=[])
    wrapped = cst.Try(
        body=cst.IndentedBlock(body=body),
        handlers=[cst.ExceptHandler(body=cst.IndentedBlock(body=[cst.parse_statement("_ro.close()\n"), cst.parse_statement("raise\n")]), type=cst.Name("BaseException"))],
    )
    first = cst.parse_statement("_ro = _round_overlap_of(self)\n")
    doc = cst.parse_statement('"""The update step with the next round collected while this one trains (round_overlap)."""\n')
    return fn.with_changes(name=cst.Name("_round_overlap_update_step"), body=fn.body.with_changes(body=[doc, first, wrapped]), leading_lines=[cst.EmptyLine(indent=False)], decorators=[])


def _collect_copy(loop: RoundLoop) -> cst.FunctionDef:
    """`_round_overlap_collect(self, db, ...)`: the collection filling `db`, stoppable at each step."""
    fn = loop.collect_fn.visit(_RenameAttribute(loop.db))
    fn = fn.visit(_PrependToLoops(cst.While, "_round_overlap_of(self).stop_point()"))
    params = fn.params.with_changes(params=[fn.params.params[0], cst.Param(cst.Name("db")), *fn.params.params[1:]])
    return fn.with_changes(name=cst.Name("_round_overlap_collect"), params=params, leading_lines=[cst.EmptyLine(indent=False)], decorators=[])


class _Replace(cst.CSTTransformer):
    """Replace nodes by identity (statements by a FlattenSentinel too)."""

    def __init__(self, replacements):
        super().__init__()
        self.replacements = replacements

    def on_leave(self, original_node, updated_node):
        new = self.replacements.get(original_node)
        return updated_node if new is None else new


class _RenameAttribute(cst.CSTTransformer):
    """`self.<name>` -> `db`."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def leave_Attribute(self, original_node, updated_node):
        if m.matches(original_node, m.Attribute(value=m.Name("self"), attr=m.Name(self.name))):
            return cst.Name("db")
        return updated_node


class _PrependToLoops(cst.CSTTransformer):
    """Put a statement first in the body of each loop of one kind."""

    def __init__(self, kind, code):
        super().__init__()
        self.kind, self.statement = kind, cst.parse_statement(code + "\n")

    def on_leave(self, original_node, updated_node):
        if isinstance(original_node, self.kind) and isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node.with_changes(body=updated_node.body.with_changes(body=[self.statement, *updated_node.body.body]))
        return updated_node
