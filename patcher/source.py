"""Read training scripts, plain or compressed self-extracting wrappers, and write them back.

Competition records often ship `train_gpt.py` as a small wrapper around a compressed,
base-N encoded copy of the real code::

    import lzma as L,base64 as B
    __wrapper_size__=21392
    exec(L.decompress(B.b85decode(";O_K5c3l..."
    "Zj4D4jJny8..."),format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]))

`read_script` recognises the general form
``exec(<codec>.decompress(<base64>.<b85|b64|a85|b32>decode(<literal>), **kw)[.decode()])``
with codec lzma, zlib, bz2 or gzip under any import alias, and hands back the
decompressed code as `Script.source`. `render` puts patched code back into the same
wrapper: same codec, keyword arguments, encoding, quote, prefix, piece width and joiner
between pieces, every other byte of the wrapper unchanged, and `__wrapper_size__`
updated. Nothing from the file is ever executed or passed to `eval`: the wrapper is
matched on its libcst tree and keyword values are resolved from literals and an
allowlist of codec constants.
"""

from __future__ import annotations

import ast
import base64
import bz2
import copy
import errno
import gzip
import io
import lzma
import os
import shutil
import stat
import sys
import tempfile
import tokenize
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from patcher.cst_walk import dotted

__all__ = [
    "SourceError",
    "Wrapper",
    "Script",
    "read_script",
    "render",
    "code_bytes",
    "write_atomic",
    "output_problem",
    "keep_style",
    "MAX_SOURCE_BYTES",
    "MAX_NESTING",
    "MAX_PIECES",
]

CODECS = ("lzma", "zlib", "bz2", "gzip")
ENCODINGS = ("b85decode", "b64decode", "a85decode", "b32decode")
_ENCODERS = {
    "b85decode": base64.b85encode,
    "b64decode": base64.b64encode,
    "a85decode": base64.a85encode,
    "b32decode": base64.b32encode,
}

# Positional parameters of each codec's decompress() after the data argument, so that
# `zlib.decompress(d, -15)` resolves to {"wbits": -15}. Keywords outside these would
# fail at run time, so they are rejected here.
_DECOMPRESS_PARAMS = {
    "lzma": ("format", "memlimit", "filters"),
    "zlib": ("wbits", "bufsize"),
    "bz2": (),
    "gzip": (),
}

# Module constants a keyword value may name (e.g. `L.FORMAT_RAW`); anything else in a
# keyword value is refused rather than evaluated.
_CONST_PREFIXES = {
    "lzma": ("FORMAT_", "FILTER_", "PRESET_", "CHECK_", "MODE_", "MF_"),
    "zlib": (),
    "bz2": (),
    "gzip": (),
}
_CONST_NAMES = {"zlib": ("MAX_WBITS", "DEF_BUF_SIZE", "DEF_MEM_LEVEL")}

_UTF8_NAMES = {"utf-8", "utf8", "utf_8", "u8"}
_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZIP_MAGIC = b"\x1f\x8b"
_BOM = "\ufeff"
_MAX_PRESET = 9 | lzma.PRESET_EXTREME

# Caps on hostile input (the largest real record is about 160 KB of code, nested a few
# dozen levels). MAX_SOURCE_BYTES: a file, and the decompressed payload of a wrapper
# (decompression stops there instead of inflating a bomb into memory). MAX_NESTING:
# depth of CPython's syntax tree; deeper code is refused before libcst sees it, because
# libcst's native parser crashes (SIGSEGV) or turns quadratic on very deep code.
# MAX_PIECES: libcst's parser reads at most this many implicitly concatenated pieces.
MAX_SOURCE_BYTES = 4 * 1024 * 1024
MAX_NESTING = 100
MAX_PIECES = 3000
# CPython's own refusals of code too deep for its parser.
_CPYTHON_LIMITS = ("too many nested parentheses", "too many levels of indentation", "too complex", "parser stack overflow")


# --------------------------------------------------------------------------- errors


class SourceError(Exception):
    """Bad input: a script that cannot be read, parsed or unwrapped.

    `str(e)` is one line: ``"<path>:<line>: <message>"``, or ``"<path>: <message>"``
    when the line is unknown. Attributes: `path` (str), `message` (str, one line),
    `line` (1-based int or None), `col` (1-based int or None).
    """

    def __init__(self, path: str | os.PathLike, message: str, line: int | None = None, col: int | None = None):
        self.path = str(path)
        # Messages from libcst or OSError may span lines; callers rely on one line.
        self.message = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
        self.line = line
        self.col = col
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {self.message}")


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Wrapper:
    """How a wrapped script is packed, enough to re-pack patched code the same way.

    codec: "lzma" | "zlib" | "bz2" | "gzip". encoding: the base64 function used,
    "b85decode" | "b64decode" | "a85decode" | "b32decode". decompress_kwargs: the
    decompress() arguments as Python values (e.g. {"format": lzma.FORMAT_RAW,
    "filters": [{"id": lzma.FILTER_LZMA2}]}). is_bytes_literal: the literal is b"...".
    compress_kwargs: candidate argument sets for the matching compress call, strongest
    settings only; `render` keeps the smallest output, ties to the first (for lzma:
    preset 9, then 9|EXTREME, because EXTREME is sometimes larger and plain 9
    reproduces the real records byte for byte).
    quote / prefix: of the first piece of the literal. piece_width: characters of
    encoded text per piece, None when the literal is one piece. joiner: the source text
    between pieces ("" / " " / "\\n"), None for one piece. text_decode: the payload is
    `.decode()`d before exec. line: 1-based line of the exec statement.
    wrapper_size_delta: file size in bytes minus the `__wrapper_size__` value, None
    when the file has no `__wrapper_size__`. has_bom: the file starts with a UTF-8 BOM.
    The libcst nodes (module, literal node, joiner node, size node) are kept by identity
    for `render`; they take no part in equality.
    """

    codec: str
    encoding: str
    decompress_kwargs: dict = field(hash=False)
    is_bytes_literal: bool
    compress_kwargs: tuple = field(default=(), hash=False)
    quote: str = '"'
    prefix: str = ""
    piece_width: int | None = None
    joiner: str | None = None
    text_decode: bool = False
    line: int = 1
    wrapper_size_delta: int | None = None
    has_bom: bool = False
    module: cst.Module | None = field(default=None, compare=False, repr=False)
    literal_node: cst.BaseExpression | None = field(default=None, compare=False, repr=False)
    joiner_node: Any = field(default=None, compare=False, repr=False)
    size_node: cst.Integer | None = field(default=None, compare=False, repr=False)

    @property
    def has_wrapper_size(self) -> bool:
        """True when the file carries a `__wrapper_size__ = N` line."""
        return self.wrapper_size_delta is not None


