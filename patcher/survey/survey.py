"""Read-only analysis of a training script: where the transforms may act, and why not.

`survey(module)` walks a parsed script (libcst) once and returns a `Survey`: the data
loader classes and their family, the training loader's construction sites and
`next_batch` call sites (with whether each argument is a run constant), whether a
loader already prefetches, the Hyperparameters class, the script's log function, the
names defined at module level, and the script's style (minified or readable).
Nodes are kept by identity so that transforms run on the same `Module` object can
find them; positions (1-based lines) are kept for reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from patcher import cst_walk
from patcher.cst_walk import dotted, walk

GLOBAL_RNG_TORCH = {"rand", "randn", "randint", "randperm", "manual_seed", "bernoulli", "multinomial", "normal", "seed"}
GLOBAL_RNG_NUMPY_OK = {"Generator", "PCG64", "default_rng", "RandomState", "SeedSequence", "Philox", "MT19937", "SFC64", "BitGenerator"}
THREAD_NAMES = {"ThreadPoolExecutor", "Thread", "ProcessPoolExecutor"}


@dataclass
class LoaderClass:
    """A class that defines `next_batch`.

    family: "tokenstream" | "coprime" | "shuffled" | "document_packing" | "custom".
    next_batch_params: parameter names after `self`. device_index: position (after
    `self`) of the `__init__` parameter that takes the device, or None.
    h2d_calls: the `<expr>.to(self.<device attr>, non_blocking=True)` nodes in
    `next_batch`. reshape_only: index of a `next_batch` parameter used only as the
    trailing dimension of `.reshape(-1, p)` of every returned tensor, or None.
    prefetches: the class already builds batches on threads. unsafe: why prefetching
    it would not be exact (global RNG, torch.distributed, device use), or None.
    in_place: where the loader changes a container or array in place (then its state
    cannot be snapshot cheaply for a rollback), or None. writes_arrays: where it writes
    into an array or tensor it keeps (`self.buf[...] = ...`, `self.buf.copy_(...)`), so a
    batch it returned may change later and a prefetched batch must be a copy, or None.
    cuda_in_next_batch: `next_batch` moves its batch to the GPU itself (`x.cuda()`,
    `x.to("cuda")`), the older modded-nanogpt `DistributedDataLoader` with no device.
    """

    name: str
    node: cst.ClassDef
    line: int
    family: str = "custom"
    next_batch_params: list[str] = field(default_factory=list)
    init_params: list[str] = field(default_factory=list)
    device_index: int | None = None
    device_attr: str | None = None
    h2d_calls: list[cst.Call] = field(default_factory=list)
    reshape_only: int | None = None
    prefetches: bool = False
    unsafe: str | None = None
    in_place: str | None = None
    writes_arrays: str | None = None
    cuda_in_next_batch: bool = False


@dataclass
class Construction:
    """`target = LoaderClass(...)`: node is the `Assign`, call its value."""

    target: str
    class_name: str
    node: cst.Assign
    call: cst.Call
    line: int
    scope: cst.CSTNode
    binding: object = None
    training: bool = False
    reason: str | None = None


@dataclass
class CallSite:
    """`receiver.next_batch(args…)`; constant[i] says whether argument i is a run constant."""

    receiver: str
    node: cst.Call
    line: int
    scope: cst.CSTNode
    args: list[str]
    constant: list[bool]
    binding: object = None


@dataclass
class IteratorSite:
    """`target = generator_function(...)`: a data generator built in the script.

    function: the generator function's name; node: the `Assign`; call: its value.
    training: the training data source (advanced with `next(target)` or
    `target.send(value)`, named for training); sends: the `target.send(value)` calls;
    reason: why it is not prefetched, or None.
    """

    target: str
    function: str
    node: cst.Assign
    call: cst.Call
    line: int
    binding: object = None
    training: bool = False
    reason: str | None = None
    sends: list = field(default_factory=list)


@dataclass
class Hyperparameters:
    """The Hyperparameters class. style: "class" | "dataclass" | "oneline"."""

    name: str
    node: cst.ClassDef
    line: int
    style: str


@dataclass
class Survey:
    """Everything the transforms need to know about one script."""

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
    collector: "_SiteCollector | None" = field(default=None, repr=False)
    _line_cache: dict = field(default_factory=dict, repr=False)
    _shared: dict = field(default_factory=dict, repr=False)
    _line_starts: dict = field(default_factory=dict, repr=False)

    def line_of(self, node: cst.CSTNode) -> int:
        """1-based line of `node` in the surveyed source.

        Positions are computed for the one top-level statement that holds `node`
        (whole-module position metadata costs more than the rest of the survey).
        """
        top = self.top_level_of(node)
        if top not in self._line_cache:
            self._line_cache[top] = _positions_in_statement(self.module, top, self._line_starts)
        start, positions = self._line_cache[top]
        return start + positions[node].start.line - 1

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

    def training_constructions(self) -> list[Construction]:
        return [c for c in self.constructions if c.training]

    def calls_on(self, construction: Construction) -> list[CallSite]:
        """`next_batch` calls whose receiver is the construction's variable."""
        return [c for c in self.calls if c.binding is construction.binding and c.receiver == construction.target]


