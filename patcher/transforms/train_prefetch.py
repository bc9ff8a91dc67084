"""Transform `train_prefetch`: build training batches ahead, off the training thread.

For every variable that holds the training data (`train_loader`), its family
(`patcher/families/<name>.py`, see `patcher/families/base.py`) says what to do: leave
it alone, with the reason, or which producer builds its batches ahead, from which
template, and with which options (a `Plan`, from `registry.data_sources`). This
transform writes what the families decided, and names none of them:

- `_make_train_loader`: every construction `train_loader = Loader(..., device)` becomes
  `train_loader = _make_train_loader(lambda loader_device: Loader(..., loader_device),
  device, prefetch=…, copy_stream=…)` (`queue_depth=…` too with the producer toggles).
  The runtime is the families' forked one, `templates/prefetch_lean.py` (a child
  process runs the loader, so it costs the training loop no GIL time), unless a
  variable needs the thread runtime `templates/prefetch_loader.py` (replay, rollback,
  reshape at hand-out, settling on attribute reads) or a runner's
  template uses it: the two define the same names, so a script gets one of them. The
  options after the run-time switches are the plan's (`Plan.options`, less those
  only the thread runtime takes where the forked one runs): `host_copy=False` for a
  loader that never writes into an array it keeps, `attrs=True` for a variable the
  script uses for more than `.next_batch(...)`; what no call site asks for is cut
  (patcher/render/cut.py).
- a runner (`_prefetch_iterator`, `_prefetch_next_batch`): the script's own call runs
  ahead on a thread, `train_loader = _prefetch_iterator(lambda: gen(...), ...)`
  (`templates/prefetch_loader.py`, the thread producer).
- module mode: a data-loader module (no training script) whose loader generators a
  "module" family finds (`registry.module_loaders`): each accepted `def name(` becomes
  `def _original_name(` and a new `def name(<the same parameters>)` after it calls the
  family's producer, `yield from <producer>(_original_name, {every argument by name},
  "<device param>", prefetch=…[, split options])`.

The loader class itself is not touched. With `producer_toggles` (`--producer-toggles`)
the prefetch depth comes along as the tuning toggle `TRAIN_PREFETCH_QUEUE`, whatever
the family; the runtime is the one the families chose without it.
"""

from __future__ import annotations

import libcst as cst

from patcher.families import registry
from patcher.families.base import MAKE_TRAIN_LOADER, PRODUCERS, THREAD_LOADER_RUNTIME, ModuleLoader
from patcher.families.sources import device_arg, imported_sources
from patcher.transforms.base import Context, Feature, Note, Toggle, replace_nodes

FEATURE = "train_prefetch"
# What module mode renames a rewritten loader generator's original definition to.
ORIGINAL_PREFIX = "_original_"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Rewrite the constructions of the training data variables as their families plan. Returns (module, notes)."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    loaders = registry.module_loaders(survey.module, survey.collector)
    if loaders:  # module mode: the data-loader module a training script imports
        return _module_mode(module, ctx, loaders)
    verdicts = ctx.verdicts
    variables = registry.data_sources(verdicts)
    staged = [i for i in verdicts.iterators if i.staged]
    if not variables and staged:  # the generator's reason, not that of a loader built inside it
        return module, [Note(FEATURE, False, f"`{i.target}`: {i.reason}", i.line) for i in staged]
    if not variables:
        return module, [Note(FEATURE, False, _no_site_reason(verdicts), _first_line(verdicts))]
    notes: list[Note] = []
    replacements: dict[cst.CSTNode, cst.CSTNode] = {}
    # First pass: each variable's plan, runners written at once, so that the runtime
    # of `_make_train_loader` (forked or thread) is known before its call sites are
    # written; the forked one takes fewer options.
    wrapped = []
    for variable in variables:
        plan = variable.plan
        if plan.refusal is not None:
            notes.append(Note(FEATURE, False, plan.refusal, plan.line))
        elif plan.producer == MAKE_TRAIN_LOADER:
            wrapped.append((variable, plan))
        else:
            for site in variable.sites:
                replacements[site.call] = _runner_call(plan.producer, site, ctx, module)
            notes.append(Note(FEATURE, True, plan.note, variable.line))
            ctx.need(plan.runtime)
    # A script has one `_make_train_loader`: the thread runtime serves every variable where
    # one plan asks for it, or where a runner (which is in it) is used anyway.
    full = any(plan.runtime == THREAD_LOADER_RUNTIME for _, plan in wrapped) or THREAD_LOADER_RUNTIME in ctx.templates
    runtime = THREAD_LOADER_RUNTIME if full else wrapped[0][1].runtime if wrapped else None
    for variable, plan in wrapped:
        # The thread runtime takes every option a plan chooses; the forked one only those
        # of its own (`OPTIONS`), so a plan's `host_copy=False` is not written for it.
        options = {k: v for k, v in plan.options.items() if full or k in OPTIONS[runtime]}
        for site in variable.sites:
            replacements[site.call] = _wrapped_call(site, ctx, options, module)
        notes.append(Note(FEATURE, True, plan.note if full else plan.forked_note, variable.line))
    if replacements:
        ctx.need(runtime)
        module = replace_nodes(module, replacements, ctx)
    return module, notes


