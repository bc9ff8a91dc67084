"""Transform `env_toggles`: run-time switches for everything injected, plus a log line.

`TRAIN_PREFETCH` (1), `TRAIN_COPY_STREAM` (1), `TRAIN_PREFETCH_QUEUE` (2) with the
producer toggles, and the validation and timing toggles (`VAL_BYTECOUNT_DEVICE` is a string, read
without `int()`), those the other transforms use, are
added in the script's own Hyperparameters idiom, copied from one of its existing
`name = int(os.environ.get("NAME", default))` lines (a `;`-joined one-liner in a
minified script, annotated fields in a dataclass), or as module constants where
there is no such class. A log line through the script's own log function, just
before the training loader (or the data generator that feeds training) is first built,
records which mode ran. With every
toggle at 0 the script runs its original code paths.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk
from patcher.survey.survey import Survey
from patcher.transforms.base import Context, Feature, Note, ReplaceNodes, Toggle, Tracking, edit_tops, insert_before, small_statement

FEATURE = "env_toggles"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Define the toggles the other transforms referenced (`ctx.toggles_used`)."""
    if not ctx.toggles_used:
        return module, [Note(FEATURE, False, "no injected behaviour to switch")]
    survey = ctx.survey
    names = [n for n in ctx.toggles if n in ctx.toggles_used]
    hp, sample = survey.hyperparameters, ctx.facts[FEATURE]
    notes = []
    if ctx.toggle_home == "class":
        new = [_like(sample, ctx.toggles[name]) for name in names]
        module = edit_tops(module, ctx, {hp.node}, _AppendAfter(sample, new, ctx.minified))
        notes.append(Note(FEATURE, True, f"{', '.join(names)} added to {hp.name}", hp.line))
    else:
        ctx.constants = [small_statement(_constant_code(name, ctx)) for name in names]
        why = f" ({hp.name} has no env line with an int default to copy)" if hp is not None else ""
        notes.append(Note(FEATURE, True, f"{', '.join(names)} added as module constants{why}"))
    module, log_note = _log_line(module, ctx, names)
    notes.append(log_note)
    return module, notes


def env_sample(survey: Survey) -> cst.BaseSmallStatement | None:
    """The Hyperparameters class's first statement in the script's env idiom whose default
    is an int, which new toggles copy; None without such a class or line."""
    hp = survey.hyperparameters
    return _env_sample(hp.node) if hp is not None else None


# After every feature that reads a toggle: defines the toggles they used.
UNIT = Feature(name=FEATURE, apply=apply, order=90, analyse=env_sample)


def _env_sample(cls: cst.ClassDef) -> cst.BaseSmallStatement | None:
    """The first class-body statement in the script's env idiom whose default is an int.

    `seed = int(os.environ.get("SEED", 1337))`, `seed: int = ...`, or a helper such
    as `seed = _e("SEED", 1337, int)`: an assignment whose value holds a call with the
    upper-cased name as a string literal and an integer literal right after it.
    """
    body = cls.body.body if isinstance(cls.body, (cst.IndentedBlock, cst.SimpleStatementSuite)) else []
    for stmt in body:
        smalls = stmt.body if isinstance(stmt, cst.SimpleStatementLine) else [stmt] if isinstance(stmt, cst.BaseSmallStatement) else []
        for small in smalls:
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                name, value = small.targets[0].target.value, small.value
            elif isinstance(small, cst.AnnAssign) and small.value is not None and isinstance(small.target, cst.Name):
                name, value = small.target.value, small.value
            else:
                continue
            if env_idiom_call(value, name) is not None:
                return small
    return None


def env_idiom_call(value: cst.BaseExpression, name: str) -> cst.Call | None:
    """The call inside `value` shaped `f("NAME", <int>, …)` for attribute `name`, or None."""
    for node in walk(value):
        if not isinstance(node, cst.Call) or len(node.args) < 2:
            continue
        first, second = node.args[0].value, node.args[1].value
        if isinstance(first, cst.SimpleString) and isinstance(second, cst.Integer) and first.evaluated_value == name.upper():
            return node
    return None