@dataclass
class Script:
    """A training script as read from disk.

    path: where it was read. raw: the file's text exactly as read (line endings kept).
    source: the Python code to patch, i.e. the decompressed payload when wrapped, else
    `raw`. wrapper: how the payload is packed, or None for a plain script.
    module: `source` as libcst parsed it while reading (None where it was not), so
    that patching does not parse a 60-160 KB script a second time.
    """

    path: Path
    raw: str
    source: str
    wrapper: Wrapper | None = None
    module: cst.Module | None = field(default=None, repr=False, compare=False)

    @property
    def wrapped(self) -> bool:
        """True when `source` came out of a compressed exec wrapper."""
        return self.wrapper is not None


# --------------------------------------------------------------------------- public API


def code_bytes(text: str) -> int:
    """Size of `text` in bytes when written as UTF-8 (the competition's code size unit)."""
    return len(text.encode("utf-8"))


def read_script(path: str | Path) -> Script:
    """Read a training script and unwrap it if it is a compressed exec wrapper.

    Returns a `Script`; `source` is the code to patch. Raises `SourceError` for a
    missing, unreadable or directory path, an empty or binary file, a syntax error in
    the file or in the wrapped payload, a corrupt or unsupported wrapper, and a file
    that only does `exec(open(<other file>).read())` (the message names that file).
    """
    p = Path(path)
    raw = _read_text(p)
    with _deep_recursion():
        source, wrapper, module = _analyse(p, raw, check_payload=True)
    return Script(path=p, raw=raw, source=source, wrapper=wrapper, module=module)


def render(script: Script, new_source: str, rewrap: bool = True) -> str:
    """Text of the file to write for `new_source`, the patched `script.source`.

    Plain scripts, and any script with `rewrap=False`, give `new_source` itself.
    Wrapped scripts give the original wrapper with only the encoded literal replaced
    (and `__wrapper_size__` updated to keep its distance, in bytes, from the file
    size). Raises SourceError when the literal would need more than MAX_PIECES pieces
    at the input's piece width (libcst could not read the result back), RuntimeError if
    the result does not decode back to `new_source`, which would be a bug here, not bad
    input. Syntax of `new_source` is not checked.
    """
    w = script.wrapper
    if w is None or not rewrap:
        return new_source
    if w.piece_width is not None:
        text_len = len(_encode_payload(w, new_source))
        pieces = -(-text_len // w.piece_width)
        if pieces > MAX_PIECES:
            raise SourceError(
                script.path,
                f"re-wrapping the patched payload in pieces of {w.piece_width} characters needs {pieces} pieces; "
                f"libcst reads at most {MAX_PIECES} (use --no-rewrap to write the payload as plain source); nothing written",
                line=w.line,
            )
    with _deep_recursion():
        text = _encode_payload(w, new_source)
        literal = _build_literal(w, text)
        rendered = _render_module(w, literal)
        _check_round_trip(script.path, w, rendered, new_source)
    return rendered


@contextmanager
def _deep_recursion(frames: int = 10_000):
    """Room for libcst to visit and print a wrapper's literal.

    A payload of N implicitly concatenated pieces on one line nests N levels deep, and
    libcst visits and prints it recursively: a few hundred 100-character pieces (about
    30 KB of encoded payload) pass Python's default limit of 1,000 frames.
    """
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, frames))
    try:
        yield
    finally:
        sys.setrecursionlimit(limit)


def output_problem(path: str | Path) -> str | None:
    """Why `path` must not be written, or None when it may be.

    A path may be written when it is absent (in an existing directory) or a regular file
    with a write permission bit that the user may write (checked on the mode bits as
    well, because root may write anything). A symlink is judged by its target. Returns
    one line such as "is a FIFO, not a regular file" or "is read-only"; touches nothing.
    """
    target = Path(os.path.realpath(path))
    try:
        st = target.stat()
    except FileNotFoundError:
        if not target.parent.is_dir():
            return f"directory {target.parent} does not exist"
        return None
    except OSError as e:
        return f"cannot stat ({e.strerror or e})"
    kind = _file_kind(st.st_mode)
    if kind != "regular file":
        return f"is a {kind}, not a regular file"
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(target, os.W_OK):
        return "is read-only"
    return None


def _file_kind(mode: int) -> str:
    """'regular file', 'directory', 'FIFO', 'character device', ... for an st_mode."""
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def write_atomic(path: str | Path, text: str, backup_suffix: str | None = None) -> None:
    """Write `text` (UTF-8, line endings as given) to `path` atomically.

    The text goes to a temporary file in the same directory, which then replaces
    `path` with `os.replace`, so readers never see a half-written file. `path` must be
    absent or a writable regular file (`output_problem`); anything else (a FIFO, a
    device, a directory, a read-only file) raises PermissionError and is left alone.
    When `backup_suffix` is given and `path` exists, the old file is first copied to
    `path + backup_suffix` (metadata kept); an existing backup is never overwritten
    (FileExistsError). The target's mode bits are kept; a new file gets the usual
    umask-based mode. A symlink is written through to its target. Raises OSError on
    I/O failure (the temporary file is removed).
    """
    target = Path(os.path.realpath(path))
    problem = output_problem(target)
    if problem is not None:
        raise PermissionError(errno.EPERM, f"{problem}; not replaced", str(path))
    exists = target.exists()
    if backup_suffix and exists:
        backup = target.with_name(target.name + backup_suffix)
        with open(target, "rb") as src, open(backup, "xb") as dst:  # "x": never overwrite
            shutil.copyfileobj(src, dst)
        shutil.copystat(target, backup)
    mode = stat.S_IMODE(target.stat().st_mode) if exists else _default_mode()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def keep_style(script: Script, new_source: str) -> str:
    """`new_source` (the patched `script.source`) with the input's line endings and BOM.

    When every line of `script.source` ends in CRLF (or CR), the lines the patch added
    with LF get the same ending (Python reads them alike, string literals included); a
    mixed input is left as it is. A plain script that starts with a UTF-8 BOM keeps it
    (a wrapper's BOM is kept by `render`). Returns the text to render.
    """
    source = script.source
    for newline in ("\r\n", "\r"):
        count = source.count(newline)
        if count and count == source.count("\n") + source.count("\r") - (count if newline == "\r\n" else 0):
            new_source = new_source.replace("\r\n", "\n").replace("\r", "\n").replace("\n", newline)
            break
    if not script.wrapped and source.startswith(_BOM) and not new_source.startswith(_BOM):
        new_source = _BOM + new_source
    return new_source


