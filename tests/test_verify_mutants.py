"""A mutation suite for verify: small bugs written into the injected runtime of a
patched fixture (with libcst, on generic constructs, not on exact text), each run
through verify with its default settings.

The runtimes covered are the ones a patch injects: the lean train prefetch
(templates/prefetch_lean.py: constant `next_batch` arguments, a forked producer
process), the full one (templates/prefetch_loader.py: a per-step argument applied at
hand-out, a rollback to a snapshot), the generator runtime
(templates/prefetch_loader.py's `_prefetch_iterator`) and the validation generator (templates/prefetch_val.py).
Every mutant in `MUTANTS` can change the batches a CPU run hands out (or leaves a
replaced loader's thread running), so verify must catch every one (a difference, or a leak line for a thread left running; never
"cannot verify"). `NOT_ON_A_CPU` lists the kinds that only a GPU run could tell apart.
"""

from __future__ import annotations

import threading
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest

from patcher.proof.recipes import top_level_names as _top_level_names
from patcher.patch import patch_source
from patcher.read.source import read_script, render
from patcher.proof import rank_compare
from patcher.proof.verify import verify

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

# Kinds that cannot change what a CPU run hands out (the copy is synchronous there and
# every batch is staged in fresh memory): verify cannot tell them apart without a GPU.
NOT_ON_A_CPU = (
    "the compute stream does not wait for the copy stream (wait_stream/wait_event removed)",
    "record_stream removed (the caching allocator may reuse a batch's memory early)",
    "the free place given back before the batch is taken (one more batch built ahead)",
)


def _code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


class _InInjected(m.MatcherDecoratableTransformer):
    """Edits only inside the top-level definitions the patch injected; counts its edits.

    `self.depth` > 0 inside an injected definition; `self.functions` is the stack of
    enclosing function names (innermost last)."""

    def __init__(self, injected: set[str]):
        super().__init__()
        self.injected, self.depth, self.edits, self.functions = injected, 0, 0, []

    def visit_FunctionDef(self, node):
        self._enter(node)
        self.functions.append(node.name.value)

    def leave_FunctionDef(self, original, updated):
        self.functions.pop()
        self._leave(original)
        return self.leave_function(original, updated)

    def leave_function(self, original, updated):
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

    def inside(self, *names: str) -> bool:
        """True inside injected code, in a function named one of `names` (any, when none given)."""
        return bool(self.depth) and (not names or bool(self.functions) and self.functions[-1] in names)


def _split_after(line: cst.SimpleStatementLine, index: int, inserted: list[cst.BaseStatement]):
    """`line` split after its small statement `index`, `inserted` statements in between."""
    head = line.with_changes(body=line.body[: index + 1])
    rest = line.body[index + 1 :]
    tail = [cst.SimpleStatementLine(body=rest)] if rest else []
    return cst.FlattenSentinel([head, *inserted, *tail])


# A batch taken from the hand-off: `return _hand_out(message[1], ...)` (the process
# producer's copy out of a filled slot, with the batch's own non-tensor values, the slot
# then freed), `item = worker.queue.get(...)`, `item = _next_built(worker)`.
SLOT_COPY = m.Call(func=m.Name("_hand_out"), args=[m.Arg(m.Subscript(value=m.Name("message"))), m.ZeroOrMore()])
TAKE = m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Call(func=m.Attribute(attr=m.Name("get")) | m.Name("_next_built")) | SLOT_COPY)


class _AfterTake(_InInjected):
    """Inserts statements after the first batch taken in `next_batch` / `__next__`
    (`return _hand_out(...)` taken as `batch = _hand_out(...)`, the inserted statements,
    `return batch`)."""

    def leave_SimpleStatementLine(self, original, updated):
        if self.edits or not self.inside("next_batch", "__next__"):
            return updated
        for index, small in enumerate(updated.body):
            if m.matches(small, m.Return(value=SLOT_COPY)):
                self.edits += 1
                taken = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name("batch"))], small.value)])
                return cst.FlattenSentinel([taken, *self.inserted("batch", _code(small.value)), cst.parse_statement("return batch\n")])
            if m.matches(small, TAKE):
                self.edits += 1
                return _split_after(updated, index, self.inserted(small.targets[0].target.value, _code(small.value)))
        return updated


# Before a mutant takes one more batch from the lean runtime (templates/prefetch_lean.py):
# the next batch's message read (`_hand_out` freed the slot just copied).
ROOM = "if hasattr(self, 'fd'): message = _receive(self.conn, self.slots, self.lent)\n"