def _positions_in_statement(module: cst.Module, top: cst.CSTNode, starts: dict) -> tuple[int, dict]:
    if not starts:
        line = 1 + len(module.header)
        for stmt in module.body:
            starts[stmt] = line
            line += module.code_for_node(stmt).count("\n")
    alone = cst.Module(body=[top], default_indent=module.default_indent, default_newline=module.default_newline)
    return starts[top], _positions(alone)


def _positions(module: cst.Module) -> dict:
    """{node: CodeRange} for `module`. libcst's PositionProvider prints the module with a
    position-tracking state; resolving it through a MetadataWrapper also walks the whole
    tree once more for nothing, so that internal step is called directly where it exists."""
    provider = PositionProvider()
    try:
        provider._gen_impl(module)
        return provider._computed
    except AttributeError:  # a libcst without those internals
        return MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)


def survey(module: cst.Module) -> Survey:
    """Analyse `module` (not modified). Returns a `Survey` whose nodes belong to `module`.

    One pass of `_SiteCollector` over the module; loader classes, which are small, are
    then read on their own. What only one feature needs (MLP squares, PEP 701
    f-strings, the env idiom of Hyperparameters) is that feature's `analyse`.
    """
    result = Survey(module=module, minified=_is_minified(module), uses_torch=_imports(module, "torch"))
    result.module_names = _module_level_names(module)
    classes = {n.name.value: n for n in module.body if isinstance(n, cst.ClassDef)}
    collector = _SiteCollector()
    cst_walk.visit(module, collector)
    result.collector = collector
    for cls in classes.values():
        if _method(cls, "next_batch") is not None:
            result.loader_classes[cls.name.value] = _survey_loader(cls, classes, result)
    _find_constructions_and_calls(collector, result)
    _find_iterators(collector, result)
    _inside_training_generators(result)
    result.hyperparameters = _find_hyperparameters(module, result)
    result.log_function = _find_log_function(collector)
    return result


@dataclass
class AttributeUse:
    """`base.attr` read or written in `scope`."""

    base: str
    attr: str
    scope: "_Scope"


class _Scope:
    """A function (or the module): its bindings, for run-constant analysis."""

    def __init__(self, node: cst.CSTNode, parent: "_Scope | None"):
        self.node = node
        self.parent = parent
        # name -> list of (kind, value): kind "param" | "assign" | "loop" | "aug" | "other"
        self.bindings: dict[str, list[tuple[str, cst.BaseExpression | None]]] = {}

    def bind(self, name: str, kind: str, value: cst.BaseExpression | None = None) -> None:
        self.bindings.setdefault(name, []).append((kind, value))

    def resolve(self, name: str) -> "_Scope | None":
        scope = self
        while scope is not None:
            if name in scope.bindings:
                return scope
            scope = scope.parent
        return None


