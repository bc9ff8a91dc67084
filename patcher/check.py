"""Pre-submission checks: compile under a real target Python, import smoke, self-containedness.

`check_file(path)` answers three questions about a training script (plain, or the
payload inside a compressed exec wrapper, see `patcher.source`):

1. **Does it compile on the target Python?** `compile_source` runs a real interpreter
   (found by `find_python`, Python 3.10 by default) on the code. The payload of a
   wrapped script is compiled as well as the wrapper, because the wrapper compiles on
   3.10 even when its payload does not (DESIGN.md, "What existing checkers miss").
   A Python 3.12-only f-string (PEP 701) is named, with its line and column and a fix.
   With no such interpreter installed, a grammar check under the running Python stands
   in, and says so.
2. **Does it import?** `import_smoke` loads the code in a child process under a module
   name other than `__main__`, registered in `sys.modules` before it runs (the dataclass
   trap), with missing GPU-only packages (`flash_attn_interface`, `triton`, ...) replaced by
   stubs that are reported. Scripts that train at top level (modded-nanogpt) are cut
   before their first executable statement, so importing them never starts training.
3. **Is it one file?** Warnings for imports of modules that sit beside the script and
   for code files read through a path built from `__file__`.

Nothing here executes the script in this process; all code search uses libcst.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from patcher import cst_walk
from patcher.source import Script, code_bytes, read_script
from patcher.survey import pep701_kind

__all__ = [
    "CompileResult",
    "ImportResult",
    "CheckResult",
    "find_python",
    "compile_source",
    "import_smoke",
    "check_file",
    "importable_part",
    "self_contained_warnings",
]

DEFAULT_TARGET = "3.10"
PROBE_TIMEOUT_S = 20.0  # starting an interpreter to ask its version
COMPILE_TIMEOUT_S = 120.0  # compiling one script in a child interpreter
_BOM = "\ufeff"


# --------------------------------------------------------------------------- results


@dataclass
class CompileResult:
    """Outcome of compiling one piece of code.

    python: "3.10.13 (/path/to/python3.10)" for the interpreter that compiled it, None
    when no real interpreter of the target ran (grammar check only). real: a real
    interpreter of the target compiled it. ok: it compiles. error: one line: the
    SyntaxError's message (with the construct and a fix for PEP 701 f-strings), or,
    when `ok` and not `real`, the note that only a grammar check ran; None otherwise.
    line / col: 1-based position of the error (for a PEP 701 f-string: where the
    f-string starts), None when ok. where: "payload" (the code inside a wrapper; lines
    are payload lines) or "file" (the file as written).
    """

    python: str | None
    real: bool
    ok: bool
    error: str | None = None
    line: int | None = None
    col: int | None = None
    where: str = "file"

    def as_dict(self) -> dict:
        """JSON-ready dict: python, ok, error, line, col, real, where."""
        return {
            "python": self.python,
            "ok": self.ok,
            "error": self.error,
            "line": self.line,
            "col": self.col,
            "real": self.real,
            "where": self.where,
        }


@dataclass
class ImportResult:
    """Outcome of the import smoke test.

    ok: the module body ran to the end (or to `stopped_at`) without an exception.
    stubbed: full names of the missing modules replaced by stubs, in import order
    (e.g. ["flash_attn_interface", "some_pkg", "some_pkg.sub"]). stopped_at: 1-based
    line of the first top-level statement not imported (a script that trains at top
    level, with no `if __name__ == "__main__":`), None when the whole module ran.
    error: one line, "ExcType: message (line N in func)", or why it could not run.
    seconds: wall time of the child process. line: line of the error in the script
    (payload lines for a wrapped script), None when unknown or ok.
    """

    ok: bool
    stubbed: list[str] = field(default_factory=list)
    stopped_at: int | None = None
    error: str | None = None
    seconds: float = 0.0
    line: int | None = None
    note: str | None = None
    # the path the script was imported as (its `__file__` and `sys.argv[0]`): where it stands
    as_path: str | None = None

    def as_dict(self) -> dict:
        """JSON-ready dict: ok, stubbed, stopped_at, error, line, seconds, note, as_path."""
        return {
            "note": self.note,
            "ok": self.ok,
            "stubbed": list(self.stubbed),
            "stopped_at": self.stopped_at,
            "error": self.error,
            "line": self.line,
            "seconds": round(self.seconds, 3),
            "as_path": self.as_path,
        }


@dataclass
class CheckResult:
    """Everything `check_file` found about one script.

    file: the path as given. compile: the code (the payload for a wrapped script).
    wrapper_compile: the wrapper file itself, None for a plain script. imports: the
    import smoke test, None when not run. code_bytes: size of the file as written, in
    bytes (what counts toward the artifact cap). warnings: one line each.
    """

    file: str
    compile: CompileResult
    wrapper_compile: CompileResult | None
    imports: ImportResult | None
    code_bytes: int
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Compiles (payload and wrapper) and, where run, imports."""
        wrapper_ok = self.wrapper_compile is None or self.wrapper_compile.ok
        import_ok = self.imports is None or self.imports.ok
        return self.compile.ok and wrapper_ok and import_ok

    def as_dict(self) -> dict:
        """JSON-ready dict: file, ok, compile, wrapper_compile, import, code_bytes, warnings."""
        return {
            "file": self.file,
            "ok": self.ok,
            "compile": self.compile.as_dict(),
            "wrapper_compile": self.wrapper_compile.as_dict() if self.wrapper_compile else None,
            "import": self.imports.as_dict() if self.imports else None,
            "code_bytes": self.code_bytes,
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- find_python


def find_python(target: str = DEFAULT_TARGET) -> tuple[str | None, str]:
    """Find a real interpreter for `target` and return (path, version), e.g. ("/.../python3.10", "3.10.13").

    target: a version "MAJOR.MINOR", or a path (or command name) of an interpreter.
    A path that is a file is used as given. For a version the search order is
    `pythonX.Y` on PATH, then `<pyenv root>/versions/X.Y*/bin/pythonX.Y`, newest patch
    first (`pyenv root` when pyenv is installed, else $PYENV_ROOT or ~/.pyenv). Every
    candidate is run once to read its `sys.version`; a discovered interpreter is
    returned by its real executable (not a pyenv shim) and must match MAJOR.MINOR.
    Returns (None, "") when nothing usable is found. Never raises.
    """
    version = _parse_version(target)
    if version is None:
        path = target if os.path.isfile(target) else shutil.which(target)
        probed = _probe(path) if path else None
        return (target if os.path.isfile(target) else path, probed[1]) if probed else (None, "")
    for candidate in _candidates(target):
        probed = _probe(candidate)
        if probed is not None and _parse_version(probed[1]) == version:
            return probed
    return None, ""


def _parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of "3.10" or "3.10.13"; None for anything else (a path, "3.10-dev")."""
    parts = text.strip().split(".")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _candidates(target: str) -> list[str]:
    """Interpreter paths to try for version `target`, best first."""
    name = f"python{target}"
    found = [shutil.which(name)]
    versions = Path(_pyenv_root()) / "versions"
    if versions.is_dir():
        dirs = [d for d in versions.iterdir() if d.name == target or d.name.startswith(target + ".")]
        for d in sorted(dirs, key=_patch_key, reverse=True):
            found.append(str(d / "bin" / name))
    return [p for p in found if p and os.path.isfile(p)]


def _patch_key(directory: Path) -> tuple[int, str]:
    """Sort key for pyenv version folders: numeric patch level, then the name."""
    tail = directory.name.split(".")[2:3]
    return (int(tail[0]) if tail and tail[0].isdigit() else -1, directory.name)


@lru_cache(maxsize=1)
def _pyenv_root() -> str:
    """`pyenv root` if pyenv is installed, else $PYENV_ROOT or ~/.pyenv."""
    if shutil.which("pyenv"):
        try:
            out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")


@lru_cache(maxsize=32)
def _probe(path: str) -> tuple[str, str] | None:
    """(sys.executable, "3.10.13") reported by running `path`, or None if it does not run."""
    code = "import sys;print(sys.version.split()[0]);print(sys.executable)"
    try:
        out = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or len(lines) != 2 or _parse_version(lines[0].rstrip("+")) is None:
        return None
    return lines[1] or path, lines[0]


# --------------------------------------------------------------------------- compile

# Runs inside the target interpreter (any Python 3): compile stdin, print one JSON line.
_COMPILE_PROGRAM = """
import json, sys
src = sys.stdin.buffer.read().decode("utf-8")
try:
    compile(src, sys.argv[1], "exec", dont_inherit=True)
    r = {"ok": True}
except SyntaxError as e:
    r = {"ok": False, "type": type(e).__name__, "msg": e.msg, "lineno": e.lineno, "offset": e.offset}
except Exception as e:
    r = {"ok": False, "type": type(e).__name__, "msg": str(e), "lineno": None, "offset": None}
sys.stdout.write(json.dumps(r) + "\\n")
"""


def compile_source(source: str, filename: str, target: str = DEFAULT_TARGET) -> CompileResult:
    """Compile `source` (text, not a path) with a real interpreter of `target`.

    filename: used in the compiler's messages only. target: as for `find_python`.
    The interpreter runs in a subprocess and never executes the code. A SyntaxError
    caused by a Python 3.12-only f-string (PEP 701: the f-string's own quote, a
    backslash, a comment or a line break in a replacement field) is explained, with
    line and column of the f-string. With no interpreter for `target` the result comes
    from `ast.parse(feature_version=...)` under the running Python plus a libcst scan
    for those f-strings, and `real` is False. A leading BOM is ignored. Never raises
    for bad code; the result carries the error.
    """
    source = source[1:] if source.startswith(_BOM) else source
    path, version = find_python(target)
    if path is None:
        return _grammar_check(source, filename, target)
    return _compile_real(source, filename, path, version)


def _compile_real(source: str, filename: str, python: str, version: str) -> CompileResult:
    label = f"{version} ({python})"
    proc = None
    try:
        proc = subprocess.run(
            [python, "-I", "-S", "-W", "ignore", "-c", _COMPILE_PROGRAM, filename],
            input=source.encode("utf-8"),
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        reply = json.loads(proc.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return CompileResult(label, True, False, f"compiling took over {COMPILE_TIMEOUT_S:g} s")
    except (OSError, ValueError, IndexError):
        why = _last_line(proc.stderr) if proc is not None else "it does not start"
        return CompileResult(label, True, False, f"could not run {python} to compile ({why})")
    if reply["ok"]:
        return CompileResult(label, True, True)
    older = (_parse_version(version) or (3, 12)) < (3, 12)
    error, line, col = _explain(source, reply, pep701=older)
    return CompileResult(label, True, False, error, line, col)


def _grammar_check(source: str, filename: str, target: str) -> CompileResult:
    """Stand-in for a real interpreter: the running Python's parser at the target's grammar."""
    running = sys.version_info[:2]
    wanted = _parse_version(target)
    feature = min(wanted, running) if wanted else running
    scan = wanted is not None and wanted < (3, 12)
    who = f"no real Python {target} ran" if wanted else f"no real Python ran ({target} not found)"
    note = (
        f"{who}; grammar check only (ast feature_version={feature[0]}.{feature[1]} under Python "
        f"{platform.python_version()}{' plus a PEP 701 f-string scan' if scan else ''})"
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ast.parse(source, filename, feature_version=feature)
    except SyntaxError as e:
        reply = {"type": type(e).__name__, "msg": e.msg, "lineno": e.lineno, "offset": e.offset}
        error, line, col = _explain(source, reply, pep701=scan)
        return CompileResult(None, False, False, f"{error} [{note}]", line, col)
    except (ValueError, MemoryError, RecursionError) as e:
        return CompileResult(None, False, False, f"{type(e).__name__}: {e} [{note}]")
    sites = _pep701_sites(source) if scan else []
    if sites:
        first = sites[0]
        error = f"f-string at line {first.line} — {first.text}{_more_sites(sites)}"
        return CompileResult(None, False, False, f"{error} [{note}]", first.line, first.col)
    return CompileResult(None, False, True, note)


def _explain(source: str, reply: dict, pep701: bool) -> tuple[str, int | None, int | None]:
    """(message, line, col) for a compiler's error reply, naming a PEP 701 f-string at that line."""
    kind = reply.get("type") or "SyntaxError"
    msg = reply.get("msg") or "invalid syntax"
    msg = msg if kind == "SyntaxError" else f"{kind}: {msg}"
    line, col = reply.get("lineno"), reply.get("offset")
    if not pep701 or line is None:
        return msg, line, col
    sites = _pep701_sites(source)
    site = next((s for s in sites if s.line <= line <= s.end_line), None)
    if site is None:
        return msg, line, col
    return f"{msg} — {site.text}{_more_sites(sites)}", site.line, site.col


def _more_sites(sites: list["_FstringSite"]) -> str:
    if len(sites) < 2:
        return ""
    lines = sorted({s.line for s in sites})
    shown = ", ".join(str(n) for n in lines[:8]) + (", …" if len(lines) > 8 else "")
    return f" ({len(sites)} such f-strings in all, line{'s' if len(lines) > 1 else ''} {shown})"


def _last_line(data: bytes | str | None) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "no output"


# --------------------------------------------------------------------------- PEP 701 f-strings

_KIND_TEXT = {
    "quote": "nested same-quote f-string (PEP 701, Python 3.12+)",
    "backslash": "backslash inside an f-string replacement field (PEP 701, Python 3.12+)",
    "comment": "comment inside an f-string replacement field (PEP 701, Python 3.12+)",
    "newline": "line break inside a replacement field of a single-quoted f-string (PEP 701, Python 3.12+)",
}
_KIND_FIX = {
    "quote": "patch-prefetch rewrites it (feature py310_fstrings)",
    "backslash": "no automatic rewrite: compute the value before the f-string",
    "comment": "no automatic rewrite: remove the comment",
    "newline": "no automatic rewrite: use a triple-quoted f-string or one line",
}


@dataclass(frozen=True)
class _FstringSite:
    """A Python 3.12-only f-string: 1-based start line/column, end line, kind, message text."""

    line: int
    col: int
    end_line: int
    kind: str
    text: str


# The tree of the code being checked when the caller already has it (the main job's
# patched module, which libcst prints to exactly that code): {code: module}, one entry.
_KNOWN_TREE: dict[str, cst.Module] = {}


def _parse(source: str) -> cst.Module | None:
    """libcst module for `source` (3.12 grammar, so PEP 701 parses), None if it does not parse."""
    known = _KNOWN_TREE.get(source)
    return known if known is not None else _parse_text(source)


@lru_cache(maxsize=4)
def _parse_text(source: str) -> cst.Module | None:
    try:
        return cst.parse_module(source)
    except (cst.ParserSyntaxError, RecursionError, ValueError):
        return None


def _pep701_sites(source: str) -> list[_FstringSite]:
    """Outermost f-strings in `source` that Python 3.10/3.11 cannot tokenize, in source order."""
    module = _parse(source)
    if module is None:
        return []
    finder = _Pep701Finder(module)
    cst_walk.visit(module, finder)
    if not finder.found:
        return []
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    sites = []
    for node, kind in finder.found:
        where = positions[node]
        text = f"{_KIND_TEXT[kind]}; {_fix_hint(node, module, kind)}"
        sites.append(_FstringSite(where.start.line, where.start.column + 1, where.end.line, kind, text))
    return sorted(sites, key=lambda s: (s.line, s.col))


class _Pep701Finder(cst.CSTVisitor):
    """Collect (f-string, kind) for f-strings with a 3.12-only replacement field."""

    def __init__(self, module: cst.Module):
        super().__init__()
        self.module = module
        self.found: list[tuple[cst.FormattedString, str]] = []

    def visit_FormattedString(self, node: cst.FormattedString) -> bool:
        kind = pep701_kind(node, self.module)
        if kind is None:
            return True  # an inner f-string may still be 3.12-only on its own
        self.found.append((node, kind))
        return False


def _fix_hint(node: cst.FormattedString, module: cst.Module, kind: str) -> str:
    """How to fix the site; for a same-quote f-string, whether the rewrite can do it."""
    if kind != "quote":
        return _KIND_FIX[kind]
    try:
        from patcher.transforms.py310_fstrings import Unfixable, rewrite
    except ImportError:
        return _KIND_FIX[kind]
    try:
        rewrite(node, module)
    except Unfixable as why:
        return f"no automatic rewrite: {why}"
    except Exception:  # the transform's own problem; the generic hint still holds
        pass
    return _KIND_FIX[kind]


# --------------------------------------------------------------------------- import smoke

# Runs in a child interpreter (the running one, which has torch). argv: script, module name.
_IMPORT_RUNNER = "import sys; from patcher.smoke_child import run_and_report; run_and_report(sys.argv[1], sys.argv[2], sys.argv[3])"

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


def import_smoke(source: str, filename: str, timeout: float = 60.0, as_path: str | os.PathLike | None = None) -> ImportResult:
    """Import `source` in a child process of the running Python and report what happened.

    source: the code (the payload for a wrapped script). filename: its name; the code
    is written to a fresh temporary directory as `<stem>.py` and run there (the working
    directory), under the module name `_smoke_<stem>`, never `__main__`, registered in
    `sys.modules` before it executes. Missing packages imported by the script are stubbed
    (`stubbed`). Without an `if __name__ == "__main__":` guard only the leading
    definitions run (`stopped_at`). timeout: seconds before the child, its process
    group and every process it started (even in a new session) are killed; the result
    then says "timed out after N s". Processes the script starts and leaves running are
    killed when the import ends. as_path: where the script stands (default `filename`):
    its `__file__` and `sys.argv[0]` during the import, absolute, so that a script that
    finds its data from its own location (`Path(__file__).resolve().parents[3]`) sees
    the place it is meant to run from, not the temporary copy (`as_path` of the result).
    Never raises for problems in the script.
    """
    as_path = os.path.abspath(str(filename if as_path is None else as_path))
    source = source[1:] if source.startswith(_BOM) else source
    body, stopped_at = importable_part(source)
    stem = _safe_stem(filename)
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-smoke-") as tmp:
        script = os.path.join(tmp, stem + ".py")
        with open(script, "w", encoding="utf-8", newline="") as f:
            f.write(body)
        run = _fork_child if _FORKED_SMOKE else _run_child
        result = run(script, f"_smoke_{stem}", tmp, timeout, as_path)
    result.stopped_at = stopped_at
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
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPORT_RUNNER, script, module_name, as_path],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return ImportResult(False, error=f"timed out after {timeout:g} s", seconds=time.monotonic() - start)
    except BaseException:  # Ctrl-C: the child and what it started go too
        _kill_group(proc)
        raise
    return _import_result(out, time.monotonic() - start, f"import child exited with code {proc.returncode} and no result: {_last_line(err)}")


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
    from patcher import smoke_child

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
    try:
        while True:
            left = timeout - (time.monotonic() - start)
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
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
    from patcher.smoke_child import kill_descendants

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


