"""Transform `val_prefetch`: validation batches built ahead, H2D double-buffered on a copy stream.

In an evaluation loop that slices a token tensor per batch (`patcher/survey/val_survey.py`),

    for batch_seq_start in range(seq_start, seq_end, local_batch_seqs):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        ...
        local = val_tokens[raw_start:raw_end].to(device=device, dtype=torch.int64, non_blocking=True)

becomes

    def _val_slice(batch_seq_start):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        ...
        return val_tokens[raw_start:raw_end]
    for batch_seq_start, _val_batch in _val_prefetch(range(seq_start, seq_end, local_batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=<VAL_PREFETCH>, copy_stream=<VAL_COPY_STREAM>):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        ...
        local = _val_batch

(runtime: `templates/prefetch_val.py`). The loop's statements that the slice needs
move into `_val_slice` where nothing else in the function reads what they assign (the root
script's `raw_start`, `raw_end`, `batch_seq_end`: no dead assignment is left in the loop);
those the rest of the body reads stay, so everything else sees the same names. Skipped, with the reason, where the slice is not
a pure function of the loop variable, the loop is not over `range(...)` (the
sliding-window loops, which fill a batch window by window), or `.to(...)` takes other
arguments.
"""

from __future__ import annotations

import libcst as cst

from patcher.transforms.base import Context, Feature, Note, Toggle, Tracking, edit_tops
from patcher.cst_walk import walk, walk_own
from patcher.survey.val_survey import ValLoop, find_val_loops

FEATURE = "val_prefetch"
BATCH_NAME = "_val_batch"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Rewrite every evaluation loop whose slice can be built ahead. Returns (module, notes)."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    sites = find_val_loops(survey)
    if not sites:
        return module, [Note(FEATURE, False, "no evaluation loop that copies a token slice to the device per batch")]
    notes, plans = [], {}
    taken: dict[int, set[str]] = {}
    for site in sites:
        if site.reason is not None:
            notes.append(Note(FEATURE, False, site.reason, site.line))
            continue
        names = taken.setdefault(id(site.function_node), {n.value for n in walk_own(site.function_node) if isinstance(n, cst.Name)})
        slice_name = _free_name("_val_slice", names)
        names.add(slice_name)
        plans[site.loop] = _Plan(site, slice_name, _iterable(site, slice_name, ctx, module), _slice_function(site, slice_name, ctx))
        h2d = "H2D on the copy stream" if "copy_stream" in ctx.enabled else "H2D on the compute stream"
        notes.append(Note(FEATURE, True, f"{site.function}: `{module.code_for_node(site.window)}` built one batch ahead (pinned), {h2d}", site.line))
    by_function: dict[int, list[ValLoop]] = {}
    for plan in plans.values():
        by_function.setdefault(id(plan.site.function_node), []).append(plan.site)
    for sites_here in by_function.values():
        moved = _moved(sites_here, ctx)
        for site in sites_here:
            plans[site.loop].moved = moved[id(site)]
    if plans:
        ctx.need("prefetch_val")
        tops = {survey.top_level_of(loop) for loop in plans}
        module = edit_tops(module, ctx, tops, _RewriteLoops(plans))
    return module, notes


UNIT = Feature(FEATURE, apply, order=60, runtime={"prefetch_val": ("copy_stream",)}, injected="_val_prefetch", toggles=(
    Toggle("VAL_PREFETCH", 1, "build the next validation batch ahead into pinned memory", position=5),
    Toggle("VAL_COPY_STREAM", 1, "host-to-device copies of validation batches on a dedicated CUDA stream", position=6),
))


class _Plan:
    """What one loop becomes: its site, the slice function's name, new iterable and definition."""

    def __init__(self, site: ValLoop, slice_name: str, iterable: cst.BaseExpression, definition: cst.FunctionDef):
        self.site, self.slice_name, self.iterable, self.definition = site, slice_name, iterable, definition
        self.moved: list[cst.BaseSmallStatement] = []  # the loop's statements that go into the slice function alone


def _moved(sites: list[ValLoop], ctx: Context) -> dict[int, list[cst.BaseSmallStatement]]:
    """For each loop (by `id` of its site), the prefix statements (`name = ...`, each
    assigned once in its loop) that it no longer needs once the window is read from
    `_val_batch`: every other occurrence of the name they assign, anywhere in the
    function, is in a window of a rewritten loop or in another such statement. Found to a
    fixed point, so a chain (`batch_seq_end` -> `raw_end`) goes whole; `sites` are the
    loops rewritten in one function, read as the earlier features left it."""
    moved = {id(site): [ctx.resolve(small) for small in site.prefix] for site in sites}
    function = ctx.resolve(sites[0].function_node)  # as earlier features left it (val_bytecount reads the window too)
    windows = {id(n) for site in sites for n in walk(ctx.resolve(site.window))}
    changed = True
    while changed:
        changed = False
        kept_out = windows | {id(n) for smalls in moved.values() for s in smalls for n in walk(s)}
        for smalls in moved.values():
            for small in list(smalls):
                name = small.targets[0].target.value
                if any(isinstance(n, cst.Name) and n.value == name and id(n) not in kept_out for n in walk(function)):
                    smalls.remove(small)
                    changed = True
    return moved