class _SiteCollector(cst.CSTVisitor):
    """One pass over the module: scopes and bindings, attribute assignments, the
    `next_batch` calls, `name = Call(...)` assignments, functions, and the top-level
    statement that holds each of them."""

    def __init__(self) -> None:
        self.module_scope = _Scope(None, None)
        self.scope = self.module_scope
        self.stack = [self.module_scope]
        self.scope_of: dict[cst.CSTNode, _Scope] = {}
        self.top: cst.CSTNode | None = None
        self.top_of: dict[cst.CSTNode, cst.CSTNode] = {}
        self.assigned_attributes: set[tuple[str, str]] = set()
        self.calls: list[tuple[cst.Call, _Scope]] = []
        self.call_assigns: list[tuple[cst.Assign, _Scope]] = []
        self.functions: list[cst.FunctionDef] = []
        self.attribute_uses: list[AttributeUse] = []
        self.next_calls: list[tuple[cst.Call, _Scope]] = []  # next(name)
        self.send_calls: list[tuple[cst.Call, _Scope]] = []  # name.send(value)
        self.generator_functions: set[cst.FunctionDef] = set()  # functions that yield
        self.calls_by_name: dict[str, list[cst.Call]] = {}  # f(...) calls by the name f
        # every f-string, with the f-strings it sits in
        self.fstrings: list[tuple[cst.FormattedString, tuple]] = []
        self.fstring_stack: list[cst.FormattedString] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.top is None:
            self.top = node if not isinstance(node, cst.Module) else None
        self.top_of[node] = self.top
        return super().on_visit(node)

    def on_leave(self, original_node: cst.CSTNode) -> None:
        super().on_leave(original_node)
        if original_node is self.top:
            self.top = None

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.scope.bind(node.name.value, "other")
        self.functions.append(node)
        self.top_of[node] = self.top
        # Python resolves names in a method past the class body, to the enclosing function.
        parent = self.scope
        while parent.node is not None and isinstance(parent.node, cst.ClassDef):
            parent = parent.parent
        self._push(_Scope(node, parent))
        self.scope_of[node] = self.scope
        for p in list(node.params.posonly_params) + list(node.params.params) + list(node.params.kwonly_params):
            self.scope.bind(p.name.value, "param")
        for star in (node.params.star_arg, node.params.star_kwarg):
            if isinstance(star, cst.Param):
                self.scope.bind(star.name.value, "param")

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.scope.bind(node.name.value, "other")
        self._push(_Scope(node, self.scope))

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self._pop()

    def _push(self, scope: _Scope) -> None:
        self.stack.append(scope)
        self.scope = scope

    def _pop(self) -> None:
        self.stack.pop()
        self.scope = self.stack[-1]

    def visit_For(self, node: cst.For) -> None:
        for name in _target_names(node.target):
            self.scope.bind(name, "loop")

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            if len(node.targets) == 1 and _parallel_assignment(t.target, node.value):
                # `B, T = args.batch_size, args.seq_len`: each name has its own value
                for target, value in zip(t.target.elements, node.value.elements):
                    self.scope.bind(target.value.value, "assign", value.value)
                continue
            names = _target_names(t.target)
            for name in names:
                kind = "assign" if isinstance(t.target, cst.Name) and len(node.targets) == 1 else "other"
                self.scope.bind(name, kind, node.value if kind == "assign" else None)
            self._note_attribute(t.target)
        if isinstance(node.value, cst.Call):
            self.call_assigns.append((node, self.scope))
            self.top_of[node] = self.top

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        for name in _target_names(node.target):
            self.scope.bind(name, "assign" if node.value is not None else "other", node.value)
        self._note_attribute(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        for name in _target_names(node.target):
            self.scope.bind(name, "aug")
        self._note_attribute(node.target)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        for name in _target_names(node.target):
            self.scope.bind(name, "other")

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            for name in _target_names(node.asname.name):
                self.scope.bind(name, "other")

    def visit_CompFor(self, node: cst.CompFor) -> None:
        for name in _target_names(node.target):
            self.scope.bind(name, "loop")

    def visit_Global(self, node: cst.Global) -> None:
        for item in node.names:
            self.scope.bind(item.name.value, "other")

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        for item in node.names:
            self.scope.bind(item.name.value, "other")

    def visit_Call(self, node: cst.Call) -> None:
        # The callee's last name first: a script has thousands of calls, matchers are slow.
        func = node.func
        if isinstance(func, cst.Name):
            self.calls_by_name.setdefault(func.value, []).append(node)
        callee = func.value if isinstance(func, cst.Name) else func.attr.value if isinstance(func, cst.Attribute) else None
        if callee not in ("next", "send", "next_batch", "setattr"):
            return
        if m.matches(node, m.Call(func=m.Name("next"), args=[m.Arg(m.Name()), m.ZeroOrMore()])):
            self.next_calls.append((node, self.scope))
        if m.matches(node, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("send")), args=[m.Arg(keyword=None)])):
            self.send_calls.append((node, self.scope))
        if m.matches(node, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("next_batch")))):
            self.calls.append((node, self.scope))
            self.top_of[node] = self.top
        if m.matches(node, m.Call(func=m.Name("setattr"), args=[m.Arg(m.Name()), m.Arg(m.SimpleString()), m.ZeroOrMore()])):
            self.assigned_attributes.add((node.args[0].value.value, node.args[1].value.evaluated_value))

    def visit_Yield(self, node: cst.Yield) -> None:
        if isinstance(self.scope.node, cst.FunctionDef):
            self.generator_functions.add(self.scope.node)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        self.fstrings.append((node, tuple(self.fstring_stack)))
        self.fstring_stack.append(node)

    def leave_FormattedString(self, original_node: cst.FormattedString) -> None:
        self.fstring_stack.pop()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name) and node.value.value != "self":
            self.attribute_uses.append(AttributeUse(node.value.value, node.attr.value, self.scope))

    def _note_attribute(self, target: cst.BaseExpression) -> None:
        for element in _flatten_targets(target):
            if isinstance(element, cst.Attribute) and isinstance(element.value, cst.Name):
                self.assigned_attributes.add((element.value.value, element.attr.value))


