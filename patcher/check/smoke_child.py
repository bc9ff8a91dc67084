"""The import smoke itself: runs inside a child process, never in the caller's.

`import_smoke.import_smoke` starts a fresh interpreter that calls `run_and_report` (the
default), or, in tree mode, forks a process that already has torch imported and
calls `smoke_import` there (`import_smoke.use_forked_smoke`). Either way the script is
imported under a module name that is not `__main__`, registered in `sys.modules`
before it executes (the dataclass trap), with missing packages stubbed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import signal
import sys
import traceback

from patcher.check.stubs import StubFinder


def _one_line(text, limit=400):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(exc, script):
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == script]
    line, func = (frames[-1].lineno, frames[-1].name) if frames else (None, None)
    if line is None and isinstance(exc, SyntaxError) and exc.filename == script:
        line, func = exc.lineno, "<module>"
    message = _one_line(exc)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if line is not None:
        text += f" (line {line} at module level)" if func == "<module>" else f" (line {line} in {func})"
    return text, line


def become_subreaper() -> None:
    """Adopt this process's orphaned descendants (Linux `PR_SET_CHILD_SUBREAPER`).

    A process the script starts in its own session (`setsid`, `start_new_session=True`)
    and then leaves behind stays a descendant of this process, so that
    `kill_descendants` finds it. Does nothing where prctl is not available.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> list[int]:
    """Process ids whose parent chain leads to `pid` (read from /proc; [] without it)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":  # zombies are dead already
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        out.append(child)
        stack.extend(children.get(child, []))
    return out


def kill_descendants(pid: int, rounds: int = 20) -> None:
    """SIGKILL every descendant of `pid` (not `pid` itself), again until none is left."""
    for _ in range(rounds):
        found = descendants(pid)
        if not found:
            return
        for child in found:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass


def smoke_import(script: str, name: str, as_path: str | None = None) -> dict:
    """Import the file `script` as module `name`, with `__file__` and `sys.argv[0]` =
    `as_path` (default `script`): the place the script stands. Returns {ok, error, line, stubbed}.

    Never raises: an exception at import (SystemExit and KeyboardInterrupt included)
    is the result, with the script line it came from.
    """
    finder = StubFinder(script)
    sys.meta_path.append(finder)
    as_path = as_path or script
    sys.argv = [as_path]
    sys.dont_write_bytecode = True
    result = {"ok": True, "error": None, "line": None}
    try:
        # the code comes from `script`; the module says it stands at `as_path`
        spec = importlib.util.spec_from_file_location(name, as_path, loader=importlib.machinery.SourceFileLoader(name, script))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec_module: dataclasses look the module up here
        spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: B036 - every way an import can end is a result
        text, line = _describe(exc, script)
        result = {"ok": False, "error": text, "line": line}
    result["stubbed"] = finder.stubbed
    return result


def report(result: dict, fd: int) -> None:
    """Write `result` as one JSON line to `fd`, then end the process at once.

    os._exit: non-daemon threads and atexit hooks the script registered do not run.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    kill_descendants(os.getpid())  # processes the script started do not outlive the smoke
    os.write(fd, ("\n" + json.dumps(result) + "\n").encode("utf-8"))
    os._exit(0)


def run_and_report(script: str, name: str, as_path: str | None = None) -> None:
    """Child interpreter entry: the result goes to a private copy of fd 1, so a script
    that replaces sys.stdout or prints at import cannot hide it."""
    become_subreaper()
    out = os.dup(1)
    report(smoke_import(script, name, as_path), out)
