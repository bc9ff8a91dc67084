"""A mutation suite for verify: small bugs written into the injected runtime of a
patched fixture (with libcst, on generic constructs, not on exact text), each run
through verify with its default settings. Every mutant here can change the batches
a CPU run hands out, so verify must catch every one (exit 1, a difference)."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest

from patcher.harness import _top_level_names
from patcher.patch import patch_source
from patcher.source import read_script, render
from patcher.verify import verify

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# Appended to a mutant: a staging buffer per shape and dtype, reused for every batch.
REUSED_BUFFER = """

_mutant_buffers = {}


def _mutant_buffer(shape, dtype=None, pin_memory=False, **kwargs):
    key = (tuple(shape), dtype)
    if key not in _mutant_buffers:
        _mutant_buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=pin_memory, **kwargs)
    return _mutant_buffers[key]
"""

# Appended to a mutant: True on the `n`-th call (counted per site).
NTH_CALL = """

_mutant_calls = {}


def _mutant_nth(site, n):
    _mutant_calls[site] = _mutant_calls.get(site, 0) + 1
    return _mutant_calls[site] == n
"""


class _InInjected(m.MatcherDecoratableTransformer):
    """Edits only inside the top-level definitions the patch injected; counts its edits."""

    def __init__(self, injected: set[str]):
        super().__init__()
        self.injected, self.depth, self.edits = injected, 0, 0

    def visit_FunctionDef(self, node):
        self._enter(node)

    def leave_FunctionDef(self, original, updated):
        self._leave(original)
        return updated

    def visit_ClassDef(self, node):
        self._enter(node)

    def leave_ClassDef(self, original, updated):
        self._leave(original)
        return updated

    def _enter(self, node):
        if self.depth or node.name.value in self.injected:
            self.depth += 1

    def _leave(self, node):
        if self.depth:
            self.depth -= 1


class ReuseStagingBuffer(_InInjected):
    """`torch.empty(shape, ..., pin_memory=...)` in the runtime -> one buffer per shape, reused."""

    def leave_Call(self, original, updated):
        if self.depth and m.matches(updated, m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("empty")), args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("pin_memory")), m.ZeroOrMore()])):
            self.edits += 1
            return updated.with_changes(func=cst.Name("_mutant_buffer"))
        return updated


class SkipABatch(_InInjected):
    """After the runtime's first `item = <queue>.get(...)`: on the 6th hand-out, take another item (one batch lost)."""

    def leave_SimpleStatementLine(self, original, updated):
        if self.depth and not self.edits and m.matches(updated, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call(func=m.Attribute(attr=m.Name("get"))))])):
            self.edits += 1
            assign = updated.body[0]
            again = cst.parse_statement(f"if _mutant_nth('get', 6): {cst.Module([]).code_for_node(assign)}")
            return cst.FlattenSentinel([updated, again])
        return updated


# Not in MUTANTS: a replay runs only for a loader that changes arrays in place (the
# others roll back to a snapshot); no fixture of ours reaches it with a changed argument.
class ShortReplay(_InInjected):
    """A replay loop `for a in handed_out: ...next_batch(*a)` runs over all but the last call."""

    def leave_For(self, original, updated):
        if self.depth and m.findall(updated.body, m.Call(func=m.Attribute(attr=m.Name("next_batch")), args=[m.Arg(star="*")])):
            self.edits += 1
            return updated.with_changes(iter=cst.Subscript(value=updated.iter, slice=[cst.SubscriptElement(cst.Slice(lower=None, upper=cst.UnaryOperation(cst.Minus(), cst.Integer("1"))))]))
        return updated


class HandOutEarly(_InInjected):
    """The 4th hand-out returns the batch after the next one is taken: two batches swap."""

    def leave_SimpleStatementLine(self, original, updated):
        if self.depth and not self.edits and m.matches(updated, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call(func=m.Attribute(attr=m.Name("get"))))])):
            self.edits += 1
            assign = updated.body[0]
            name = assign.targets[0].target.value
            get = cst.Module([]).code_for_node(assign.value)
            swap = cst.parse_statement(f"if _mutant_nth('swap', 4):\n    _mutant_held = {name}; {name} = {get}; _mutant_calls['held'] = _mutant_held\n")
            back = cst.parse_statement(f"if _mutant_nth('back', 5) and 'held' in _mutant_calls: {name} = _mutant_calls.pop('held')\n")
            return cst.FlattenSentinel([updated, swap, back])
        return updated


MUTANTS = [
    pytest.param("own_configuration", ReuseStagingBuffer, REUSED_BUFFER, id="reused-staging-buffer"),
    pytest.param("own_configuration", SkipABatch, NTH_CALL, id="one-batch-skipped"),
    pytest.param("own_configuration", HandOutEarly, NTH_CALL, id="batch-handed-out-early"),
]


def mutant(tmp_path: Path, name: str, transformer, helpers: str) -> tuple[Path, Path]:
    """(fixture, patched fixture with `transformer` applied to the injected runtime)."""
    original = FIXTURES / f"{name}.py"
    if not original.exists():
        original = FIXTURES / "verify" / f"{name}.py"
    script = read_script(original)
    patched = cst.parse_module(patch_source(script.source).source)
    edit = transformer(_top_level_names(patched) - _top_level_names(cst.parse_module(script.source)))
    mutated = patched.visit(edit)
    assert edit.edits, f"{transformer.__name__}: nothing to mutate in the runtime (it changed; adapt the mutant)"
    out = tmp_path / f"{name}_mutant.py"
    out.write_text(render(script, mutated.code + helpers, rewrap=False))
    return original, out


@pytest.mark.parametrize("name, transformer, helpers", MUTANTS)
def test_verify_catches_the_mutant_with_default_settings(tmp_path, name, transformer, helpers):
    original, out = mutant(tmp_path, name, transformer, helpers)
    result = verify(original, out)
    assert not result.identical, f"{transformer.__name__} survived: {result.notes}"


def test_the_unmutated_runtime_is_identical(tmp_path):
    original, out = mutant(tmp_path, "own_configuration", lambda injected: _Counted(injected), "")
    assert verify(original, out).identical


class _Counted(_InInjected):
    """No edit; counts the injected definitions it walks into (the suite's control)."""

    def visit_FunctionDef(self, node):
        super().visit_FunctionDef(node)
        self.edits += bool(self.depth)