def _default_mode() -> int:
    """Mode a plain open() would give a new file (0666 minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# --------------------------------------------------------------------------- reading


def _read_text(p: Path) -> str:
    """The file's text, decoded as UTF-8 with no newline translation.

    Raises SourceError for a directory, a FIFO or device (not opened: reading one could
    block or never end), a file over MAX_SOURCE_BYTES, and unreadable or binary files.
    """
    if p.is_dir():
        raise SourceError(p, "is a directory, not a Python source file")
    try:
        kind = _file_kind(p.stat().st_mode)
        if kind != "regular file":
            raise SourceError(p, f"is a {kind}, not a regular file; not read")
        with p.open("rb") as f:
            data = f.read(MAX_SOURCE_BYTES + 1)
        if len(data) > MAX_SOURCE_BYTES:
            raise SourceError(p, f"file larger than {MAX_SOURCE_BYTES} bytes (the limit for a training script); not read")
    except FileNotFoundError:
        raise SourceError(p, "no such file") from None
    except PermissionError:
        raise SourceError(p, "cannot read file (permission denied)") from None
    except OSError as e:
        raise SourceError(p, f"cannot read file ({e.strerror or e})") from None
    if not data.strip():
        raise SourceError(p, "empty file")
    if b"\0" in data:
        raise SourceError(p, "not a Python source file (binary): contains NUL bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(p, f"not a Python source file (binary): invalid UTF-8 at byte {e.start}") from None


def _parse(path: Path, text: str, payload_line: int | None = None) -> cst.Module:
    """Parse `text` with libcst; syntax errors become SourceError.

    For a wrapped payload (`payload_line` = line of the exec call) the error is
    reported on the exec line and the message gives the line inside the payload.
    """
    _check_depth(path, text, payload_line)
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as e:
        line, col, why = _syntax_position(text, e)
        pieces = _longest_string_run(text) if _cpython_syntax_error(text) is None else 0
    except cst.CSTValidationError as e:  # parsed, but not a valid tree: "Cannot concatenate string and bytes."
        line, col, why = _cpython_syntax_error(text) or (1, 1, str(e))
        pieces = 0
    if pieces > MAX_PIECES:
        where = "" if payload_line is None else f"wrapped payload line {line}: "
        raise SourceError(
            path,
            f"{where}a string literal of {pieces} implicitly concatenated pieces; "
            f"valid Python, but libcst's parser reads at most {MAX_PIECES}",
            line=payload_line or line,
        )
    if payload_line is None:
        raise SourceError(path, f"syntax error at column {col}: {why}", line=line, col=col)
    raise SourceError(path, f"syntax error in wrapped payload line {line}, column {col}: {why}", line=payload_line)


def _check_depth(path: Path, text: str, payload_line: int | None) -> None:
    """Refuse code nested deeper than MAX_NESTING, asking CPython first.

    CPython's parser (`compile(..., PyCF_ONLY_AST)`, which never runs the code) rejects
    what it cannot handle with an exception instead of crashing, as libcst's native
    parser does on 5,000 nested parentheses. Other SyntaxErrors are left to libcst: a
    script may need a newer Python than the one running (3.12 f-strings).
    """
    def where(line: int | None) -> str:
        if payload_line is None:
            return ""
        return "wrapped payload: " if line is None else f"wrapped payload line {line}: "

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(min(limit, 1000))  # CPython's default depth, not _deep_recursion's
    try:
        tree = compile(text, str(path), "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as e:
        if any(s in str(e.msg) for s in _CPYTHON_LIMITS):
            line = e.lineno or 1
            raise SourceError(path, f"{where(line)}nested too deeply for Python's parser ({e.msg})", line=payload_line or line) from None
        return
    except (RecursionError, MemoryError) as e:
        raise SourceError(path, f"{where(None)}code nested too deeply for Python's parser ({type(e).__name__})", line=payload_line) from None
    except ValueError:
        return
    finally:
        sys.setrecursionlimit(limit)
    depth, line = _ast_depth(tree)
    if depth > MAX_NESTING:
        raise SourceError(
            path, f"{where(line)}code nested more than {MAX_NESTING} levels deep (the limit for a training script)", line=payload_line or line
        )


def _ast_depth(tree: ast.AST) -> tuple[int, int]:
    """(greatest depth of `tree`, a line at that depth), walked without recursion.

    Stops early, reporting MAX_NESTING + 1, once the limit is passed.
    """
    best, best_line = 0, 1
    stack = [(tree, 1, 1)]
    while stack:
        node, depth, line = stack.pop()
        line = getattr(node, "lineno", line)
        if depth > best:
            best, best_line = depth, line
            if best > MAX_NESTING:
                break
        stack.extend((child, depth + 1, line) for child in ast.iter_child_nodes(node))
    return best, best_line


def _longest_string_run(text: str) -> int:
    """Most STRING tokens in a row in `text` (implicit concatenation), 0 if it does not tokenize."""
    best = run = 0
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                run += 1
                best = max(best, run)
            elif tok.type not in skip or tok.type == tokenize.NEWLINE:
                run = 0
    except (tokenize.TokenError, SyntaxError):
        return best
    return best


def _syntax_position(text: str, err: cst.ParserSyntaxError) -> tuple[int, int, str]:
    """(1-based line, 1-based column, reason) of a libcst syntax error.

    libcst's parser errors point at the token where parsing stopped, often the start
    of the next line; its tokenizer errors (unterminated string, stray character)
    always say 1:0. CPython's parser (`ast.parse`, which never runs the code) is
    exact, but on an interpreter older than the script it also rejects newer syntax
    (3.12 f-strings) that appears earlier, so its answer is only taken where it cannot
    be such a false alarm: a parser error's line or the one before, or a tokenizer
    error that the `tokenize` module cannot place.
    """
    line, col, why = err.raw_line, err.editor_column, _syntax_reason(err.message)
    if err.message.startswith("tokenizer error"):
        return _tokenizer_position(text) or _cpython_syntax_error(text) or (line, col, why)
    cpython = _cpython_syntax_error(text)
    if cpython is not None and line - 1 <= cpython[0] <= line:
        return cpython
    return line, col, why


def _cpython_syntax_error(text: str) -> tuple[int, int, str] | None:
    """(line, column, message) of CPython's SyntaxError for `text`, if it raises one."""
    try:
        ast.parse(text)
    except SyntaxError as e:
        if e.lineno:
            return e.lineno, e.offset or 1, e.msg
    except (ValueError, MemoryError, RecursionError):
        pass
    return None


