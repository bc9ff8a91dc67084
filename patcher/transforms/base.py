"""What every transform shares: options, notes, toggle expressions, node edits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import libcst as cst

from patcher.cst_walk import children
from patcher.families.verdicts import Verdicts
from patcher.survey.survey import Survey


@dataclass(frozen=True)
class Toggle:
    """One run-time switch a feature's injected code reads.

    name: the environment variable (`TRAIN_PREFETCH`); its attribute in the
    Hyperparameters idiom is the lower-cased name. default: its value when unset; its
    type is the toggle's type (an int is read through `int(...)`, a str as is). doc:
    one line saying what it switches. position: its place among the toggle lines a patch
    writes (fixed, so the same script patches to the same bytes from version to version).
    """

    name: str
    default: int | str
    doc: str
    position: int

    @property
    def attr(self) -> str:
        return self.name.lower()

    @property
    def type(self) -> type:
        return type(self.default)


@dataclass(frozen=True)
class Feature:
    """A feature as one unit: what its module declares (`UNIT = Feature(...)`).

    name: what `--only`/`--skip`/`--with` take. apply: `(module, ctx) -> (module, notes)`.
    order: its place in the pipeline (lower runs first; later features see the edits of
    earlier ones). toggles: the switches its code reads. runtime: the templates it may
    inject, each with the templates that one uses (injected before it). options: for a
    template, the parameters of its entry function that the feature chooses per call
    site and whose code the cut drops when no call chooses them (patcher/render/cut.py;
    their defaults are the entry function's own). injected: the
    module-level name its runtime defines, or the names where it has several entry
    points (the presence of any means the script is already patched). diagnostic: only with `--with`/`--diagnostics`. analyse: `survey -> facts`,
    the feature's own reading of the script, run on the unpatched module before any
    transform; the result is `ctx.facts[name]`. opt_in: only with `--with` (not with
    `--diagnostics`): a feature that changes what the script computes (`round_overlap`).
    """

    name: str
    apply: Callable
    order: int
    toggles: tuple[Toggle, ...] = ()
    runtime: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    options: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    injected: str | tuple[str, ...] | None = None
    diagnostic: bool = False
    analyse: Callable[[Survey], object] | None = None
    opt_in: bool = False


@dataclass
class Note:
    """One line of the report: a feature applied, or skipped with the reason and line.

    unfixable: a skipped site the target Python cannot run and the tool cannot rewrite
    (a PEP 701 form quoting cannot fix): nothing is written for such a script.
    """

    feature: str
    applied: bool
    reason: str | None = None
    line: int | None = None
    unfixable: bool = False

    def as_dict(self) -> dict:
        return {"feature": self.feature, "reason": self.reason, "line": self.line}


@dataclass
class Context:
    """Shared state of one patch run.

    verdicts: the families' verdicts on the script (frozen), whose `survey` holds its
    facts (`ctx.survey`). enabled: features the user asked for. toggles: every feature's toggles by name.
    facts: each enabled feature's own analysis (`Feature.analyse`) by feature name.
    templates: runtime templates the applied transforms need. toggles_used: toggle
    names referenced by the new code. keep: runtime names kept although the script
    does not use them (benchmarks).
    producer_toggles: add the producer tuning toggle `TRAIN_PREFETCH_QUEUE`.
    What the new code uses of the runtime, for the renderer (`runtime_call`):
    runtime_calls: runtime function -> the options of each call written, {keyword:
    value}; runtime_reads: runtime names and attribute names the new code reads;
    runtime_holders: script variables that hold a runtime object (`train_loader`).
    """

    verdicts: Verdicts
    enabled: set[str]
    toggles: Mapping[str, Toggle] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    templates: list[str] = field(default_factory=list)
    toggles_used: list[str] = field(default_factory=list)
    current: dict = field(default_factory=dict)
    constants: list = field(default_factory=list)
    keep: set = field(default_factory=set)
    producer_toggles: bool = False
    runtime_calls: dict[str, list[dict]] = field(default_factory=dict)
    runtime_reads: set[str] = field(default_factory=set)
    runtime_holders: set[str] = field(default_factory=set)

    @property
    def survey(self) -> Survey:
        """The facts of the script (`verdicts.survey`)."""
        return self.verdicts.survey

    @property
    def minified(self) -> bool:
        return self.survey.minified

    def toggle(self, env_name: str) -> str:
        """Source of the expression that reads toggle `env_name` at run time.

        `Hyperparameters.train_prefetch` where the script has such a class, the module
        constant `TRAIN_PREFETCH` otherwise, the default itself when `env_toggles` is off.
        """
        toggle = self.toggles[env_name]
        if self.toggle_home == "literal":
            return repr(toggle.default)
        if env_name not in self.toggles_used:
            self.toggles_used.append(env_name)
        return f"{self.survey.hyperparameters.name}.{toggle.attr}" if self.toggle_home == "class" else env_name

    def toggle_value(self, env_name: str) -> "Code | int | str":
        """Toggle `env_name` as an option value (`runtime_call`): the expression that
        reads it at run time, or its default itself where env_toggles is off."""
        return self.toggles[env_name].default if self.toggle_home == "literal" else Code(self.toggle(env_name))

    @property
    def toggle_home(self) -> str:
        """Where toggles live: "class" (Hyperparameters has an env line to copy),
        "module" (module constants), or "literal" (env_toggles off: defaults inline)."""
        if "env_toggles" not in self.enabled:
            return "literal"
        has_env_line = self.facts.get("env_toggles") is not None  # the env_toggles analysis: a line to copy
        return "class" if self.survey.hyperparameters is not None and has_env_line else "module"

    def resolve(self, node: cst.CSTNode) -> cst.CSTNode:
        """The present version of a node of the surveyed module (edits rebuild ancestors)."""
        seen = 0
        while node in self.current and seen < 1000:
            node = self.current[node]
            seen += 1
        return node

    def need(self, template: str) -> None:
        if template not in self.templates:
            self.templates.append(template)

    def code(self, readable: str, minified: str) -> str:
        return minified if self.minified else readable

    def runtime_call(self, function: str, arguments: Sequence[str] = (), options: Mapping[str, object] | None = None, holder: str | None = None) -> cst.Call:
        """The call `function(*arguments, **options)` of the injected runtime, recorded.

        function: a runtime function, or a method of a runtime object
        (`_step_timer.next_step`). arguments: the positional arguments' source, written
        as is. options: keyword -> value, written in this order: a literal (None, bool,
        int, str: written with repr) or `Code` (source read at run time: a toggle).
        holder: the script variable the call's result is assigned to, whose attributes
        the script reads (`train_loader.next_batch`).
        Records the options under `function` (the cut's facts: `render.cut_facts`), the
        names the call reads, and the holder. Returns the call in the script's style.
        """
        options = dict(options or {})
        self.runtime_calls.setdefault(function, []).append(options)
        self.runtime_reads.update(function.split("."))
        if holder is not None:
            self.runtime_holders.add(holder)
        keywords = [f"{keyword}={value if isinstance(value, Code) else repr(value)}" for keyword, value in options.items()]
        return cst.parse_expression(f"{function}({self.code(', ', ',').join([*arguments, *keywords])})")

    def uses_runtime(self, *names: str) -> None:
        """Record runtime names (module-level or attribute names) that new code built
        without `runtime_call` reads (`_step_timer`, `time`)."""
        self.runtime_reads.update(names)


class Code(str):
    """An option value given as source (`Hyperparameters.train_prefetch`): an expression
    evaluated at run time, written as is, never a literal the cut may rely on."""


class Tracking(cst.CSTTransformer):
    """A transformer that records, in `ctx.current`, every node it rebuilt, so that
    later transforms can still find survey nodes whose ancestors changed."""

    ctx: "Context | None" = None

    def __init__(self):
        super().__init__()
        self.rebuilt = {}
        self._path: set[int] | None = None

    def prepare(self, ctx: "Context") -> None:
        """Called before the pass: map survey nodes to their present versions."""
        self.ctx = ctx
        self.rebuilt = {}

    def targets(self) -> list[cst.CSTNode] | None:
        """The only nodes this transformer changes, each through a leave_ method of the
        node itself or of one of its ancestors (after `prepare`), or None when it may change
        any node. Given, `edit_tops` enters only the ancestors of these nodes (and the
        nodes themselves): libcst rebuilds every node a transformer enters, and the rest
        of a large top-level statement is then left as it is, the same objects."""
        return None

    def on_visit(self, node) -> bool:
        if self._path is not None and id(node) not in self._path:
            return False
        return super().on_visit(node)

    def on_leave(self, original_node, updated_node):
        result = super().on_leave(original_node, updated_node)
        if isinstance(result, cst.CSTNode) and result is not original_node:
            self.rebuilt[original_node] = result
        return result


class ReplaceNodes(Tracking):
    """Replace nodes by identity: {original node: new node}."""

    def __init__(self, replacements: dict[cst.CSTNode, cst.CSTNode]):
        super().__init__()
        self.replacements = replacements

    def prepare(self, ctx: "Context") -> None:
        super().prepare(ctx)
        self.replacements = {ctx.resolve(k): v for k, v in self.replacements.items()}

    def targets(self) -> list[cst.CSTNode]:
        return list(self.replacements)

    def on_leave(self, original_node, updated_node):
        new = self.replacements.get(original_node)
        return super().on_leave(original_node, updated_node if new is None else new)


def edit_tops(module: cst.Module, ctx: "Context", originals: set, visitor: cst.CSTTransformer) -> cst.Module:
    """Run `visitor` over the top-level statements that were (originally) `originals`.

    Earlier transforms may have rebuilt a top-level statement; `ctx.current` maps
    each original statement to its present version, so later edits still find it.
    """
    wanted = {id(ctx.resolve(t)) for t in originals}
    visitor.prepare(ctx)
    targets = visitor.targets() if isinstance(visitor, Tracking) else None
    body = []
    for stmt in module.body:
        if id(stmt) not in wanted:
            body.append(stmt)
            continue
        if targets is not None:
            visitor._path = _ancestors(stmt, targets)
        new = stmt.visit(visitor)
        if isinstance(new, cst.FlattenSentinel):  # statements inserted before a top-level one
            body.extend(new.nodes)
            visitor.rebuilt[stmt] = new.nodes[-1]
            continue
        if isinstance(new, cst.CSTNode) and new is not stmt:
            visitor.rebuilt[stmt] = new
        body.append(new)
    ctx.current.update(visitor.rebuilt)
    return module.with_changes(body=body)


def _ancestors(top: cst.CSTNode, targets: list[cst.CSTNode]) -> set[int]:
    """ids of the nodes under `top` (included) that are `targets` or hold one, found by
    one read-only walk (no node rebuilt)."""
    wanted = {id(t) for t in targets}
    parent: dict[int, cst.CSTNode] = {}
    found = []
    stack = [top]
    while stack:
        node = stack.pop()
        if id(node) in wanted:
            found.append(node)
        for child in children(node):
            parent[id(child)] = node
            stack.append(child)
    path: set[int] = set()
    for node in found:
        while node is not None and id(node) not in path:
            path.add(id(node))
            node = parent.get(id(node))
    return path


def replace_nodes(module: cst.Module, replacements: dict, ctx: "Context") -> cst.Module:
    """Replace nodes by identity, visiting only the top-level statements that hold them."""
    if not replacements:
        return module
    tops = {ctx.survey.top_level_of(node) for node in replacements}
    return edit_tops(module, ctx, tops, ReplaceNodes(replacements))


class InsertBefore(Tracking):
    """Insert small statements before the small statement `anchor` (an Assign, …).

    In an indented block they go on lines of their own; on a `;`-joined line or a
    one-line suite they join that line, as a minified script would write them.
    """

    def __init__(self, anchor: cst.CSTNode, statements: list[cst.BaseSmallStatement], own_line: bool):
        super().__init__()
        self.anchor = anchor
        self.statements = statements
        self.own_line = own_line
        self.done = False

    def prepare(self, ctx: "Context") -> None:
        super().prepare(ctx)
        self.anchor = ctx.resolve(self.anchor)

    def targets(self) -> list[cst.CSTNode]:
        return [self.anchor]

    def _insert(self, original_node, updated_node):
        body = list(updated_node.body)
        for index, small in enumerate(original_node.body):
            if small is self.anchor:
                self.done = True
                if self.own_line and isinstance(updated_node, cst.SimpleStatementLine) and index == 0:
                    lines = [cst.SimpleStatementLine(body=[s], leading_lines=updated_node.leading_lines) for s in self.statements]
                    return cst.FlattenSentinel(lines + [updated_node.with_changes(leading_lines=[])])
                semicolon = cst.Semicolon(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("" if not self.own_line else " "))
                new = [s.with_changes(semicolon=semicolon) for s in self.statements]
                return updated_node.with_changes(body=body[:index] + new + body[index:])
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        return self._insert(original_node, updated_node)

    def leave_SimpleStatementSuite(self, original_node, updated_node):
        return self._insert(original_node, updated_node)


def insert_before(module: cst.Module, anchor: cst.CSTNode, statements: list, ctx: "Context") -> cst.Module:
    """Insert `statements` just before the small statement `anchor`."""
    transformer = InsertBefore(anchor, statements, own_line=not ctx.minified)
    return edit_tops(module, ctx, {ctx.survey.top_level_of(anchor)}, transformer)


def small_statement(code: str) -> cst.BaseSmallStatement:
    """Parse one simple statement, e.g. `x = 1`."""
    return cst.parse_statement(code + "\n").body[0]