class SkipABatch(_AfterTake):
    """On the 6th hand-out, another batch is taken over the one just taken (one batch lost)."""

    def inserted(self, name, take):
        return [cst.parse_statement(f"if _mutant_nth('get', 6):\n    {ROOM}    {name} = {take}\n")]


class HandOutEarly(_AfterTake):
    """The 4th hand-out returns the batch after it; the held one comes 5th (two batches swap, one lost)."""

    def inserted(self, name, take):
        return [
            cst.parse_statement(f"if _mutant_nth('swap', 4):\n    {ROOM}    _mutant_held = {name}; {name} = {take}; _mutant_calls['held'] = _mutant_held\n"),
            cst.parse_statement(f"if _mutant_nth('back', 5) and 'held' in _mutant_calls: {name} = _mutant_calls.pop('held')\n"),
        ]


class ReuseStagingBuffer(_InInjected):
    """`torch.empty(shape, ..., pin_memory=...)` in the runtime -> one buffer per shape, reused."""

    def leave_Call(self, original, updated):
        if self.depth and m.matches(updated, m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("empty")), args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("pin_memory")), m.ZeroOrMore()])):
            self.edits += 1
            return updated.with_changes(func=cst.Name("_mutant_buffer"))
        return updated


class WorkerDropsABatch(_InInjected):
    """The worker builds its 12th batch twice and queues only the second (one batch lost).

    The 12th: the warm-up loader's producer builds up to 7 (4 taken, 2 queued, 1 in hand;
    the lean runtime's child up to 6), and a batch it built that nobody takes is no loss."""

    def leave_SimpleStatementLine(self, original, updated):
        if self.edits or not self.inside("_run", "_produce"):
            return updated
        # `batch = build()` in the process producer's loop (not the method that passes
        # it `lambda: self.loader.next_batch(...)`), a thread's `next_batch` or `plan`.
        builds = m.Call(func=m.Attribute(attr=m.Name("next_batch") | m.Name("plan")) | m.Name("build"))
        for index, small in enumerate(updated.body):
            if m.matches(small, m.Assign(targets=[m.AssignTarget(m.Name() | m.Tuple())]) | m.Expr(value=builds)) and m.findall(small.value, builds):
                self.edits += 1
                return _split_after(updated, index, [cst.parse_statement(f"if _mutant_nth('build', 12): {_code(small)}\n")])
        return updated


class HandOutTheSlot(_InInjected):
    """The lean runtime gives a slot back at the next batch whatever its batch's views
    (`lent[index] = weakref.ref(...)` -> `lent[index] = lambda: None`, a reference
    always dead): the child then rewrites a batch the caller still holds."""

    def leave_Assign(self, original, updated):
        if self.inside("_hand_out") and m.matches(updated, m.Assign(targets=[m.AssignTarget(m.Subscript(value=m.Name("lent")))], value=m.Call(func=m.Attribute(attr=m.Name("ref"))))):
            self.edits += 1
            return updated.with_changes(value=cst.parse_expression("lambda: None"))
        return updated


class OldWorkerLeftRunning(_InInjected):
    """Building the loader again starts another worker and does not shut the previous
    one down (the lean runtime's `old.reset(...)` read as False, `old.shutdown()`
    removed, and the finaliser's `self.shutdown()`, which would otherwise stop it when
    the old loader is collected)."""

    def leave_Expr(self, original, updated):
        if self.inside("_make_train_loader", "_stop_previous", "__del__") and m.matches(updated, m.Expr(m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("shutdown"))))):
            self.edits += 1
            return updated.with_changes(value=cst.Name("None"))
        return updated

    def leave_Call(self, original, updated):
        if self.inside("_make_train_loader") and m.matches(updated, m.Call(func=m.Attribute(value=m.Name("old"), attr=m.Name("reset")))):
            return cst.Name("False")
        return updated


class ResetKeepsTheOldBatches(_InInjected):
    """The lean runtime's reset at a rebuild does not drop the batches its producer had
    built ahead from the old loader: its loop over their messages, up to the reset's
    answer, read as that answer received, and `next_batch` passing over the answer when
    it comes (so the old batches are handed out as the new loader's, and nothing raises)."""

    def leave_While(self, original, updated):
        if self.inside("reset"):
            self.edits += 1
            return cst.parse_statement('message = ("reset",)\n')
        return updated

    def leave_SimpleStatementLine(self, original, updated):
        received = m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name("message"))], value=m.Call(func=m.Name("_receive")))])
        if self.inside("next_batch") and m.matches(updated, received):
            return cst.FlattenSentinel([updated, cst.parse_statement('if message[0] == "reset": message = _receive(self.conn, self.slots, self.lent)\n')])
        return updated