def _tokenizer_position(text: str) -> tuple[int, int, str] | None:
    """Where Python's `tokenize` trips over `text`, if it can say."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.ERRORTOKEN and tok.string.strip():
                what = "unterminated string" if tok.string in "'\"" else f"invalid character {tok.string!r}"
                return tok.start[0], tok.start[1] + 1, what
    except tokenize.TokenError as e:
        message, (row, column) = e.args
        if "string" in message:  # "EOF in multi-line string": start of the string
            return row, column + 1, "unterminated triple-quoted string"
    except SyntaxError as e:  # IndentationError, or the 3.12+ C tokenizer's errors
        if e.lineno:
            return e.lineno, e.offset or 1, e.msg
    return None


def _syntax_reason(message: str) -> str:
    """libcst's message without its own 'parser error: error at L:C:' preamble."""
    for lead in ("parser error: ", "tokenizer error: "):
        if message.startswith(lead):
            message = message[len(lead):]
    if message.startswith("error at "):
        _, sep, rest = message.partition(": ")
        if sep:
            message = rest
    return message


def _analyse(path: Path, raw: str, check_payload: bool) -> tuple[str, Wrapper | None, cst.Module | None]:
    """(code to patch, wrapper or None, that code parsed or None) for the file text `raw`."""
    has_bom = raw.startswith(_BOM)
    # libcst drops a BOM when printing, so parse without it and re-add it on render.
    module = _parse(path, raw[1:] if has_bom else raw)
    imports = _ImportTable.of(module)
    stmts = _top_level_statements(module)
    lines = _Lines(module)
    stmt = _wrapper_statement(path, stmts, imports, lines)
    if stmt is None:
        return raw, None, None if has_bom else module

    exec_line = lines.of(stmt)
    match = _match_wrapper(path, _exec_call(stmt), imports, exec_line)
    blob = _decode_literal(path, match, exec_line)
    payload = _decompress(path, match, blob, exec_line)
    parsed = None
    if check_payload:
        if not payload.strip():
            raise SourceError(path, "wrapped payload is empty", line=exec_line)
        parsed = _parse(path, payload, payload_line=exec_line)
    wrapper = _make_wrapper(module, stmts, match, blob, raw, exec_line, has_bom)
    return payload, wrapper, parsed


def _wrapper_statement(
    path: Path, stmts: list[cst.CSTNode], imports: "_ImportTable", lines: "_Lines"
) -> cst.Expr | None:
    """The top-level `exec(<codec>.decompress(...))` statement, or None for plain code.

    Raises SourceError for an `exec(open(X).read())` indirection and for wrappers this
    module cannot re-render faithfully (two of them, or one mixed with other code).
    """
    execs = [s for s in stmts if _exec_call(s) is not None]
    if not execs:
        return None
    exec_ids = {id(s) for s in execs}
    others = [s for s in stmts if id(s) not in exec_ids and not _is_wrapper_furniture(s)]

    if not others and len(execs) == 1 and _is_indirection(_exec_call(execs[0])):
        target = _indirection_target(path, _exec_call(execs[0]))
        raise SourceError(
            path,
            f"this file only runs exec(open(...).read()); the code is in {target}: patch that file instead",
            line=lines.of(execs[0]),
        )

    wrappers = [s for s in execs if _looks_like_wrapper(_exec_call(s), imports)]
    if not wrappers:
        return None
    if len(wrappers) > 1:
        raise SourceError(path, "more than one compressed exec wrapper in one file", line=lines.of(wrappers[1]))
    if others:
        raise SourceError(
            path,
            "compressed exec wrapper mixed with other code; only a pure wrapper "
            "(imports, __wrapper_size__, one exec) is supported",
            line=lines.of(others[0]),
        )
    return wrappers[0]


def _top_level_statements(module: cst.Module) -> list[cst.CSTNode]:
    """Module-level small statements and compound statements, in order."""
    out: list[cst.CSTNode] = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            out.extend(stmt.body)
        else:
            out.append(stmt)
    return out


def _exec_call(stmt: cst.CSTNode) -> cst.Call | None:
    """The `exec(...)` call if `stmt` is a bare exec expression statement."""
    if m.matches(stmt, m.Expr(value=m.Call(func=m.Name("exec")))):
        call = stmt.value
        if call.args and call.args[0].keyword is None and not call.args[0].star:
            return call
    return None


