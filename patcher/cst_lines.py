"""Start lines of every node of a libcst tree, in one printing pass that tracks lines only.

libcst's `PositionProvider` prints the module with a state that records a line and a
column (`CodePosition`, `CodeRange` objects) for every node; resolving it costs about
four times a plain codegen. `start_lines` prints once with a state that keeps one line
number per node and no text, which costs little more than a plain codegen and gives
exactly `PositionProvider`'s `start.line` for every node (the syntactic start where a
node records one, a child's where it hoists it, else where its own printing begins).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import libcst as cst
from libcst._nodes.internal import CodegenState
from libcst.metadata.position_provider import NEWLINE_RE


@dataclass
class _LineState(CodegenState):
    """A printing state that counts lines and records each node's start line."""

    line: int = 1
    lines: dict = field(default_factory=dict)
    _stack: list = field(default_factory=list)

    def add_indent_tokens(self) -> None:
        pass  # indentation holds no newline

    def add_token(self, value: str) -> None:
        if "\n" in value or "\r" in value:
            self.line += len(NEWLINE_RE.split(value)) - 1

    def before_codegen(self, node: cst.CSTNode) -> None:
        self._stack.append(self.line)

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self._stack.pop()
        if node not in self.lines:  # a syntactic start, recorded below, wins
            self.lines[node] = start

    @contextmanager
    def record_syntactic_position(self, node: cst.CSTNode, *, start_node: Optional[cst.CSTNode] = None, end_node: Optional[cst.CSTNode] = None) -> Iterator[None]:
        start = self.line
        yield
        self.lines[node] = self.lines[start_node] if start_node is not None else start


def start_lines(module: cst.Module) -> dict[cst.CSTNode, int]:
    """{node: 1-based start line} for every node of `module` (keyed by identity, as
    libcst nodes hash), equal to `PositionProvider`'s `start.line` of each node."""
    state = _LineState(default_indent=module.default_indent, default_newline=module.default_newline)
    module._codegen(state)
    return state.lines


class LineIndex:
    """`start_lines` of a module, printed one top-level statement at a time, as asked.

    A survey asks the line of a few dozen nodes of a 160 KB module; printing the
    statements that hold them with the line-tracking state, and the statements before
    them with a plain codegen (to count their lines), costs a fraction of printing the
    whole module with that state. The lines are the same as `start_lines(module)`: a
    top-level statement prints the same tokens alone (`Module.code_for_node`) as in
    its module, its leading blank lines and comments included.

    module: the module; top_of: {node: the statement of `module.body` holding it} (the
    survey's `ScriptIndex.top_of`), or None to print the whole module on the first call.
    """

    def __init__(self, module: cst.Module, top_of=None):
        self.module = module
        self.top_of = top_of
        self._position = {id(s): i for i, s in enumerate(module.body)}
        header = "".join(module.code_for_node(line) for line in module.header)
        self._first_lines = [len(NEWLINE_RE.split(header))]  # body[i] starts at line _first_lines[i]
        self._printed: set[int] = set()
        self._lines: dict = {}
        self._whole: dict | None = None

    def line_of(self, node: cst.CSTNode) -> int:
        """1-based start line of `node` (`PositionProvider`'s `start.line`). Raises
        KeyError for a node that is not in the module."""
        top = self.top_of.get(node) if self.top_of is not None else None
        position = self._position.get(id(top)) if top is not None else None
        if position is None:  # the module itself, its header or footer, or not indexed
            if self._whole is None:
                self._whole = start_lines(self.module)
            return self._whole[node]
        if position not in self._printed:
            state = _LineState(default_indent=self.module.default_indent, default_newline=self.module.default_newline, line=self._first_line(position))
            top._codegen(state)
            self._lines.update(state.lines)
            self._printed.add(position)
        return self._lines[node]

    def _first_line(self, position: int) -> int:
        body = self.module.body
        while len(self._first_lines) <= position:
            done = len(self._first_lines) - 1
            code = self.module.code_for_node(body[done])
            self._first_lines.append(self._first_lines[done] + len(NEWLINE_RE.split(code)) - 1)
        return self._first_lines[position]