def _module_mode(module: cst.Module, ctx: Context, loaders: list[ModuleLoader]) -> tuple[cst.Module, list[Note]]:
    """Rewrite the loader generators of a data-loader module that its "module" families accept."""
    notes = []
    for loader in loaders:
        line = ctx.survey.line_of(loader.function)
        if loader.refusal is not None:
            notes.append(Note(FEATURE, False, loader.refusal, line))
        else:
            splits = f"; a build with `{loader.split[0]}` other than {loader.split[1]!r} runs the original in the training process (a child's start costs seconds; TRAIN_PREFETCH_EVERY_SPLIT=1 spawns for every split)" if loader.split else ""
            notes.append(Note(FEATURE, True, f"{loader.name} (line {line}) runs ahead in a spawned producer process; the H2D copy stays here, through pinned memory{splits}", line))
    for runtime in dict.fromkeys(loader.family.runtime for loader in loaders if loader.refusal is None):
        ctx.need(runtime)
    if any(loader.refusal is None for loader in loaders):
        module = _rewrite_loader_generators(module, ctx, loaders)
    return module, notes


def _rewrite_loader_generators(module: cst.Module, ctx: Context, loaders: list[ModuleLoader]) -> cst.Module:
    """`module` with each accepted loader renamed `_original_<name>` and a new `def <name>`
    with the same parameters after it, calling its family's producer (`ctx.runtime_call`)."""
    body = []
    wanted = {id(loader.function): loader for loader in loaders if loader.refusal is None}
    for statement in module.body:
        loader = wanted.get(id(statement))
        if loader is None:
            body.append(statement)
            continue
        original = ORIGINAL_PREFIX + loader.name
        params = statement.params
        names = [p.name.value for p in params.params + params.kwonly_params]
        arguments = ctx.code("{" + ", ".join(f'"{n}": {n}' for n in names) + "}", "{" + ",".join(f'"{n}":{n}' for n in names) + "}")
        options = {"prefetch": ctx.toggle_value("TRAIN_PREFETCH")}
        if loader.split is not None:  # only the training split's build spawns a producer
            options.update(split_param=loader.split[0], train_split=loader.split[1], every_split=ctx.toggle_value("TRAIN_PREFETCH_EVERY_SPLIT"))
        call = ctx.runtime_call(loader.family.producer, [original, arguments, f'"{loader.device}"'], options)
        wrapper = cst.FunctionDef(
            name=cst.Name(loader.name),
            params=params,
            body=cst.IndentedBlock(body=[cst.SimpleStatementLine(body=[cst.Expr(cst.Yield(value=cst.From(item=call)))])]),
            leading_lines=[cst.EmptyLine(), cst.EmptyLine()] if not ctx.minified else [],
        )
        body.extend([statement.with_changes(name=cst.Name(original)), wrapper])
    return module.with_changes(body=body)


def _no_site_reason(verdicts) -> str:
    survey = verdicts.survey
    if not survey.loader_classes:
        return "; ".join(verdicts.iterator_reasons() or imported_sources(survey)) or "no loader with next_batch or data generator found"
    if not survey.constructions:
        names = ", ".join(survey.loader_classes)
        return f"{names} defined but never built as `name = {next(iter(survey.loader_classes))}(...)`"
    return "; ".join(verdicts.construction_reasons())


def _first_line(verdicts) -> int | None:
    lines = [c.line for c in verdicts.survey.loader_classes.values()] or [i.line for i in verdicts.iterators]
    return min(lines) if lines else None


def _wrapped_call(site, ctx: Context, plan_options: dict, module: cst.Module) -> cst.Call:
    """`_make_train_loader(lambda loader_device: <the construction on loader_device>, <its device>, …)`:
    the run-time switches, then the plan's options (`plan_options`), then `name=`."""
    cls = ctx.survey.loader_classes[site.class_name]
    index = device_arg(site.call, cls)
    device_expr = module.code_for_node(site.call.args[index].value)
    args = list(site.call.args)
    args[index] = args[index].with_changes(value=cst.Name("loader_device"))
    inner = module.code_for_node(site.call.with_changes(args=args))
    options = {"prefetch": ctx.toggle_value("TRAIN_PREFETCH"), **_queue_depth(ctx), "copy_stream": _copy_stream(ctx), **plan_options}
    if site.target != "train_loader":
        options["name"] = site.target
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


TOGGLES = (
    Toggle("TRAIN_PREFETCH", 1, "build training batches ahead in a forked child process (or a thread)", position=0),
    Toggle("TRAIN_PREFETCH_QUEUE", 2, "batches built ahead at most", position=1),
    Toggle("TRAIN_PREFETCH_EVERY_SPLIT", 0, "spawn a data-loader module's producer for every split (val too), not only the training split", position=12),
)
RUNTIME = {
    "staging": ("copy_stream",),
    "prefetch_lean": ("staging",),
    "prefetch_loader": ("copy_stream", "staging"),
}
# The options of `_make_train_loader` whose code a script gets only where a call site
# chooses them. The lean runtime's depth is one: a default patch passes none (the
# TRAIN_PREFETCH_QUEUE toggle comes with the producer toggles), so the depth is 2.
OPTIONS = {
    "prefetch_lean": ("queue_depth", "pinned_slots"),  # pinned_slots: passed by no patch yet (templates/prefetch_lean.py, `_hand_out_pinned`)
    "prefetch_loader": ("reshape_arg", "rollback", "host_copy", "attrs", "replay"),
}
# Every producer a family's plan may call (`PRODUCERS`) marks a patched script, the
# thread runners of generators and self-prefetching loaders and module mode's spawned
# producer included: patching it again changes nothing.
UNIT = Feature(FEATURE, apply, order=10, toggles=TOGGLES, runtime=RUNTIME, options=OPTIONS, injected=tuple(PRODUCERS))
