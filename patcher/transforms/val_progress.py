"""Transform `val_progress`: a progress line every N validation batches.

The evaluation loop's iterable (`range(...)`, or `_val_prefetch(...)` after
`val_prefetch`) becomes `_val_progress(<iterable>, <log function>,
<VAL_PROGRESS_LOG_EVERY>, "<function name>")` (runtime: `templates/val_progress.py`):
the same items in the same order, and with the toggle at N > 0 a line such as
`eval_val batch:16/64 elapsed_ms:812` through the script's own log function after
every N batches and after the last. Skipped, with the reason, where the log function
is not visible in the evaluation function (parameter-golf's `log0` is defined inside
`main()`; passing it in would change the function's signature and every call), and for
loops nested in another loop (test-time training's per-chunk loops: a line per chunk).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.transforms.base import Code, Context, Feature, Note, Toggle, Tracking, edit_tops
from patcher.survey.val_survey import find_val_loops

FEATURE = "val_progress"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Wrap each top-level validation batch loop's iterable. Returns (module, notes)."""
    survey = ctx.survey
    sites = [s for s in find_val_loops(survey) if s.over_range and s.assign is not None]
    if not survey.uses_torch or not sites:
        return module, [Note(FEATURE, False, "no evaluation loop over batches of a token slice")]
    notes, plans = [], {}
    for site in sites:
        reason = site.log_reason
        if site.nested:
            reason = f"the loop in {site.function} runs inside another loop (one line per outer iteration)"
        if reason is not None:
            notes.append(Note(FEATURE, False, reason, site.line))
            continue
        plans[site.loop] = site
        notes.append(Note(FEATURE, True, f"{site.function}: progress through {site.log} every VAL_PROGRESS_LOG_EVERY batches", site.line))
    if plans:
        ctx.need("val_progress")
        module = edit_tops(module, ctx, {survey.top_level_of(loop) for loop in plans}, _WrapIterable(plans))
    return module, notes


# wraps the iterable val_prefetch built
UNIT = Feature(FEATURE, apply, order=70, toggles=(Toggle("VAL_PROGRESS_LOG_EVERY", 0, "validation batches between two progress lines (0: none)", position=8),), runtime={"val_progress": ()}, injected="_val_progress", diagnostic=True)


class _WrapIterable(Tracking):
    def __init__(self, plans: dict):
        super().__init__()
        self.plans = plans

    def prepare(self, ctx: Context) -> None:
        super().prepare(ctx)
        self.by_loop = {id(ctx.resolve(loop)): site for loop, site in self.plans.items()}
        self._changed = [ctx.resolve(loop) for loop in self.plans]

    def targets(self) -> list[cst.CSTNode]:
        return self._changed

    def leave_For(self, original_node, updated_node):
        site = self.by_loop.get(id(original_node))
        if site is None:
            return updated_node
        iterable = cst.Module([]).code_for_node(updated_node.iter)
        every = self.ctx.toggle("VAL_PROGRESS_LOG_EVERY")
        quote = self.ctx.code('"', "'")
        options = {}
        if m.matches(updated_node.iter, m.Call(func=m.Name("_val_prefetch"))):
            # Prefetched batches are a generator: the total is the number of starts.
            options["total"] = Code(f"len({cst.Module([]).code_for_node(updated_node.iter.args[0].value)})")
        call = self.ctx.runtime_call("_val_progress", [iterable, site.log, every, quote + site.function + quote], options)
        return updated_node.with_changes(iter=call)