def _like(sample: cst.BaseSmallStatement, toggle: Toggle) -> cst.BaseSmallStatement:
    """A copy of `sample` (`x = int(os.environ.get("X", 3))`, `x = _e("X", 3, int)`, …) for `toggle`."""
    env_name, attr, default = toggle.name, toggle.attr, toggle.default
    old_name = sample.targets[0].target.value if isinstance(sample, cst.Assign) else sample.target.value
    call = env_idiom_call(sample.value, old_name)
    quote = call.args[0].value.quote
    if isinstance(default, str):
        return _like_text(sample, call, env_name, attr, default, quote)
    new_call = call.with_changes(
        args=[
            call.args[0].with_changes(value=cst.SimpleString(f"{quote}{env_name}{quote}")),
            call.args[1].with_changes(value=cst.Integer(str(default))),
            *call.args[2:],
        ]
    )
    value = sample.value.visit(ReplaceNodes({call: new_call}))
    if isinstance(sample, cst.AnnAssign):
        return sample.with_changes(target=cst.Name(attr), value=value, semicolon=cst.MaybeSentinel.DEFAULT)
    return sample.with_changes(targets=[sample.targets[0].with_changes(target=cst.Name(attr))], value=value, semicolon=cst.MaybeSentinel.DEFAULT)


def _like_text(sample, call: cst.Call, env_name: str, attr: str, default: str, quote: str) -> cst.BaseSmallStatement:
    """A string toggle in the sample's style: `attr = os.environ.get("NAME", "default")`,
    the sample's own getter call when it is `os.environ.get`/`os.getenv`, with no int()."""
    args = [cst.SimpleString(f"{quote}{env_name}{quote}"), cst.SimpleString(f"{quote}{default}{quote}")]
    if m.matches(call.func, m.Attribute(value=m.Attribute(value=m.Name("os"), attr=m.Name("environ")), attr=m.Name("get")) | m.Attribute(value=m.Name("os"), attr=m.Name("getenv"))):
        value = call.with_changes(args=[call.args[0].with_changes(value=args[0]), call.args[1].with_changes(value=args[1], comma=cst.MaybeSentinel.DEFAULT)])
    else:
        value = cst.parse_expression(f"os.environ.get({quote}{env_name}{quote}, {quote}{default}{quote})")
    if isinstance(sample, cst.AnnAssign):
        return sample.with_changes(target=cst.Name(attr), annotation=sample.annotation.with_changes(annotation=cst.Name("str")), value=value, semicolon=cst.MaybeSentinel.DEFAULT)
    return sample.with_changes(targets=[sample.targets[0].with_changes(target=cst.Name(attr))], value=value, semicolon=cst.MaybeSentinel.DEFAULT)


def _constant_code(env_name: str, ctx: Context) -> str:
    default = ctx.toggles[env_name].default
    if isinstance(default, str):
        return ctx.code(f'{env_name} = os.environ.get("{env_name}", "{default}")', f'{env_name}=os.environ.get("{env_name}","{default}")')
    return ctx.code(f'{env_name} = int(os.environ.get("{env_name}", {default}))', f'{env_name}=int(os.environ.get("{env_name}",{default}))')


class _AppendAfter(Tracking):
    """Put `new` small statements after the statement that holds `sample`."""

    def __init__(self, sample, new, minified):
        super().__init__()
        self.sample, self.new, self.minified = sample, new, minified

    def prepare(self, ctx: Context) -> None:
        super().prepare(ctx)
        self.sample = ctx.resolve(self.sample)

    def targets(self) -> list[cst.CSTNode]:
        return [self.sample]

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if not any(s is self.sample for s in original_node.body):
            return updated_node
        if len(original_node.body) == 1 and not self.minified:
            lines = [cst.SimpleStatementLine(body=[s]) for s in self.new]
            return cst.FlattenSentinel([updated_node] + lines)
        return updated_node.with_changes(body=_joined(list(updated_node.body), self.new))

    def leave_SimpleStatementSuite(self, original_node, updated_node):
        if not any(s is self.sample for s in original_node.body):
            return updated_node
        return updated_node.with_changes(body=_joined(list(updated_node.body), self.new))


