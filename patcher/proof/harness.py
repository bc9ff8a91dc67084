"""Drive a script's own training loader outside its training loop (for verify and bench).

`load_module` imports a script's source as a module that is not `__main__` (so its
`main()` does not run), registered in `sys.modules` before it executes (the dataclass
import trap), with imports that are not installed (flash_attn_interface, ...)
replaced by stubs. `LoaderRecipe` knows, from the survey, how the script builds its
training loader and calls `next_batch`; `build` and `arguments` evaluate the script's
own expressions in a namespace that stands in for the enclosing function: the
Hyperparameters instance as `args`/`h`, `rank`, `world_size`, `device`, and the
run constants the expressions name (e.g. `grad_accum_steps = 8 // world_size`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import types
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
import torch

from patcher.check.stubs import StubFinder
from patcher.cst_walk import small_statements
from patcher.survey.survey import Construction, Survey, survey

_counter = itertools.count()


class HarnessError(Exception):
    """The loader cannot be driven outside the script (one line, says why)."""


@contextlib.contextmanager
def stub_missing_imports(script: str):
    """Context in which the missing packages that code compiled as `script` imports are stubbed; yields the finder."""
    finder = StubFinder(script)
    sys.meta_path.append(finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)


def load_module(source: str, filename: str) -> types.ModuleType:
    """Import `source` as a fresh module (not `__main__`). Raises what the script raises."""
    name = f"_patch_prefetch_script_{next(_counter)}"
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # before executing: dataclasses look the module up here
    with stub_missing_imports(filename):
        exec(compile(source, filename, "exec"), module.__dict__)
    return module


def load_definitions(source: str, filename: str) -> types.ModuleType:
    """Import the definitions of a script that trains at top level, one statement at a time.

    `source` is `check.definitions_only(...)`: imports, functions, classes and cheap
    assignments. A cheap assignment that needs what was left out (`x = int(os.environ
    ["RANK"])`, `opts = [optimizer1, optimizer2]`) is skipped: `IteratorRecipe.evaluate`
    evaluates the names an expression needs from the original script when it needs them.
    Raises what an import, function or class definition raises.
    """
    name = f"_patch_prefetch_script_{next(_counter)}"
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    parsed = cst.parse_module(source)
    with stub_missing_imports(filename):
        for stmt in parsed.body:
            code = compile(parsed.with_changes(body=[stmt]).code, filename, "exec")
            try:
                exec(code, module.__dict__)
            except Exception:
                if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign() | m.AnnAssign() | m.AugAssign() | m.Expr()])):
                    raise
    return module


@contextlib.contextmanager
def cuda_as_host(notes: list[str]):
    """Without CUDA, `.cuda()` and `.to("cuda", ...)` keep tensors on the host (values are the same).

    For data generators that hard-code their H2D copy; with CUDA present, nothing changes.
    """
    if torch.cuda.is_available():
        yield
        return
    original_cuda, original_to = torch.Tensor.cuda, torch.Tensor.to

    def host_cuda(self, *args, **kwargs):
        return self

    def host_to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    torch.Tensor.cuda, torch.Tensor.to = host_cuda, host_to
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.Tensor.to = original_cuda, original_to
        notes.append("no CUDA here: the generator's .cuda() / .to('cuda') copies kept on the host (values are the same)")


def _is_cuda(value) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


@dataclass
class LoaderRecipe:
    """How a script builds and feeds its training loader.

    constructions: the training loader's construction sites in source order (the
    first builds it, later ones rebuild it). call: the training loop's `next_batch`
    call. varying: indices of per-step `next_batch` arguments.
    """

    survey: Survey
    constructions: list[Construction]
    call_args: list[str]
    varying: list[int] = field(default_factory=list)
    call_scope: object = None
    # "`name` = <code> (line N), ..." for every name evaluated from its one unconditional
    # assignment among several (a fresh run's value), for verify to report.
    assumed: list[str] = field(default_factory=list)

    @classmethod
    def from_source(cls, source: str) -> "LoaderRecipe":
        """Raises HarnessError when the script has no training loader with a next_batch call."""
        surveyed = survey_of(source)
        sites = sorted(surveyed.training_constructions(), key=lambda c: c.line)
        if not sites:
            reasons = "; ".join(sorted({c.reason for c in surveyed.constructions if c.reason})) or "no training loader found"
            raise HarnessError(reasons)
        # One variable's constructions: the one built most often (the warm-up rebuild),
        # the later one of a tie; a calibration function's `loader = ...` stays out.
        groups: dict = {}
        for site in sites:
            groups.setdefault((site.target, id(site.binding)), []).append(site)
        sites = max(reversed(list(groups.values())), key=len)
        calls = surveyed.calls_on(sites[0])
        call = calls[-1]  # the main loop's call comes after the warm-up's
        varying = [i for i, const in enumerate(call.constant) if not const]
        scope = surveyed.collector.scope_of.get(call.scope, surveyed.collector.module_scope)
        return cls(surveyed, sites, call.args, varying, scope)

    def namespace(self, module: types.ModuleType, hparams, rank: int, world_size: int, device) -> dict:
        """Names the construction and call expressions may use, as `main()` would have them."""
        ns = dict(module.__dict__)
        ns.update(args=hparams, h=hparams, hparams=hparams, rank=rank, world_size=world_size, local_rank=0, device=device, distributed=world_size > 1)
        if "grad_accum_steps" not in ns:
            # the script's own computation where the call's function makes one
            # (`grad_accum_steps = 8 // world_size`), else the Hyperparameters', else 8 // world_size
            try:
                if self.call_scope is None or self.call_scope.resolve("grad_accum_steps") in (None, self.survey.collector.module_scope):
                    raise HarnessError("no local grad_accum_steps")
                value = evaluate_script_code(self.survey, "grad_accum_steps", ns, self.call_scope)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise HarnessError("not a positive int")
            except (HarnessError, Exception):
                value = getattr(hparams, "grad_accum_steps", max(1, 8 // world_size))
            ns["grad_accum_steps"] = value
        return ns

    def build(self, site: Construction, ns: dict):
        """Evaluate construction `site`'s expression (the script's own code) in `ns`."""
        return self._eval_constant(self.survey.module.code_for_node(site.call), ns, scope=site.binding)

    def evaluate(self, code: str, ns: dict, scope=None):
        """Evaluate script code in `ns`, resolving run-constant locals through `scope`."""
        return self._eval_constant(code, ns, scope=scope)

    def arguments(self, ns: dict, step: int, seq_lens: list[int] | None = None) -> tuple:
        """`next_batch` arguments for `step`: run constants evaluated; a per-step one
        cycles every 5 calls through `seq_lens` (a sequence length) or through the
        Hyperparameters batch size and half of it (a token count)."""
        values = []
        for index, code in enumerate(self.call_args):
            if index in self.varying:
                schedule = seq_lens if "seq" in code or "len" in code else None
                hp = ns.get("args", ns.get("h"))
                if "tok" in code and hasattr(hp, "train_batch_tokens"):
                    schedule = [hp.train_batch_tokens, hp.train_batch_tokens // 2]
                if not schedule:
                    # neither a sequence length nor a token count (`grad_accum_steps =
                    # math.gcd(...)`): its value in a fresh run, from its assignment
                    try:
                        values.append(self._eval_constant(code, ns))
                        continue
                    except HarnessError:
                        raise HarnessError(f"next_batch argument `{code}` changes during the run; no schedule for it") from None
                values.append(schedule[(step // 5) % len(schedule)])
            else:
                values.append(self._eval_constant(code, ns))
        return tuple(values)

    def _eval_constant(self, code: str, ns: dict, scope=None):
        """Evaluate a run-constant expression; a local it names is evaluated from its one assignment."""
        return evaluate_script_code(self.survey, code, ns, scope if scope is not None else self.call_scope, assumed=self.assumed)


def evaluate_script_code(surveyed: Survey, code: str, ns: dict, scope, depth: int = 0, assumed: list[str] | None = None):
    """Evaluate the script's `code` in `ns`. A name missing from `ns` that has exactly one
    assignment where `scope` resolves it is evaluated first, from that assignment (and
    stored in `ns`); of several assignments, the one unconditional assignment is taken,
    and `assumed` (when given) gets "`name` = <code> (line N)". Raises HarnessError when
    a name cannot be found that way."""
    try:
        return eval(code, ns)
    except NameError as error:
        name = getattr(error, "name", None)
        owner = scope.resolve(name) if name and scope is not None else None
        if owner is None and name and depth <= 8 and _import_binding(surveyed, scope, name, ns):
            return evaluate_script_code(surveyed, code, ns, scope, depth + 1, assumed)
        bindings = owner.bindings.get(name, []) if owner is not None else []
        if len(bindings) > 1:
            # the one assignment that runs unconditionally, directly in the module or
            # function body: a fresh run's value (a top-level script's `bs =
            # args.schedule[0]` before the loop that reassigns it; `resume_tokens_consumed
            # = 0` before `if args.resume_from:` changes it)
            bindings = [b for b in bindings if b[0] == "assign" and b[1] is not None and _is_unconditional_assignment(surveyed, owner, b[1])]
            if len(bindings) == 1 and assumed is not None:
                value = bindings[0][1]
                assumed.append(f"`{name}` = {surveyed.module.code_for_node(value)} (line {surveyed.line_of(value)}), its unconditional assignment")
        if depth > 8 or len(bindings) != 1 or bindings[0][1] is None:
            raise HarnessError(f"cannot evaluate `{code}` outside the script: {error}") from None
        ns[name] = evaluate_script_code(surveyed, surveyed.module.code_for_node(bindings[0][1]), ns, owner, depth + 1, assumed)
        if owner is surveyed.collector.module_scope:
            _module_globals(ns).setdefault(name, ns[name])  # the script's functions read it there
        return evaluate_script_code(surveyed, code, ns, scope, depth + 1, assumed)


def _module_globals(ns: dict) -> dict:
    """The globals of the module `ns` was copied from (its `__name__` in sys.modules), else `ns`."""
    module = sys.modules.get(ns.get("__name__", ""))
    return module.__dict__ if module is not None else ns


def _import_binding(surveyed: Survey, scope, name: str, ns: dict) -> bool:
    """Bind `name` in `ns` by running the script's own import statement that binds it,
    where Python would find it from `scope`: an import in the enclosing function bodies
    (innermost first; `import numpy as np` inside `main()`, under a `try:` or an `if`),
    else one at module level that the import of the module did not run (under `if
    __name__ == "__main__":` or another guard). An import that raises ImportError is
    skipped for the next one (the guard's fallback). Returns True when `name` is bound."""
    owners, missing = [], None
    while scope is not None:
        owners.append(scope.node if scope.node is not None else surveyed.module)
        scope = scope.parent
    for owner in owners or [surveyed.module]:
        for statement in _imports_in_body(owner):
            if name not in _names_imported(statement):
                continue
            try:
                exec(compile(cst.Module([cst.SimpleStatementLine([statement])]).code, "<script import>", "exec"), ns)
            except ImportError as error:
                missing = missing or error
                continue
            if name in ns:
                if owner is surveyed.module:
                    _module_globals(ns).setdefault(name, ns[name])  # a module-level import the import did not run
                return True
    if missing is not None:
        raise missing
    return False


class _BodyImports(cst.CSTVisitor):
    """Import statements of one body, in source order, not those of nested functions or classes."""

    def __init__(self, root: cst.CSTNode):
        self.root, self.found = root, []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return node is self.root

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return node is self.root

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Import(self, node: cst.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not isinstance(node.names, cst.ImportStar):
            self.found.append(node)


def _imports_in_body(owner: cst.CSTNode) -> list:
    visitor = _BodyImports(owner)
    owner.visit(visitor)
    return visitor.found


def _names_imported(statement) -> set[str]:
    """The names an `import` / `from ... import` statement binds."""
    names = set()
    for alias in statement.names:
        if alias.asname is not None:
            names.add(alias.asname.name.value)
        elif isinstance(statement, cst.Import):
            names.add(cst.Module([]).code_for_node(alias.name).split(".")[0])
        else:
            names.add(alias.name.value)
    return names


def _is_unconditional_assignment(surveyed: Survey, owner, value: cst.CSTNode) -> bool:
    """True when `value` is assigned by a statement directly in the body of `owner`, the
    scope holding the name (the module, or a function: not inside an if, loop or with)."""
    if owner is surveyed.collector.module_scope:
        statements = [surveyed.top_level_of(value)]
    elif isinstance(owner.node, cst.FunctionDef) and isinstance(owner.node.body, cst.IndentedBlock):
        statements = owner.node.body.body
    else:
        return False
    return any(isinstance(top, cst.SimpleStatementLine) and any(getattr(small, "value", None) is value for small in top.body) for top in statements)


def patched_constructions(source: str, recipe: LoaderRecipe, original_source: str | None = None) -> list[str]:
    """Code of the patched script's constructions that stand where the original's
    training constructions stand, in the original's order.

    An original construction is the k-th `target = call(...)` assignment to its
    variable in its function (by qualified name); its patched counterpart is the k-th
    such assignment in the same function of the patched script. Assignments inside
    what the patch injected (top-level definitions the original does not have, e.g.
    the runtime's own `loader = ...`) never count. Without `original_source`, every
    assignment of the first construction's variable to a call of its class or of an
    injected function counts. Raises HarnessError when a construction has no
    counterpart.
    """
    surveyed = survey_of(source)
    patched_module = surveyed.module
    if original_source is None:
        target = recipe.constructions[0].target
        names = {recipe.constructions[0].class_name} | _top_level_names(patched_module)
        return [
            surveyed.module.code_for_node(assign.value)
            for assign, _scope in surveyed.collector.call_assigns
            if m.matches(assign.targets[0].target, m.Name(target)) and isinstance(assign.value.func, cst.Name) and assign.value.func.value in names
        ]
    injected = _top_level_names(patched_module) - _top_level_names(recipe.survey.module)
    patched_groups = _call_assign_groups(surveyed, injected)
    original_groups = _call_assign_groups(recipe.survey, set())
    found = []
    for site in recipe.constructions:
        key = next((k for k, assigns in original_groups.items() if any(a is site.node for a in assigns)), None)
        if key is None:
            raise HarnessError(f"construction of `{site.target}` (line {site.line}) not found among the original's assignments")
        position = [id(a) for a in original_groups[key]].index(id(site.node))
        candidates = patched_groups.get(key, [])
        if len(candidates) != len(original_groups[key]):
            where = f"in {key[0]}()" if key[0] else "at module level"
            raise HarnessError(f"the patched script assigns `{site.target}` from a call {len(candidates)} times {where}, the original {len(original_groups[key])} times")
        found.append(surveyed.module.code_for_node(candidates[position].value))
    return found


def _top_level_names(module: cst.Module) -> set[str]:
    """Names a module's top-level statements define: functions, classes, assigned names, imports."""
    names = set()
    for statement in small_statements(module.body):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            names.add(statement.name.value)
        elif isinstance(statement, cst.Assign):
            for target in statement.targets:
                names.update(n.value for n in m.findall(target.target, m.Name()) if m.matches(target.target, m.Name() | m.Tuple() | m.List()))
        elif isinstance(statement, cst.AnnAssign) and isinstance(statement.target, cst.Name):
            names.add(statement.target.value)
        elif isinstance(statement, (cst.Import, cst.ImportFrom)) and not isinstance(statement.names, cst.ImportStar):
            names.update(_names_imported(statement))
    return names


def _call_assign_groups(surveyed: Survey, skip_top_level: set[str]) -> dict:
    """{(qualified function name, variable): [Assign, ...]} of `variable = call(...)`
    assignments in source order, leaving out those inside a top-level definition named
    in `skip_top_level`."""
    groups: dict = {}
    for assign, scope in surveyed.collector.call_assigns:
        target = assign.targets[0].target
        if len(assign.targets) != 1 or not isinstance(target, cst.Name):
            continue
        top = surveyed.top_level_of(assign)
        if isinstance(top, (cst.FunctionDef, cst.ClassDef)) and top.name.value in skip_top_level:
            continue
        if isinstance(top, cst.SimpleStatementLine) and _top_level_names(cst.Module([top])) & skip_top_level:
            continue
        groups.setdefault((_qualified_name(scope), target.value), []).append(assign)
    return groups


def _qualified_name(scope) -> str:
    """`outer.inner` for a function scope (classes included), "" for the module."""
    parts = []
    while scope is not None and scope.node is not None:
        parts.append(scope.node.name.value)
        scope = scope.parent
    return ".".join(reversed(parts))


@functools.lru_cache(maxsize=4)
def survey_of(source: str) -> Survey:
    """The survey of `source` (str), parsed and surveyed once per source text: a
    `Survey` is read-only, so verify's recipes and validation pairs share one."""
    return survey(cst.parse_module(source))


@contextlib.contextmanager
def swapped(read, write, value):
    """`write(value)` inside, the value `read()` gave before written back after.

    E.g. `swapped(os.getcwd, os.chdir, path)`, `swapped(torch.get_num_threads,
    torch.set_num_threads, 1)`.
    """
    previous = read()
    write(value)
    try:
        yield
    finally:
        write(previous)


@contextlib.contextmanager
def host_only_pinning(notes: list[str]):
    """Without CUDA, pinning raises; make `pin_memory()` a plain copy (as it is for an
    unpinned tensor: never a view of its input) and drop `pin_memory=True` (values are the same)."""
    if torch.cuda.is_available():
        yield
        return
    originals = {name: getattr(torch, name) for name in ("empty", "zeros", "ones", "full")}
    original_pin = torch.Tensor.pin_memory

    def unpinned(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self.clone()
    for name, factory in originals.items():
        setattr(torch, name, unpinned(factory))
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original_pin
        for name, factory in originals.items():
            setattr(torch, name, factory)
        notes.append("no CUDA here: pinned-memory requests treated as plain host memory (values are the same)")


def hparams_factory(recipe: LoaderRecipe, module, world_size: int, data_dir: str):
    """`rank -> Hyperparameters instance` for a simulated world, its train_files on `data_dir`."""
    hp_info = recipe.survey.hyperparameters
    cls = getattr(module, hp_info.name) if hp_info is not None else None
    pattern = os.path.join(data_dir, "fineweb_train_*.bin")

    def make(rank: int):
        hp = cls() if cls is not None else type("Hyperparameters", (), {})()
        for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", 0)):
            _set(hp, name, value)
        point_at_shards(hp, data_dir, pattern)
        own = getattr(hp, "grad_accum_steps", None)
        if own is not None and not (isinstance(own, int) and not isinstance(own, bool) and own >= 1):
            _set(hp, "grad_accum_steps", max(1, 8 // world_size))  # not a usable count: the records' 8 // world_size
        return hp

    return make


def point_at_shards(hp, data_dir: str, pattern: str) -> None:
    """Make `hp.train_files` name the synthetic shards (an attribute, or a property of a data dir).

    Other shard patterns it holds (`input_bin`, `input_val_bin`) point at the synthetic
    train and val shards too.
    """
    for name in dir(hp):
        value = getattr(hp, name, None) if not name.startswith("_") else None
        if isinstance(value, str) and ("*" in value or value.endswith(".bin")):
            is_val = "val" in name.lower() or "val" in os.path.basename(value).lower()
            try:
                _set(hp, name, os.path.join(data_dir, "fineweb_val_*.bin") if is_val else pattern)
            except AttributeError:
                pass
    try:
        _set(hp, "train_files", pattern)
        return
    except AttributeError:
        pass
    for name in ("data_path", "data_dir", "datasets_dir", "dataset_dir"):
        if hasattr(hp, name):
            _set(hp, name, data_dir)
    if os.path.dirname(str(getattr(hp, "train_files", ""))) != data_dir:
        raise HarnessError("cannot point Hyperparameters.train_files at the synthetic shards")


def _set(obj, name, value):
    try:
        setattr(obj, name, value)
    except TypeError:  # frozen dataclass
        object.__setattr__(obj, name, value)


@dataclass
class IteratorRecipe:
    """How a script builds its training data generator, and how the patched one does.

    target: the variable (`train_loader`); original / patched: the construction
    expressions, in source order, of the original and of the patched script;
    survey: the original's survey (for the module-level names the expressions use);
    sent: the expressions that may give the values the script passes to
    `target.send(value)` (see `_sent_value_codes`), in source order.
    """

    survey: Survey
    target: str
    original: list[str]
    patched: list[str]
    sent: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # as LoaderRecipe.assumed

    @classmethod
    def from_source(cls, original: str, patched: str) -> "IteratorRecipe":
        """Raises HarnessError when the original has no training generator the patch wrapped."""
        surveyed = survey_of(original)
        sites = [i for i in surveyed.iterators if i.training]
        if not sites:
            reasons = sorted({i.reason for i in surveyed.iterators if i.reason})
            raise HarnessError("; ".join(reasons) or "no training loader or data generator found")
        target = sites[0].target
        codes = [surveyed.module.code_for_node(i.call) for i in sites if i.target == target]
        patched_survey = survey_of(patched)
        wrapped = [
            patched_survey.module.code_for_node(assign.value)
            for assign, _scope in patched_survey.collector.call_assigns
            if m.matches(assign, m.Assign(targets=[m.AssignTarget(m.Name(target))], value=m.Call(func=m.Name("_prefetch_iterator") | m.Name(sites[0].function))))
        ]
        if len(wrapped) != len(codes):
            raise HarnessError(f"the patched script builds `{target}` {len(wrapped)} times, the original {len(codes)}")
        sends = [c for i in sites if i.target == target for c in i.sends]
        return cls(surveyed, target, codes, wrapped, _sent_value_codes(surveyed, sends))

    def sent_values(self, module: types.ModuleType) -> list:
        """The values of `sent` that evaluate outside training (module-level names only)
        to something other than None, distinct, in order; the others are left out."""
        values = []
        for code in self.sent:
            try:
                value = self.evaluate(code, module)
            except HarnessError:
                continue
            if value is not None and value not in values:
                values.append(value)
        return values

    def evaluate(self, code: str, module: types.ModuleType):
        """Evaluate `code` in the module's globals; a module-level name it uses that the
        definitions-only import left out (`args = Hyperparameters()`) is evaluated from
        its one assignment in the original script first."""
        return evaluate_script_code(self.survey, code, module.__dict__, self.survey.collector.module_scope, assumed=self.assumed)


def _sent_value_codes(surveyed: Survey, sends: list[cst.Call]) -> list[str]:
    """Source of what each `target.send(value)` may pass: the argument itself, or for a
    name the values assigned to it in its scope, and both branches of a conditional
    (`(bs, seq_len) if step == k else None`); the literal None left out."""
    scopes = dict(surveyed.collector.send_calls)
    codes: list[str] = []

    def add(expr: cst.BaseExpression, scope, depth: int) -> None:
        if m.matches(expr, m.Name("None")):
            return
        if isinstance(expr, cst.IfExp):
            add(expr.body, scope, depth)
            add(expr.orelse, scope, depth)
            return
        home = scope.resolve(expr.value) if isinstance(expr, cst.Name) and depth < 3 else None
        if home is not None:
            for kind, value in home.bindings[expr.value]:
                if kind == "assign" and value is not None:
                    add(value, home, depth + 1)
            return
        code = surveyed.module.code_for_node(expr)
        if code not in codes:
            codes.append(code)

    for call in sends:
        add(call.args[0].value, scopes[call], 0)
    return codes


class SimulatedDist:
    """Stands in for `torch.distributed` in a script's globals: rank and world size of
    a simulated run, as if the process group were initialised; anything else is torch's."""

    def __init__(self, rank: int, world_size: int):
        self._rank, self._world_size = rank, world_size

    def get_rank(self, group=None) -> int:
        return self._rank

    def get_world_size(self, group=None) -> int:
        return self._world_size

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class _HostStream:
    """Stands in for `torch.cuda.Stream` on a machine without CUDA: work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostEvent:
    """Stands in for `torch.cuda.Event`: always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


# torch factories whose `device=` / `pin_memory=` a loader or the injected runtime may pass
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "empty_strided", "randint", "randperm", "from_numpy")


@contextlib.contextmanager
def cuda_on_host(notes: list[str] | None = None):
    """Inside: `torch.cuda.is_available()` is True and CUDA means host memory, so code
    that takes its CUDA path (pinned staging buffers, a copy stream, events,
    `record_stream`) runs on a CPU-only machine with the same values.

    An H2D copy (`.to("cuda")`, `.cuda()`) returns the host tensor itself, not a copy:
    a device tensor that still views its pinned staging buffer, the worst case of an
    asynchronous copy in flight, so that a staging buffer overwritten while its batch
    is in use changes that batch. `pin_memory()` returns a copy (as torch does); a
    `pin_memory=True` or `device="cuda"` argument of a factory means host memory.
    Streams and events are synchronous stand-ins. With real CUDA present nothing
    changes. Not thread-safe against other code patching torch at the same time.
    """
    if torch.cuda.is_available():
        yield False
        return
    saved_cuda = {name: getattr(torch.cuda, name, None) for name in ("is_available", "current_device", "device_count", "set_device", "synchronize", "Stream", "Event", "current_stream", "default_stream", "stream")}
    saved_tensor = {name: getattr(torch.Tensor, name) for name in ("cuda", "to", "pin_memory", "record_stream", "is_pinned")}
    saved_factories = {name: getattr(torch, name) for name in _FACTORIES if hasattr(torch, name)}
    original_to = saved_tensor["to"]

    def host_to(self, *args, **kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    def on_host(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    host_stream = _HostStream()
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream, torch.cuda.Event = _HostStream, _HostEvent
    torch.cuda.current_stream = torch.cuda.default_stream = lambda *a, **k: host_stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.to = host_to
    torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()
    torch.Tensor.record_stream = lambda self, *a, **k: None
    torch.Tensor.is_pinned = lambda self, *a, **k: True
    for name, factory in saved_factories.items():
        setattr(torch, name, on_host(factory))
    try:
        yield True
    finally:
        for name, value in saved_cuda.items():
            if value is not None:
                setattr(torch.cuda, name, value)
        for name, value in saved_tensor.items():
            setattr(torch.Tensor, name, value)
        for name, factory in saved_factories.items():
            setattr(torch, name, factory)
        if notes is not None:
            note = "CUDA path driven on host memory: is_available() True, pinned staging and copy-stream calls run, an H2D copy keeps viewing its staging buffer (the worst case of a copy in flight)"
            if note not in notes:
                notes.append(note)