def _parallel_assignment(target: cst.BaseExpression, value: cst.BaseExpression) -> bool:
    """`a, b = x, y`: names on the left, as many plain (unstarred) values on the right."""
    return (
        isinstance(target, (cst.Tuple, cst.List))
        and isinstance(value, (cst.Tuple, cst.List))
        and len(target.elements) == len(value.elements)
        and all(isinstance(e, cst.Element) and isinstance(e.value, cst.Name) for e in target.elements)
        and all(isinstance(e, cst.Element) for e in value.elements)
    )


def _flatten_targets(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(target, (cst.Tuple, cst.List)):
        out = []
        for e in target.elements:
            out.extend(_flatten_targets(e.value))
        return out
    if isinstance(target, cst.StarredElement):
        return _flatten_targets(target.value)
    return [target]


def _target_names(target: cst.BaseExpression) -> list[str]:
    return [t.value for t in _flatten_targets(target) if isinstance(t, cst.Name)]


# ----------------------------------------------------------------------------- style


def _is_minified(module: cst.Module) -> bool:
    """Minified scripts indent with tabs or put several statements on one line."""
    if module.default_indent == "\t":
        return True
    lines = [s for s in module.body if isinstance(s, cst.SimpleStatementLine)]
    multi = sum(1 for s in lines if len(s.body) > 2)
    return bool(lines) and multi * 4 > len(lines)


def _imports(module: cst.Module, top: str) -> bool:
    for node in walk(module):
        if isinstance(node, cst.Import):
            for alias in node.names:
                if dotted(alias.name).split(".")[0] == top:
                    return True
        if isinstance(node, cst.ImportFrom) and node.module is not None and dotted(node.module).split(".")[0] == top:
            return True
    return False


def _module_level_names(module: cst.Module) -> set[str]:
    names = set()
    for stmt in cst_walk.small_statements(module.body):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.add(stmt.name.value)
        elif isinstance(stmt, cst.Assign):
            names.update(t.target.value for t in stmt.targets if isinstance(t.target, cst.Name))
    return names


# ----------------------------------------------------------------------------- loaders


def _survey_loader(cls: cst.ClassDef, classes: dict[str, cst.ClassDef], result: Survey) -> LoaderClass:
    info = LoaderClass(name=cls.name.value, node=cls, line=result.line_of(cls))
    next_batch = _method(cls, "next_batch")
    info.next_batch_params = _params(next_batch)[1:]
    init = _method(cls, "__init__")
    info.init_params = _params(init)[1:] if init is not None else []
    if "device" in info.init_params:
        info.device_index = info.init_params.index("device")
        info.device_attr = _attr_assigned_from(init, "device")
    # Classes the loader builds (TokenStream) share its state and its risks.
    related = [cls] + [classes[n] for n in _called_names(cls) if n in classes and n != cls.name.value]
    names_used = set()
    for c in related:
        names_used |= _called_names(c)
    info.prefetches = bool(names_used & THREAD_NAMES) or info.name == "DocumentPackingLoader"
    if info.prefetches:
        info.family = "document_packing" if info.name == "DocumentPackingLoader" else "custom"
    elif any(c.name.value == "TokenStream" for c in related[1:]):
        info.family = "tokenstream"
    elif info.name == "ShuffledSequenceLoader":
        info.family = "shuffled"
    elif _method(cls, "_pick_coprime_stride") is not None or "Generator" in names_used:
        info.family = "coprime" if info.name == "DistributedTokenLoader" else "custom"
    info.unsafe = _unsafe_reason(related, info)
    if info.device_attr is not None:
        info.h2d_calls = _h2d_calls(next_batch, info.device_attr)
    info.reshape_only = _reshape_only_param(next_batch, info.next_batch_params)
    info.in_place = _in_place_mutation(related)
    info.writes_arrays = _array_writes(related)
    info.cuda_in_next_batch = any(m.matches(node, _CUDA_MOVE) for node in walk(next_batch))
    return info


IN_PLACE_METHODS = {"shuffle", "fill", "sort", "resize", "put", "itemset", "append", "extend", "pop", "insert", "remove", "clear", "update", "setdefault"}


def _in_place_mutation(classes: list[cst.ClassDef]) -> str | None:
    """Where the loader changes one of its containers or arrays in place, if anywhere.

    A snapshot of such a loader would have to copy every array; loaders that only
    rebind attributes (the TokenStream family: `self.pos += k`, `self.tokens = ...`)
    can be snapshot cheaply, sharing their read-only shard arrays.
    """
    self_attr = m.Attribute(value=m.Name("self"))
    for cls in classes:
        for node in walk(cls):
            if isinstance(node, (cst.AssignTarget, cst.AugAssign)):
                target = node.target
                if m.matches(target, m.Subscript(value=self_attr | m.Subscript())):
                    return f"{cls.name.value} assigns into {cst.Module([]).code_for_node(target)}"
            if m.matches(node, m.Call(func=m.Attribute(value=self_attr))):
                method = node.func.attr.value
                if method in IN_PLACE_METHODS or (method.endswith("_") and not method.startswith("_")):
                    return f"{cls.name.value} calls self.{node.func.value.attr.value}.{method}()"
            if m.matches(node, m.Call(func=m.Attribute(value=m.Subscript(value=self_attr)))):
                method = node.func.attr.value
                if method in IN_PLACE_METHODS or method.endswith("_"):
                    return f"{cls.name.value} changes {cst.Module([]).code_for_node(node.func.value)} in place"
    return None


ARRAY_WRITE_METHODS = {"fill", "sort", "resize", "put", "itemset", "shuffle"}


def _array_writes(classes: list[cst.ClassDef]) -> str | None:
    """Where the loader writes into an array or tensor it keeps, if anywhere.

    Subscript assignment into a `self` attribute, an in-place method on one
    (`self.buf.copy_(x)`, `self.buf[i].fill(0)`), or `out=self.buf`. List methods
    (`append`, `pop`) do not count: they do not change an array a batch may view.
    """
    self_attr = m.Attribute(value=m.Name("self"))
    containers = _container_attrs(classes)
    for cls in classes:
        for node in walk(cls):
            if isinstance(node, (cst.AssignTarget, cst.AugAssign)):
                target = node.target
                while m.matches(target, m.Subscript(value=m.Subscript())):
                    target = target.value
                if m.matches(target, m.Subscript(value=self_attr)) and target.value.attr.value not in containers:
                    return f"{cls.name.value} assigns into {cst.Module([]).code_for_node(node.target)}"
            if isinstance(node, cst.Call):
                if m.matches(node.func, m.Attribute(value=self_attr | m.Subscript(value=self_attr))):
                    method = node.func.attr.value
                    if method in ARRAY_WRITE_METHODS or (method.endswith("_") and not method.startswith("_")):
                        return f"{cls.name.value} calls {cst.Module([]).code_for_node(node.func)}()"
                for arg in node.args:
                    if arg.keyword is not None and arg.keyword.value == "out" and m.matches(arg.value, self_attr | m.Subscript(value=self_attr)):
                        return f"{cls.name.value} writes out={cst.Module([]).code_for_node(arg.value)}"
    return None


def _container_attrs(classes: list[cst.ClassDef]) -> set[str]:
    """`self` attributes only ever bound to list, dict or set displays or comprehensions."""
    literal = m.List() | m.Dict() | m.Set() | m.ListComp() | m.DictComp() | m.SetComp()
    bound: dict[str, bool] = {}
    for cls in classes:
        for node in walk(cls):
            if isinstance(node, cst.Assign):
                targets = [t.target for t in node.targets]
            elif isinstance(node, cst.AnnAssign):
                targets = [node.target]  # `self.x: list[int] = []`
            else:
                continue
            for target in targets:
                if m.matches(target, m.Attribute(value=m.Name("self"))):
                    name = target.attr.value
                    is_container = node.value is not None and m.matches(node.value, literal)
                    bound[name] = bound.get(name, True) and is_container
    return {name for name, only_containers in bound.items() if only_containers}


def _global_rng(called: str) -> str | None:
    """"the global torch RNG (torch.randint)" when the dotted call name draws from a
    process-wide RNG (torch, numpy's legacy module functions, `random`), else None."""
    parts = called.split(".")
    if len(parts) == 2 and parts[0] == "torch" and parts[1] in GLOBAL_RNG_TORCH:
        return f"the global torch RNG ({called})"
    if len(parts) >= 3 and parts[-2] == "random" and parts[0] in ("np", "numpy") and parts[-1] not in GLOBAL_RNG_NUMPY_OK:
        return f"the global numpy RNG ({called})"
    if len(parts) == 2 and parts[0] == "random":
        return f"the global random module ({called})"
    return None


def _unsafe_reason(related: list[cst.ClassDef], info: LoaderClass) -> str | None:
    for c in related:
        for node in walk(c):
            if not isinstance(node, cst.Call):
                continue
            name = dotted(node.func)
            parts = name.split(".")
            rng = _global_rng(name)
            if rng is not None:
                return f"loader draws from {rng}; a background thread would change the draw order"
            if parts[0] == "dist" or name.startswith("torch.distributed"):
                return f"loader calls torch.distributed ({name}) inside next_batch; it must stay on the main thread"
            if name.startswith("torch.cuda") or name.startswith("cuda."):
                return f"loader calls {name}; it must stay on the main thread"
    if info.device_attr is not None:
        uses = _device_attr_uses(info.node, info.device_attr)
        if uses:
            return f"loader uses self.{info.device_attr} beyond the final H2D copy ({uses}); cannot build it on the CPU"
    return None


def _device_attr_uses(cls: cst.ClassDef, attr: str) -> str | None:
    """Describe a use of `self.<attr>` other than its assignment and `.to(self.<attr>, …)`."""
    device_ref = m.Attribute(value=m.Name("self"), attr=m.Name(attr))
    allowed: set[int] = set()
    for node in walk(cls):
        if m.matches(node, m.Call(func=m.Attribute(attr=m.Name("to")), args=[m.Arg(value=device_ref, keyword=None), m.ZeroOrMore()])):
            allowed.add(id(node.args[0].value))
        if m.matches(node, m.AssignTarget(target=device_ref)):
            allowed.add(id(node.target))
    for node in walk(cls):
        if m.matches(node, device_ref) and id(node) not in allowed:
            return f"self.{attr}"
    return None


_CUDA_STRING = m.SimpleString(value=m.MatchIfTrue(lambda v: v.strip("'\"").startswith("cuda")))
_CUDA_MOVE = m.Call(func=m.Attribute(attr=m.Name("cuda"))) | m.Call(
    func=m.Attribute(attr=m.Name("to")),
    args=[m.ZeroOrMore(), m.Arg(value=_CUDA_STRING), m.ZeroOrMore()],
)


def _h2d_calls(next_batch: cst.FunctionDef, attr: str) -> list[cst.Call]:
    pattern = m.Call(
        func=m.Attribute(attr=m.Name("to")),
        args=[
            m.Arg(value=m.Attribute(value=m.Name("self"), attr=m.Name(attr)), keyword=None),
            m.Arg(keyword=m.Name("non_blocking"), value=m.Name("True")),
        ],
    )
    return [n for n in walk(next_batch) if m.matches(n, pattern)]


def _reshape_only_param(fn: cst.FunctionDef, params: list[str]) -> int | None:
    """Index of a parameter used only as `n` in `<v> = <expr>.reshape(-1, n)` whose `v`s are all that is returned."""
    returns = [n for n in walk(fn) if isinstance(n, cst.Return)]
    if len(returns) != 1 or returns[0].value is None:
        return None
    elements = _returned_names(returns[0].value)
    if elements is None:
        return None
    for index, param in enumerate(params):
        refs = [n for n in walk(fn.body) if m.matches(n, m.Name(param))]
        reshaped_into = set()
        ok = bool(refs)
        for ref in refs:
            assign = _reshape_assignment(fn, ref)
            if assign is None:
                ok = False
                break
            reshaped_into.add(assign)
        if ok and reshaped_into and set(elements) <= reshaped_into:
            return index
    return None


def _returned_names(value: cst.BaseExpression) -> list[str] | None:
    """Names returned, seen through `.to(...)`: `x.to(d), y.to(d)` -> ["x", "y"]."""
    items = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
    names = []
    for item in items:
        while m.matches(item, m.Call(func=m.Attribute(attr=m.Name("to")))):
            item = item.func.value
        if not isinstance(item, cst.Name):
            return None
        names.append(item.value)
    return names


def _reshape_assignment(fn: cst.FunctionDef, ref: cst.Name) -> str | None:
    """If `ref` is `n` in a statement `v = <expr>.reshape(-1, n)` of `fn`, return `v`."""
    for node in walk(fn.body):
        if not isinstance(node, cst.Assign) or len(node.targets) != 1 or not isinstance(node.targets[0].target, cst.Name):
            continue
        call = node.value
        if m.matches(
            call,
            m.Call(
                func=m.Attribute(attr=m.Name("reshape") | m.Name("view")),
                args=[m.Arg(value=m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))), m.Arg()],
            ),
        ) and call.args[1].value is ref:
            return node.targets[0].target.value
    return None