class StaleSequenceLength(_InInjected):
    """A batch is reshaped with the sequence length it was built with, not the caller's (a stale argument)."""

    def leave_Param(self, original, updated):
        if self.inside("_to_device") and m.matches(updated, m.Param(default=m.Subscript(value=m.Name("args")))):
            self.edits += 1
            return updated.with_changes(default=updated.default.with_changes(value=cst.parse_expression("self._worker_args")))
        return updated


class SnapshotAfterTheBatch(_InInjected):
    """The rollback snapshot is taken after the batch is built, not before it (a restore lands one batch late):
    `_Built(_snapshot(loader), BATCH)` becomes `(lambda batch: _Built(_snapshot(loader), batch))(BATCH)`."""

    def leave_Call(self, original, updated):
        if self.edits or not self.inside("_builder") or not m.matches(updated, m.Call(func=m.Name("_Built"), args=[m.Arg(), m.Arg()])):
            return updated
        self.edits += 1
        before, batch = updated.args
        late = updated.with_changes(args=[before, cst.Arg(cst.Name("batch"))])
        params = cst.Parameters(params=[cst.Param(cst.Name("batch"))])
        return cst.Call(func=cst.Lambda(params=params, body=late, lpar=[cst.LeftParen()], rpar=[cst.RightParen()]), args=[batch.with_changes(comma=cst.MaybeSentinel.DEFAULT)])


class SentValueIgnored(_InInjected):
    """A generator's rebuilt copy is resumed with None instead of the value the caller sent (stale arguments)."""

    def leave_Call(self, original, updated):
        if self.inside("send") and m.matches(updated, m.Call(func=m.Attribute(value=m.Attribute(attr=m.Name("_iterator")), attr=m.Name("send")), args=[m.Arg(m.Name("value"))])):
            self.edits += 1
            return updated.with_changes(args=[cst.Arg(cst.Name("None"))])
        return updated


class ShortReplay(_InInjected):
    """A replay loop (`for value in self._sent[1:]: iterator.send(value)`, `... next_batch(*a)`) runs over all but the last call."""

    def leave_For(self, original, updated):
        replays = m.Call(func=m.Attribute(attr=m.Name("next_batch")), args=[m.Arg(star="*")]) | m.Call(func=m.Attribute(attr=m.Name("send")))
        if self.depth and m.findall(updated.body, replays):
            self.edits += 1
            return updated.with_changes(iter=cst.Subscript(value=updated.iter, slice=[cst.SubscriptElement(cst.Slice(lower=None, upper=cst.UnaryOperation(cst.Minus(), cst.Integer("1"))))]))
        return updated


class ValHandedOutEarly(_InInjected):
    """The validation generator's 3rd batch is the one built after it (batch k+1 handed out as batch k)."""

    def leave_Arg(self, original, updated):
        if self.inside("_val_prefetch") and m.matches(updated, m.Arg(value=m.Name("pending"), star="*")):
            self.edits += 1
            return updated.with_changes(value=cst.parse_expression("built if _mutant_nth('val', 3) else pending"))
        return updated


class ValStagingReused(_InInjected):
    """The validation generator stages every batch in one reused pinned buffer instead of `pin_memory()`'s fresh copy."""

    def leave_Call(self, original, updated):
        if self.inside("_val_prefetch") and m.matches(updated, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("pin_memory")), args=[])):
            self.edits += 1
            piece = updated.func.value.value
            return cst.parse_expression(f"_mutant_buffer({piece}.shape, dtype={piece}.dtype, pin_memory=True).copy_({piece})")
        return updated


LEAN, FULL_RESHAPE, FULL_ROLLBACK, GENERATOR, VAL = (
    "own_configuration",  # TokenStream, templates/prefetch_lean.py
    "curriculum",  # a per-step sequence length: templates/prefetch_loader.py, reshape at hand-out
    "batch_switch",  # a per-step batch size: templates/prefetch_loader.py, rollback
    "generator_toplevel",  # a data generator with .send(): `_prefetch_iterator`
    "tokenstream_readable",  # the validation generator: templates/prefetch_val.py
)

