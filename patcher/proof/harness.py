"""Load a training script outside its run, and stand in for what its `main()` would have.

`load_module` imports a script's source as a module that is not `__main__` (so its
`main()` does not run), registered in `sys.modules` before it executes (the dataclass
import trap), with imports that are not installed (flash_attn_interface, ...)
replaced by stubs; `load_definitions` imports only the definitions of a script that
trains at top level. `SimulatedDist` answers `torch.distributed`'s rank and world
size for one rank of a simulated world; `hparams_for` makes each rank's
Hyperparameters instance, its data paths pointed at the synthetic shards.
How a script builds its loader is read by `patcher.proof.recipes`; CUDA stand-ins
for a host are in `patcher.proof.host_cuda`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import sys
import traceback
import types

import libcst as cst
import libcst.matchers as m
import torch

from patcher.check.stubs import StubFinder
from patcher.read.source import read_script


_PREFIX = "_patch_prefetch_script_"  # the names of loaded script modules: _PREFIX + a count
_counter = itertools.count()
# module name -> the atexit hooks its code registered (the runtime's producer shutdown, the
# script's own). Held here, not by atexit, so that `unload` can run them and let the module
# go; those of a module never unloaded run at this process's exit, as atexit would have.
_exit_hooks: dict[str, list] = {}


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


@contextlib.contextmanager
def exit_hooks_held(name: str):
    """Context in which `atexit.register` records in `_exit_hooks` a hook that module
    `name` defines (see `unload`). A library's hook, registered by an import the script
    makes first (multiprocessing's, torch's), is registered with atexit as usual: it
    belongs to the process, not to the script."""
    hooks = _exit_hooks.setdefault(name, [])
    register = atexit.register

    def hold(func, *args, **kwargs):
        if getattr(func, "__module__", None) != name:
            return register(func, *args, **kwargs)
        hooks.append((func, args, kwargs))
        return func

    with swapped(lambda: atexit.register, lambda f: setattr(atexit, "register", f), hold):
        yield


def _run_exit_hooks(name: str) -> None:
    """Run, once, the exit hooks module `name` registered, last registered first as
    atexit does; a hook that raises is ignored, as atexit would print and go on."""
    for func, args, kwargs in reversed(_exit_hooks.pop(name, [])):
        try:
            func(*args, **kwargs)
        except Exception:
            pass


def unload(module: types.ModuleType) -> None:
    """Undo `load_module`/`load_definitions` for `module`: run the exit hooks its code
    registered (its prefetchers shut down, their children reaped) and take it out of
    `sys.modules`, so that what it held (open shard memmaps, shared slots) can be
    released before this process's exit: at once where nothing else refers to it, else
    by the next cyclic collection (its functions and their globals form cycles;
    `scripts_unloaded` collects)."""
    _run_exit_hooks(module.__name__)
    if sys.modules.get(module.__name__) is module:
        del sys.modules[module.__name__]


@contextlib.contextmanager
def scripts_unloaded():
    """Context (or, called, a decorator) at whose end every script module loaded inside it
    is `unload`ed and collected. For a process that loads many scripts (a test run, a tree
    verified in one process): each script's open shards would otherwise stay open until
    it exits. As a decorator it collects after the function's frame is gone, so the
    function's own references do not keep the scripts."""
    before = loaded_script_names()
    try:
        yield
    finally:
        for name in loaded_script_names() - before:
            unload(sys.modules[name])
        gc.collect()  # the cycles of their functions and globals: a loader's __del__ runs with its globals whole


def loaded_script_names() -> set[str]:
    """The `sys.modules` names of the script modules loaded and not unloaded."""
    return {name for name in sys.modules if name.startswith(_PREFIX)}


@atexit.register
def _run_exit_hooks_of_scripts_still_loaded() -> None:
    """At this process's exit: the hooks of the modules never unloaded, as atexit would have run them."""
    for name in list(_exit_hooks):
        _run_exit_hooks(name)


def _new_module(filename: str) -> types.ModuleType:
    """A fresh script module, registered in `sys.modules` before its code runs:
    dataclasses look the module up there."""
    module = types.ModuleType(f"{_PREFIX}{next(_counter)}")
    module.__file__ = filename
    sys.modules[module.__name__] = module
    return module


def load_module(source: str, filename: str) -> types.ModuleType:
    """Import `source` as a fresh module (not `__main__`); `unload` lets it go. Raises
    what the script raises."""
    module = _new_module(filename)
    with stub_missing_imports(filename), exit_hooks_held(module.__name__):
        try:
            exec(compile(source, filename, "exec"), module.__dict__)
        except Exception as error:
            _say_where(error, filename)
            raise
    return module


