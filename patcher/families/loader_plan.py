"""The plan of the families whose loader `_make_train_loader` rebuilds on the CPU.

`train_loader = Loader(..., device)` becomes `_make_train_loader(lambda loader_device:
Loader(..., loader_device), device, ...)`: a producer builds the batches on the CPU and
hands them out in order. By default the producer is a forked child process
(`templates/prefetch_lean.py`: it holds no GIL of the training loop); the thread
runtime (`templates/prefetch_loader.py`) where the variable needs what only it has:
a `next_batch` argument that changes during the run (applied at hand-out when the
loader only reshapes with it, else a snapshot rollback), or reads of the loader beyond
`.next_batch` (settled where the caller is).

Refused, with the reason, where the batches could differ or a forked child would hang:
a loader that already prefetches or reaches threads outside its class (the reason says
where: a forked child has none of them), draws from a global RNG, calls
torch.distributed, or uses its device for more than the final H2D copy; a loader with
no `device` parameter, or a construction that passes none; a per-step argument on a
loader that changes arrays in place (its state cannot be snapshot cheaply).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk
from patcher.families.base import THREAD_LOADER_RUNTIME, DataVariable, Plan, refused
from patcher.survey.threads import THREAD_NAMES


def already_prefetches(loader) -> Plan:
    """The refusal of a loader that builds batches ahead itself: where the thread comes
    from when its code reaches one outside its classes (`LoaderClass.threads`)."""
    return refused(loader.threads or f"{loader.name} already prefetches (threads in the loader); not wrapped again", loader.line)


def plan_rebuilt_on_cpu(variable: DataVariable, verdicts) -> Plan:
    """The plan for `variable` (read with `verdicts`, a `Verdicts`), whose loader is
    rebuilt on the CPU by `_make_train_loader`.

    Returns a refusal, or the wrap: its options (`reshape_arg`, `rollback`,
    `host_copy=False` for the thread runtime where the loader writes into no array it
    keeps, `attrs` and `replay`) and its runtime, the thread one where an option needs it.
    """
    survey = verdicts.survey
    reason, line, reshape_arg, rollback = _blocker(variable, verdicts)
    if reason is not None:
        return refused(reason, line)
    attrs = _read_beyond_next_batch(survey.module, variable.target)
    head = f"`{variable.target}` built at line {variable.lines} prefetches"
    tail = ""
    direct = _direct_uses(survey, variable)
    if direct:
        tail += f"; reading {', '.join(direct)} first replays the loader to the caller's position (exact, costs one pass)"
    if rollback:
        tail += f"; per-step argument {rollback}: batches queued with older values are dropped and the loader restored from a snapshot"
    options = {}
    if reshape_arg is not None:
        options["reshape_arg"] = reshape_arg
    if rollback:
        options["rollback"] = True
    thread = bool(options) or attrs
    needs = _thread_reasons(variable, survey, reshape_arg, rollback, attrs)
    # The forked runtime always copies a batch out of its slot; the thread one need not
    # where the loader never writes into an array it keeps.
    if variable.loader.writes_arrays is None:
        options["host_copy"] = False
    if attrs:
        options.update(attrs=True, replay=True)
    return Plan(
        note=f"{head}; a thread of this process builds the batches (the thread runtime: {needs}){tail}",
        forked_note=f"{head}; {_planned_start(variable, survey)}{tail}",
        options=options,
        runtime=THREAD_LOADER_RUNTIME if thread else None,
    )


def _thread_reasons(variable: DataVariable, survey, reshape_arg: int | None, rollback: str | None, attrs: bool) -> str:
    """Why `variable` runs on the thread runtime, as the report says it: what of it the
    forked one cannot serve, or else that another data source of the script needs it (a
    script has one `_make_train_loader`)."""
    reasons = []
    if reshape_arg is not None:
        changing = sorted({f"`{call.args[reshape_arg]}`" for site in variable.sites for call in survey.calls_on(site) if not call.constant[reshape_arg]})
        reasons.append(f"next_batch's {', '.join(changing)} {'change' if len(changing) > 1 else 'changes'} during the run, applied at hand-out")
    if rollback:
        reasons.append("the snapshot rollback")
    if attrs:
        reasons.append(f"the script uses `{variable.target}` beyond next_batch")
    return "; ".join(reasons) or "another data source of this script needs it"


def _blocker(variable: DataVariable, verdicts) -> tuple[str | None, int | None, int | None, str | None]:
    """Why this loader variable cannot be prefetched exactly, else (None, None, reshape_arg, rollback).

    rollback names the per-step arguments (beyond a reshape-only one) that need the
    snapshot rollback; it is allowed for loaders that change no array in place.
    """
    cls, survey = variable.loader, verdicts.survey
    if verdicts.prefetches(cls.name):
        return already_prefetches(cls).refusal, cls.line, None, None
    if cls.unsafe:
        return cls.unsafe, cls.line, None, None
    if cls.device_index is None:
        return f"{cls.name}.__init__ takes no `device` parameter to build it on the CPU", cls.line, None, None
    for site, device_arg in zip(variable.sites, variable.device_args):
        if device_arg is None:
            return f"`{site.target} = {cls.name}(...)` passes no device argument", site.line, None, None
    reshape_arg, rollback = None, []
    for call in (c for site in variable.sites for c in survey.calls_on(site)):
        changing = [i for i, const in enumerate(call.constant) if not const]
        if cls.reshape_only is not None and cls.reshape_only in changing:
            reshape_arg = cls.reshape_only
            changing.remove(cls.reshape_only)
        if not changing:
            continue
        names = ", ".join(f"`{call.args[i]}`" for i in changing)
        if cls.in_place is not None:
            return (
                f"next_batch gets per-step argument {names} and {cls.in_place}, so queued batches cannot be rolled back cheaply",
                call.line,
                None,
                None,
            )
        rollback.append(names)
    return None, None, reshape_arg, ", ".join(sorted(set(rollback))) or None


def _read_beyond_next_batch(module: cst.Module, target: str) -> bool:
    """Whether the script uses the name `target` other than to assign it or call
    `.next_batch` on it (an attribute read, an argument, ...): then its loader is built
    with `attrs=True`, which settles it on such reads. By name, whatever the scope, so
    that a doubt keeps the settling code."""
    nodes = list(walk(module))
    # Script functions whose parameter of the same name receives the loader: their
    # uses of that name are counted here like the caller's.
    params = {n.name.value: [p.name.value for p in (*n.params.posonly_params, *n.params.params)] for n in nodes if isinstance(n, cst.FunctionDef)}
    names = accounted = 0
    for node in nodes:
        if isinstance(node, cst.Name) and node.value == target:
            names += 1
        elif isinstance(node, (cst.Attribute, cst.AssignTarget, cst.Param)) and m.matches(node, m.Attribute(value=m.Name(target), attr=m.Name("next_batch")) | m.AssignTarget(target=m.Name(target)) | m.Param(name=m.Name(target))):  # the type first: matchers are slow
            accounted += 1
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in params:
            for index, arg in enumerate(node.args):
                if m.matches(arg.value, m.Name(target)) and not arg.star:
                    name = arg.keyword.value if arg.keyword is not None else (params[node.func.value] + [None] * (index + 1))[index]
                    accounted += name == target and (arg.keyword is not None or index < len(params[node.func.value]))
    return names > accounted


def _direct_uses(survey, variable: DataVariable) -> list[str]:
    """`train_loader.<attr>` reads other than next_batch (served after a replay)."""
    binding = variable.sites[0].binding
    uses = [a for a in survey.collector.attribute_uses if a.base == variable.target and a.scope.resolve(a.base) is binding]
    return sorted({f"{a.base}.{a.attr}" for a in uses if a.attr != "next_batch"})


def _planned_start(variable: DataVariable, survey) -> str:
    """How the forked runtime's producer will start, and why, as the report says it: a
    child process forked once at the first batch, which a rebuild resets; a thread of the
    training process instead where the script's own threads run at that batch (the
    calls that start threads outside the loader classes are named)."""
    rebuilds = [site.line for site in variable.sites[1:]]
    start = "a child process forked once, at the first batch, builds the batches"
    if rebuilds:
        start += f"; the rebuild{'s' if len(rebuilds) > 1 else ''} at line {', '.join(map(str, rebuilds))} reset{'' if len(rebuilds) > 1 else 's'} it, without another fork"
    threads = _thread_starts(survey)
    if threads:
        return f"the script starts threads (line {', '.join(map(str, threads))}): where one runs at the first batch, a thread of this process builds the batches; else {start}"
    return f"{start} (a thread of this process instead where threads other than torch's own run at the first batch)"


_THREAD_CALL = m.Call(func=m.Name(m.MatchIfTrue(THREAD_NAMES.__contains__)) | m.Attribute(attr=m.Name(m.MatchIfTrue(THREAD_NAMES.__contains__))))


def _thread_starts(survey) -> list[int]:
    """Lines of the script's calls that create threads (`threading.Thread(...)`, an
    executor) outside its loader classes, which `LoaderClass.threads` covers."""
    loaders = [loader.node for loader in survey.loader_classes.values()]
    inside = {id(node) for loader in loaders for node in walk(loader)}
    return sorted({survey.line_of(call) for call in m.findall(survey.module, _THREAD_CALL) if id(call) not in inside})