MUTANTS = [
    pytest.param(LEAN, HandOutEarly, NTH_CALL, id="lean-batch-handed-out-early"),
    pytest.param(LEAN, SkipABatch, NTH_CALL, id="lean-batch-skipped"),
    pytest.param(LEAN, HandOutTheSlot, "", id="lean-slot-freed-while-lent"),
    pytest.param(LEAN, WorkerDropsABatch, NTH_CALL, id="lean-worker-drops-a-batch"),
    pytest.param(LEAN, OldWorkerLeftRunning, "", id="lean-old-worker-left-running"),
    pytest.param(LEAN, ResetKeepsTheOldBatches, "", id="lean-reset-keeps-the-old-batches"),
    pytest.param(FULL_RESHAPE, HandOutEarly, NTH_CALL, id="full-batch-handed-out-early"),
    pytest.param(FULL_RESHAPE, SkipABatch, NTH_CALL, id="full-batch-skipped"),
    pytest.param(FULL_RESHAPE, StaleSequenceLength, "", id="full-stale-sequence-length"),
    pytest.param(FULL_RESHAPE, OldWorkerLeftRunning, "", id="full-old-worker-left-running"),
    pytest.param(FULL_ROLLBACK, ReuseStagingBuffer, REUSED_BUFFER, id="full-staging-buffer-reused"),
    pytest.param(FULL_ROLLBACK, SnapshotAfterTheBatch, "", id="full-rollback-snapshot-after-the-batch"),
    pytest.param(GENERATOR, SkipABatch, NTH_CALL, id="generator-item-skipped"),
    pytest.param(GENERATOR, SentValueIgnored, "", id="generator-sent-value-ignored"),
    pytest.param(GENERATOR, ShortReplay, "", id="generator-replay-one-short"),
    pytest.param(VAL, ValHandedOutEarly, NTH_CALL, id="val-batch-handed-out-early"),
    pytest.param(VAL, ValStagingReused, REUSED_BUFFER, id="val-staging-buffer-reused"),
]


@pytest.fixture(autouse=True)
def _stop_leftover_workers():
    """Stop the prefetch threads a mutant left running (a loader that is never shut down),
    so that later tests in this process do not see them."""
    before = set(threading.enumerate())
    yield
    for thread in set(threading.enumerate()) - before:
        owner = getattr(getattr(thread, "_target", None), "__self__", None)
        if hasattr(owner, "shutdown"):
            owner.shutdown()
        elif hasattr(owner, "stop") and hasattr(owner, "queue"):
            owner.stop.set()
            owner.queue.clear()
        thread.join(5)


def mutant(tmp_path: Path, name: str, transformer, helpers: str) -> tuple[Path, Path]:
    """(fixture script, its patched copy with `transformer` applied to the injected runtime).

    name: the fixture's name under fixtures/ or fixtures/verify/ (a default patch)."""
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


@pytest.mark.parametrize("fixture, transformer, helpers", MUTANTS)
def test_verify_catches_the_mutant_with_default_settings(tmp_path, fixture, transformer, helpers, monkeypatch):
    monkeypatch.setattr(rank_compare, "REBUILD_GRACE_S", 0.5)  # a worker left running never ends: wait less for it
    original, out = mutant(tmp_path, fixture, transformer, helpers)
    result = verify(original, out)
    if transformer is OldWorkerLeftRunning:  # no batch differs: a leak of its own (exit 4)
        assert result.leaks, f"{transformer.__name__} survived: {result.notes}"
        return
    assert not result.identical, f"{transformer.__name__} survived: {result.notes}"
    # Caught for what it breaks: a mutant that fails to run (a stale call into the
    # runtime raising TypeError) would be "caught" too.
    assert "the patched loader raised" not in result.difference.what, result.difference


class _Counted(_InInjected):
    """No edit; counts the injected functions it walks into (the suite's control)."""

    def visit_FunctionDef(self, node):
        super().visit_FunctionDef(node)
        self.edits += bool(self.depth)


@pytest.mark.parametrize("fixture", [LEAN, FULL_RESHAPE], ids=["lean", "full"])
def test_the_unmutated_runtime_is_identical(tmp_path, fixture):
    original, out = mutant(tmp_path, fixture, _Counted, "")
    result = verify(original, out)
    assert result.identical, result.difference
