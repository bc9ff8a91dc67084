"""The review diff (`--diff`): what a reviewer reads, the unwrapped payloads line by line.

A wrapped record is compared as its payload: the decompressed source before and after
the patch, never the base85 text. Lines the patch does not touch are the payload's own
(a minified record's one-line `Hyperparameters` body stays one line, with the toggles
appended where they are written). The injected runtime of a minified script is written
as python-minifier writes it (`;`-joined, one-line bodies) to save code bytes; in the
review diff it is shown formatted instead, one statement a line, 4-space indents, its
header comment kept: the same code (the same syntax tree), readable. The diff's `+++`
line says so. Everything else in the diff is byte for byte what is written.
"""

from __future__ import annotations

import ast
import difflib
from typing import Iterator

import libcst as cst

FORMATTED_NOTE = "injected runtime shown formatted; written minified"


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


def review_view(patched: str, runtime: str, minified: bool) -> tuple[str, bool]:
    """The patched source as the review diff shows it: `patched` with its injected
    `runtime` formatted (`readable_runtime`) when the script is `minified`. Returns the
    text and whether the runtime was reformatted."""
    if not (minified and runtime):
        return patched, False
    found = patched.find(runtime)
    crlf = runtime.replace("\n", "\r\n")
    if found < 0 and crlf in patched:  # the input's CRLF line endings
        runtime, found = crlf, patched.find(crlf)
    if found < 0:
        return patched, False
    shown = readable_runtime(runtime.replace("\r\n", "\n"))
    if runtime.endswith("\r\n"):
        shown = shown.replace("\n", "\r\n")
    return patched[:found] + shown + patched[found + len(runtime) :], True


def patch_diff(done, name: str) -> list[str]:
    """`review_diff` of a patch as `patcher.patch_file.patch_file` returned it (`done`, a
    `FileResult`: its original and patched sources, its runtime, minified where the script
    is), for the script called `name`: what `--diff` prints for one file."""
    survey = done.patch.survey
    return list(review_diff(done.original, done.patched, name, done.patch.runtime, survey is not None and survey.minified))


def review_diff(original: str, patched: str, name: str, runtime: str = "", minified: bool = False) -> Iterator[str]:
    """Unified diff lines (each ending in a newline) of `original` vs `patched`, both
    unwrapped sources, for the script called `name`; the runtime formatted as
    `review_view` says, the `+++` line noting it when it was."""
    shown, formatted = review_view(patched, runtime, minified)
    note = f"; {FORMATTED_NOTE}" if formatted else ""
    for line in difflib.unified_diff(original.splitlines(True), shown.splitlines(True), f"{name} (original)", f"{name} (patched{note})"):
        yield line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