def importable_part(source: str) -> tuple[str, int | None]:
    """(code to import, line where it was cut or None).

    A script with an `if __name__ == "__main__":` guard, or one that libcst cannot
    parse, is returned whole. Otherwise the code is cut before the first top-level
    statement that is not an import, definition, docstring, cheap assignment,
    `if TYPE_CHECKING:` or try-import block, or that calls `torch.cuda.*` or
    `init_process_group` while defining (decorators, defaults, class bodies).
    The kept text is byte-identical, so line numbers do not move.
    """
    module = _parse(source)
    if module is None or _has_main_guard(module):
        return source, None
    body = list(module.body)
    cut = next((i for i, stmt in enumerate(body) if not _is_definition(stmt)), None)
    if cut is None:
        return source, None
    prefix = module.with_changes(body=body[: cut + 1])
    positions = MetadataWrapper(prefix, unsafe_skip_copy=True).resolve(PositionProvider)
    stop = body[cut]
    first = stop.decorators[0] if getattr(stop, "decorators", None) else stop
    line = positions[first].start.line
    return module.with_changes(body=body[:cut], footer=()).code, line


def definitions_only(source: str) -> str:
    """`source` without its top-level training code: every top-level statement that
    `importable_part` would keep (imports, definitions, cheap assignments), from the
    whole file, not only before the first one it cuts at. A script with a
    `__main__` guard, or one libcst cannot parse, is returned whole. For `verify`,
    which needs the functions a top-level script defines after its first run-time
    statement (`args = Hyperparameters()`), and evaluates such statements itself.
    """
    module = _parse(source)
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
        name = _dotted(node.func)
        return name in _CHEAP_CALLS and all(_is_cheap_expr(a.value) for a in node.args)
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
        name = _dotted(node.func)
        if name:
            self.names.append(name)


