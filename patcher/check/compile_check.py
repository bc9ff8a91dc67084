"""Does it compile on the target Python? `compile_source` runs a real interpreter of the
target on the code (never executing it) and names a Python 3.12-only f-string (PEP 701)
with its line, column and a fix; with no such interpreter a grammar check under the
running Python stands in, and says so.
"""

from __future__ import annotations

import ast
import json
import platform
import subprocess
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Mapping

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from patcher import cst_walk
from patcher.check.interpreters import DEFAULT_TARGET, find_python, parse_version
from patcher.transforms.py310_fstrings import pep701_kind


COMPILE_TIMEOUT_S = 120.0  # compiling one script in a child interpreter
_BOM = "\ufeff"
EMPTY: Mapping[str, cst.Module] = MappingProxyType({})  # no tree known beforehand


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


def compile_source(source: str, filename: str, target: str = DEFAULT_TARGET, known: Mapping[str, cst.Module] = EMPTY) -> CompileResult:
    """Compile `source` (text, not a path) with a real interpreter of `target`.

    filename: used in the compiler's messages only. target: as for `find_python`.
    The interpreter runs in a subprocess and never executes the code. A SyntaxError
    caused by a Python 3.12-only f-string (PEP 701: the f-string's own quote, a
    backslash, a comment or a line break in a replacement field) is explained, with
    line and column of the f-string. With no interpreter for `target` the result comes
    from `ast.parse(feature_version=...)` under the running Python plus a libcst scan
    for those f-strings, and `real` is False. A leading BOM is ignored. Never raises
    for bad code; the result carries the error. known: as for `_parse`.
    """
    source = source[1:] if source.startswith(_BOM) else source
    path, version = find_python(target)
    if path is None:
        return _grammar_check(source, filename, target, known)
    return _compile_real(source, filename, path, version, known)


def _compile_real(source: str, filename: str, python: str, version: str, known: Mapping[str, cst.Module]) -> CompileResult:
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
        why = last_line(proc.stderr) if proc is not None else "it does not start"
        return CompileResult(label, True, False, f"could not run {python} to compile ({why})")
    if reply["ok"]:
        return CompileResult(label, True, True)
    older = (parse_version(version) or (3, 12)) < (3, 12)
    error, line, col = _explain(source, reply, older, known)
    return CompileResult(label, True, False, error, line, col)


def _grammar_check(source: str, filename: str, target: str, known: Mapping[str, cst.Module]) -> CompileResult:
    """Stand-in for a real interpreter: the running Python's parser at the target's grammar."""
    running = sys.version_info[:2]
    wanted = parse_version(target)
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
        error, line, col = _explain(source, reply, scan, known)
        return CompileResult(None, False, False, f"{error} [{note}]", line, col)
    except (ValueError, MemoryError, RecursionError) as e:
        return CompileResult(None, False, False, f"{type(e).__name__}: {e} [{note}]")
    sites = _pep701_sites(source, known) if scan else []
    if sites:
        first = sites[0]
        error = f"f-string at line {first.line} — {first.text}{_more_sites(sites)}"
        return CompileResult(None, False, False, f"{error} [{note}]", first.line, first.col)
    return CompileResult(None, False, True, note)


def _explain(source: str, reply: dict, pep701: bool, known: Mapping[str, cst.Module]) -> tuple[str, int | None, int | None]:
    """(message, line, col) for a compiler's error reply, naming a PEP 701 f-string at that line."""
    kind = reply.get("type") or "SyntaxError"
    msg = reply.get("msg") or "invalid syntax"
    msg = msg if kind == "SyntaxError" else f"{kind}: {msg}"
    line, col = reply.get("lineno"), reply.get("offset")
    if not pep701 or line is None:
        return msg, line, col
    sites = _pep701_sites(source, known)
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


def last_line(data: bytes | str | None) -> str:
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


def parse_known(source: str, known: Mapping[str, cst.Module] = EMPTY) -> cst.Module | None:
    """libcst module for `source` (3.12 grammar, so PEP 701 parses), None if it does not parse.

    known: trees the caller already has, by the code they print to (the main job's
    patched module), so that the code is not parsed again.
    """
    tree = known.get(source)
    return tree if tree is not None else _parse_text(source)


@lru_cache(maxsize=4)
def _parse_text(source: str) -> cst.Module | None:
    try:
        return cst.parse_module(source)
    except (cst.ParserSyntaxError, RecursionError, ValueError):
        return None


def _pep701_sites(source: str, known: Mapping[str, cst.Module] = EMPTY) -> list[_FstringSite]:
    """Outermost f-strings in `source` that Python 3.10/3.11 cannot tokenize, in source order."""
    module = parse_known(source, known)
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
