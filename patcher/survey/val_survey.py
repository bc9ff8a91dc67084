"""Read-only analysis of a script's evaluation loops (features `val_prefetch`, `val_bytecount`, `val_progress`).

`find_val_loops(survey)` looks in every function whose name contains `eval` for
loops that slice a token tensor per batch and copy the slice to the device:

    for batch_seq_start in range(seq_start, seq_end, local_batch_seqs):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        raw_start = batch_seq_start * seq_len
        raw_end = batch_seq_end * seq_len + 1
        local = val_tokens[raw_start:raw_end].to(device=device, dtype=torch.int64, non_blocking=True)

and decides, with the reason when not, whether the slice is a pure function of the
loop variable (so it may be built ahead), where the bits-per-byte byte counting is,
and whether the script's log function is visible there. Nodes belong to the
surveyed module (transforms find them by identity).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import dotted, dotted_reads, walk_own as _walk_own
from patcher.survey.survey import LOG_FUNCTIONS, Survey

# Calls a slice bound may make: pure functions of their arguments.
PURE_CALLS = {"min", "max", "int", "abs", "len"}
TO_KEYWORDS = {"device", "dtype", "non_blocking"}

SLICE_TO = m.Call(
    func=m.Attribute(value=m.Subscript(slice=[m.SubscriptElement(slice=m.Slice())]), attr=m.Name("to")),
)


@dataclass
class ByteCount:
    """The three byte-counting statements of a loop (`token_bytes = lut[tgt_ids]...`,
    `token_bytes += (...)`, `val_byte_count += token_bytes.to(torch.float64).sum()`).

    statements: the three small statements; luts: source of the three table
    expressions (base bytes, has leading space, is boundary); accumulator: the
    float64 tensor they add to.
    """

    statements: list[cst.BaseSmallStatement]
    luts: list[str]
    accumulator: str
    line: int


@dataclass
class ValLoop:
    """One evaluation loop that copies a per-batch token slice to the device.

    function: the enclosing function's name; loop: the `For`; target: the loop
    variable; assign: the `local = <window>.to(...)` statement, to_call its value and
    window the slice (`val_tokens[raw_start:raw_end]`); prefix: the loop's
    statements before `assign` that the window needs, in order. reason: why the
    slice cannot be built ahead (None: it can). bytes: the byte counting, or None
    with bytes_reason. log: the log function visible in the loop, or None with
    log_reason. nested: the loop runs inside another loop of the function (per
    chunk of test-time training, say).
    """

    function: str
    function_node: cst.FunctionDef
    loop: cst.For
    line: int
    target: str | None = None
    assign: cst.Assign | None = None
    to_call: cst.Call | None = None
    window: cst.Subscript | None = None
    prefix: list[cst.BaseSmallStatement] = field(default_factory=list)
    reason: str | None = None
    bytes: ByteCount | None = None
    bytes_reason: str | None = None
    log: str | None = None
    log_reason: str | None = None
    nested: bool = False

    @property
    def over_range(self) -> bool:
        return m.matches(self.loop.iter, m.Call(func=m.Name("range"))) and isinstance(self.loop.target, cst.Name)


def find_val_loops(survey: Survey) -> list[ValLoop]:
    """Every loop in an `eval*` function whose body copies a token slice to the device.

    A loop whose slice `.to(...)` sits only in a nested block or an inner loop is
    reported too, with the reason, at the innermost loop holding it. Surveyed once per
    `Survey` (the three validation transforms ask the same question of the same module).
    """
    return list(survey.shared("val_loops", lambda: _find_val_loops(survey)))


@functools.lru_cache(maxsize=256)
def _own(node: cst.CSTNode) -> tuple[cst.CSTNode, ...]:
    """`walk_own(node)` as a tuple, made once per node (libcst nodes are immutable and hash
    by identity): the loop survey asks the same function bodies again and again. Cleared
    when `_find_val_loops` ends."""
    return tuple(_walk_own(node))


def _find_val_loops(survey: Survey) -> list[ValLoop]:
    try:
        found = []
        for function in survey.collector.functions:
            if "eval" not in function.name.value:
                continue
            loops = _own_loops(function)
            inner = {id(n) for loop in loops for n in _own(loop.body) if isinstance(n, cst.For)}
            for loop in loops:
                site = _survey_loop(survey, function, loop)
                if site is not None:
                    site.nested = id(loop) in inner
                    found.append(site)
        return found
    finally:
        _own.cache_clear()  # the walks belong to this module's survey; keep no tree alive


def _own_loops(function: cst.FunctionDef) -> list[cst.For]:
    """The `for` loops of `function` in source order, not those of functions defined inside it."""
    return [n for n in _own(function.body) if isinstance(n, cst.For)]


def _direct_smalls(block: cst.BaseSuite) -> list[tuple[cst.BaseSmallStatement, cst.CSTNode]]:
    """(small statement, its line) for the simple statements directly in `block`, in order."""
    if isinstance(block, cst.SimpleStatementSuite):
        return [(s, block) for s in block.body]
    out = []
    for stmt in block.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            out.extend((s, stmt) for s in stmt.body)
    return out


def _slice_assign(small: cst.BaseSmallStatement) -> bool:
    return m.matches(small, m.Assign(targets=[m.AssignTarget(m.Name())], value=SLICE_TO))


def _survey_loop(survey: Survey, function: cst.FunctionDef, loop: cst.For) -> ValLoop | None:
    smalls = _direct_smalls(loop.body)
    assigns = [s for s, _ in smalls if _slice_assign(s)]
    if not assigns:
        in_inner_loops = {id(n) for inner in _own(loop.body) if isinstance(inner, cst.For) for n in _own(inner)}
        nested = [n for n in _own(loop.body) if isinstance(n, cst.Call) and m.matches(n, SLICE_TO) and id(n) not in in_inner_loops]  # the type first: matchers are slow
        if not nested:
            return None  # no slice here, or it belongs to an inner loop (reported there)
        site = ValLoop(function.name.value, function, loop, survey.line_of(loop))
        site.reason = site.bytes_reason = site.log_reason = f"the slice `.to(...)` in {site.function} is inside a nested block, not a statement of the loop"
        return site
    site = ValLoop(function.name.value, function, loop, survey.line_of(loop))
    site.assign = assigns[0]
    site.to_call = site.assign.value
    site.window = site.to_call.func.value
    site.target = loop.target.value if isinstance(loop.target, cst.Name) else None
    module = survey.module
    if not site.over_range:
        site.reason = f"`for {module.code_for_node(loop.target)} in {module.code_for_node(loop.iter)}` in {site.function} iterates over no `range(...)` of batch starts"
    else:
        site.reason = _purity(site, smalls, module)
    site.log, site.log_reason = _visible_log(survey, function, site)
    if site.reason is not None:
        site.bytes_reason = site.reason
    else:
        site.bytes, site.bytes_reason = _byte_count(site, survey)
    return site


def _assigned_in(node: cst.CSTNode) -> dict[str, int]:
    """How many times each name is bound under `node` (assignments, loop and with targets, walrus, del)."""
    counts: dict[str, int] = {}
    for n in _own(node):
        targets = []
        if isinstance(n, cst.Assign):
            targets = [t.target for t in n.targets]
        elif isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.NamedExpr)):
            targets = [n.target]
        elif isinstance(n, (cst.For, cst.CompFor)):
            targets = [n.target]
        elif isinstance(n, cst.WithItem) and n.asname is not None:
            targets = [n.asname.name]
        elif isinstance(n, cst.Del):
            targets = [n.target]
        for t in targets:
            for name in _bound_names(t):
                counts[name] = counts.get(name, 0) + 1
    return counts


def _bound_names(target: cst.BaseExpression) -> list[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in _bound_names(e.value)]
    if isinstance(target, cst.StarredElement):
        return _bound_names(target.value)
    if isinstance(target, (cst.Attribute, cst.Subscript)):
        return [dotted(target) or "<subscript>"]
    return []


def _purity(site: ValLoop, smalls, module: cst.Module) -> str | None:
    """Why the window is not a pure function of the loop variable, else None (and fills site.prefix)."""
    assigned = _assigned_in(site.loop.body)
    before = []
    for small, _line in smalls:
        if small is site.assign:
            break
        before.append(small)
    where = f"in {site.function}"
    for arg in site.to_call.args:
        if arg.keyword is None or arg.keyword.value not in TO_KEYWORDS:
            return f"`.to({module.code_for_node(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT))})` {where}: only device=, dtype=, non_blocking= keywords are rebuilt"
        for name in dotted_reads(arg.value):
            if assigned.get(name):
                return f"`.to(...)` argument `{name}` {where} changes inside the loop"
    if not any(a.keyword.value == "device" for a in site.to_call.args):
        return f"`.to(...)` {where} names no device"
    definitions = {}
    for small in before:
        if m.matches(small, m.Assign(targets=[m.AssignTarget(m.Name())])):
            definitions[small.targets[0].target.value] = small
    needed, wanted = [], list(dotted_reads(site.window))
    while wanted:
        name = wanted.pop()
        if name == site.target or name in [n.targets[0].target.value for n in needed]:
            continue
        if name in definitions and assigned.get(name) == 1:
            small = definitions[name]
            for call in (n for n in _own(small.value) if isinstance(n, cst.Call)):
                called = dotted(call.func)
                if called not in PURE_CALLS:
                    return f"slice bound `{name}` {where} calls `{module.code_for_node(call.func)}`; only {', '.join(sorted(PURE_CALLS))} are known to be pure"
            needed.append(small)
            wanted.extend(dotted_reads(small.value))
        elif assigned.get(name):
            return f"slice bound `{name}` {where} is assigned in the loop other than once before the slice"
    order = {id(s): i for i, s in enumerate(before)}
    site.prefix = sorted(needed, key=lambda s: order[id(s)])
    return None


def _visible_log(survey: Survey, function: cst.FunctionDef, site: ValLoop) -> tuple[str | None, str | None]:
    """The script's log function if `function` can call it, else (None, why)."""
    if survey.log_function is None:
        return None, f"no log function ({', '.join(LOG_FUNCTIONS)}) in the script"
    name, log_fn = survey.log_function
    defined_in = survey.collector.scope_of[log_fn].parent
    scope = survey.collector.scope_of.get(function)
    while scope is not None and scope is not defined_in:
        scope = scope.parent
    if scope is None:
        home = defined_in.node.name.value if isinstance(defined_in.node, cst.FunctionDef) else "another function"
        return None, f"{name} is defined inside {home}(), not visible in {site.function}"
    if name in _assigned_in(function):
        return None, f"{site.function} rebinds the name {name}"
    return name, None


