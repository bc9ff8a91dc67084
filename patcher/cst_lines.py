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
