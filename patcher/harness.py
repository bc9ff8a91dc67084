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
import itertools
import os
import sys
import types
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
import torch

from patcher.stubs import StubFinder
from patcher.survey import Construction, Survey, survey

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
        surveyed = survey(cst.parse_module(source))
        sites = sorted(surveyed.training_constructions(), key=lambda c: c.line)
        if not sites:
            reasons = "; ".join(sorted({c.reason for c in surveyed.constructions if c.reason})) or "no training loader found"
            raise HarnessError(reasons)
        calls = surveyed.calls_on(sites[0])
        call = calls[-1]  # the main loop's call comes after the warm-up's
        varying = [i for i, const in enumerate(call.constant) if not const]
        scope = surveyed.collector.scope_of.get(call.scope, surveyed.collector.module_scope)
        return cls(surveyed, sites, call.args, varying, scope)

    def namespace(self, module: types.ModuleType, hparams, rank: int, world_size: int, device) -> dict:
        """Names the construction and call expressions may use, as `main()` would have them."""
        ns = dict(module.__dict__)
        ns.update(args=hparams, h=hparams, hparams=hparams, rank=rank, world_size=world_size, local_rank=0, device=device, distributed=world_size > 1)
        ns.setdefault("grad_accum_steps", getattr(hparams, "grad_accum_steps", max(1, 8 // world_size)))
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
                schedule = seq_lens
                hp = ns.get("args", ns.get("h"))
                if "tok" in code and hasattr(hp, "train_batch_tokens"):
                    schedule = [hp.train_batch_tokens, hp.train_batch_tokens // 2]
                if not schedule:
                    raise HarnessError(f"next_batch argument `{code}` changes during the run; no schedule for it")
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
        return evaluate_script_code(surveyed, code, ns, scope, depth + 1, assumed)


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


def patched_constructions(source: str, recipe: LoaderRecipe) -> list[str]:
    """Code of the patched script's constructions of the same loader variable, in order."""
    surveyed = survey(cst.parse_module(source))
    target = recipe.constructions[0].target
    names = {recipe.constructions[0].class_name, "_make_train_loader", "_prefetch_next_batch"}
    found = []
    for assign, _scope in surveyed.collector.call_assigns:
        t, func = assign.targets[0].target, assign.value.func
        if isinstance(t, cst.Name) and t.value == target and isinstance(func, cst.Name) and func.value in names:
            found.append(surveyed.module.code_for_node(assign.value))
    return found


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
    """Without CUDA, pinning raises; make `pin_memory()` the identity and drop `pin_memory=True` (values are the same)."""
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

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
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
        if hasattr(hp, "grad_accum_steps"):
            _set(hp, "grad_accum_steps", max(1, 8 // world_size))
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
        surveyed = survey(cst.parse_module(original))
        sites = [i for i in surveyed.iterators if i.training]
        if not sites:
            reasons = sorted({i.reason for i in surveyed.iterators if i.reason})
            raise HarnessError("; ".join(reasons) or "no training loader or data generator found")
        target = sites[0].target
        codes = [surveyed.module.code_for_node(i.call) for i in sites if i.target == target]
        patched_survey = survey(cst.parse_module(patched))
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