def _is_wrapper_furniture(stmt: cst.CSTNode) -> bool:
    """Statements a pure wrapper may hold besides its exec: imports, docstring, size."""
    return (
        isinstance(stmt, (cst.Import, cst.ImportFrom, cst.Pass))
        or m.matches(stmt, m.Expr(value=m.SimpleString() | m.ConcatenatedString()))
        or _wrapper_size_int(stmt) is not None
    )


def _wrapper_size_int(stmt: cst.CSTNode) -> cst.Integer | None:
    """The Integer node of `__wrapper_size__ = N`, else None."""
    pattern = m.Assign(targets=[m.AssignTarget(target=m.Name("__wrapper_size__"))], value=m.Integer())
    return stmt.value if m.matches(stmt, pattern) else None


class _Lines:
    """1-based start lines of nodes, computed on first use (positions are costly)."""

    def __init__(self, module: cst.Module):
        self._module = module
        self._pos = None

    def of(self, node: cst.CSTNode) -> int:
        if self._pos is None:
            # unsafe_skip_copy keeps node identity, so positions key our own nodes.
            wrapper = MetadataWrapper(self._module, unsafe_skip_copy=True)
            self._pos = wrapper.resolve(PositionProvider)
        return self._pos[node].start.line


# --------------------------------------------------------------------------- matching


@dataclass
class _ImportTable:
    """Top-level import bindings: alias -> module, and name -> (module, attribute)."""

    modules: dict[str, str]
    names: dict[str, tuple[str, str]]

    @classmethod
    def of(cls, module: cst.Module) -> "_ImportTable":
        table = cls({}, {})
        for stmt in _top_level_statements(module):
            if isinstance(stmt, cst.Import):
                for alias in stmt.names:
                    full = dotted(alias.name)
                    if alias.asname is not None:
                        table.modules[alias.asname.name.value] = full
                    elif "." not in full:
                        table.modules[full] = full
            elif isinstance(stmt, cst.ImportFrom) and stmt.module is not None and not stmt.relative:
                if isinstance(stmt.names, cst.ImportStar):
                    continue
                mod = dotted(stmt.module)
                for alias in stmt.names:
                    bound = alias.asname.name.value if alias.asname else alias.name.value
                    table.names[bound] = (mod, dotted(alias.name))
        return table

    def resolve(self, func: cst.BaseExpression) -> tuple[str, str] | None:
        """(module, function) that `func` (`L.decompress` or `decompress`) refers to."""
        if m.matches(func, m.Attribute(value=m.Name(), attr=m.Name())):
            mod = self.modules.get(func.value.value)
            return (mod, func.attr.value) if mod else None
        if isinstance(func, cst.Name):
            return self.names.get(func.value)
        return None


@dataclass
class _Match:
    """What `_match_wrapper` found in the exec call."""

    codec: str
    encoding: str
    kwargs: dict
    literal: cst.BaseExpression
    pieces: list[cst.SimpleString]
    text_decode: bool


def _strip_decode(expr: cst.BaseExpression) -> tuple[cst.BaseExpression, cst.Call | None]:
    """Split `X.decode(...)` into (X, the decode call); other expressions unchanged."""
    if m.matches(expr, m.Call(func=m.Attribute(attr=m.Name("decode")))):
        return expr.func.value, expr
    return expr, None


def _looks_like_wrapper(call: cst.Call, imports: _ImportTable) -> bool:
    """The exec argument is `<something>.decompress(...)` (optionally `.decode()`d)."""
    inner, _ = _strip_decode(call.args[0].value)
    if not isinstance(inner, cst.Call):
        return False
    if m.matches(inner.func, m.Attribute(attr=m.Name("decompress"))):
        return True
    resolved = imports.resolve(inner.func)
    return resolved is not None and resolved[1] == "decompress"


def _match_wrapper(path: Path, call: cst.Call, imports: _ImportTable, line: int) -> _Match:
    """Check the exec call against the supported wrapper form and extract its parts."""

    def fail(why: str) -> SourceError:
        return SourceError(path, f"unsupported exec wrapper: {why}", line=line)

    inner, decode_call = _strip_decode(call.args[0].value)
    if decode_call is not None:
        _check_decode_args(decode_call, fail)
    resolved = imports.resolve(inner.func)
    if resolved is None or resolved[1] != "decompress":
        raise fail("cannot tell which module's decompress() is called (import it at the top of the file)")
    codec = resolved[0]
    if codec not in CODECS:
        raise fail(f"codec {codec!r} (supported: {', '.join(CODECS)})")

    data_arg, kwargs = _decompress_args(inner, codec, imports, fail)
    enc_call = data_arg.value
    enc = imports.resolve(enc_call.func) if isinstance(enc_call, cst.Call) else None
    if enc is None or enc[0] != "base64" or enc[1] not in ENCODINGS:
        raise fail(f"the data must be base64.<{'|'.join(ENCODINGS)}>(<literal>)")
    if len(enc_call.args) != 1 or enc_call.args[0].keyword is not None or enc_call.args[0].star:
        raise fail(f"{enc[1]}() must take exactly one literal argument")
    literal = enc_call.args[0].value
    pieces = _literal_pieces(literal)
    if pieces is None:
        raise fail("the encoded data is not a plain string or bytes literal")
    return _Match(codec, enc[1], kwargs, literal, pieces, decode_call is not None)


def _check_decode_args(decode_call: cst.Call, fail) -> None:
    """Only `.decode()` / `.decode("utf-8")` are accepted: payloads are read as UTF-8."""
    args = decode_call.args
    if not args:
        return
    arg = args[0]
    if len(args) == 1 and not arg.star and (arg.keyword is None or arg.keyword.value == "encoding"):
        value = arg.value
        if isinstance(value, cst.SimpleString) and str(value.evaluated_value).lower() in _UTF8_NAMES:
            return
    raise fail(".decode() with an encoding other than UTF-8")