# ----------------------------------------------------------------------------- sites


def _find_constructions_and_calls(collector: _SiteCollector, result: Survey) -> None:
    module = result.module
    loader_names = set(result.loader_classes)
    for assign, scope in collector.call_assigns:
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
    for call, scope in collector.calls:
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
                constant=[_is_run_constant(a.value, scope, collector, depth=0) for a in call.args],
                binding=binding,
            )
        )
    for c in result.constructions:
        if _names_other_data(c.target):
            c.reason = f"`{c.target}` is not the training loader"
        elif not result.calls_on(c):
            c.reason = f"`{c.target}` has no next_batch call where it is built"
        else:
            c.training = True


def _names_other_data(target: str) -> bool:
    """True for a variable named for validation or calibration data, not training data."""
    return "calib" in target.lower() or "val" in target.lower()


DIST_LOCAL_QUERIES = {"get_rank", "get_world_size", "is_initialized", "is_available", "get_backend"}


def _find_iterators(collector: _SiteCollector, result: Survey) -> None:
    """Data generators: `name = gen(...)` for a module-level generator function `gen`."""
    generators = {f.name.value: f for f in result.module.body if f in collector.generator_functions}
    for assign, scope in collector.call_assigns:
        func, target = assign.value.func, assign.targets[0].target
        if len(assign.targets) != 1 or not isinstance(func, cst.Name) or func.value not in generators or not isinstance(target, cst.Name):
            continue
        binding = scope.resolve(target.value)
        site = IteratorSite(target.value, func.value, assign, assign.value, result.line_of(assign), binding)
        advanced = [c for c, sc in collector.next_calls if c.args[0].value.value == target.value and sc.resolve(target.value) is binding]
        site.sends = [c for c, sc in collector.send_calls if c.func.value.value == target.value and sc.resolve(target.value) is binding]
        # `.send(value)` is exact in the runtime (rebuild and replay); other methods are not ours to run ahead
        uses = sorted({a.attr for a in collector.attribute_uses if a.base == target.value and a.scope.resolve(a.base) is binding} - ({"send"} if site.sends else set()))
        advanced += site.sends
        if _names_other_data(site.target):
            site.reason = f"`{site.target}` is not the training data source"
        elif uses:
            site.reason = f"`{site.target}` is used as {', '.join(f'`{site.target}.{u}`' for u in uses)}, not only with next()"
        elif not advanced:
            site.reason = f"`{site.target}` is never advanced with next()"
        else:
            site.reason = _generator_unsafe(generators[func.value])
            site.training = site.reason is None
        result.iterators.append(site)


