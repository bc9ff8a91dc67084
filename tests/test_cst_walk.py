"""cst_walk: the read-only traversal makes exactly the calls libcst's own visit makes."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from patcher import cst_walk

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "fixtures").glob("*.py")) + sorted((ROOT / "patcher").rglob("[!_]*.py"))


class _Recorder(cst.CSTVisitor):
    def __init__(self, prune=()):
        self.calls: list[tuple[str, int]] = []
        self.prune = prune

    def on_visit(self, node):
        self.calls.append(("visit", id(node)))
        return not isinstance(node, self.prune)

    def on_leave(self, node):
        self.calls.append(("leave", id(node)))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_same_visits_as_libcst(path):
    module = cst.parse_module(path.read_text())
    expected, got = _Recorder(), _Recorder()
    module.visit(expected)
    cst_walk.visit(module, got)
    assert got.calls == expected.calls


def test_a_false_on_visit_prunes_the_subtree_as_in_libcst():
    module = cst.parse_module((ROOT / "fixtures" / "tokenstream_readable.py").read_text())
    expected, got = _Recorder(prune=(cst.FunctionDef,)), _Recorder(prune=(cst.FunctionDef,))
    module.visit(expected)
    cst_walk.visit(module, got)
    assert got.calls == expected.calls
    assert len(got.calls) < len(_count(module))


def _count(module):
    everything = _Recorder()
    cst_walk.visit(module, everything)
    return everything.calls


def test_children_match_libcst_for_every_node_type_present():
    module = cst.parse_module((ROOT / "fixtures" / "shuffled_minified.py").read_text() + (ROOT / "patcher" / "survey" / "survey.py").read_text())
    seen = set()
    for node in cst_walk.walk(module):
        assert [id(c) for c in cst_walk.children(node)] == [id(c) for c in node.children], type(node).__name__
        seen.add(type(node))
    assert len(seen) > 60  # the check covered most node kinds


def test_deep_nesting_does_not_recurse():
    # 3000 chained additions nest 3000 BinaryOperation nodes.
    module = cst.parse_module("x = " + " + ".join(["1"] * 3000) + "\n")
    recorder = _Recorder()
    cst_walk.visit(module, recorder)
    assert sum(1 for kind, _ in recorder.calls if kind == "visit") > 6000


def test_start_lines_match_libcst_metadata():
    # cst_lines.start_lines prints once tracking lines only; it must give the start line
    # the public MetadataWrapper path gives, for every node (syntactic starts, hoisted
    # starts, decorators, comments and blank lines, a header, CRLF newlines).
    from libcst.metadata import MetadataWrapper, PositionProvider

    from patcher.cst_lines import start_lines

    readable = (ROOT / "fixtures" / "tokenstream_readable.py").read_text()
    for source in (readable, "# header\n\n" + readable.replace("\n", "\r\n")):
        module = cst.parse_module(source)
        expected = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
        got = start_lines(module)
        assert len(got) == len(expected) > 1000
        assert all(got[node] == expected[node].start.line for node in expected)
        assert len({line for line in got.values()}) > 100  # lines advance


def test_line_index_prints_only_what_it_is_asked_and_gives_the_same_lines():
    # LineIndex prints one top-level statement at a time; its lines must equal the
    # whole-module pass for every node, with a header, CRLF, decorators, a multi-line
    # string and comments between statements, and for nodes the index does not hold.
    from patcher.cst_lines import LineIndex, start_lines
    from patcher.cst_walk import walk
    from patcher.survey.survey import index_of

    readable = (ROOT / "fixtures" / "tokenstream_readable.py").read_text()
    extra = '#!/usr/bin/env python\n# header\n\n@decorate\n# between\ndef f():\n    """a\n    b"""\n    return 1\n\n\nx = 1; y = 2\n'
    for source in (readable, extra + readable.replace("\n", "\r\n"), extra):
        module = cst.parse_module(source)
        whole = start_lines(module)
        lines = LineIndex(module, index_of(module).top_of)
        last = module.body[-1]
        assert lines.line_of(last) == whole[last]
        assert len(lines._printed) == 1  # the statement asked for, and no other, printed with lines
        assert all(lines.line_of(node) == whole[node] for node in walk(module))
        assert LineIndex(module).line_of(module.body[0]) == whole[module.body[0]]  # no index: the whole pass
        with pytest.raises(KeyError):
            lines.line_of(cst.Name("elsewhere"))
