"""The facts about a loader class (a class that defines `next_batch`) that every family shares.

`survey_loader` reads one class, with the script's classes it builds (TokenStream),
and returns a `LoaderClass`: its parameters, where its device goes, its H2D copies,
whether it already uses threads (its own, or threads it reaches: `threads.py`), why running it ahead would not be exact (a global
RNG, torch.distributed, device use), and how it changes its state. Which family it
belongs to is the family units' call (`patcher/families/sources.py`), made after the survey.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import dotted, walk
from patcher.survey.threads import THREAD_NAMES, ThreadReach

GLOBAL_RNG_TORCH = {"rand", "randn", "randint", "randperm", "manual_seed", "bernoulli", "multinomial", "normal", "seed"}
GLOBAL_RNG_NUMPY_OK = {"Generator", "PCG64", "default_rng", "RandomState", "SeedSequence", "Philox", "MT19937", "SFC64", "BitGenerator"}


@dataclass
class LoaderClass:
    """A class that defines `next_batch`.

    Which family it is of, and so how it is prefetched, is the families' verdict
    (`patcher/families/verdicts.py`), never stored here. related: the class and the script's classes it builds
    (TokenStream), which share its state and its risks. called: the last names of the
    calls made in those classes (`Thread`, `Generator`, `TokenStream`).
    next_batch_params: parameter names after `self`. init_params: the same of
    `__init__`. device_index: position (after `self`) of the `__init__` parameter that
    takes the device, or None; device_attr: the `self` attribute it is kept in.
    h2d_calls: the `<expr>.to(self.<device attr>, non_blocking=True)` nodes in
    `next_batch`. reshape_only: index of a `next_batch` parameter used only as the
    trailing dimension of `.reshape(-1, p)` of every returned tensor, or None.
    threaded: the class uses threads: its own, or threads its code reaches (`threads`);
    whether it prefetches is the families' verdict (`Verdicts.prefetches`: threaded, or a
    family that prefetches by design). threads: where its methods reach a thread outside its own
    classes (a module-level helper that starts one, a module-level executor, a
    `threading.Thread` subclass of the script), as the refusal says it, or None; left
    None when its own classes create threads. unsafe: why prefetching
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
    related: list[cst.ClassDef] = field(default_factory=list)
    called: set[str] = field(default_factory=set)
    next_batch_params: list[str] = field(default_factory=list)
    init_params: list[str] = field(default_factory=list)
    device_index: int | None = None
    device_attr: str | None = None
    h2d_calls: list[cst.Call] = field(default_factory=list)
    reshape_only: int | None = None
    threaded: bool = False
    threads: str | None = None
    unsafe: str | None = None
    in_place: str | None = None
    writes_arrays: str | None = None
    cuda_in_next_batch: bool = False


def survey_loader(cls: cst.ClassDef, classes: dict[str, cst.ClassDef], line: int, reach: ThreadReach | None = None) -> LoaderClass:
    """The family-independent facts of the loader class `cls` (at 1-based `line`);
    classes: the script's module-level classes by name; reach: the script's
    `ThreadReach`, to find threads the loader reaches outside its classes (None: only
    its own are seen). Its family is the families' verdict (`sources.judge`)."""
    info = LoaderClass(name=cls.name.value, node=cls, line=line)
    next_batch = method(cls, "next_batch")
    info.next_batch_params = _params(next_batch)[1:]
    init = method(cls, "__init__")
    info.init_params = _params(init)[1:] if init is not None else []
    if "device" in info.init_params:
        info.device_index = info.init_params.index("device")
        info.device_attr = _attr_assigned_from(init, "device")
    # Classes the loader builds (TokenStream) share its state and its risks.
    info.related = related = [cls] + [classes[n] for n in _called_names(cls) if n in classes and n != cls.name.value]
    for c in related:
        info.called |= _called_names(c)
    if not info.called & THREAD_NAMES and reach is not None:
        info.threads = reach.reached(related)
    info.threaded = bool(info.called & THREAD_NAMES) or info.threads is not None
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


def global_rng(called: str) -> str | None:
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
            rng = global_rng(name)
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
    return [n for n in walk(next_batch) if isinstance(n, cst.Call) and m.matches(n, pattern)]


def _reshape_only_param(fn: cst.FunctionDef, params: list[str]) -> int | None:
    """Index of a parameter used only as `n` in `<v> = <expr>.reshape(-1, n)` whose `v`s are all that is returned."""
    returns = [n for n in walk(fn) if isinstance(n, cst.Return)]
    if len(returns) != 1 or returns[0].value is None:
        return None
    elements = _returned_names(returns[0].value)
    if elements is None:
        return None
    for index, param in enumerate(params):
        refs = [n for n in walk(fn.body) if isinstance(n, cst.Name) and n.value == param]
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


def method(cls: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    """The method `name` defined in the body of `cls`, or None."""
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