def _starts_gpu_or_dist(stmt: cst.CSTNode) -> bool:
    """Calls `torch.cuda.*` or `init_process_group` while the statement runs."""
    calls = _ImportTimeCalls()
    cst_walk.visit(stmt, calls)
    return any(n.startswith(("torch.cuda.", "cuda.")) or n.rsplit(".", 1)[-1] == "init_process_group" for n in calls.names)


def _dotted(node: cst.CSTNode) -> str | None:
    """"a.b.c" for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


# --------------------------------------------------------------------------- check_file


def check_file(
    path: str | os.PathLike,
    target: str = DEFAULT_TARGET,
    timeout: float = 60.0,
    run_import: bool = True,
    script: Script | None = None,
    as_path: str | os.PathLike | None = None,
) -> CheckResult:
    """Check one training script: compile on `target`, import smoke, one-file warnings.

    path: a plain or wrapped script (`patcher.source.read_script`). target: as for
    `find_python`. timeout: seconds for the import smoke test. run_import: False skips
    it (`imports` is None). For a wrapped script the payload is compiled (`compile`,
    payload lines) and the wrapper file too (`wrapper_compile`). The import runs only
    when the running Python can compile the code; otherwise `imports.ok` is False and
    its error says why. Raises `SourceError` for a file `read_script` rejects (missing,
    empty, binary, unparsable, corrupt wrapper, exec(open(other).read()) only).
    script: the file as already read (`patcher.source.Script`, e.g. what the main job
    just wrote and round-tripped), so that it is not read and unwrapped again; its
    `module`, when set, is used instead of parsing `source` again. as_path: where the
    script is meant to stand (the input of a patch); the import smoke runs it with that
    `__file__`. Default: `path` itself.
    """
    script = read_script(path) if script is None else script
    _KNOWN_TREE.clear()
    if script.module is not None:
        _KNOWN_TREE[script.source] = script.module
    name = str(path)
    compiled = compile_source(script.source, name, target)
    compiled.where = "payload" if script.wrapped else "file"
    wrapper = None
    if script.wrapped:
        wrapper = compile_source(script.raw, name, target)
        wrapper.where = "file"
    imports = _import_if_compiles(script.source, name, timeout, path if as_path is None else as_path) if run_import else None
    return CheckResult(
        file=name,
        compile=compiled,
        wrapper_compile=wrapper,
        imports=imports,
        code_bytes=code_bytes(script.raw),
        warnings=self_contained_warnings(script.source, script.path, script.wrapped),
    )


def _requoted(source: str) -> str | None:
    """`source` with PEP 701 f-strings requoted when that makes it compile here, else None."""
    from patcher.patch import features_from, patch_source

    try:
        fixed = patch_source(source, features_from(["py310_fstrings"], None)).source
        compile(fixed, "requoted", "exec", dont_inherit=True)
    except Exception:
        return None
    return fixed


def _import_if_compiles(source: str, filename: str, timeout: float, as_path=None) -> ImportResult:
    """import_smoke, unless the running Python cannot compile `source` (then say so)."""
    code = source[1:] if source.startswith(_BOM) else source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(code, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        requoted = _requoted(code)
        if requoted is not None:
            # Same AST with PEP 701 f-strings requoted: import that, and say so.
            result = import_smoke(requoted, filename, timeout, as_path)
            result.note = f"imported with its Python 3.12-only f-strings requoted (same AST); the running Python {platform.python_version()} cannot compile them"
            return result
        why = (
            f"not imported: the running Python {platform.python_version()} cannot compile it either "
            f"({e.msg}, line {e.lineno})"
        )
        return ImportResult(False, error=why, line=e.lineno)
    except (ValueError, MemoryError, RecursionError) as e:
        return ImportResult(False, error=f"not imported: cannot compile ({type(e).__name__}: {e})")
    return import_smoke(source, filename, timeout, as_path)


# --------------------------------------------------------------------------- self-contained

_CODE_EXTS = frozenset({".py", ".pyc", ".pyx", ".so", ".cu", ".cuh", ".cpp", ".cc", ".c", ".h", ".hpp"})
_FILE_ANCHOR = m.Name("__file__") | m.Subscript(
    value=m.Attribute(value=m.Name("sys"), attr=m.Name("argv")),
    slice=[m.SubscriptElement(slice=m.Index(value=m.Integer("0")))],
)
_READ_METHODS = frozenset({"read", "read_text", "read_bytes", "readlines"})


def self_contained_warnings(source: str, path: str | os.PathLike, wrapped: bool = False) -> list[str]:
    """One-line warnings for code the script needs from other files at run time.

    source: the code (payload for a wrapped script). path: the script's file, whose
    folder is searched for sibling modules. Warns for an import (anywhere in the code)
    of a module that exists beside the script as `<name>.py`, a package or an extension
    module, and for a path built from `__file__` or `sys.argv[0]` that names a code file
    (`.py`, `.so`, `.cu`, ...). Data paths (glob patterns, `.bin`, `data/`) and reading
    the script itself are not warned about. Lines are payload lines when `wrapped`.
    """
    module = _parse(source[1:] if source.startswith(_BOM) else source)
    if module is None:
        return []
    script = Path(path)
    found = _Findings(script.name)
    cst_walk.visit(module, found)
    imports = [(node, name) for node, name in found.imports if _sibling_module(script, name)]
    anchors = found.anchors if found.code_literals else []  # no code-file name, no path to one
    if not imports and not anchors:
        return []
    meta = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = meta.resolve(PositionProvider)
    parents = meta.resolve(ParentNodeProvider)
    where = "payload line" if wrapped else "line"
    out: list[str] = []
    for node, name in imports:
        sibling = _sibling_module(script, name)
        out.append(
            f"not self-contained: {where} {positions[node].start.line} imports {name}, "
            f"which is {sibling.name} beside the script; the submission must be one file"
        )
    for line, target in _file_built_paths(module, anchors, parents, positions, script.name):
        out.append(
            f"not self-contained: {where} {line} reads {target} through a path built from the "
            f"script's own location; inline it"
        )
    return list(dict.fromkeys(out))


class _Findings(cst.CSTVisitor):
    """One pass: absolute imports (statement, top-level module name), `__file__` /
    `sys.argv[0]` anchors, and whether any string literal names a code file."""

    def __init__(self, script_name: str):
        self.script_name = script_name
        self.imports: list[tuple[cst.CSTNode, str]] = []
        self.anchors: list[cst.CSTNode] = []
        self.code_literals = False

    def visit_Import(self, node: cst.Import) -> None:
        self.imports.extend((node, _dotted(alias.name).split(".")[0]) for alias in node.names)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not node.relative and node.module is not None:
            self.imports.append((node, _dotted(node.module).split(".")[0]))

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == "__file__":
            self.anchors.append(node)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        if m.matches(node, _FILE_ANCHOR):
            self.anchors.append(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if not self.code_literals:
            self.code_literals = bool(_code_file_names([node], self.script_name))


def _sibling_module(script: Path, name: str) -> Path | None:
    """The file or package beside `script` that `import name` would load, if any."""
    folder = script.parent
    candidates = [folder / f"{name}.py", folder / name / "__init__.py"]
    candidates += sorted(folder.glob(f"{name}.*.so")) + [folder / f"{name}.so"]
    for candidate in candidates:
        if candidate.is_file() and candidate.resolve() != script.resolve():
            return candidate if candidate.name != "__init__.py" else candidate.parent
    return None


def _file_built_paths(module, anchors, parents, positions, script_name: str) -> list[tuple[int, str]]:
    """(line, code file) for each path expression built from the script's location.

    The expression around an anchor is followed up through calls, attributes, operators
    and arguments; names assigned such a path (`here = os.path.dirname(__file__)`) become
    anchors too. String literals naming a code file in it are reported, except the
    argument replaced in `.replace(old, new)` and the script's own name.
    """
    found: list[tuple[int, str]] = []
    seen_names: set[str] = set()
    frontier = list(anchors)
    for _ in range(4):  # names assigned from anchors, a few levels deep
        new_names = []
        for anchor in frontier:
            top = _expression_top(anchor, parents)
            for literal in _code_literals(top, script_name):
                found.append((positions[top].start.line, literal))
            assigned = _assigned_name(top, parents)
            if assigned and assigned not in seen_names and not _is_read(top):
                seen_names.add(assigned)
                new_names.append(assigned)
        if not new_names:
            break
        frontier = [n for n in m.findall(module, m.Name()) if n.value in new_names and not _is_store(n, parents)]
    return list(dict.fromkeys(found))


def _expression_top(node: cst.CSTNode, parents) -> cst.CSTNode:
    """The largest expression around `node`: climbs through calls, attributes, operators,
    arguments and container elements; stops at statements, assignments and with-items."""
    carriers = (cst.BaseExpression, cst.Arg, cst.BaseElement, cst.BaseDictElement, cst.SubscriptElement, cst.BaseSlice)
    top = node
    while isinstance(parents.get(top), carriers):
        top = parents[top]
    return top


def _code_literals(top: cst.CSTNode, script_name: str) -> list[str]:
    """Code-file names among the string literals of a path expression."""
    replaced = {
        id(call.args[0].value)
        for call in m.findall(top, m.Call(func=m.Attribute(attr=m.Name("replace"))))
        if call.args
    }
    return _code_file_names([n for n in m.findall(top, m.SimpleString()) if id(n) not in replaced], script_name)


def _code_file_names(literals, script_name: str) -> list[str]:
    """The values of `literals` that name a code file other than the script itself."""
    out = []
    for node in literals:
        try:
            value = node.evaluated_value
        except Exception:  # an unusual literal (bytes with escapes, ...): not a path
            continue
        if not isinstance(value, str) or _is_data_path(value) or os.path.splitext(value)[1].lower() not in _CODE_EXTS:
            continue
        if os.path.basename(value) != script_name:
            out.append(value)
    return out


def _is_data_path(value: str) -> bool:
    value = value.replace("\\", "/")
    return any(c in value for c in "*?[") or ".bin" in value or "data/" in value


def _assigned_name(top: cst.CSTNode, parents) -> str | None:
    """`x` when `top` is the value of `x = top`."""
    parent = parents.get(top)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
        return parent.targets[0].target.value
    return None


def _is_read(top: cst.CSTNode) -> bool:
    """`open(...).read()`, `Path(...).read_text()`: a file's contents, not a path."""
    return isinstance(top, cst.Call) and isinstance(top.func, cst.Attribute) and top.func.attr.value in _READ_METHODS


def _is_store(name: cst.Name, parents) -> bool:
    parent = parents.get(name)
    return isinstance(parent, cst.AssignTarget)
