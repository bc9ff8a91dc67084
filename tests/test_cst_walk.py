"""cst_walk: the read-only traversal makes exactly the calls libcst's own visit makes."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from patcher import cst_walk

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "fixtures").glob("*.py")) + sorted((ROOT / "templates").glob("[!_]*.py")) + sorted((ROOT / "patcher").rglob("[!_]*.py"))


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