def _decompress_args(call: cst.Call, codec: str, imports: _ImportTable, fail) -> tuple[cst.Arg, dict]:
    """(the data argument, the other arguments resolved to Python values by name)."""
    params = _DECOMPRESS_PARAMS[codec]
    positional = [a for a in call.args if a.keyword is None]
    if not positional or any(a.star for a in call.args):
        raise fail("decompress() needs the encoded data as its first argument (no * or **)")
    kwargs: dict = {}
    for i, arg in enumerate(positional[1:]):
        if i >= len(params):
            raise fail(f"too many positional arguments to {codec}.decompress()")
        kwargs[params[i]] = _resolve_value(arg.value, codec, imports, fail)
    for arg in call.args:
        if arg.keyword is None:
            continue
        name = arg.keyword.value
        if name not in params or name in kwargs:
            raise fail(f"unexpected keyword {name!r} for {codec}.decompress()")
        kwargs[name] = _resolve_value(arg.value, codec, imports, fail)
    return positional[0], kwargs


def _resolve_value(node: cst.BaseExpression, codec: str, imports: _ImportTable, fail) -> Any:
    """Python value of a keyword argument: literals and allowlisted codec constants only."""
    if isinstance(node, (cst.Integer, cst.SimpleString, cst.ConcatenatedString)):
        if isinstance(node, cst.ConcatenatedString) and _literal_pieces(node) is None:
            raise fail("f-strings are not allowed in decompress() arguments")
        return node.evaluated_value
    if m.matches(node, m.Name("True") | m.Name("False") | m.Name("None")):
        return {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, (cst.List, cst.Tuple)):
        items = []
        for el in node.elements:
            if not isinstance(el, cst.Element):
                raise fail("starred element in decompress() arguments")
            items.append(_resolve_value(el.value, codec, imports, fail))
        return items if isinstance(node, cst.List) else tuple(items)
    if isinstance(node, cst.Dict):
        out = {}
        for el in node.elements:
            if not isinstance(el, cst.DictElement):
                raise fail("** in a dict in decompress() arguments")
            out[_resolve_value(el.key, codec, imports, fail)] = _resolve_value(el.value, codec, imports, fail)
        return out
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        value = _int_value(_resolve_value(node.expression, codec, imports, fail), fail)
        return -value if isinstance(node.operator, cst.Minus) else value
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.BitOr, cst.Add, cst.Subtract)):
        left = _int_value(_resolve_value(node.left, codec, imports, fail), fail)
        right = _int_value(_resolve_value(node.right, codec, imports, fail), fail)
        if isinstance(node.operator, cst.BitOr):
            return left | right
        return left + right if isinstance(node.operator, cst.Add) else left - right
    resolved = imports.resolve(node) if isinstance(node, (cst.Attribute, cst.Name)) else None
    if resolved is not None and resolved[0] == codec and _allowed_constant(codec, resolved[1]):
        return getattr(_codec_module(codec), resolved[1])
    raise fail(f"cannot resolve a decompress() argument safely: {cst.Module([]).code_for_node(node)!r}")


def _int_value(value: Any, fail) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise fail("arithmetic on a non-integer in decompress() arguments")
    return value


def _allowed_constant(codec: str, name: str) -> bool:
    mod = _codec_module(codec)
    allowed = name.startswith(_CONST_PREFIXES[codec]) or name in _CONST_NAMES.get(codec, ())
    return allowed and isinstance(getattr(mod, name, None), int)


def _codec_module(codec: str):
    return {"lzma": lzma, "zlib": zlib, "bz2": bz2, "gzip": gzip}[codec]


def _literal_pieces(node: cst.BaseExpression) -> list[cst.SimpleString] | None:
    """The SimpleString pieces of a (possibly implicitly concatenated) literal.

    libcst nests `"a" "b" "c"` to the right: Concat("a", Concat("b", "c")). Returns
    None when a piece is an f-string.
    """
    pieces: list[cst.SimpleString] = []
    while isinstance(node, cst.ConcatenatedString):
        if not isinstance(node.left, cst.SimpleString):
            return None
        pieces.append(node.left)
        node = node.right
    if not isinstance(node, cst.SimpleString):
        return None
    pieces.append(node)
    return pieces


def _joiner(node: cst.BaseExpression) -> tuple[str | None, Any]:
    """(source text, whitespace node) between the first two pieces, or (None, None)."""
    if not isinstance(node, cst.ConcatenatedString):
        return None, None
    ws = node.whitespace_between
    return cst.Module([]).code_for_node(ws), ws


# --------------------------------------------------------------------------- indirection


_OPEN_READ = m.Call(func=m.Attribute(value=m.Call(func=m.Name("open")), attr=m.Name("read")))
_READ_TEXT = m.Call(func=m.Attribute(attr=m.Name("read_text")))
_FILE_REPLACE = m.Call(
    func=m.Attribute(value=m.Name("__file__"), attr=m.Name("replace")),
    args=[m.Arg(value=m.SimpleString()), m.Arg(value=m.SimpleString())],
)


def _is_indirection(call: cst.Call) -> bool:
    """`exec(open(X).read())` or `exec(<path>.read_text())`."""
    return m.matches(call.args[0].value, _OPEN_READ | _READ_TEXT)


def _indirection_target(path: Path, call: cst.Call) -> str:
    """Best static guess at the file that `exec(open(X).read())` runs."""
    reader = call.args[0].value.func.value  # open(X) / <path expression>
    # The record's form: open(__file__.replace("train_gpt.py", "train_gpt_decode.py")).
    for found in m.findall(reader, _FILE_REPLACE):
        old, new = (a.value.evaluated_value for a in found.args)
        if isinstance(old, str) and isinstance(new, str):
            return str(Path(str(path).replace(old, new)))
    # Otherwise name the last .py literal, e.g. os.path.join(dirname(__file__), "x.py").
    names = [
        s.evaluated_value
        for s in m.findall(reader, m.SimpleString())
        if isinstance(s.evaluated_value, str) and s.evaluated_value.endswith(".py")
    ]
    return str(path.parent / names[-1]) if names else "another file"


# --------------------------------------------------------------------------- decoding


