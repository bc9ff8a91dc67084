"""What every transform shares: options, notes, toggle expressions, node edits."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from patcher.survey import Survey

FEATURES = ["train_prefetch", "copy_stream", "env_toggles", "mlp_fusion", "py310_fstrings", "step_timing", "val_prefetch", "val_bytecount", "val_progress"]
# Diagnostics only add code until a toggle is set, so a default patch leaves them out
# (every added byte counts against the artifact cap): `--with FEATURE` or `--diagnostics`.
DIAGNOSTICS = ["step_timing", "val_bytecount", "val_progress"]
DEFAULT_FEATURES = [f for f in FEATURES if f not in DIAGNOSTICS]

# Toggle name -> (attribute in the Hyperparameters idiom, default)
TOGGLES = {
    "TRAIN_PREFETCH": ("train_prefetch", 1),
    "TRAIN_PREFETCH_QUEUE": ("train_prefetch_queue", 2),
    "TRAIN_COPY_STREAM": ("train_copy_stream", 1),
    "TRAINING_TIMING_BREAKDOWN": ("training_timing_breakdown", 0),
    "TRAINING_TIMING_EVERY": ("training_timing_every", 200),
    "VAL_PREFETCH": ("val_prefetch", 1),
    "VAL_COPY_STREAM": ("val_copy_stream", 1),
    "VAL_BYTECOUNT_DEVICE": ("val_bytecount_device", "cuda"),  # a string toggle
    "VAL_PROGRESS_LOG_EVERY": ("val_progress_log_every", 0),
    "TRAIN_PREFETCH_WORKERS": ("train_prefetch_workers", 1),
    "TRAIN_PREFETCH_NUMPY": ("train_prefetch_numpy", 1),
}


@dataclass
class Note:
    """One line of the report: a feature applied, or skipped with the reason and line."""

    feature: str
    applied: bool
    reason: str | None = None
    line: int | None = None

    def as_dict(self) -> dict:
        return {"feature": self.feature, "reason": self.reason, "line": self.line}


@dataclass
class Context:
    """Shared state of one patch run.

    enabled: features the user asked for. templates: runtime templates the applied
    transforms need. toggles_used: toggle names referenced by the new code. keep:
    runtime names kept although the script does not use them (benchmarks).
    producer_toggles: add the producer tuning toggles (`TRAIN_PREFETCH_WORKERS`,
    `TRAIN_PREFETCH_NUMPY`) where the loader family has them.
    """

    survey: Survey
    enabled: set[str]
    templates: list[str] = field(default_factory=list)
    toggles_used: list[str] = field(default_factory=list)
    current: dict = field(default_factory=dict)
    constants: list = field(default_factory=list)
    keep: set = field(default_factory=set)
    producer_toggles: bool = False

    @property
    def minified(self) -> bool:
        return self.survey.minified

    def toggle(self, env_name: str) -> str:
        """Source of the expression that reads toggle `env_name` at run time.

        `Hyperparameters.train_prefetch` where the script has such a class, the module
        constant `TRAIN_PREFETCH` otherwise, the default itself when `env_toggles` is off.
        """
        attr, default = TOGGLES[env_name]
        if self.toggle_home == "literal":
            return repr(default)
        if env_name not in self.toggles_used:
            self.toggles_used.append(env_name)
        return f"{self.survey.hyperparameters.name}.{attr}" if self.toggle_home == "class" else env_name

    @property
    def toggle_home(self) -> str:
        """Where toggles live: "class" (Hyperparameters has an env line to copy),
        "module" (module constants), or "literal" (env_toggles off: defaults inline)."""
        if "env_toggles" not in self.enabled:
            return "literal"
        hp = self.survey.hyperparameters
        return "class" if hp is not None and hp.sample is not None else "module"

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


class Tracking(cst.CSTTransformer):
    """A transformer that records, in `ctx.current`, every node it rebuilt, so that
    later transforms can still find survey nodes whose ancestors changed."""

    ctx: "Context | None" = None

    def __init__(self):
        super().__init__()
        self.rebuilt = {}

    def prepare(self, ctx: "Context") -> None:
        """Called before the pass: map survey nodes to their present versions."""
        self.ctx = ctx
        self.rebuilt = {}

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
    body = []
    for stmt in module.body:
        if id(stmt) not in wanted:
            body.append(stmt)
            continue
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