def _byte_count(site: ValLoop, survey: Survey) -> tuple[ByteCount | None, str | None]:
    """The byte-counting statements of the loop, checked to read the batch's own tokens."""
    module = survey.module
    where = f"in {site.function}"
    blocks = [n for n in _own(site.loop.body) if isinstance(n, (cst.IndentedBlock, cst.SimpleStatementSuite))]
    inner_loops = [n for n in _own(site.loop.body) if isinstance(n, cst.For)]
    inner = {id(b) for loop in inner_loops for b in _own(loop.body)}
    for block in blocks:
        if id(block) in inner:
            continue
        smalls = [s for s, _ in _direct_smalls(block)]
        for i in range(len(smalls) - 2):
            found = _match_three(smalls[i : i + 3])
            if found is None:
                continue
            if isinstance(block, cst.SimpleStatementSuite):
                return None, f"byte counting {where} sits on a one-line block; left on the device"
            tb, luts, tgt, prev, acc = found
            why = _ids_from_window(site, tgt, prev, where) or _accumulator_is_tensor(site.function_node, acc, where)
            if why is None and _assigned_in(site.function_node).get(tb, 0) != 2:
                why = f"`{tb}` {where} is assigned outside the byte counting"
            if why is None and sum(1 for n in dotted_reads(site.function_node.body) if n == tb) != 3:
                why = f"`{tb}` {where} is read outside the byte counting"
            if why is not None:
                return None, why
            return ByteCount(smalls[i : i + 3], [module.code_for_node(x) for x in luts], acc, survey.line_of(smalls[i])), None
    return None, f"no `token_bytes = base_bytes_lut[tgt_ids]...` byte counting {where}"


