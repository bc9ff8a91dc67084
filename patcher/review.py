"""The review diff (`--diff`): what a reviewer reads, the unwrapped payloads line by line.

A wrapped record is compared as its payload: the decompressed source before and after
the patch, never the base85 text. Lines the patch does not touch are the payload's own
(a minified record's one-line `Hyperparameters` body stays one line, with the toggles
appended where they are written). The injected runtime of a minified script is written
as python-minifier writes it (`;`-joined, one-line bodies) to save code bytes; in the
review diff it is shown formatted instead, one statement a line, 4-space indents, its
header comment kept: the same code (the same syntax tree), readable. The shown text is
minified again, with the renderer's own minifier call, and compared with the bytes
written; the diff's `+++` line says that it was, or, when they differ, that the runtime is
shown as written instead. Everything else in the diff is byte for byte what is written.

A changed pair of long lines (a minified record's one-line `Hyperparameters`, over
`LONG_LINE` characters) is shown as one line starting with `~`: only the changed spans,
git's word diff style (`[-removed-]`, `{+added+}`), with a little context around each and
`…` for what is left out. Such a diff is for reading; it is not for `patch` to apply.
"""

from __future__ import annotations

import ast
import difflib
from typing import Iterable, Iterator

import libcst as cst

FORMATTED_NOTE = "injected runtime shown formatted; written minified"
SAME_NOTE = "re-minified: the bytes written"
DIFFERENT_NOTE = "injected runtime shown as written: the formatted text, re-minified, would differ from the bytes written"
LONG_LINE = 200  # characters: a changed pair with a line this long is shown as a word diff
CONTEXT = 40  # characters of unchanged text kept on each side of a change in a word diff
ELISION = "…"


def readable_runtime(runtime: str) -> str:
    """The runtime block `runtime` (source text of top-level statements) formatted for
    reading: each statement as `ast.unparse` writes it, its leading comments kept, a blank
    line before each def and class. Returns `runtime` itself when it does not parse."""
    try:
        block = cst.parse_module(runtime)
    except cst.ParserSyntaxError:
        return runtime
    out: list[str] = [line.comment.value for line in block.header if line.comment is not None]
    for stmt in block.body:
        comments = [line.comment.value for line in stmt.leading_lines if line.comment is not None]
        code = block.code_for_node(stmt.with_changes(leading_lines=()))
        try:
            text = ast.unparse(ast.parse(code))
        except SyntaxError:
            text = code.rstrip("\n")
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and out:
            out.append("")
        out.extend(comments)
        out.append(text)
    return "\n".join(out) + "\n"


def review_view(patched: str, runtime: str, minified: bool) -> tuple[str, str]:
    """The patched source as the review diff shows it: `patched` with its injected
    `runtime` formatted (`readable_runtime`) when the script is `minified` and the
    formatted text, minified again (`reminified`), is the runtime as written. Returns the
    text and a note for the diff's `+++` line: "" (nothing formatted), FORMATTED_NOTE plus
    SAME_NOTE, or DIFFERENT_NOTE (shown as written)."""
    if not (minified and runtime):
        return patched, ""
    found = patched.find(runtime)
    crlf = runtime.replace("\n", "\r\n")
    if found < 0 and crlf in patched:  # the input's CRLF line endings
        runtime, found = crlf, patched.find(crlf)
    if found < 0:
        return patched, ""
    written = patched[found : found + len(runtime)]
    shown = readable_runtime(written.replace("\r\n", "\n"))
    if not same_when_minified(shown, written.replace("\r\n", "\n")):
        return patched, DIFFERENT_NOTE
    if runtime.endswith("\r\n"):
        shown = shown.replace("\n", "\r\n")
    return patched[:found] + shown + patched[found + len(runtime) :], f"{FORMATTED_NOTE}; {SAME_NOTE}"


def same_when_minified(shown: str, written: str) -> bool:
    """Whether `shown` (the formatted runtime) minified the way the renderer minifies a
    runtime (`patcher.render.render.styled`) is `written` (the runtime's bytes in the
    file), and both carry the same comment lines. False when either does not parse."""
    from patcher.render.render import styled

    try:
        shown_block, written_block = cst.parse_module(shown), cst.parse_module(written)
    except cst.ParserSyntaxError:
        return False
    if _comments(shown_block) != _comments(written_block):
        return False
    again = cst.Module(styled(list(shown_block.body), True)).code
    bare = cst.Module([stmt.with_changes(leading_lines=[]) for stmt in written_block.body]).code
    return again == bare


def _comments(block: cst.Module) -> list[str]:
    """The comment lines of `block`'s header and before its top-level statements."""
    lines = list(block.header) + [line for stmt in block.body for line in stmt.leading_lines]
    return [line.comment.value for line in lines if line.comment is not None]


def patch_diff(done, name: str) -> list[str]:
    """`review_diff` of a patch as `patcher.patch_file.patch_file` returned it (`done`, a
    `FileResult`: its original and patched sources, its runtime, minified where the script
    is), for the script called `name`: what `--diff` prints for one file."""
    survey = done.patch.survey
    return list(review_diff(done.original, done.patched, name, done.patch.runtime, survey is not None and survey.minified))


