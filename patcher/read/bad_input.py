"""What counts as bad input: `SourceError` (one line naming the file) and the caps on hostile input.
"""

from __future__ import annotations

import os




BOM = "\ufeff"  # a byte-order mark, read past and written back as found

# Caps on hostile input (the largest real record is about 160 KB of code, nested a few
# dozen levels). MAX_SOURCE_BYTES: a file, and the decompressed payload of a wrapper
# (decompression stops there instead of inflating a bomb into memory). MAX_NESTING:
# depth of CPython's syntax tree; deeper code is refused before libcst sees it, because
# libcst's native parser crashes (SIGSEGV) or turns quadratic on very deep code.
# MAX_PIECES: libcst's parser reads at most this many implicitly concatenated pieces.
# MAX_OPERATOR_RUN: binary operators in one run (`1+1+...+1`), checked where CPython's
# parser cannot give a tree to measure (a syntax error): libcst's parse time grows with
# the cube of the run (2,000: 2 s; 4,000: 17 s; 17,000: many minutes).
MAX_SOURCE_BYTES = 4 * 1024 * 1024
MAX_NESTING = 100
MAX_PIECES = 3000
MAX_OPERATOR_RUN = 1000
# CPython's own refusals of code too deep for its parser.
CPYTHON_LIMITS = ("too many nested parentheses", "too many levels of indentation", "too complex", "parser stack overflow")
# CPython's errors for a string literal it cannot decode, on every version: libcst
# accepts such a literal, and reading its value later would raise.
LITERAL_ERRORS = ("(unicode error)", "(value error)", "bytes can only contain ASCII")




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