def _free_name(base: str, taken: set[str]) -> str:
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}{n}"
    return name


def _iterable(site: ValLoop, slice_name: str, ctx: Context, module: cst.Module) -> cst.BaseExpression:
    sep = ctx.code(", ", ",")
    to_kwargs = f"dict({sep.join(f'{a.keyword.value}={module.code_for_node(a.value)}' for a in site.to_call.args)})"
    copy_stream = ctx.toggle_value("VAL_COPY_STREAM") if "copy_stream" in ctx.enabled else False
    options = {"prefetch": ctx.toggle_value("VAL_PREFETCH"), "copy_stream": copy_stream}
    return ctx.runtime_call("_val_prefetch", [module.code_for_node(site.loop.iter), slice_name, to_kwargs], options)


def _slice_function(site: ValLoop, slice_name: str, ctx: Context) -> cst.FunctionDef:
    """`def _val_slice(<loop variable>): <the statements the slice needs>; return <slice>`."""
    smalls = [s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for s in site.prefix]
    smalls.append(cst.Return(value=site.window.deep_clone(), whitespace_after_return=cst.SimpleWhitespace(" ")))
    if ctx.minified:
        semicolon = cst.Semicolon(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
        smalls = [s.with_changes(semicolon=semicolon) for s in smalls[:-1]] + smalls[-1:]
        body = cst.SimpleStatementSuite(body=smalls, leading_whitespace=cst.SimpleWhitespace(""))
    else:
        body = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=[s]) for s in smalls])
    return cst.FunctionDef(name=cst.Name(slice_name), params=cst.Parameters(params=[cst.Param(cst.Name(site.target))]), body=body)


class _RewriteLoops(Tracking):
    """Put each planned loop's slice function before it, iterate over `_val_prefetch`, and
    read the batch from the loop target instead of the slice's `.to(...)`."""

    def __init__(self, plans: dict[cst.For, _Plan]):
        super().__init__()
        self.plans = plans

    def prepare(self, ctx: Context) -> None:
        super().prepare(ctx)
        self.by_loop = {id(ctx.resolve(loop)): plan for loop, plan in self.plans.items()}
        self.to_calls = {id(ctx.resolve(plan.site.to_call)) for plan in self.plans.values()}
        self.moved = {id(small) for plan in self.plans.values() for small in plan.moved}  # resolved already
        self._changed = [ctx.resolve(n) for loop, plan in self.plans.items() for n in (loop, plan.site.to_call)] + [small for plan in self.plans.values() for small in plan.moved]

    def targets(self) -> list[cst.CSTNode]:
        return self._changed

    def _without_moved(self, original_node, updated_node):
        """The line without the statements that moved into the slice function; removed
        when none is left."""
        if not any(id(small) in self.moved for small in original_node.body):
            return updated_node
        body = [new for old, new in zip(original_node.body, updated_node.body) if id(old) not in self.moved]
        if not body:
            return cst.RemoveFromParent()
        return updated_node.with_changes(body=[*body[:-1], body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)])

    def leave_SimpleStatementLine(self, original_node, updated_node):
        return self._without_moved(original_node, updated_node)

    def leave_SimpleStatementSuite(self, original_node, updated_node):
        return self._without_moved(original_node, updated_node)

    def leave_Call(self, original_node, updated_node):
        return cst.Name(BATCH_NAME) if id(original_node) in self.to_calls else updated_node

    def leave_For(self, original_node, updated_node):
        plan = self.by_loop.get(id(original_node))
        if plan is None:
            return updated_node
        comma = cst.Comma(whitespace_after=cst.SimpleWhitespace("" if self.ctx.minified else " "))
        target = cst.Tuple([cst.Element(updated_node.target, comma=comma), cst.Element(cst.Name(BATCH_NAME))], lpar=[], rpar=[])
        loop = updated_node.with_changes(target=target, iter=plan.iterable, leading_lines=[])
        definition = plan.definition.with_changes(leading_lines=updated_node.leading_lines)
        self.rebuilt[original_node] = loop
        return cst.FlattenSentinel([definition, loop])
