"""Read-only analysis of a training script: where the transforms may act, and why not.

`survey(module)` walks a parsed script (libcst) once (`ScriptIndex`) and returns a
`Survey`: the data loader classes, the loader construction sites and `next_batch`
call sites (with whether each argument is a run constant), the sites built from
module-level generator functions, the Hyperparameters class, the script's log
function, the names defined at module level, and the script's style (minified or
readable). It records facts only, the same for every family: which family a loader
class or generator site is of, and the verdicts that follow, are the families'
(`patcher/families/verdicts.py`: `registry.judge` surveys, then judges into a separate,
frozen `Verdicts`; nothing of them is written here). Nodes
are kept by identity so that transforms run on the same `Module` object can find
them; positions (1-based lines) are kept for reports. Nothing reads a `Survey` to change it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from patcher import cst_walk
from patcher.cst_lines import LineIndex
from patcher.cst_walk import walk
from patcher.survey.index import ScriptIndex
from patcher.survey.loaders import LoaderClass, method, survey_loader
from patcher.survey.script import LOG_FUNCTIONS, Hyperparameters, find_hyperparameters, find_log_function, imports, is_minified, module_level_names
from patcher.survey.sites import CallSite, Construction, IteratorSite, is_run_constant, names_other_data
from patcher.survey.threads import ThreadReach

# What the rest of the tool imports from here.
__all__ = ["LOG_FUNCTIONS", "CallSite", "Construction", "Hyperparameters", "IteratorSite", "LoaderClass", "ScriptIndex", "Survey", "survey"]


@dataclass
class Survey:
    """Everything the transforms need to know about one script; read, never written, after `survey()`.

    module: the surveyed tree. minified: tabs or `;`-joined lines (`script.is_minified`).
    uses_torch: the script imports torch. loader_classes: class name -> `LoaderClass`.
    constructions / calls: the loaders built and their `next_batch` calls (`sites.py`). iterators: the sites built from module-level
    generator functions (`IteratorSite`; the families judge those of a generator they
    recognise, `SiteVerdict`).
    hyperparameters: the Hyperparameters class, or None. log_function: (name, its
    `FunctionDef`), or None. module_names: names defined at module level. collector:
    the `ScriptIndex` of the one pass over `module` (scopes, calls, functions, the
    statement holding each node).
    """

    module: cst.Module
    minified: bool
    uses_torch: bool
    loader_classes: dict[str, LoaderClass] = field(default_factory=dict)
    constructions: list[Construction] = field(default_factory=list)
    calls: list[CallSite] = field(default_factory=list)
    iterators: list[IteratorSite] = field(default_factory=list)
    hyperparameters: Hyperparameters | None = None
    log_function: tuple[str, cst.CSTNode] | None = None
    module_names: set[str] = field(default_factory=set)
    collector: ScriptIndex | None = field(default=None, repr=False)
    _lines: LineIndex | None = field(default=None, repr=False)
    _shared: dict = field(default_factory=dict, repr=False)

    def line_of(self, node: cst.CSTNode) -> int:
        """1-based line of `node` in the surveyed source (its `PositionProvider` start line).

        Lines come from a line-only printing pass over the top-level statement that holds
        `node` (`cst_lines.LineIndex`, made on the first call). Raises KeyError for a node
        that is not in the surveyed module.
        """
        if self._lines is None:
            self._lines = LineIndex(self.module, self.collector.top_of if self.collector is not None else None)
        try:
            return self._lines.line_of(node)
        except KeyError:
            raise KeyError("node is not in the surveyed module") from None

    def top_level_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The statement of `module.body` that contains `node`."""
        top = self.collector.top_of.get(node) if self.collector else None
        if top is not None:
            return top
        for stmt in self.module.body:
            if stmt is node or any(n is node for n in walk(stmt)):
                return stmt
        raise KeyError("node is not in the surveyed module")

    def shared(self, name: str, compute):
        """The analysis `name` of this survey's module, computed once by `compute()`
        (several features ask the same question of the same module)."""
        if name not in self._shared:
            self._shared[name] = compute()
        return self._shared[name]

    def calls_on(self, construction: Construction) -> list[CallSite]:
        """`next_batch` calls whose receiver is the construction's variable."""
        return [c for c in self.calls if c.binding is construction.binding and c.receiver == construction.target]