def _inside_training_generators(result: Survey) -> None:
    """A loader built inside a data generator that runs ahead as a whole (modded-nanogpt's
    `BOSFinder` in `distributed_data_generator`) is not wrapped a second time."""
    generators = {i.function for i in result.iterators if i.training}
    for construction in result.constructions:
        scope = construction.scope
        if construction.training and isinstance(scope, cst.FunctionDef) and scope.name.value in generators:
            construction.training = False
            construction.reason = f"`{construction.target}` is built inside the data generator {scope.name.value}, which runs ahead as a whole"


def _generator_unsafe(function: cst.FunctionDef) -> str | None:
    """Why running `function` on another thread could change what it yields, else None."""
    name = function.name.value
    for node in walk(function):
        if not isinstance(node, cst.Call):
            continue
        called = dotted(node.func)
        parts = called.split(".")
        if parts[-1] in THREAD_NAMES or parts[-1] == "load_async":
            return f"{name} already loads data in the background ({called}); not wrapped again"
        rng = _global_rng(called)
        if rng is not None:
            return f"{name} draws from {rng}; a background thread would change the draw order"
        if (parts[0] == "dist" or called.startswith("torch.distributed")) and parts[-1] not in DIST_LOCAL_QUERIES:
            return f"{name} calls {called} (a collective); it must stay on the training thread"
    return None