def _decode_literal(path: Path, match: _Match, line: int) -> bytes:
    """Compressed bytes from the encoded literal; bad encoding -> SourceError."""
    values = [p.evaluated_value for p in match.pieces]
    if len({type(v) for v in values}) > 1:
        raise SourceError(path, "unsupported exec wrapper: the literal mixes bytes and str pieces", line=line)
    encoded = b"".join(values) if _is_bytes(match.pieces[0]) else "".join(values)
    try:
        return getattr(base64, match.encoding)(encoded)
    except (ValueError, TypeError) as e:  # binascii.Error is a ValueError
        raise SourceError(path, f"corrupt wrapper payload: bad {match.encoding} data ({e})", line=line) from None


def _decompress(path: Path, match: _Match, blob: bytes, line: int) -> str:
    """Payload text from the compressed bytes; bad data, non-UTF-8 or a payload over
    MAX_SOURCE_BYTES -> SourceError."""
    try:
        data = decompress_capped(match.codec, blob, match.kwargs, MAX_SOURCE_BYTES)
    except _TooLarge:
        why = f"wrapped payload decompresses to more than {MAX_SOURCE_BYTES} bytes (the limit for a training script); not unpacked"
        raise SourceError(path, why, line=line) from None
    except (lzma.LZMAError, zlib.error, OSError, EOFError, ValueError, TypeError, MemoryError) as e:
        raise SourceError(path, f"corrupt wrapper payload: {match.codec} decompress failed ({e})", line=line) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        why = f"corrupt wrapper payload: decompressed data is not UTF-8 (byte {e.start})"
        raise SourceError(path, why, line=line) from None


class _TooLarge(Exception):
    """Decompressed data would pass the cap."""


def decompress_capped(codec: str, blob: bytes, kwargs: dict, cap: int) -> bytes:
    """`<codec>.decompress(blob, **kwargs)`, streamed, stopping after `cap` bytes of output.

    Same result and same errors as the codec's own decompress (lzma and bz2:
    concatenated streams, trailing garbage after the first ignored; zlib: one stream;
    gzip: every member), but never holds more than `cap` + 1 decompressed bytes.
    Raises `_TooLarge` past `cap`; the codec's error (LZMAError, zlib.error, OSError,
    EOFError, ValueError, TypeError) for bad data or arguments.
    """
    if codec == "gzip":
        with gzip.GzipFile(fileobj=io.BytesIO(blob)) as f:
            data = f.read(cap + 1)
        if len(data) > cap:
            raise _TooLarge
        return data
    if codec == "zlib":
        d = zlib.decompressobj(kwargs.get("wbits", zlib.MAX_WBITS))
        data = d.decompress(blob, cap + 1)
        if len(data) > cap:
            raise _TooLarge
        if not d.eof:
            raise zlib.error("Error -5 while decompressing data: incomplete or truncated stream")
        return data
    make = (lambda: lzma.LZMADecompressor(**kwargs)) if codec == "lzma" else bz2.BZ2Decompressor
    bad = lzma.LZMAError if codec == "lzma" else OSError
    out: list[bytes] = []
    total = 0
    while True:
        d = make()
        try:
            chunk = d.decompress(blob, max_length=cap - total + 1)
        except bad:
            if out:
                break  # trailing data that is not another stream: ignored, as decompress does
            raise
        total += len(chunk)
        if total > cap:
            raise _TooLarge
        out.append(chunk)
        if not d.eof:
            if d.needs_input:
                raise EOFError("Compressed data ended before the end-of-stream marker was reached")
            raise _TooLarge  # output stopped at max_length
        blob = d.unused_data
        if not blob:
            break
    return b"".join(out)


def _is_bytes(piece: cst.SimpleString) -> bool:
    return "b" in piece.prefix.lower()


def _prefix(piece: cst.SimpleString) -> str:
    """The literal's prefix as written (libcst's `.prefix` lower-cases it)."""
    return piece.value[: len(piece.value) - len(piece.value.lstrip("bBrRuU"))]


def _compress_kwargs(codec: str, kwargs: dict, blob: bytes) -> tuple[dict, ...]:
    """Candidate arguments for `<codec>.compress` that its decompress call will accept.

    Only the strongest settings, since the competition counts code bytes. lzma gets two
    candidates, preset 9 then 9|EXTREME: `render` keeps the smaller output, ties going
    to preset 9, which the real records used (EXTREME is sometimes larger). Where the
    decompress arguments auto-detect the container (lzma, zlib), it is read from `blob`.
    """
    if codec == "lzma":
        best = _lzma_kwargs(kwargs, blob)
        return (_with_preset(best, 9), best)
    if codec == "zlib":
        wbits = kwargs.get("wbits", zlib.MAX_WBITS)
        if wbits == 0 or wbits >= 32:  # decompress auto-detects zlib vs gzip header
            wbits = 16 + zlib.MAX_WBITS if blob.startswith(_GZIP_MAGIC) else zlib.MAX_WBITS
        return ({"level": 9, "wbits": wbits},)
    if codec == "bz2":
        return ({"compresslevel": 9},)
    return ({"compresslevel": 9, "mtime": 0},)  # gzip; mtime 0 keeps output reproducible


def _with_preset(kw: dict, preset: int) -> dict:
    """Copy of lzma compress arguments with every preset replaced by `preset`."""
    out = copy.deepcopy(kw)
    if "preset" in out:
        out["preset"] = preset
    for spec in out.get("filters", []):
        if spec.get("preset") == _MAX_PRESET:
            spec["preset"] = preset
    return out


def _lzma_kwargs(kwargs: dict, blob: bytes) -> dict:
    """lzma.compress arguments at preset 9|EXTREME matching the decompress kwargs."""
    fmt = kwargs.get("format", lzma.FORMAT_AUTO)
    if fmt == lzma.FORMAT_RAW:
        filters = copy.deepcopy(kwargs.get("filters") or [])
        for spec in filters:
            # preset only fills in options the decompress filters leave unset.
            if spec.get("id") in (lzma.FILTER_LZMA1, lzma.FILTER_LZMA2) and "preset" not in spec:
                spec["preset"] = _MAX_PRESET
        return {"format": lzma.FORMAT_RAW, "filters": filters}
    if fmt == lzma.FORMAT_AUTO:
        fmt = lzma.FORMAT_XZ if blob.startswith(_XZ_MAGIC) else lzma.FORMAT_ALONE
    if fmt == lzma.FORMAT_XZ:
        check = blob[7] & 0x0F if len(blob) > 7 else lzma.CHECK_CRC64  # stream flags
        return {"format": fmt, "check": check, "preset": _MAX_PRESET}
    return {"format": fmt, "preset": _MAX_PRESET}