def survey(module: cst.Module, index: ScriptIndex | None = None) -> Survey:
    """Analyse `module` (not modified). Returns a `Survey` of facts whose nodes belong to
    `module`; `patcher.families.registry.judge` is what the tool calls (this, then the
    families' verdicts beside it).

    index: the `ScriptIndex` of a pass over `module` already made (`index_of`), so that
    a caller can read it before the rest of the survey; without it the pass is made here.

    One pass of `ScriptIndex` over the module; loader classes, which are small, are
    then read on their own. What only one feature needs (MLP squares, PEP 701
    f-strings, the env idiom of Hyperparameters) is that feature's `analyse`.
    """
    result = Survey(module=module, minified=is_minified(module), uses_torch=imports(module, "torch"))
    result.module_names = module_level_names(module)
    classes = {n.name.value: n for n in module.body if isinstance(n, cst.ClassDef)}
    index = index if index is not None else index_of(module)
    result.collector = index
    reach = ThreadReach(module, index, result.line_of)
    for cls in classes.values():
        if method(cls, "next_batch") is not None:
            result.loader_classes[cls.name.value] = survey_loader(cls, classes, result.line_of(cls), reach)
    find_constructions_and_calls(index, result)
    find_iterators(index, result)
    result.hyperparameters = find_hyperparameters(module, result.line_of)
    result.log_function = find_log_function(index)
    return result


def find_constructions_and_calls(index: ScriptIndex, result: Survey) -> None:
    """Fill `result.constructions` (`name = LoaderClass(...)` of a surveyed loader class)
    and `result.calls` (their `next_batch` calls), and say which construction builds
    the training loader."""
    module = result.module
    loader_names = set(result.loader_classes)
    for assign, scope in index.call_assigns:
        func, target = assign.value.func, assign.targets[0].target
        if len(assign.targets) == 1 and isinstance(func, cst.Name) and func.value in loader_names and isinstance(target, cst.Name):
            result.constructions.append(
                Construction(
                    target=target.value,
                    class_name=func.value,
                    node=assign,
                    call=assign.value,
                    line=result.line_of(assign),
                    scope=scope.node,
                    binding=scope.resolve(target.value),
                )
            )
    for call, scope in index.calls:
        receiver = call.func.value.value
        binding = scope.resolve(receiver)
        if not any(c.binding is binding and c.target == receiver for c in result.constructions):
            continue  # not a loader this script builds here (e.g. a parameter of a helper)
        result.calls.append(
            CallSite(
                receiver=receiver,
                node=call,
                line=result.line_of(call),
                scope=scope.node,
                args=[module.code_for_node(a.value) for a in call.args],
                constant=[is_run_constant(a.value, scope, index, depth=0) for a in call.args],
                binding=binding,
            )
        )
    for c in result.constructions:
        if names_other_data(c.target):
            c.why_not = f"`{c.target}` is not the training loader"
        elif not result.calls_on(c):
            c.why_not = f"`{c.target}` has no next_batch call where it is built"
        else:
            c.candidate = True


def find_iterators(index: ScriptIndex, result: Survey) -> None:
    """Fill `result.iterators`: every `name = gen(...)` for a module-level generator
    function `gen`, with its `.send(value)` calls; which are data sources, and why one
    is not run ahead, is the families' call."""
    generators = {f.name.value for f in result.module.body if f in index.generator_functions}
    for assign, scope in index.call_assigns:
        func, target = assign.value.func, assign.targets[0].target
        if len(assign.targets) != 1 or not isinstance(func, cst.Name) or not isinstance(target, cst.Name) or func.value not in generators:
            continue
        binding = scope.resolve(target.value)
        site = IteratorSite(target.value, func.value, assign, assign.value, result.line_of(assign), binding)
        site.sends = [c for c, sc in index.send_calls if c.func.value.value == target.value and sc.resolve(target.value) is binding]
        result.iterators.append(site)


def index_of(module: cst.Module) -> ScriptIndex:
    """The `ScriptIndex` of one pass over `module` (what `survey` reads)."""
    index = ScriptIndex()
    cst_walk.visit(module, index)
    return index