def review_diff(original: str, patched: str, name: str, runtime: str = "", minified: bool = False) -> Iterator[str]:
    """Unified diff lines (each ending in a newline) of `original` vs `patched`, both
    unwrapped sources, for the script called `name`; the runtime formatted as
    `review_view` says, the `+++` line saying how it is shown; a changed pair of long
    lines as one `~` line (`word_diff`)."""
    shown, note = review_view(patched, runtime, minified)
    note = f"; {note}" if note else ""
    lines = difflib.unified_diff(original.splitlines(True), shown.splitlines(True), f"{name} (original)", f"{name} (patched{note})")
    for line in _with_word_diffs(lines):
        yield line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def _with_word_diffs(lines: Iterator[str]) -> Iterator[str]:
    """`lines` of a unified diff, each run of removed lines followed by added lines
    (a change) passed to `_change`. The `---`/`+++` header is passed as it is."""
    removed: list[str] = []
    added: list[str] = []
    in_hunks = False
    for line in lines:
        if not in_hunks:
            in_hunks = line.startswith("@@")
            yield line
        elif line.startswith("-") and not added:
            removed.append(line)
        elif line.startswith("+") and removed:
            added.append(line)
        else:
            yield from _change(removed, added)
            removed, added = [], []
            if line.startswith("-"):
                removed.append(line)
            else:
                yield line
    yield from _change(removed, added)


def _change(removed: list[str], added: list[str]) -> Iterator[str]:
    """One change of a unified diff: each removed line of over LONG_LINE characters that
    has a like added line (half its tokens or more in common) becomes one `~` line, its
    word diff with that line, where the removed line stood; the other lines unchanged."""
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    for i, old in enumerate(removed):
        if len(old) <= LONG_LINE:
            continue
        old_tokens = _tokens(old[1:].rstrip("\r\n"))
        best, best_ratio = None, 0.5
        for j, new in enumerate(added):
            if j in taken or len(new) <= LONG_LINE:
                continue
            matcher = difflib.SequenceMatcher(None, old_tokens, _tokens(new[1:].rstrip("\r\n")), autojunk=False)
            if matcher.real_quick_ratio() >= best_ratio and matcher.quick_ratio() >= best_ratio and matcher.ratio() >= best_ratio:
                best, best_ratio = j, matcher.ratio()
        if best is not None:
            pairs[i] = best
            taken.add(best)
    for i, old in enumerate(removed):
        if i in pairs:
            new = added[pairs[i]]
            end = "\n" if new.endswith("\n") else ""
            yield "~" + word_diff(old[1:].rstrip("\r\n"), new[1:].rstrip("\r\n")) + end
        else:
            yield old
    yield from (new for j, new in enumerate(added) if j not in taken)


def word_diff(old: str, new: str) -> str:
    """`old` changed into `new`, as one line in git's word diff style: `[-removed-]`,
    `{+added+}`, CONTEXT characters of unchanged text kept around each change, the rest
    of each unchanged stretch left out as `…`."""
    a, b = _tokens(old), _tokens(new)
    codes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    out: list[str] = []
    for index, (op, i1, i2, j1, j2) in enumerate(codes):
        if op == "equal":
            same = "".join(a[i1:i2])
            head = same[:CONTEXT] if index > 0 else ""
            tail = same[-CONTEXT:] if index < len(codes) - 1 else ""
            if len(head) + len(tail) >= len(same):
                out.append(same)
            else:
                out.append(f"{head}{ELISION}{tail}")
            continue
        if i2 > i1:
            out.append(f"[-{''.join(a[i1:i2])}-]")
        if j2 > j1:
            out.append(f"{{+{''.join(b[j1:j2])}+}}")
    return "".join(out)


def _tokens(line: str) -> list[str]:
    """`line` cut into words for `word_diff`: runs of letters, digits and underscores,
    runs of white space, and every other character alone. Joined, they are `line`."""
    tokens: list[str] = []
    for char in line:
        kind = "w" if char.isalnum() or char == "_" else "s" if char.isspace() else None
        last = tokens[-1][-1] if tokens else ""
        last_kind = "w" if last.isalnum() or last == "_" else "s" if last.isspace() else None
        if kind is not None and kind == last_kind:
            tokens[-1] += char
        else:
            tokens.append(char)
    return tokens


def coloured_review(lines: Iterable[str]) -> Iterator[str]:
    """`patcher.progress.coloured_diff` of the review diff `lines`, with a `~` line's
    removed spans red and its added spans green, as git colours a word diff."""
    from patcher.colour import GREEN, RED, RESET
    from patcher.progress import coloured_diff

    for line in lines:
        if not line.startswith("~"):
            yield from coloured_diff([line])
            continue
        parts = []
        for piece in _marked_spans(line):
            colour = RED if piece.startswith("[-") else GREEN if piece.startswith("{+") else None
            parts.append(f"{colour}{piece}{RESET}" if colour else piece)
        yield "".join(parts)


def _marked_spans(line: str) -> list[str]:
    """`line` cut at its word diff marks: `[-...-]` and `{+...+}` spans and the text between."""
    pieces: list[str] = []
    at = 0
    while at < len(line):
        starts = [(line.find(opening, at), opening, closing) for opening, closing in (("[-", "-]"), ("{+", "+}"))]
        starts = [s for s in starts if s[0] >= 0]
        if not starts:
            pieces.append(line[at:])
            break
        start, _, closing = min(starts)
        end = line.find(closing, start + 2)
        if end < 0:
            pieces.append(line[at:])
            break
        pieces.extend([line[at:start], line[start : end + 2]])
        at = end + 2
    return [p for p in pieces if p]