def _match_three(smalls) -> tuple | None:
    """(token_bytes name, [three LUT exprs], tgt name, prev name, accumulator) for the script's three statements."""
    first, second, third = smalls
    lookup = m.Subscript(slice=[m.SubscriptElement(slice=m.Index(value=m.Name()))])
    if not m.matches(first, m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call(func=m.Attribute(value=lookup, attr=m.Name("to"))))):
        return None
    tb = first.targets[0].target.value
    base = first.value.func.value
    tgt = base.slice[0].slice.value.value
    pair = m.BinaryOperation(operator=m.BitAnd(), left=lookup, right=m.UnaryOperation(operator=m.BitInvert(), expression=lookup))
    if not m.matches(second, m.AugAssign(target=m.Name(tb), operator=m.AddAssign(), value=m.Call(func=m.Attribute(value=pair, attr=m.Name("to"))))):
        return None
    op = second.value.func.value
    if op.left.slice[0].slice.value.value != tgt:
        return None
    prev = op.right.expression.slice[0].slice.value.value
    total = m.Call(func=m.Attribute(value=m.Call(func=m.Attribute(value=m.Name(tb), attr=m.Name("to"))), attr=m.Name("sum")), args=[])
    if not m.matches(third, m.AugAssign(target=m.Name(), operator=m.AddAssign(), value=total)):
        return None
    if not m.matches(third.value.func.value, m.Call(args=[m.Arg(keyword=None, value=m.Attribute(value=m.Name("torch"), attr=m.Name("float64")))])):
        return None
    return tb, [base.value, op.left.value, op.right.expression.value], tgt, prev, third.target.value


