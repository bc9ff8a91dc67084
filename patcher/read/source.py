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

This module reads and writes files (atomic writes, line endings, BOM, limits on hostile
input in `patcher.read.bad_input`); the wrapper codec itself (matching, decoding, building
a wrapper) is `patcher.read.wrapper`.
"""

from __future__ import annotations

import ast
import errno
import io
import os
import shutil
import stat
import sys
import tempfile
import tokenize
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, PositionProvider

from patcher.read.bad_input import BOM, CPYTHON_LIMITS, LITERAL_ERRORS, MAX_NESTING, MAX_OPERATOR_RUN, MAX_PIECES, MAX_SOURCE_BYTES, SourceError
from patcher.read.wrapper import (
    ImportTable,
    Wrapper,
    build_literal,
    code_bytes,
    decode_literal,
    decompress_payload,
    encode_payload,
    indirection_target,
    is_indirection,
    looks_like_wrapper,
    make_wrapper,
    match_wrapper,
    render_module,
    top_level_statements,
    wrapper_size_int,
)

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


# --------------------------------------------------------------------------- data


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


def read_script(path: str | Path, on_text=None) -> Script:
    """Read a training script and unwrap it if it is a compressed exec wrapper.

    Returns a `Script`; `source` is the code to patch. on_text: called with the file's
    text once read, before it is parsed (to start work that needs only the text). Raises `SourceError` for a
    missing, unreadable or directory path, an empty or binary file, a syntax error in
    the file or in the wrapped payload, a corrupt or unsupported wrapper, and a file
    that only does `exec(open(<other file>).read())` (the message names that file).
    """
    p = Path(path)
    raw = _read_text(p)
    if on_text is not None:
        on_text(raw)
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
        text_len = len(encode_payload(w, new_source))
        pieces = -(-text_len // w.piece_width)
        if pieces > MAX_PIECES:
            raise SourceError(
                script.path,
                f"re-wrapping the patched payload in pieces of {w.piece_width} characters needs {pieces} pieces; "
                f"libcst reads at most {MAX_PIECES} (use --no-rewrap to write the payload as plain source); nothing written",
                line=w.line,
            )
    with _deep_recursion():
        text = encode_payload(w, new_source)
        literal = build_literal(w, text)
        rendered = render_module(w, literal)
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
        return "is a symlink loop" if e.errno == errno.ELOOP else f"cannot stat ({e.strerror or e})"
    kind = _file_kind(st.st_mode)
    if kind != "regular file":
        return f"is a {kind}, not a regular file"
    if not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(target, os.W_OK):
        return "is read-only"
    return None


def is_symlink_loop(path: str | Path) -> bool:
    """Whether resolving `path` never ends: it, or a symlink on the way to it, leads
    back to itself (ELOOP). Touches nothing."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


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