def _joined(body, new):
    semicolon = cst.Semicolon(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
    last = body[-1].with_changes(semicolon=semicolon)
    tail = [s.with_changes(semicolon=semicolon) for s in new[:-1]] + [new[-1]]
    return body[:-1] + [last] + tail


def _log_line(module: cst.Module, ctx: Context, names: list[str]):
    survey = ctx.survey
    sites = _data_sources(ctx.verdicts)
    if survey.log_function is None or not sites:
        return module, Note(FEATURE, False, "no log function in reach of the loader construction; toggles not logged")
    log_name, log_fn = survey.log_function
    first = sites[0]
    defined_in = survey.collector.scope_of[log_fn].parent
    scope = first.binding
    while scope is not None and scope is not defined_in:
        scope = scope.parent
    # Both at module level: the function must be defined before the line that would call it.
    if scope is None or (scope is first.binding and survey.line_of(log_fn) > first.line):
        built = "loader" if ctx.verdicts.training_constructions() else "data generator"
        return module, Note(FEATURE, False, f"{log_name} is not visible where the {built} is built; toggles not logged", first.line)
    listing = _hyperparameters_listing(survey, log_name) if ctx.toggle_home == "class" else None
    if listing is not None:  # the toggles are class attributes: that loop logs them already
        return module, Note(FEATURE, True, f"toggles logged by the script's own listing of {survey.hyperparameters.name}", survey.line_of(listing))
    fields = " ".join(f"{ctx.toggles[n].attr}:{{{ctx.toggle(n)}}}" for n in names)
    statement = small_statement(f'{log_name}(f"patch_prefetch {fields}")')
    module = insert_before(module, first.node, [statement], ctx)
    return module, Note(FEATURE, True, f"toggles logged through {log_name} before line {first.line}", first.line)


def _data_sources(verdicts) -> list:
    """Where the training data source is built, first line first: the training loader's
    constructions, or else the data generator that feeds training (run ahead, or with its
    own H2D copies staged: modded-nanogpt's `train_loader = distributed_data_generator(...)`)."""
    sites = verdicts.training_constructions() or [i for i in verdicts.iterators if i.training or i.staged]
    return sorted(sites, key=lambda site: site.line)


def _hyperparameters_listing(survey: Survey, log_name: str) -> cst.For | None:
    """The script's loop that logs every attribute of its Hyperparameters class, or None.

    Records from 2026-04 on log their settings at start-up with
    `for k, v in sorted(vars(type(h)).items()): ... log(f"  {k}: {v}")`, `h` being an
    instance of the class (`h = Hyperparameters()`); `vars(Hyperparameters)` counts too.
    Toggles added to that class are then in the log already, and a log line of our own
    would only cost code bytes. A loop over the instance (`vars(h)`) does not count: a
    plain class's instance holds none of its class attributes.
    """
    hp = survey.hyperparameters.name
    index = survey.collector  # the survey's one pass: its `name = f(...)` assignments and its loops
    instances = {
        target.target.value
        for node, _ in index.call_assigns
        if m.matches(node, m.Assign(value=m.Call(func=m.Name(hp))))
        for target in node.targets
        if isinstance(target.target, cst.Name)
    }
    of_class = m.Call(func=m.Name("vars"), args=[m.Arg(m.Name(hp) | m.Call(func=m.Name("type"), args=[m.Arg(m.Name(value=m.MatchIfTrue(instances.__contains__)))]))])
    logs = m.Call(func=m.Name(log_name))
    for node in index.loops:
        if any(isinstance(n, cst.Call) and m.matches(n, of_class) for n in walk(node.iter)) and any(isinstance(n, cst.Call) and m.matches(n, logs) for n in walk(node.body)):
            return node
    return None