def _single_value(function_body: cst.CSTNode, name: str, augmented: bool = False) -> cst.BaseExpression | None:
    """The value of the one assignment of `name` (plain or in a parallel tuple assignment),
    else None; with `augmented`, `name += ...` statements besides it are allowed."""
    values = []
    for n in _own(function_body):
        if isinstance(n, cst.Assign) and len(n.targets) == 1:
            t = n.targets[0].target
            if isinstance(t, cst.Name) and t.value == name:
                values.append(n.value)
            elif isinstance(t, cst.Tuple) and isinstance(n.value, cst.Tuple) and len(t.elements) == len(n.value.elements):
                for te, ve in zip(t.elements, n.value.elements):
                    if isinstance(te.value, cst.Name) and te.value.value == name:
                        values.append(ve.value)
    if len(values) != 1:
        return None
    augments = sum(1 for n in _own(function_body) if isinstance(n, cst.AugAssign) and m.matches(n, m.AugAssign(target=m.Name(name))))
    bound = _assigned_in(function_body).get(name, 0)
    return values[0] if bound == 1 or (augmented and bound == 1 + augments) else None


def _ids_from_window(site: ValLoop, tgt: str, prev: str, where: str) -> str | None:
    """None when `prev`/`tgt` are the batch's `local[:-1]`/`local[1:]` (reshaped or flattened), else why not."""
    local = site.assign.targets[0].target.value
    body = site.loop.body

    def flat_of(name: str, cut: str) -> bool:
        value = _single_value(body, name)
        if value is None:
            return False
        value = _strip_reshape(value)
        if isinstance(value, cst.Name):  # prev_ids = x (.reshape(-1)), x = local[:-1] (.reshape(...))
            inner = _single_value(body, value.value)
            value = _strip_reshape(inner) if inner is not None else None
        return value is not None and m.matches(value, m.Subscript(value=m.Name(local))) and cst.Module([]).code_for_node(value.slice[0].slice).replace(" ", "") == cut

    if not flat_of(tgt, "1:"):
        return f"`{tgt}` {where} is not the batch's targets `{local}[1:]`"
    if not flat_of(prev, ":-1"):
        return f"`{prev}` {where} is not the batch's inputs `{local}[:-1]`"
    return None


def _strip_reshape(value: cst.BaseExpression) -> cst.BaseExpression:
    """`e.reshape(...)` -> `e` (the same elements in the same order)."""
    while m.matches(value, m.Call(func=m.Attribute(attr=m.Name("reshape")))):
        value = value.func.value
    return value


def _accumulator_is_tensor(function: cst.FunctionDef, name: str, where: str) -> str | None:
    value = _single_value(function.body, name, augmented=True)
    if value is not None and m.matches(value, m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("zeros")))):
        return None
    return f"byte accumulator `{name}` {where} is not one `torch.zeros(...)` tensor"