def write_atomic(path: str | Path, text: str, backup_suffix: str | None = None, temp: str | Path | None = None, on_staged=None) -> None:
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

    temp: the temporary file's path (in the directory of the file `path` leads to,
    symlinks resolved, for `os.replace`; one left there by a process that was killed is
    replaced), for a caller that must find it if this process is killed; default a
    fresh name. on_staged: called once the temporary
    file holds the whole text, just before it replaces `path`.
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
    if temp is None:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    else:
        tmp = str(temp)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp creates 0600
        if on_staged is not None:
            on_staged()
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
    if not script.wrapped and source.startswith(BOM) and not new_source.startswith(BOM):
        new_source = BOM + new_source
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
        if e.errno == errno.ELOOP:
            raise SourceError(p, "is a symlink loop; not read") from None
        raise SourceError(p, f"cannot read file ({e.strerror or e})") from None
    if not data.strip():
        raise SourceError(p, "empty file")
    if b"\0" in data:
        raise SourceError(p, "not a Python source file (binary): contains NUL bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(p, f"not a Python source file (binary): invalid UTF-8 at byte {e.start}") from None


def parse_known(path: Path, text: str, payload_line: int | None = None) -> cst.Module:
    """Parse `text` with libcst; syntax errors become SourceError.

    For a wrapped payload (`payload_line` = line of the exec call) the error is
    reported on the exec line and the message gives the line inside the payload.
    """
    _refuse_before_libcst(path, text, payload_line)
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


def _refuse_before_libcst(path: Path, text: str, payload_line: int | None) -> None:
    """Refuse, asking CPython first, what libcst would crash on, take minutes over or
    accept wrongly: code nested deeper than MAX_NESTING, a syntax error with an operator
    run over MAX_OPERATOR_RUN, a string literal CPython cannot decode.

    CPython's parser (`compile(..., PyCF_ONLY_AST)`, which never runs the code) rejects
    what it cannot handle with an exception instead of crashing, as libcst's native
    parser does on 5,000 nested parentheses. A string literal CPython cannot decode is
    refused with its message. Other SyntaxErrors are left to libcst: a script may need
    a newer Python than the one running (3.12 f-strings).
    """
    def where(line: int | None) -> str:
        if payload_line is None:
            return ""
        return "wrapped payload: " if line is None else f"wrapped payload line {line}: "

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(min(limit, 1000))  # CPython's default depth, not _deep_recursion's
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" and such: the one-line error says it
            warnings.simplefilter("ignore")
            tree = compile(text, str(path), "exec", ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as e:
        line = e.lineno or 1
        if any(s in str(e.msg) for s in CPYTHON_LIMITS):
            raise SourceError(path, f"{where(line)}nested too deeply for Python's parser ({e.msg})", line=payload_line or line) from None
        if e.msg.startswith(LITERAL_ERRORS):  # libcst parses the literal and fails later, on its value
            raise SourceError(path, f"{where(line)}syntax error: {e.msg}", line=payload_line or line) from None
        run, run_line = _longest_operator_run(text)
        if run > MAX_OPERATOR_RUN:  # libcst would take minutes to say the same
            raise SourceError(
                path, f"{where(line)}syntax error: {e.msg} (Python's parser; libcst not asked: a run of {run} binary operators at line {run_line})", line=payload_line or line
            ) from None
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

    Stops early, reporting MAX_NESTING + 1, once the limit is passed. The depth is
    counted level by level (a list per level, no per-node bookkeeping); the line, which
    only a refusal reports, is looked for only then (`_deepest_line`).
    """
    level, depth = [tree], 0
    while level:
        depth += 1
        if depth > MAX_NESTING:
            return _deepest_line(tree)
        level = [child for node in level for child in ast.iter_child_nodes(node)]
    return depth, 1


def _deepest_line(tree: ast.AST) -> tuple[int, int]:
    """(MAX_NESTING + 1, the line of a node at that depth) for a tree deeper than that."""
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


_OPERATORS = frozenset("+ - * / // % @ ** << >> & | ^".split())
_RUN_BREAKS = frozenset(", ; = :".split())


def _longest_operator_run(text: str) -> tuple[int, int]:
    """(most binary operators in one run, its line): operators counted at one bracket
    depth until a comma, `;`, `=`, `:` or the end of the line ends the run, e.g. 16,999 for
    `x = 1+1+...+1` of 17,000 terms. (0, 1) when the text does not tokenize."""
    best, best_line, runs = 0, 1, [0]
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.OP and token.string in _OPERATORS or token.type == tokenize.NAME and token.string in ("and", "or"):
                runs[-1] += 1
                if runs[-1] > best:
                    best, best_line = runs[-1], token.start[0]
            elif token.type == tokenize.OP and token.string in ("(", "[", "{"):
                runs.append(0)
            elif token.type == tokenize.OP and token.string in (")", "]", "}"):
                if len(runs) > 1:
                    runs.pop()  # the bracketed operand continues the run outside it
            elif token.type == tokenize.OP and token.string in _RUN_BREAKS or token.type == tokenize.NEWLINE:
                runs[-1] = 0
    except (tokenize.TokenError, SyntaxError):
        pass
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
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
    has_bom = raw.startswith(BOM)
    # libcst drops a BOM when printing, so parse without it and re-add it on render.
    module = parse_known(path, raw[1:] if has_bom else raw)
    imports = ImportTable.of(module)
    stmts = top_level_statements(module)
    lines = _Lines(module)
    stmt = _wrapper_statement(path, stmts, imports, lines)
    if stmt is None:
        return raw, None, None if has_bom else module

    exec_line = lines.of(stmt)
    match = match_wrapper(path, _exec_call(stmt), imports, exec_line)
    blob = decode_literal(path, match, exec_line)
    payload = decompress_payload(path, match, blob, exec_line)
    parsed = None
    if check_payload:
        if not payload.strip():
            raise SourceError(path, "wrapped payload is empty", line=exec_line)
        parsed = parse_known(path, payload, payload_line=exec_line)
    wrapper = make_wrapper(module, stmts, match, blob, raw, exec_line, has_bom)
    return payload, wrapper, parsed


def _wrapper_statement(
    path: Path, stmts: list[cst.CSTNode], imports: "ImportTable", lines: "_Lines"
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

    if not others and len(execs) == 1 and is_indirection(_exec_call(execs[0])):
        target = indirection_target(path, _exec_call(execs[0]))
        raise SourceError(
            path,
            f"this file only runs exec(open(...).read()); the code is in {target}: patch that file instead",
            line=lines.of(execs[0]),
        )

    wrappers = [s for s in execs if looks_like_wrapper(_exec_call(s), imports)]
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
        or wrapper_size_int(stmt) is not None
    )


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
    # render_module keeps the distance, or writes the file's own size where the kept one would be negative
    own_size = again.wrapper_size_delta == 0 and code_bytes(rendered) < (w.wrapper_size_delta or 0)
    if again.wrapper_size_delta != w.wrapper_size_delta and not own_size:
        raise RuntimeError("rendered __wrapper_size__ lost its relation to the file size")
