"""Does it import? `import_smoke` loads the code in a child process under a module name
other than `__main__`, registered in `sys.modules` first (the dataclass trap), with
missing GPU-only packages stubbed; a script that trains at top level is cut before its
statements that do work, everywhere in the file (`runnable_part`; `definitions_only` for verify).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping


import libcst as cst
import libcst.matchers as m

from patcher import cst_walk
from patcher.cst_walk import dotted
from patcher.check.compile_check import EMPTY, last_line, parse_known


_BOM = "\ufeff"


@dataclass
class ImportResult:
    """Outcome of the import smoke test.

    ok: what ran (`ran` of `total` top-level statements) ran without an exception.
    stubbed: full names of the missing modules replaced by stubs, in import order
    (e.g. ["flash_attn_interface", "some_pkg", "some_pkg.sub"]). total, ran: the
    script's top-level statements and how many of them the smoke ran; skipped: the
    statements it left out (a script that trains at top level, with no
    `if __name__ == "__main__":`), `"line N: <first line>"` each (`Runnable`).
    error: one line, "ExcType: message (line N in func)", or why it could not run.
    seconds: wall time of the child process. line: line of the error in the script
    (payload lines for a wrapped script), None when unknown or ok.
    """

    ok: bool
    stubbed: list[str] = field(default_factory=list)
    total: int | None = None
    ran: int | None = None
    skipped: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    line: int | None = None
    note: str | None = None
    # the path the script was imported as (its `__file__` and `sys.argv[0]`): where it stands
    as_path: str | None = None

    @property
    def partial(self) -> bool:
        """Some top-level statements were not run (`skipped`)."""
        return bool(self.skipped)

    def as_dict(self) -> dict:
        """JSON-ready dict: ok, partial, total, ran, skipped, stubbed, error, line, seconds, note, as_path."""
        return {
            "note": self.note,
            "ok": self.ok,
            "partial": self.partial,
            "total": self.total,
            "ran": self.ran,
            "skipped": list(self.skipped),
            "stubbed": list(self.stubbed),
            "error": self.error,
            "line": self.line,
            "seconds": round(self.seconds, 3),
            "as_path": self.as_path,
        }


# --------------------------------------------------------------------------- import smoke

# Runs in a child interpreter (the running one, which has torch). argv: script, module name, as_path.
_IMPORT_RUNNER = "import sys; from patcher.check.smoke_child import run_and_report; run_and_report(sys.argv[1], sys.argv[2], sys.argv[3])"

# Tree mode: fork the import smoke from a process that has torch imported already
# (saves the interpreter start and the ~1 s torch import per file).
_FORKED_SMOKE = False


def use_forked_smoke() -> None:
    """Import torch here and fork later import smokes from this process (Linux, tree mode).

    Only for processes that do nothing else with torch: a fork copies the parent's
    state, and a parent with CUDA or OpenMP threads running must not fork.
    """
    global _FORKED_SMOKE
    if hasattr(os, "fork"):
        # Imported once, before the forks: torch, and the compiler stack that scripts
        # touch at import (`torch._dynamo.config`, `torch._inductor.config`), ~1.5 s each time.
        for name in ("torch", "torch._dynamo", "torch._inductor.compile_fx"):
            try:
                importlib.import_module(name)
            except Exception:
                pass
        _FORKED_SMOKE = True


# A child started ahead of its script (`prewarm`): it imports torch (what every training
# script imports first; not the compiler stack, which only some touch), then reads one JSON line [script, module name, as_path, cwd] on stdin and runs
# the import runner on it, as a fresh child would.
_WARM_RUNNER = (
    "import importlib, json, os, sys\n"
    "try:\n    importlib.import_module('torch')\nexcept Exception:\n    pass\n"
    "line = sys.stdin.readline()\n"
    "if line:\n"
    "    script, name, as_path, cwd = json.loads(line)\n"
    "    os.chdir(cwd)\n"
    "    from patcher.check.smoke_child import run_and_report\n"
    "    run_and_report(script, name, as_path)\n"
)
_warm: subprocess.Popen | None = None
_running: set[subprocess.Popen] = set()  # import children now waited on (by a check thread)


def prewarm() -> None:
    """Start the next import smoke's child now, so that its interpreter start and torch
    import (seconds) run while the caller is still patching. The next `import_smoke` in
    this process hands its script to that child (its timeout counts from then);
    `discard_warm` ends it when no import smoke comes. Not in tree mode, which forks its
    smokes from a process that has torch imported already (`use_forked_smoke`)."""
    global _warm
    if _warm is None and not _FORKED_SMOKE:
        _warm = subprocess.Popen(
            [sys.executable, "-c", _WARM_RUNNER],
            env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )


def discard_warm() -> None:
    """End the child `prewarm` started, if no import smoke took it."""
    global _warm
    proc, _warm = _warm, None
    if proc is not None:
        _kill_group(proc)


def kill_running() -> None:
    """SIGKILL every import child now running (and what it started), and the prewarmed one.
    For a Ctrl-C in the main thread while a check thread waits on the import smoke: the
    thread's wait then ends at once instead of at the smoke's timeout."""
    for proc in list(_running):
        _kill_tree(proc.pid)
    discard_warm()


def _take_warm(script: str, module_name: str, cwd: str, as_path: str) -> subprocess.Popen | None:
    """The prewarmed child, given its script, or None (none, or it died)."""
    global _warm
    proc, _warm = _warm, None
    if proc is None:
        return None
    try:
        proc.stdin.write((json.dumps([script, module_name, as_path, cwd]) + "\n").encode("utf-8"))
        proc.stdin.flush()
        return proc
    except OSError:
        _kill_group(proc)
        return None


def import_smoke(source: str, filename: str, timeout: float = 60.0, known: Mapping[str, cst.Module] = EMPTY, as_path: str | os.PathLike | None = None) -> ImportResult:
    """Import `source` in a child process of the running Python and report what happened.

    source: the code (the payload for a wrapped script). filename: its name; the code
    is written to a fresh temporary directory as `<stem>.py` and run there (the working
    directory), under the module name `_smoke_<stem>`, never `__main__`, registered in
    `sys.modules` before it executes. Missing packages imported by the script are stubbed
    (`stubbed`). Without an `if __name__ == "__main__":` guard only the leading
    definitions run (`skipped`). timeout: seconds before the child, its process
    group and every process it started (even in a new session) are killed; the result
    then says "timed out after N s". Processes the script starts and leaves running are
    killed when the import ends. Never raises for problems in the script. known: as
    for `_parse`. as_path: where the script stands (default `filename`): its `__file__`
    and `sys.argv[0]` during the import, absolute, so that a script that finds its data
    from its own location (`Path(__file__).resolve().parents[3]`) sees the place it is
    meant to run from, not the temporary copy (`as_path` of the result).
    """
    as_path = os.path.abspath(str(filename if as_path is None else as_path))
    source = source[1:] if source.startswith(_BOM) else source
    runnable = runnable_part(source, known)
    body = runnable.code
    stem = _safe_stem(filename)
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-smoke-") as tmp:
        script = os.path.join(tmp, stem + ".py")
        with open(script, "w", encoding="utf-8", newline="") as f:
            f.write(body)
        run = _fork_child if _FORKED_SMOKE else _run_child
        result = run(script, f"_smoke_{stem}", tmp, timeout, as_path)
    result.total, result.ran, result.skipped = runnable.total, runnable.ran, runnable.skipped
    result.as_path = as_path
    return result


def _safe_stem(filename: str) -> str:
    stem = Path(str(filename)).stem
    stem = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)
    return stem if stem and not stem[0].isdigit() else f"script_{stem}"


def _run_child(script: str, module_name: str, cwd: str, timeout: float, as_path: str) -> ImportResult:
    """Run the import runner on `script`; kill its process group after `timeout` seconds."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    proc = _take_warm(script, module_name, cwd, as_path)
    if proc is None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _IMPORT_RUNNER, script, module_name, as_path],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    _running.add(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return ImportResult(False, error=f"timed out after {timeout:g} s", seconds=time.monotonic() - start)
    except BaseException:  # Ctrl-C: the child and what it started go too
        _kill_group(proc)
        raise
    finally:
        _running.discard(proc)
    return _import_result(out, time.monotonic() - start, f"import child exited with code {proc.returncode} and no result: {last_line(err)}")


def _import_result(out: bytes, seconds: float, no_result: str) -> ImportResult:
    """The ImportResult in the child's last JSON line; `no_result` is the error without one."""
    reply = _last_json(out)
    if reply is None:
        return ImportResult(False, error=no_result, seconds=seconds)
    return ImportResult(
        ok=bool(reply.get("ok")),
        stubbed=list(reply.get("stubbed") or []),
        error=reply.get("error"),
        seconds=seconds,
        line=reply.get("line"),
    )


def _fork_child(script: str, module_name: str, cwd: str, timeout: float, as_path: str) -> ImportResult:
    """`_run_child`, forked from this process instead of a fresh interpreter."""
    from patcher.check import smoke_child

    start = time.monotonic()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own session, output discarded, one JSON line back
        try:
            os.close(read_end)
            os.setsid()
            smoke_child.become_subreaper()
            os.chdir(cwd)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            smoke_child.report(smoke_child.smoke_import(script, module_name, as_path), write_end)
        finally:
            os._exit(1)
    os.close(write_end)
    data = b""
    # poll, not select: select refuses descriptors above FD_SETSIZE (1024), which a host process may hold
    report = select.poll()
    report.register(read_end, select.POLLIN)
    try:
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0 or not report.poll(left * 1000):
                _kill_tree(pid)
                os.waitpid(pid, 0)
                return ImportResult(False, error=f"timed out after {timeout:g} s", seconds=time.monotonic() - start)
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            data += chunk
    except BaseException:  # Ctrl-C: the child and what it started go too
        _kill_tree(pid)
        os.waitpid(pid, 0)
        raise
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return _import_result(data, time.monotonic() - start, f"import child exited with status {status} and no result")


def _kill_tree(pid: int) -> None:
    """SIGKILL the child `pid`, its process group and every process descended from it.

    The child is stopped first, so that it starts nothing new, and is a subreaper
    (`smoke_child.become_subreaper`), so processes that left its group with `setsid`
    are still found among its descendants.
    """
    from patcher.check.smoke_child import kill_descendants

    try:
        os.kill(pid, signal.SIGSTOP)
    except OSError:
        pass
    kill_descendants(pid)
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child, its process group and its descendants (`_kill_tree`), then reap it."""
    _kill_tree(proc.pid)
    try:
        proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _last_json(out: bytes) -> dict | None:
    lines = [ln for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        reply = json.loads(lines[-1])
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


# --------------------------------------------------------------------------- top-level training

# Calls that are cheap and side-effect free enough to run while importing definitions.
_CHEAP_CALLS = frozenset(
    {
        "os.environ.get", "environ.get", "os.getenv", "getenv",
        "int", "float", "str", "bool", "bytes", "tuple", "list", "dict", "set", "frozenset",
        "len", "min", "max", "abs", "round", "range", "object",
        "Path", "pathlib.Path", "os.path.join", "os.path.dirname", "os.path.basename",
        "os.path.abspath", "os.path.expanduser",
        "TypeVar", "typing.TypeVar", "namedtuple", "collections.namedtuple", "NamedTuple",
        "field", "dataclasses.field", "re.compile", "logging.getLogger",
        # run names built at the top of modded-nanogpt scripts: run_id = f"... {uuid.uuid4()}"
        "uuid.uuid4", "uuid.uuid1", "time.time", "repr",
    }
)


@dataclass
class Runnable:
    """What the import smoke runs of a script, and what it leaves out.

    code: the text to import: the whole source, or, for a script that trains at top
    level, every top-level statement that only defines things (imports, functions,
    classes, dataclasses, cheap constant assignments) with each statement that does work
    replaced by as many empty lines, so that line numbers do not move. total: the
    script's top-level statements; ran: how many of them `code` runs. skipped: one entry
    per statement left out, `"line N: <its first line>"` (a statement that needs a name
    only a skipped statement binds is left out too, and says so).
    """

    code: str
    total: int
    ran: int
    skipped: list[str] = field(default_factory=list)


def runnable_part(source: str, known: Mapping[str, cst.Module] = EMPTY) -> Runnable:
    """The part of `source` the import smoke may run (`Runnable`).

    A script with an `if __name__ == "__main__":` guard, or one that libcst cannot
    parse, runs whole. Otherwise every top-level statement that is not an import,
    definition, docstring, cheap assignment, `if TYPE_CHECKING:` or try-import block,
    or that calls `torch.cuda.*` or `init_process_group` while defining (decorators,
    defaults, class bodies), is skipped, from the whole file (not only up to the first
    one), and so is every statement that reads, while it runs, a name that only skipped
    statements bind (a `def f(lr=args.lr)` after a skipped `args = Hyperparameters()`).
    known: as for `_parse`.
    """
    module = parse_known(source, known)
    if module is None:
        return Runnable(source, 0, 0)
    body = list(module.body)
    if _has_main_guard(module):
        return Runnable(source, len(body), len(body))
    kept = [_is_definition(stmt) for stmt in body]
    bound_by_kept: set[str] = set()
    bound_by_skipped: set[str] = set()
    because: dict[int, str] = {}
    for index, stmt in enumerate(body):
        names = _ImportTimeNames()
        cst_walk.visit(stmt, names)
        if kept[index]:
            missing = sorted((names.read - bound_by_kept) & bound_by_skipped)
            if missing:
                kept[index] = False
                because[index] = f" (needs {', '.join(missing[:3])}, bound only by skipped statements)"
        (bound_by_kept if kept[index] else bound_by_skipped).update(names.bound)
    if all(kept):
        return Runnable(source, len(body), len(body))
    texts = [module.code_for_node(stmt) for stmt in body]
    header = "".join(module.code_for_node(empty) for empty in module.header)
    footer = "".join(module.code_for_node(empty) for empty in module.footer)
    if header + "".join(texts) + footer != source:  # not expected; then run nothing rather than misplace lines
        return Runnable("", len(body), 0, ["line 1: the file could not be split into statements"])
    pieces, skipped, line = [header], [], 1 + header.count("\n")
    for index, stmt in enumerate(body):
        text = texts[index]
        if kept[index]:
            pieces.append(text)
        else:
            lead = len(stmt.leading_lines) if hasattr(stmt, "leading_lines") else 0
            first = text.splitlines()[lead] if len(text.splitlines()) > lead else ""
            first = " ".join(first.split())
            skipped.append(f"line {line + lead}: {first[:60] + ('…' if len(first) > 60 else '')}{because.get(index, '')}")
            pieces.append("\n" * text.count("\n"))
        line += text.count("\n")
    pieces.append(footer)
    return Runnable("".join(pieces), len(body), sum(kept), skipped)


class _ImportTimeNames(cst.CSTVisitor):
    """Names a top-level statement binds, and the names it reads while it runs.

    Function and lambda bodies do not run at import: their reads are not counted
    (decorators, defaults and annotations are). Attribute names and keyword names are
    not reads. Over-counting a read only makes the smoke skip more (and say so).
    """

    def __init__(self):
        super().__init__()
        self.bound: set[str] = set()
        self.read: set[str] = set()
        self._not_reads: set[int] = set()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.bound.add(node.name.value)
        for part in (*node.decorators, node.params, node.returns):
            if part is not None:
                cst_walk.visit(part, self)
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.bound.add(node.name.value)
        for part in (*node.decorators, *node.bases, *node.keywords):
            cst_walk.visit(part, self)
        body = _ImportTimeNames()  # the class body runs now, in a scope of its own
        cst_walk.visit(node.body, body)
        self.read |= body.read - body.bound
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        cst_walk.visit(node.params, self)
        return False

    def visit_Param(self, node: cst.Param) -> None:
        self._not_reads.add(id(node.name))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._not_reads.add(id(node.attr))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self._not_reads.add(id(node.keyword))

    def visit_ImportAlias(self, node: cst.ImportAlias) -> bool:
        bound = node.asname.name if node.asname is not None else node.name
        while isinstance(bound, cst.Attribute):
            bound = bound.value
        if isinstance(bound, cst.Name):
            self.bound.add(bound.value)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if not isinstance(node.names, cst.ImportStar):
            for alias in node.names:
                alias.visit(self)
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._bind(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._bind(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.target, cst.Name):
            self.bound.add(node.target.value)  # read, then bound: the read is counted too

    def visit_For(self, node: cst.For) -> None:
        self._bind(node.target)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._bind(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._bind(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._bind(node.target)

    def _bind(self, target: cst.CSTNode) -> None:
        if isinstance(target, cst.Name):
            self.bound.add(target.value)
            self._not_reads.add(id(target))
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._bind(element.value)
        elif isinstance(target, cst.StarredElement):
            self._bind(target.value)

    def visit_Name(self, node: cst.Name) -> None:
        if id(node) not in self._not_reads:
            self.read.add(node.value)


def definitions_only(source: str, known: Mapping[str, cst.Module] = EMPTY) -> str:
    """`source` without its top-level training code: every top-level statement that
    `runnable_part` would keep for itself (imports, definitions, cheap assignments). A script with a
    `__main__` guard, or one libcst cannot parse, is returned whole. For `verify`,
    which needs the functions a top-level script defines after its first run-time
    statement (`args = Hyperparameters()`), and evaluates such statements itself.
    known: as for `_parse`.
    """
    module = parse_known(source, known)
    if module is None or _has_main_guard(module):
        return source
    return module.with_changes(body=[stmt for stmt in module.body if _is_definition(stmt)]).code


_MAIN_GUARD = m.If(
    test=m.Comparison(
        left=m.Name("__name__"),
        comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.SimpleString())],
    )
    | m.Comparison(
        left=m.SimpleString(),
        comparisons=[m.ComparisonTarget(operator=m.Equal(), comparator=m.Name("__name__"))],
    )
)


def _has_main_guard(module: cst.Module) -> bool:
    """True when a top-level `if __name__ == "__main__":` exists (either operand order)."""
    for stmt in module.body:
        if m.matches(stmt, _MAIN_GUARD):
            strings = m.findall(stmt.test, m.SimpleString())
            if any(s.evaluated_value == "__main__" for s in strings):
                return True
    return False


def _is_definition(stmt: cst.CSTNode) -> bool:
    """True for a top-level statement that only defines things and is safe to run on import."""
    if _starts_gpu_or_dist(stmt):
        return False
    if isinstance(stmt, cst.SimpleStatementLine):
        return all(_is_cheap_small(s) for s in stmt.body)
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
        return True
    if isinstance(stmt, cst.If):
        return _is_type_checking_block(stmt)
    if isinstance(stmt, cst.Try):
        return _is_try_import(stmt)
    return False


def _is_cheap_small(stmt: cst.BaseSmallStatement) -> bool:
    if isinstance(stmt, (cst.Import, cst.ImportFrom, cst.Pass)):
        return True
    if isinstance(stmt, cst.Expr):  # a docstring, nothing else
        return isinstance(stmt.value, (cst.SimpleString, cst.ConcatenatedString))
    if isinstance(stmt, cst.Assign):
        targets_ok = all(not m.findall(t.target, m.Call()) for t in stmt.targets)
        return targets_ok and _is_cheap_expr(stmt.value)
    if isinstance(stmt, (cst.AnnAssign, cst.AugAssign)):
        value_ok = stmt.value is None or _is_cheap_expr(stmt.value)
        return value_ok and not m.findall(stmt.target, m.Call())
    return False


def _is_cheap_expr(node: cst.CSTNode) -> bool:
    """Literals, names, attributes, containers and arithmetic of those, and allowlisted calls."""
    if isinstance(node, (cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.Name, cst.Ellipsis)):
        return True
    if isinstance(node, cst.Lambda):
        return True  # defines, runs nothing
    if isinstance(node, cst.Call):
        name = dotted(node.func, partial=False)
        return name in _CHEAP_CALLS and all(_is_cheap_expr(a.value) for a in node.args)
    if isinstance(node, cst.Subscript) and dotted(node.value, partial=False) in ("os.environ", "environ"):
        return False  # `os.environ["RANK"]`: set by the launcher (torchrun), not by an import
    cheap_kinds = (
        cst.Attribute, cst.ConcatenatedString, cst.FormattedString, cst.FormattedStringExpression,
        cst.Tuple, cst.List, cst.Set, cst.Dict, cst.UnaryOperation, cst.BinaryOperation,
        cst.BooleanOperation, cst.Comparison, cst.IfExp, cst.Subscript,
    )
    if not isinstance(node, cheap_kinds):
        return False
    return all(_is_cheap_expr(child) for child in _value_children(node))


def _value_children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The sub-expressions of `node` that get evaluated (not operators or whitespace)."""
    out: list[cst.CSTNode] = []
    for child in cst_walk.children(node):
        if isinstance(child, cst.BaseExpression):
            out.append(child)
        elif isinstance(child, (cst.BaseElement, cst.BaseDictElement, cst.SubscriptElement, cst.ComparisonTarget)):
            out.extend(_value_children(child))
        elif isinstance(child, (cst.Index, cst.Slice, cst.FormattedStringExpression)):
            out.extend(_value_children(child))
    return out


def _is_type_checking_block(stmt: cst.If) -> bool:
    is_tc = m.matches(stmt.test, m.Name("TYPE_CHECKING") | m.Attribute(attr=m.Name("TYPE_CHECKING")))
    return is_tc and _only_imports(stmt.body.body) and (stmt.orelse is None or _only_imports(stmt.orelse.body.body))


def _is_try_import(stmt: cst.Try) -> bool:
    """`try: import x ... except ImportError: x = None` and the like."""
    body = stmt.body.body
    has_import = any(
        isinstance(s, cst.SimpleStatementLine) and any(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body)
        for s in body
    )
    blocks = [body] + [h.body.body for h in stmt.handlers]
    blocks += [b.body.body for b in (stmt.orelse, stmt.finalbody) if b is not None]
    return has_import and all(_only_imports(b) for b in blocks)


def _only_imports(stmts) -> bool:
    """Only imports, `pass` and cheap assignments."""
    return all(isinstance(s, cst.SimpleStatementLine) and all(_is_cheap_small(x) for x in s.body) for s in stmts)


class _ImportTimeCalls(cst.CSTVisitor):
    """Dotted names of calls made when a statement runs (not inside function bodies)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        for decorator in node.decorators:
            decorator.visit(self)
        node.params.visit(self)
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Call(self, node: cst.Call) -> None:
        name = dotted(node.func, partial=False)
        if name:
            self.names.append(name)


def _starts_gpu_or_dist(stmt: cst.CSTNode) -> bool:
    """Calls `torch.cuda.*` or `init_process_group` while the statement runs."""
    calls = _ImportTimeCalls()
    cst_walk.visit(stmt, calls)
    return any(n.startswith(("torch.cuda.", "cuda.")) or n.rsplit(".", 1)[-1] == "init_process_group" for n in calls.names)
