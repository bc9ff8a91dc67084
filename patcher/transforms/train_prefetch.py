"""Transform `train_prefetch`: build training batches ahead, off the training thread.

Every construction of the training loader, `train_loader = Loader(..., device)`,
becomes `train_loader = _make_train_loader(lambda loader_device: Loader(...,
loader_device), device, prefetch=…, copy_stream=…)` (`queue_depth=…` too with the
producer toggles); the runtime is
`templates/prefetch_lean.py` where every call passes run constants and the script
uses the variable for nothing but `.next_batch` (a forked child process runs the
loader, so it costs the training loop no GIL time), else `templates/prefetch_loader.py`
(a thread; replay, rollback, reshape at hand-out, settling on attribute reads,
several workers). The loader class itself is not touched.

A data generator (`train_loader = gen(...)`, advanced with `next(train_loader)`)
becomes `_prefetch_iterator(lambda: gen(...), ...)` (`templates/prefetch_iterator.py`),
unless it receives `.send(...)`, draws from a global RNG, calls a collective, or
already loads in the background.

Skipped, with the reason, where the data could differ: a loader that already
prefetches, draws from a global RNG, calls torch.distributed, or uses its device
for more than the final H2D copy; a `next_batch` argument that changes during the
run, for a loader that changes arrays in place (its state cannot be snapshot cheaply).
A changing argument the loader only reshapes with (`seq_len` in the TokenStream
family) is applied at hand-out; any other changing argument gets `rollback=True`:
the worker snapshots the loader before each batch and a change restores it.
On the full runtime, a loader that never writes into an array it keeps gets
`host_copy=False`: on a host device its batches are handed out as built, without a
defensive copy.
A script that uses the loader variable for more than `.next_batch(...)` (reads an
attribute, passes it to a function whose parameter has another name) gets
`attrs=True`: such reads settle the loader where the caller is. Others get no settling
code at all (patcher/render/cut.py cuts what no call site asks for).

With `producer_toggles` (`--producer-toggles`, and `bench`), the ShuffledSequenceLoader
family runs on the full runtime with the tuning toggles `TRAIN_PREFETCH_WORKERS`
(several threads, batches handed out in order) and, when its `next_batch` is exactly
the known shape (`patcher/survey/assembly.py`), `TRAIN_PREFETCH_NUMPY`: the batch is
planned (the RNG draws, in order) and gathered in numpy
(`templates/shuffled_assembly.py`). A default patch leaves them out: the lean
runtime's child process runs the script's own `next_batch` at no GIL cost to the
training loop, and every byte counts against the artifact cap.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.survey.assembly import Recognition, recognise_shuffled
from patcher.cst_walk import walk
from patcher.transforms.base import Code, Context, Feature, Note, Toggle, replace_nodes

FEATURE = "train_prefetch"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Rewrite the training loader's construction sites. Returns (module, notes)."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    sites = survey.training_constructions()
    iterators = [i for i in survey.iterators if i.training]
    if not sites and not iterators:
        return module, [Note(FEATURE, False, _no_site_reason(survey), _first_line(survey))]
    notes: list[Note] = []
    replacements: dict[cst.CSTNode, cst.CSTNode] = {}
    # Per-step arguments (reshape, rollback) or attribute reads need the full runtime
    # (templates/prefetch_loader.py); constant arguments alone get templates/prefetch_lean.py.
    needs_full = False
    for target in sorted({i.target for i in iterators}):
        group = [i for i in iterators if i.target == target]
        for site in group:
            replacements[site.call] = _runner_call("_prefetch_iterator", site, ctx, module)
        lines = ", ".join(str(i.line) for i in group)
        notes.append(Note(FEATURE, True, f"`{target}` (generator {group[0].function}) built at line {lines} runs ahead on a background thread", group[0].line))
        ctx.need("prefetch_iterator")
    # First pass: what each loader variable needs, so that the runtime (lean or full)
    # is known before its call sites are written; the lean one takes fewer options.
    wrapped = []
    for target in sorted({c.target for c in sites}):
        group = [c for c in sites if c.target == target]
        cls = survey.loader_classes[group[0].class_name]
        if cls.device_index is None and cls.cuda_in_next_batch and not cls.prefetches and not cls.unsafe:
            reason, line = _calls_ahead_blocker(group, survey)
            if reason is not None:
                notes.append(Note(FEATURE, False, reason, line))
                continue
            for site in group:
                replacements[site.call] = _runner_call("_prefetch_next_batch", site, ctx, module)
            lines = ", ".join(str(c.line) for c in group)
            notes.append(Note(FEATURE, True, f"`{target}` built at line {lines}: next_batch() runs ahead on a background thread, its own .cuda() copies on the copy stream", group[0].line))
            ctx.need("prefetch_iterator")
            continue
        reason, line, reshape_arg, rollback = _blocker(group, ctx)
        if reason is not None:
            notes.append(Note(FEATURE, False, reason, line))
            continue
        # The numpy assembly and the producer toggles (ShuffledSequenceLoader family)
        # come with the producer toggles only, on the full runtime.
        recognition = _assembly(cls, ctx) if ctx.producer_toggles else None
        attrs = _read_beyond_next_batch(survey.module, target)
        needs_full = needs_full or reshape_arg is not None or bool(rollback) or attrs or recognition is not None
        wrapped.append((target, group, cls, reshape_arg, rollback, recognition, attrs))
    # `prefetch_iterator` needs the full loader runtime, whose names the lean one shares.
    full = needs_full or "prefetch_iterator" in ctx.templates
    for target, group, cls, reshape_arg, rollback, recognition, attrs in wrapped:
        for site in group:
            replacements[site.call] = _wrapped_call(site, ctx, reshape_arg, rollback, module, recognition, attrs, full)
        lines = ", ".join(str(c.line) for c in group)
        extra = _assembly_note(cls, recognition, ctx) if full else "; a forked child process builds the batches"
        direct = _direct_uses(survey, group)
        if direct:
            extra += f"; reading {', '.join(direct)} first replays the loader to the caller's position (exact, costs one pass)"
        if rollback:
            extra += f"; per-step argument {rollback}: batches queued with older values are dropped and the loader restored from a snapshot"
        notes.append(Note(FEATURE, True, f"`{target}` built at line {lines} prefetches{extra}", group[0].line))
    if replacements:
        ctx.need("prefetch_loader" if full else "prefetch_lean")
        module = replace_nodes(module, replacements, ctx)
    return module, notes


def _no_site_reason(survey) -> str:
    if not survey.loader_classes:
        reasons = sorted({i.reason for i in survey.iterators if i.reason})
        return "; ".join(reasons) if reasons else "no loader with next_batch or data generator found"
    if not survey.constructions:
        names = ", ".join(survey.loader_classes)
        return f"{names} defined but never built as `name = {next(iter(survey.loader_classes))}(...)`"
    return "; ".join(sorted({c.reason for c in survey.constructions if c.reason}))


def _first_line(survey) -> int | None:
    lines = [c.line for c in survey.loader_classes.values()] or [i.line for i in survey.iterators]
    return min(lines) if lines else None


def _blocker(group, ctx: Context) -> tuple[str | None, int | None, int | None, str | None]:
    """Why this loader variable cannot be prefetched exactly, else (None, None, reshape_arg, rollback).

    rollback names the per-step arguments (beyond a reshape-only one) that need the
    snapshot rollback; it is allowed for loaders that change no array in place.
    """
    survey = ctx.survey
    cls = survey.loader_classes[group[0].class_name]
    if cls.prefetches:
        return f"{cls.name} already prefetches (threads in the loader); not wrapped again", cls.line, None, None
    if cls.unsafe:
        return cls.unsafe, cls.line, None, None
    if cls.device_index is None:
        return f"{cls.name}.__init__ takes no `device` parameter to build it on the CPU", cls.line, None, None
    for site in group:
        if _device_arg(site.call, cls) is None:
            return f"`{site.target} = {cls.name}(...)` passes no device argument", site.line, None, None
    reshape_arg, rollback = None, []
    for call in (c for site in group for c in survey.calls_on(site)):
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
        elif m.matches(node, m.Attribute(value=m.Name(target), attr=m.Name("next_batch")) | m.AssignTarget(target=m.Name(target)) | m.Param(name=m.Name(target))):
            accounted += 1
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in params:
            for index, arg in enumerate(node.args):
                if m.matches(arg.value, m.Name(target)) and not arg.star:
                    name = arg.keyword.value if arg.keyword is not None else (params[node.func.value] + [None] * (index + 1))[index]
                    accounted += name == target and (arg.keyword is not None or index < len(params[node.func.value]))
    return names > accounted


def _direct_uses(survey, group) -> list[str]:
    """`train_loader.<attr>` reads other than next_batch (served after a replay)."""
    return sorted({f"{a.base}.{a.attr}" for a in _attribute_uses(survey, group) if a.attr != "next_batch"})


def _attribute_uses(survey, group):
    binding = group[0].binding
    return [a for a in survey.collector.attribute_uses if a.base == group[0].target and a.scope.resolve(a.base) is binding]


def _device_arg(call: cst.Call, cls) -> int | None:
    """Index in call.args of the device argument (positional at device_index, or device=)."""
    for index, arg in enumerate(call.args):
        if arg.keyword is not None and arg.keyword.value == cls.init_params[cls.device_index]:
            return index
    positional = [i for i, a in enumerate(call.args) if a.keyword is None and a.star == ""]
    if cls.device_index < len(positional):
        return positional[cls.device_index]
    return None


def _assembly(cls, ctx: Context) -> Recognition | None:
    """For the ShuffledSequenceLoader family, whether numpy can assemble its batches; else None."""
    if cls.family != "shuffled":
        return None
    return recognise_shuffled(cls.node, ctx.survey.module)


def _assembly_note(cls, recognition: Recognition | None, ctx: Context) -> str:
    if recognition is None:
        return ""
    workers = " (TRAIN_PREFETCH_WORKERS threads, batches handed out in order)" if ctx.producer_toggles else ""
    if recognition.recognised:
        numpy_toggle = " (TRAIN_PREFETCH_NUMPY)" if ctx.producer_toggles else ""
        return f"{workers}; {cls.name}.next_batch recognised: batches planned in its RNG order and gathered in numpy{numpy_toggle}"
    where = f" at line {ctx.survey.line_of(recognition.node)}" if recognition.node is not None else ""
    return f"{workers}; numpy assembly not used: {recognition.reason}{where}; the worker calls the script's own next_batch"


def _wrapped_call(site, ctx: Context, reshape_arg: int | None, rollback: str | None, module: cst.Module, recognition: Recognition | None = None, attrs: bool = False, full: bool = True) -> cst.Call:
    cls = ctx.survey.loader_classes[site.class_name]
    index = _device_arg(site.call, cls)
    device_expr = module.code_for_node(site.call.args[index].value)
    args = list(site.call.args)
    args[index] = args[index].with_changes(value=cst.Name("loader_device"))
    inner = module.code_for_node(site.call.with_changes(args=args))
    options = {"prefetch": ctx.toggle_value("TRAIN_PREFETCH"), **_queue_depth(ctx), "copy_stream": _copy_stream(ctx)}
    if reshape_arg is not None:
        options["reshape_arg"] = reshape_arg
    if rollback:
        options["rollback"] = True
    if cls.writes_arrays is None and full:  # the lean runtime always copies out of its slots
        options["host_copy"] = False
    if site.target != "train_loader":
        options["name"] = site.target
    if attrs:
        options.update(attrs=True, replay=True)
    if recognition is not None and ctx.producer_toggles:
        ctx.need("ordered_handoff")
        options["workers"] = ctx.toggle_value("TRAIN_PREFETCH_WORKERS")
    if recognition is not None and recognition.recognised:
        ctx.need("shuffled_assembly")
        assembly = recognition.getter
        if ctx.producer_toggles:
            numpy_on = ctx.toggle("TRAIN_PREFETCH_NUMPY")
            assembly = Code(ctx.code(f"{assembly!r} if {numpy_on} else None", f"{assembly!r}if {numpy_on} else None"))
        options["assembly"] = assembly
    lambda_ = ctx.code(f"lambda loader_device: {inner}", f"lambda loader_device:{inner}")
    return ctx.runtime_call("_make_train_loader", [lambda_, device_expr], options, holder=site.target)


def _queue_depth(ctx: Context) -> dict:
    """The `queue_depth=` option: the `TRAIN_PREFETCH_QUEUE` toggle with the producer
    toggles, else none (the runtime's depth of 2). A tuning knob, not an off switch: in a
    default patch it would cost 40-60 counted bytes of a wrapped record (toggle, log
    entry, header and call-site argument)."""
    return {"queue_depth": ctx.toggle_value("TRAIN_PREFETCH_QUEUE")} if ctx.producer_toggles else {}


def _copy_stream(ctx: Context):
    """The `copy_stream=` option: the `TRAIN_COPY_STREAM` toggle, False without the copy_stream feature."""
    return ctx.toggle_value("TRAIN_COPY_STREAM") if "copy_stream" in ctx.enabled else False


def _runner_call(runner: str, site, ctx: Context, module: cst.Module) -> cst.Call:
    """`<runner>(lambda: <the script's call>, prefetch=…, copy_stream=…)` (`queue_depth=…` with the producer toggles):
    `_prefetch_iterator` for a data generator, `_prefetch_next_batch` for a loader whose
    next_batch() moves batches to the GPU itself."""
    options = {"prefetch": ctx.toggle_value("TRAIN_PREFETCH"), **_queue_depth(ctx), "copy_stream": _copy_stream(ctx)}
    if site.target != "train_loader":
        options["name"] = site.target
    lambda_ = ctx.code(f"lambda: {module.code_for_node(site.call)}", f"lambda:{module.code_for_node(site.call)}")
    return ctx.runtime_call(runner, [lambda_], options, holder=site.target)


def _calls_ahead_blocker(group, survey) -> tuple[str | None, int | None]:
    """Why a loader that moves batches to the GPU itself cannot run ahead exactly, else (None, None)."""
    for call in (c for site in group for c in survey.calls_on(site)):
        changing = [call.args[i] for i, const in enumerate(call.constant) if not const]
        if changing:
            names = ", ".join(f"`{a}`" for a in changing)
            return f"next_batch gets per-step argument {names} and moves batches to the GPU itself; only constant arguments run ahead", call.line
    return None, None


TOGGLES = (
    Toggle("TRAIN_PREFETCH", 1, "build training batches ahead in a forked child process (or a thread)", position=0),
    Toggle("TRAIN_PREFETCH_QUEUE", 2, "batches built ahead at most", position=1),
    Toggle("TRAIN_PREFETCH_WORKERS", 1, "threads building ShuffledSequenceLoader batches, handed out in order", position=9),
    Toggle("TRAIN_PREFETCH_NUMPY", 1, "plan and gather ShuffledSequenceLoader batches in numpy", position=10),
)
RUNTIME = {
    "staging": (),
    "prefetch_lean": ("copy_stream", "staging"),
    "prefetch_loader": ("copy_stream", "staging"),
    "prefetch_iterator": ("prefetch_loader",),
    "ordered_handoff": ("prefetch_loader",),
    "shuffled_assembly": (),
}
# The options of `_make_train_loader` whose code a script gets only where a call site
# chooses them. The lean runtime's depth is one: a default patch passes none (the
# TRAIN_PREFETCH_QUEUE toggle comes with the producer toggles), so the depth is 2.
OPTIONS = {
    "prefetch_lean": ("queue_depth",),
    "prefetch_loader": ("reshape_arg", "rollback", "host_copy", "workers", "assembly", "attrs", "replay"),
}
UNIT = Feature(FEATURE, apply, order=10, toggles=TOGGLES, runtime=RUNTIME, options=OPTIONS, injected="_make_train_loader")