def _say_where(error: Exception, filename: str) -> None:
    """Add to the message of `error`, raised while the script compiled as `filename` was
    imported, the script's line that raised it and, for a file or directory it did not
    find (a script that locates its repository or data from its own path), what to do.
    Only an exception whose arguments are one message is changed."""
    line = _script_line(error, filename)
    if line is None or len(error.args) != 1 or not isinstance(error.args[0], str):
        return
    advice = ""
    if isinstance(error, OSError):
        advice = f"; verify imports both scripts as if they stood at {filename}: run it on the script where it runs, in its repository"
    error.args = (f"{error.args[0]} (line {line}, run when the script is imported{advice})",)


def _script_line(error: BaseException, filename: str) -> int | None:
    """The line of the innermost frame of `error`'s traceback that runs the script
    compiled as `filename`, or None where no frame does."""
    lines = [line for frame, line in traceback.walk_tb(error.__traceback__) if frame.f_code.co_filename == filename]
    return lines[-1] if lines else None


def load_definitions(source: str, filename: str) -> types.ModuleType:
    """Import the definitions of a script that trains at top level, one statement at a time.

    `source` is `check.definitions_only(...)`: imports, functions, classes and cheap
    assignments. A cheap assignment that needs what was left out (`x = int(os.environ
    ["RANK"])`, `opts = [optimizer1, optimizer2]`) is skipped: `IteratorRecipe.evaluate`
    evaluates the names an expression needs from the original script when it needs them.
    Raises what an import, function or class definition raises.
    """
    module = _new_module(filename)
    parsed = cst.parse_module(source)
    with stub_missing_imports(filename), exit_hooks_held(module.__name__):
        for stmt in parsed.body:
            code = compile(parsed.with_changes(body=[stmt]).code, filename, "exec")
            try:
                exec(code, module.__dict__)
            except Exception as error:
                if m.matches(stmt, m.SimpleStatementLine(body=[m.Assign() | m.AnnAssign() | m.AugAssign() | m.Expr()])):
                    continue  # a cheap assignment that needs what was left out: skipped
                reason = _unbound_name_reason(error, parsed.code_for_node(stmt), filename, len(parsed.header)) if isinstance(error, NameError) else None
                if reason is None:
                    raise
                raise NameError(reason, name=error.name) from None
    return module


def _unbound_name_reason(error: NameError, statement: str, filename: str, header_lines: int = 0) -> str | None:
    """Where a definition of the script at `filename` (a top-level function or class,
    `statement` its code) reads a name that is not bound when it runs, and what to do:
    nothing in the script binds the name before that line (running the script fails there
    too), or only a statement that runs with the training does (`if master_process:
    run_id = ...`, which a definitions-only import does not run). None where the
    statement or the line cannot be found in the script (a wrapped payload that differs).
    header_lines: the comment and blank lines compiled above `statement`."""
    name = getattr(error, "name", None)
    line_in_script = _script_line(error, filename)
    offset = line_in_script - header_lines if line_in_script is not None else None  # the statement's own line
    try:
        original = cst.parse_module(read_script(filename).source)
    except Exception:  # not readable as it stands: the plain NameError
        return None
    line = 1 + len(original.header)  # the comment and blank lines above the first statement
    binding = None
    for top in original.body:
        code = original.code_for_node(top)
        if code == statement:
            where = line + (offset - 1 if offset is not None else len(top.leading_lines))
            label = f"`{'class' if isinstance(top, cst.ClassDef) else 'def'} {top.name.value}`" if isinstance(top, (cst.ClassDef, cst.FunctionDef)) else "a top-level statement"
            if binding is None:
                return f"name '{name}' is not defined: line {where} ({label}) reads it before any statement of the script binds it, so running the script fails there too; bind `{name}` above line {where}"
            return f"name '{name}' is not defined: line {where} ({label}) reads it, and only line {binding}, which runs with the training (verify imports the definitions of a script that trains at top level), binds it; bind `{name}` above line {where} with a value that does not need the run"
        if binding is None and name is not None and _binds(top, name):
            binding = line + len(top.leading_lines)
        line += code.count("\n")
    return None


def _binds(statement: cst.CSTNode, name: str) -> bool:
    """Whether a top-level statement binds `name` in the module (an assignment, an import,
    a definition, directly or in an if / for / with / try block; not inside a function or class)."""
    if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
        return statement.name.value == name
    target = m.Name(name)
    bound = m.AssignTarget(target=target) | m.AnnAssign(target=target) | m.AugAssign(target=target) | m.For(target=target) | m.AsName(name=target) | m.ImportAlias(name=target, asname=None)
    nested = {id(node) for inner in m.findall(statement, m.FunctionDef() | m.ClassDef()) for node in m.findall(inner, bound)}
    return any(id(node) not in nested for node in m.findall(statement, bound))


@contextlib.contextmanager
def environment(values: dict):
    """Environment variables set to `values` inside, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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


def hparams_for(hyperparameters, module, world_size: int, data_dir: str):
    """`rank -> Hyperparameters instance` for a simulated world, its train_files on `data_dir`.

    hyperparameters: the survey's `Hyperparameters` fact of the script (None: the script
    has none, and a bare object stands in for it); module: the loaded script.
    """
    cls = getattr(module, hyperparameters.name) if hyperparameters is not None else None
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