def _is_run_constant(expr: cst.BaseExpression, scope: _Scope, collector: _SiteCollector, depth: int) -> bool:
    """True when `expr` has the same value every time the statement holding it runs.

    Literals; attributes `a.b` never assigned anywhere in the script (the
    Hyperparameters idiom `args.train_seq_len`); names bound once in their scope
    (a parameter, or one plain assignment of a run constant, not a loop target);
    arithmetic and int/float/min/max of those.
    """
    if depth > 8:
        return False
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)):
        return True
    if isinstance(expr, cst.UnaryOperation):
        return _is_run_constant(expr.expression, scope, collector, depth + 1)
    if isinstance(expr, cst.BinaryOperation):
        return _is_run_constant(expr.left, scope, collector, depth + 1) and _is_run_constant(expr.right, scope, collector, depth + 1)
    if isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name):
        return (expr.value.value, expr.attr.value) not in collector.assigned_attributes
    if isinstance(expr, cst.Name):
        owner = scope.resolve(expr.value)
        if owner is None:
            return False
        bindings = owner.bindings[expr.value]
        if len(bindings) != 1:
            return False
        kind, value = bindings[0]
        if kind == "param":
            return True
        if kind == "assign" and value is not None:
            return _is_run_constant(value, owner, collector, depth + 1)
        return False
    if isinstance(expr, cst.Call) and dotted(expr.func) in CONSTANT_CALLS:
        return all(_is_run_constant(a.value, scope, collector, depth + 1) for a in expr.args)
    if m.matches(expr, m.Subscript(value=m.Attribute(value=m.Name("os"), attr=m.Name("environ")))):
        return True
    return False


