"""The patch pipeline: source -> survey -> transforms -> runtime block -> source.

`patch_source` works on Python source text (a wrapper's payload, already
decompressed by `patcher.read.source`). It never writes files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from patcher.render import render
from patcher.transforms.features import DEFAULT_FEATURES, DIAGNOSTICS, FEATURES, INJECTED_NAMES, SWITCHED, TOGGLE_UNITS, UNITS
from patcher.families import registry
from patcher.families.verdicts import Verdicts
from patcher.survey.survey import Survey
from patcher.transforms.base import Context, Note


@dataclass
class PatchResult:
    """What one patch run did.

    source: the patched source (equal to the input when nothing applied).
    notes: one `Note` per feature decision. already_patched: the input carries
    this tool's runtime already, so nothing was changed. module: the patched tree
    (`module.code == source`), so that checking the output need not parse it again.
    runtime: the text of the injected runtime block (header line and templates) as it
    stands in `source`, "" when none was injected. producer_toggles: the option it was
    patched with (a re-patch repeats it). verdicts: the families' verdicts on the input,
    whose `survey` (`.survey`) holds its facts. switches: the environment variables
    the patched script reads, those of the features applied (position order), each
    turning its behaviour off at 0.
    """

    source: str
    notes: list[Note] = field(default_factory=list)
    already_patched: bool = False
    verdicts: Verdicts | None = None
    module: cst.Module | None = field(default=None, repr=False)
    runtime: str = field(default="", repr=False)
    producer_toggles: bool = False
    switches: tuple[str, ...] = ()

    @property
    def survey(self) -> Survey | None:
        """The input's survey (`verdicts.survey`)."""
        return self.verdicts.survey if self.verdicts is not None else None

    @property
    def applied(self) -> list[str]:
        seen = []
        for n in self.notes:
            if n.applied and n.feature not in seen:
                seen.append(n.feature)
        return seen

    @property
    def skipped(self) -> list[Note]:
        return [n for n in self.notes if not n.applied]

    @property
    def changed(self) -> bool:
        return bool(self.applied)


def features_from(only: list[str] | None, skip: list[str] | None, extra: list[str] | None = None, diagnostics: bool = False) -> set[str]:
    """The enabled feature set for `--only` / `--skip` / `--with` / `--diagnostics`.

    Without `only`, the default features (`DEFAULT_FEATURES`: what makes a run faster)
    plus `extra` (`--with`), plus every diagnostic feature when `diagnostics`.
    Raises ValueError on an unknown name.
    """
    for name in (only or []) + (skip or []) + (extra or []):
        if name not in FEATURES:
            raise ValueError(f"unknown feature {name!r}; choose from {', '.join(FEATURES)}")
    enabled = set(only) if only else set(DEFAULT_FEATURES)
    enabled |= set(extra or []) | (set(DIAGNOSTICS) if diagnostics else set())
    if only and (SWITCHED & enabled):
        enabled.add("env_toggles")  # the switches come with the behaviour they switch
    return enabled - set(skip or [])


def patch_source(source: str, enabled: set[str] | None = None, module: cst.Module | None = None, verdicts: Verdicts | None = None, keep: frozenset[str] = frozenset(), producer_toggles: bool = False) -> PatchResult:
    """Patch one script's source. Returns a `PatchResult`.

    enabled: feature names (default: `DEFAULT_FEATURES`, the command's default).
    module: `source` already parsed; verdicts: `module`'s `registry.judge` (read-only,
    so one serves several patches of the same module); keep: runtime names to inject
    although the script never uses them (methods a benchmark drives);
    producer_toggles: add `TRAIN_PREFETCH_QUEUE` (`--producer-toggles`; costs code
    bytes).
    Raises libcst.ParserSyntaxError when `source` is not valid Python.
    """
    enabled = set(DEFAULT_FEATURES) if enabled is None else enabled
    module = module if module is not None else cst.parse_module(source)
    verdicts = verdicts if verdicts is not None and verdicts.survey.module is module else registry.judge(module)
    surveyed = verdicts.survey
    already = {feature for feature, names in INJECTED_NAMES.items() if any(name in surveyed.module_names for name in names)}
    if already:
        names = ", ".join(sorted(already))
        return PatchResult(source, [Note("all", False, f"already patched ({names} present); nothing to do")], True, verdicts)
    units = [u for u in UNITS if u.name in enabled]
    facts = {u.name: u.analyse(surveyed) for u in units if u.analyse is not None}  # on the unpatched module
    ctx = Context(verdicts, enabled, toggles=TOGGLE_UNITS, facts=facts, keep=set(keep), producer_toggles=producer_toggles)
    notes: list[Note] = []
    for unit in units:
        module, new_notes = unit.apply(module, ctx)
        notes.extend(new_notes)
    runtime = ""
    if ctx.templates or ctx.constants:
        module, runtime = _insert_runtime(module, ctx)
    switches = tuple(name for name in ctx.toggles if name in ctx.toggles_used) if "env_toggles" in {n.feature for n in notes if n.applied} else ()
    return PatchResult(module.code, notes, False, verdicts, module, runtime, producer_toggles, switches)


def _insert_runtime(module: cst.Module, ctx: Context) -> tuple[cst.Module, str]:
    """Put constants and templates after the leading imports, before the first def or class.

    Returns the new module and the text of the templates' block in it ("" for none)."""
    body = list(module.body)
    at = next((i for i, s in enumerate(body) if isinstance(s, (cst.ClassDef, cst.FunctionDef))), len(body))
    # Only imports above the insertion point count: a script may import `os` further down.
    imports = _top_level_imports(module.with_changes(body=body[:at]))
    block: list[cst.BaseStatement] = []
    runtime: list[cst.BaseStatement] = []
    if ctx.constants:
        if "os" not in imports:
            block.append(cst.parse_statement("import os\n"))
            imports = imports | {"os"}  # the runtime below it needs no second `import os`
        block.extend(cst.SimpleStatementLine(body=[s]) for s in ctx.constants)
    if ctx.templates:
        facts = render.cut_facts(ctx.templates, ctx.runtime_calls)
        runtime = render.runtime_block(ctx.templates, imports, ctx.minified, list(ctx.toggles_used), facts, _runtime_used(ctx))
        block.extend(runtime)
    if block and not ctx.minified and at < len(body) and not body[at].leading_lines:
        body[at] = body[at].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
    module = module.with_changes(body=body[:at] + block + body[at:])
    return module, "".join(module.code_for_node(stmt) for stmt in runtime)


def _runtime_used(ctx: Context) -> set[str]:
    """What the patched script uses of the runtime (the cut's roots): the names the new
    code reads (`ctx.runtime_reads`), the attributes the script reads on a variable that
    holds a runtime object (`train_loader.next_batch`: from the survey of the original,
    by name in any scope), and the names kept for benchmarks (`ctx.keep`)."""
    held = {use.attr for use in ctx.survey.collector.attribute_uses if use.base in ctx.runtime_holders}
    return ctx.runtime_reads | held | ctx.keep


def _top_level_imports(module: cst.Module) -> set[str]:
    names = set()
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Import):
                    for alias in small.names:
                        if alias.asname is None:
                            names.add(module.code_for_node(alias.name))
    return names