def _make_wrapper(
    module: cst.Module,
    stmts: list[cst.CSTNode],
    match: _Match,
    blob: bytes,
    raw: str,
    line: int,
    has_bom: bool,
) -> Wrapper:
    """Record everything `render` needs to re-pack code in the same style."""
    first = match.pieces[0]
    joiner_text, joiner_node = _joiner(match.literal)
    width = len(first.evaluated_value) if len(match.pieces) > 1 else None
    size_nodes = [n for n in (_wrapper_size_int(s) for s in stmts) if n is not None]
    size_node = size_nodes[0] if size_nodes else None
    delta = code_bytes(raw) - int(size_node.evaluated_value) if size_node is not None else None
    return Wrapper(
        codec=match.codec,
        encoding=match.encoding,
        decompress_kwargs=match.kwargs,
        is_bytes_literal=_is_bytes(first),
        compress_kwargs=_compress_kwargs(match.codec, match.kwargs, blob),
        quote=first.quote,
        prefix=_prefix(first),
        piece_width=width or None,
        joiner=joiner_text,
        text_decode=match.text_decode,
        line=line,
        wrapper_size_delta=delta,
        has_bom=has_bom,
        module=module,
        literal_node=match.literal,
        joiner_node=joiner_node,
        size_node=size_node,
    )


# --------------------------------------------------------------------------- rendering


def _encode_payload(w: Wrapper, source: str) -> str:
    """Compressed and encoded `source`, as the text to put inside the literal."""
    data = source.encode("utf-8")
    # min() keeps the first of equal sizes, so ties go to the first candidate.
    blob = min((_compress(w.codec, data, kw) for kw in w.compress_kwargs), key=len)
    return _ENCODERS[w.encoding](blob).decode("ascii")


def _compress(codec: str, data: bytes, kw: dict) -> bytes:
    """`data` compressed by `codec` with arguments `kw` (from `_compress_kwargs`)."""
    if codec == "lzma":
        return lzma.compress(data, **kw)
    if codec == "zlib":
        # compressobj, not compress(wbits=...), which needs Python 3.11.
        c = zlib.compressobj(kw["level"], zlib.DEFLATED, kw["wbits"])
        return c.compress(data) + c.flush()
    if codec == "bz2":
        return bz2.compress(data, **kw)
    return gzip.compress(data, **kw)


def _build_literal(w: Wrapper, text: str) -> cst.BaseExpression:
    """The new literal: same prefix, quote, piece width, joiner and parentheses."""
    if w.piece_width is None:
        chunks = [text]
    else:
        chunks = [text[i : i + w.piece_width] for i in range(0, len(text), w.piece_width)] or [""]
    node: cst.BaseExpression = _piece(w.prefix, w.quote, chunks[-1])
    for chunk in reversed(chunks[:-1]):
        left = _piece(w.prefix, w.quote, chunk)
        node = cst.ConcatenatedString(left=left, right=node, whitespace_between=w.joiner_node)
    old = w.literal_node
    return node.with_changes(lpar=old.lpar, rpar=old.rpar)


def _piece(prefix: str, quote: str, chunk: str) -> cst.SimpleString:
    """One string piece holding `chunk` verbatim.

    Base85/64/32 text never needs escaping, but Ascii85 can hold quotes and
    backslashes: those are escaped, and a raw prefix is dropped for such a piece
    because raw strings cannot escape them.
    """
    q = quote[0]
    if "r" in prefix.lower() and (q in chunk or "\\" in chunk):
        prefix = "".join(c for c in prefix if c not in "rR")
    if "r" not in prefix.lower():
        chunk = chunk.replace("\\", "\\\\").replace(q, "\\" + q)
    return cst.SimpleString(f"{prefix}{quote}{chunk}{quote}")


class _Swap(cst.CSTTransformer):
    """Replace nodes by identity, leaving every other byte of the module as it was."""

    def __init__(self, swaps: dict[int, cst.CSTNode]):
        super().__init__()
        self.swaps = swaps

    def on_leave(self, original_node, updated_node):
        return self.swaps.get(id(original_node), updated_node)


def _render_module(w: Wrapper, literal: cst.BaseExpression) -> str:
    """Wrapper text with the new literal and, if present, a consistent __wrapper_size__."""
    bom = _BOM if w.has_bom else ""
    if w.size_node is None:
        return bom + w.module.visit(_Swap({id(w.literal_node): literal})).code
    # N = file bytes - delta, but N's digit count changes the file size: iterate.
    n = int(w.size_node.evaluated_value)
    for _ in range(16):
        size = w.size_node.with_changes(value=str(n))
        text = bom + w.module.visit(_Swap({id(w.literal_node): literal, id(w.size_node): size})).code
        want = code_bytes(text) - w.wrapper_size_delta
        if want == n:
            return text
        n = want
    raise RuntimeError("__wrapper_size__ did not reach a fixed point")


def _check_round_trip(path: Path, w: Wrapper, rendered: str, new_source: str) -> None:
    """Decode `rendered` with the reader and insist it gives back `new_source`."""
    try:
        payload, again, _ = _analyse(path, rendered, check_payload=False)
    except SourceError as e:
        raise RuntimeError(f"rendered wrapper does not read back: {e}") from e
    if again is None or payload != new_source:
        raise RuntimeError("rendered wrapper does not decode to the new source")
    if (again.codec, again.encoding, again.decompress_kwargs) != (w.codec, w.encoding, w.decompress_kwargs):
        raise RuntimeError("rendered wrapper changed codec, encoding or decompress arguments")
    if again.wrapper_size_delta != w.wrapper_size_delta:
        raise RuntimeError("rendered __wrapper_size__ lost its relation to the file size")