# Calls whose result is fixed for the whole run when their arguments are.
CONSTANT_CALLS = {
    "int", "float", "bool", "str", "max", "min", "len", "abs", "round",
    "os.environ.get", "os.getenv", "math.ceil", "math.floor",
    "dist.get_world_size", "dist.get_rank", "torch.distributed.get_world_size", "torch.distributed.get_rank",
    "torch.cuda.device_count",
}


# ----------------------------------------------------------------------------- hyperparameters


def _find_hyperparameters(module: cst.Module, result: Survey) -> Hyperparameters | None:
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef) and stmt.name.value in ("Hyperparameters", "Hyperparams", "HParams", "Config", "Args"):
            dataclass = any(dotted(d.decorator if not isinstance(d.decorator, cst.Call) else d.decorator.func).endswith("dataclass") for d in stmt.decorators)
            body = stmt.body
            style = "dataclass" if dataclass else ("oneline" if isinstance(body, cst.SimpleStatementSuite) or _single_line_body(body) else "class")
            return Hyperparameters(
                name=stmt.name.value,
                node=stmt,
                line=result.line_of(stmt),
                style=style,
            )
    return None


def _single_line_body(body: cst.BaseSuite) -> bool:
    return isinstance(body, cst.IndentedBlock) and len(body.body) == 1 and isinstance(body.body[0], cst.SimpleStatementLine) and len(body.body[0].body) > 3


# ----------------------------------------------------------------------------- logging


# The names a script's log function goes by, in order of preference.
LOG_FUNCTIONS = ("log0", "log", "print0", "log_print")


def _find_log_function(collector: _SiteCollector) -> tuple[str, cst.CSTNode] | None:
    """The script's log function and the scope that defines it: the first of `LOG_FUNCTIONS` defined."""
    for name in LOG_FUNCTIONS:
        for fn in collector.functions:
            if fn.name.value == name:
                return name, fn
    return None


# ----------------------------------------------------------------------------- helpers


def _method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else []
    for stmt in body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def _params(fn: cst.FunctionDef | None) -> list[str]:
    if fn is None:
        return []
    return [p.name.value for p in list(fn.params.posonly_params) + list(fn.params.params)]


def _attr_assigned_from(fn: cst.FunctionDef, param: str) -> str | None:
    for node in walk(fn.body):
        if isinstance(node, cst.Assign) and m.matches(node.value, m.Name(param)):
            for t in node.targets:
                if m.matches(t.target, m.Attribute(value=m.Name("self"))):
                    return t.target.attr.value
    return None


def _called_names(cls: cst.ClassDef) -> set[str]:
    names = set()
    for node in walk(cls):
        if isinstance(node, cst.Call):
            name = dotted(node.func)
            if name:
                names.add(name.split(".")[-1])
    return names
