"""verify for a hand-edited script: no runtime of this tool, its own loader driven by its
own calls, and the copies a GPU runs late modelled on the CPU (`host_cuda.AsyncCopies`).

Each edit is one of our miniatures applied to a bundled fixture: a hand-written thread
prefetch (exact with constant arguments; stale where the loop's arguments change), a
pinned ring with and without its fence, and a loop that fetches the next batch before
using the current one."""
from __future__ import annotations

import contextlib
import queue
import threading
from pathlib import Path

import pytest

from patcher.cli import EXIT_FAILED, EXIT_LEAKED, EXIT_NOTHING, EXIT_OK, main
from patcher.proof import rank_compare
from patcher.proof.verify import CannotVerify, verify

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CONSTRUCTION = "train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)"

THREAD_PREFETCH = '''

class ThreadPrefetch:
    """A hand-written prefetch: a daemon thread calls next_batch ahead with the first call's arguments."""

    current = None

    def __init__(self, loader, depth=2):
        self.loader, self.queue, self.args = loader, queue.Queue(depth), None
        ThreadPrefetch.current = self  # a rebuild stops the thread of the loader built before

    def next_batch(self, *args):
        if self.args is None:
            self.args = args
            threading.Thread(target=self._run, daemon=True).start()
        return self.queue.get()

    def shutdown(self):
        ThreadPrefetch.current = None

    def _run(self):
        while ThreadPrefetch.current is self:
            batch = self.loader.next_batch(*self.args)
            while ThreadPrefetch.current is self:
                try:
                    self.queue.put(batch, timeout=0.05)
                    break
                except queue.Full:
                    pass
'''

# The fixture's H2D, made through a pinned ring of `depth` slots; `fence`: the host waits
# for a slot's last copy (a CUDA event) before refilling it.
RETURN = "        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)\n"
RING = '''        if not hasattr(self, "ring"):
            self.ring = [torch.empty(mine.numel(), dtype=torch.int64, pin_memory=True) for _ in range({depth})]
            self.fences = [None] * {depth}
            self.slot = 0
        i = self.slot
        self.slot = (i + 1) % len(self.ring)
        if {fence} and self.fences[i] is not None:
            self.fences[i].synchronize()
        self.ring[i].copy_(mine)
        x = self.ring[i][:-1].reshape(-1, seq_len).to(self.device, non_blocking=True)
        y = self.ring[i][1:].reshape(-1, seq_len).to(self.device, non_blocking=True)
        if torch.cuda.is_available():
            self.fences[i] = torch.cuda.Event()
            self.fences[i].record()
        return x, y
'''

FETCH = "            x, y = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)\n"
EARLY = '''    x, y = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)
'''


def edited(tmp_path: Path, fixture: str, *edits: tuple[str, str]) -> tuple[Path, Path]:
    """(the fixture, a copy of it with each (old, new) made once at least), as files in `tmp_path`."""
    source = (FIXTURES / fixture).read_text()
    original = tmp_path / fixture
    original.write_text(source)
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    changed = tmp_path / f"edited_{fixture}"
    changed.write_text(source)
    return original, changed


def thread_prefetch(tmp_path: Path, fixture: str) -> tuple[Path, Path]:
    return edited(
        tmp_path, fixture,
        ("import copy\n", "import copy\nimport queue\nimport threading\n"),
        (CONSTRUCTION, CONSTRUCTION.replace("= DistributedTokenLoader(", "= ThreadPrefetch(DistributedTokenLoader(") + ")"),
        ("\n\nclass DistributedTokenLoader:", THREAD_PREFETCH + "\n\nclass DistributedTokenLoader:"),
    )


def test_an_exact_hand_written_thread_prefetch_is_identical(tmp_path, capsys):
    original, changed = thread_prefetch(tmp_path, "tokenstream_readable.py")
    assert main(["verify", str(original), str(changed), "--batches", "24"]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert any("holds no runtime of patch-prefetch: verified as a hand-edited version of" in line for line in out)
    assert out[-1].startswith("identical: 56 batches and 66 validation batches over 2 ranks") and out[-1].endswith("a hand-edited script (no runtime of patch-prefetch), driven through its own loader")


def test_a_thread_prefetch_that_keeps_the_first_calls_arguments_differs_where_the_loop_changes_them(tmp_path):
    # The curriculum fixture's loop changes the sequence length every few steps: the
    # batches queued ahead keep the length of the call that queued them.
    original, changed = thread_prefetch(tmp_path, "curriculum.py")
    result = verify(original, changed, batches=12, world_size=1)
    assert result.edited and not result.identical
    assert (result.difference.rank, result.difference.phase, result.difference.batch, result.difference.field) == (0, "train", 5, 0)
    assert result.difference.what.startswith("shape (")


@pytest.mark.parametrize("depth, fence, run_ahead, differs", [
    (1, False, 2, True),   # one pinned buffer, refilled before its copy ran
    (2, False, 2, True),   # a double buffer without a fence: as deep as the host runs ahead
    (3, False, 2, False),  # deeper than the run-ahead: passes at 2 ...
    (3, False, 3, True),   # ... and fails where the host runs 3 micro-steps ahead
    (1, True, 4, False),   # fenced: the host waits for the slot's last copy
])
def test_a_pinned_ring_is_judged_by_its_fence_and_depth_against_the_run_ahead(tmp_path, depth, fence, run_ahead, differs):
    original, changed = edited(tmp_path, "tokenstream_readable.py", (RETURN, RING.format(depth=depth, fence=fence)))
    result = verify(original, changed, batches=8, world_size=1, run_ahead=run_ahead)
    assert result.run_ahead == run_ahead and result.edited
    if differs:
        d = result.difference
        assert (d.rank, d.phase, d.batch, d.field) == (0, "warmup", 0, 0) and d.what.startswith("bytes differ")
        assert d.configuration == "the edited loader on the CUDA path (host memory)"
    else:
        assert result.identical, result.difference


def test_a_loop_that_fetches_the_next_batch_before_using_the_current_one(tmp_path):
    # The first batch fetched before the loop, each next one right after the forward that
    # uses the current: the same calls in the same order, so the same batches.
    autocast = "            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == \"cuda\"):\n                loss = model(x, y)\n"
    original, changed = edited(
        tmp_path, "tokenstream_readable.py",
        ("    elapsed_ms = 0.0\n", EARLY + "    elapsed_ms = 0.0\n"),
        ("        for micro in range(grad_accum_steps):\n" + FETCH + autocast, "        for micro in range(grad_accum_steps):\n" + autocast + FETCH),
    )
    result = verify(original, changed, batches=8, world_size=1)
    assert result.edited and result.identical and not result.skipped, (result.difference, result.skipped)


# The fixture's loader as nanochat's: one device buffer, refilled at each call, its views
# handed out (a batch holds until the next call).
DEVICE_BUFFER = """        if not hasattr(self, "on_device"):
            self.on_device = torch.empty(mine.numel(), dtype=torch.int64, device=self.device)
        self.on_device.copy_(mine)
        return self.on_device[:-1].reshape(-1, seq_len), self.on_device[1:].reshape(-1, seq_len)
"""
AUTOCAST = "            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == \"cuda\"):\n                loss = model(x, y)\n"


@pytest.mark.parametrize("fetch_first", [False, True])
def test_a_loop_that_fetches_the_next_batch_before_using_a_batch_that_holds_until_the_next_call(tmp_path, fetch_first):
    # Both sides' loader hands out views of its device buffer. The original loop uses
    # each batch before the next call; the edited one fetches first, so the model
    # trains on the next batch's data.
    loop = "        for micro in range(grad_accum_steps):\n" + FETCH + AUTOCAST
    early = ("        for micro in range(grad_accum_steps):\n" + FETCH.replace("x, y =", "next_x, next_y =")
             + "            x, y = x_held, y_held\n" + AUTOCAST + "            x_held, y_held = next_x, next_y\n")
    original, changed = edited(tmp_path, "tokenstream_readable.py", (RETURN, DEVICE_BUFFER))
    source = changed.read_text()
    original.write_text(source)  # the original: the same loader, its own loop
    if fetch_first:
        assert source.count(loop) == 1
        source = source.replace(loop, early).replace("    elapsed_ms = 0.0\n", "    x_held, y_held = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)\n    elapsed_ms = 0.0\n")
    else:
        source = source.replace("import copy\n", "import copy  # the loop as it was\n")
    changed.write_text(source)
    result = verify(original, changed, batches=8, world_size=1)
    assert result.edited
    if not fetch_first:
        assert result.identical, result.difference
        return
    d = result.difference
    line = source[: source.index("x, y = x_held, y_held")].count("\n") + 1  # where the loop reads the batch it holds
    assert (d.phase, d.batch, d.field) == ("train", 0, 0), d
    assert d.what == f"bytes differ: first at [0, 0]: 1 vs 16 (the edited loop fetches the next batch before it uses this one, line {line})"


def test_a_copy_with_only_its_layout_changed_is_verified_not_refused(tmp_path, capsys):
    original, changed = edited(tmp_path, "tokenstream_readable.py", ("import copy\n", "import copy  # unchanged otherwise\n"))
    assert main(["verify", str(original), str(changed), "--batches", "8"]) == EXIT_OK
    assert main(["verify", str(original), str(original)]) == EXIT_NOTHING


def test_an_edited_loader_built_where_the_survey_cannot_follow_is_cannot_verify_with_the_reason(tmp_path, capsys):
    # The rebuild replaced by resetting the loader's stream in place: no second construction to drive.
    rebuild = "        " + CONSTRUCTION + "\n"
    original, changed = edited(tmp_path, "tokenstream_readable.py", (rebuild, "        train_loader.stream = TokenStream(args.train_files)\n"))
    assert main(["verify", str(original), str(changed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"patch-prefetch verify: cannot verify: {changed}: the edited script assigns `train_loader` from a call 1 times in main(), the original 2 times"]


# A data generator's own H2D copy routed through pinned memory by hand (the generator
# driver): a fresh pinned block per batch is exact; one block per shape, refilled by the
# next item while its copy is still in flight, is not.
INPUTS_COPY = "            inputs.to(device=device, non_blocking=True),\n"
YIELD = "        new_args = yield (\n"


@pytest.mark.parametrize("pinned, identical", [
    ("torch.empty_like(inputs, pin_memory=True)", True),
    ("_pinned_inputs.setdefault((inputs.shape, inputs.dtype), torch.empty_like(inputs, pin_memory=True))", False),
])
def test_a_generator_staged_by_hand(tmp_path, pinned, identical):
    original, changed = edited(
        tmp_path, "generator_shards.py",
        ("import threading\n", "import threading\n\n_pinned_inputs = {}\n"),
        (YIELD, f"        pinned = {pinned}\n        pinned.copy_(inputs)\n" + YIELD),
        (INPUTS_COPY, "            pinned.to(device=device, non_blocking=True),\n"),
    )
    result = verify(original, changed, batches=16, world_size=1)
    assert result.edited and result.identical is identical, result.difference
    if not identical:
        assert (result.difference.phase, result.difference.batch, result.difference.field) == ("train", 0, 0)


# A loader that stages each batch in pinned int32 memory, copies it with
# `dev.copy_(pinned, non_blocking=True)` into a fresh device tensor, and widens it there
# (`.long()`): on a GPU the widening is stream-ordered after the copy and the host does
# not wait for it. `slots` pinned buffers reused in turn, each refilled only after its
# event completed where `fence`.
STAGED_LONG = '''        if not hasattr(self, "pinned"):
            self.pinned = [torch.empty(mine.numel(), dtype=torch.int32, pin_memory=True) for _ in range({slots})]
            self.events, self.i = [None] * {slots}, 0
        i, self.i = self.i, (self.i + 1) % {slots}
        if {fence} and self.events[i] is not None:
            self.events[i].synchronize()
        self.pinned[i].copy_(mine)
        dev = torch.empty(mine.numel(), dtype=torch.int32, device=self.device)
        dev.copy_(self.pinned[i], non_blocking=True)
        if torch.cuda.is_available():
            self.events[i] = torch.cuda.Event()
            self.events[i].record()
        return dev[:-1].reshape(-1, seq_len).long(), dev[1:].reshape(-1, seq_len).long()
'''


@pytest.mark.parametrize("slots, fence, run_ahead, differs", [
    (1, False, 1, True),  # one pinned buffer, rewritten before the GPU reached its copy
    (2, True, 3, False),  # the fenced double buffer: each buffer reused only after its event
])
def test_a_device_op_on_a_late_copy_does_not_make_the_copy_run_on_time(tmp_path, slots, fence, run_ahead, differs):
    original, changed = edited(tmp_path, "tokenstream_readable.py", (RETURN, STAGED_LONG.format(slots=slots, fence=fence)))
    result = verify(original, changed, batches=6, world_size=1, run_ahead=run_ahead)
    if not differs:
        # Every value exact on the CUDA path (the CPU run comes after it). On a CPU device
        # the widened x and y are two tensors where the original's overlap: a loop that
        # masks y in place would change x in the original only.
        d = result.difference
        assert d.configuration == "the edited loader on a CPU device" and d.what.startswith("memory shared in the original"), d
        return
    d = result.difference
    assert (d.rank, d.phase, d.batch, d.field) == (0, "warmup", 0, 0), d
    assert d.what.startswith("bytes differ: first at [0, 0]: ") and d.configuration == "the edited loader on the CUDA path (host memory)"


# A hand-written prefetch thread on a bounded queue that nothing stops: after the
# script rebuilds its loader, the old one's thread blocks on its full queue for good.
UNSTOPPED = '''

class ThreadPrefetch:
    """A hand-written prefetch with no way to stop its thread."""

    def __init__(self, loader, depth=2):
        self.loader, self.queue, self.args, self.stopped = loader, queue.Queue(depth), None, False

    def next_batch(self, *args):
        if self.args is None:
            self.args = args
            threading.Thread(target=self._work, daemon=True).start()
        return self.queue.get()

    def _work(self):
        while not self.stopped:
            self.queue.put(self.loader.next_batch(*self.args))
'''


def test_a_leaked_thread_is_no_difference_in_the_batches_but_a_leak_line_and_exit_4(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rank_compare, "REBUILD_GRACE_S", 0.5)  # the leaked thread never ends: wait less for it
    original, changed = edited(
        tmp_path, "tokenstream_readable.py",
        ("import copy\n", "import copy\nimport queue\nimport threading\n"),
        (CONSTRUCTION, CONSTRUCTION.replace("= DistributedTokenLoader(", "= ThreadPrefetch(DistributedTokenLoader(") + ")"),
        ("\n\nclass DistributedTokenLoader:", UNSTOPPED + "\n\nclass DistributedTokenLoader:"),
    )
    before = set(threading.enumerate())
    try:
        code = main(["verify", str(original), str(changed), "--batches", "8", "--world-size", "1"])
        out = capsys.readouterr().out.splitlines()
        assert code == EXIT_LEAKED and any(line.startswith("identical: ") for line in out), out
        leaks = [line for line in out if line.startswith("LEAK: ")]
        line = changed.read_text().splitlines().index("            threading.Thread(target=self._work, daemon=True).start()") + 1
        assert leaks and all(f"runs ThreadPrefetch._work (line {line + 3}), started at line {line} in next_batch; holds " in leak for leak in leaks), leaks
        held = int(leaks[0].split("holds ")[1].split(" bytes)")[0].split("(")[-1].split()[0])
        assert held > 4096  # the old loader's shard
    finally:
        for thread in set(threading.enumerate()) - before:  # unblock the leaked threads
            owner = thread._target.__self__
            owner.stopped = True
            while thread.is_alive():
                with contextlib.suppress(queue.Empty):
                    owner.queue.get(timeout=0.01)


# Edits to the training loop and to the seeding, outside the loader itself.
STEP = "        step_loss = 0.0\n"
MINE = "        mine = chunk[self.rank * span : (self.rank + 1) * span].long()\n"
ROLLED = MINE + "        mine = mine.roll(int(np.random.randint(3)))\n"  # the loader draws from the global RNG


def test_an_extra_next_batch_in_the_training_loop_is_never_a_bare_identical(tmp_path, capsys):
    skip = "        if step == 5:\n            train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)\n" + STEP
    original, changed = edited(tmp_path, "tokenstream_readable.py", (STEP, skip))
    line = changed.read_text().splitlines().index("        if step == 5:") + 2
    assert main(["verify", str(original), str(changed), "--batches", "6", "--world-size", "1"]) == EXIT_OK
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict.startswith("partial: ") and f"not exercised: the training loop was not compared: its next_batch calls on `train_loader` changed (the edited script calls line {line}: next_batch(" in verdict and "under `if step == 5`" in verdict, verdict


def test_a_seed_edit_reaching_the_loader_through_the_global_rng_differs(tmp_path):
    original, changed = edited(tmp_path, "tokenstream_readable.py", (MINE, ROLLED), ("    np.random.seed(args.seed)\n", "    np.random.seed(args.seed + 1)\n"))
    original.write_text(original.read_text().replace(MINE, ROLLED))  # the same loader, the script's own seed
    result = verify(original, changed, batches=6, world_size=1)
    d = result.difference
    assert (d.phase, d.batch, d.field) == ("warmup", 0, 0) and d.what.startswith("bytes differ: first at [0, 0]: "), d
    changed.write_text(original.read_text().replace("import copy\n", "import copy  # the seed as it was\n"))
    assert verify(original, changed, batches=6, world_size=1).identical


def test_a_changed_argument_in_the_training_loop_is_reported_at_its_call(tmp_path):
    call = FETCH + AUTOCAST
    original, changed = edited(tmp_path, "tokenstream_readable.py", (call, call.replace("args.train_seq_len,", "args.train_seq_len // 2,")))
    line = changed.read_text().splitlines().index(FETCH.replace("args.train_seq_len,", "args.train_seq_len // 2,").rstrip("\n")) + 1
    d = verify(original, changed, batches=6, world_size=1).difference
    assert (d.phase, d.batch, d.field) == ("train", 0, 0) and d.what.startswith("shape ("), d  # the warm-up's call is unchanged
    assert f"(the edited script's call at line {line}: next_batch(args.train_batch_tokens, args.train_seq_len // 2, grad_accum_steps), the original's at line {line}: " in d.what


def test_a_generator_whose_first_item_raises_stop_iteration_inside_says_what_to_provide(tmp_path):
    # The generator's own `next(files)` runs out on the synthetic shards (PEP 479 turns
    # it into "RuntimeError: generator raised StopIteration"): tried on larger shards,
    # then a reason naming what the shards lack.
    cycle = "    files = itertools.cycle(sorted(Path(f) for f in glob.glob(filename_pattern)))\n"
    held_out = "    files = iter(sorted(Path(f) for f in glob.glob(filename_pattern))[4:])  # the first four held out\n"
    original, changed = edited(tmp_path, "generator_shards.py", (cycle, held_out))
    original.write_text(changed.read_text())
    changed.write_text(changed.read_text().replace("import glob\n", "import glob  # as it was\n"))
    with pytest.raises(CannotVerify) as caught:
        verify(original, changed, batches=4, world_size=1)
    why = str(caught.value)
    assert "before its first item: an iterator it advances inside ran out (generator raised StopIteration), on 4 synthetic shards of " in why and " tokens in turn: it needs data these shards lack (more shard files," in why, why


def test_a_loader_whose_index_runs_out_is_tried_on_more_shards_before_verify_gives_up(tmp_path):
    # Its stream reads the first 500 tokens of each shard file and never wraps around:
    # larger shards do not help it, more shard files do.
    original, changed = edited(
        tmp_path, "tokenstream_readable.py",
        ("        self.buf = read_shard(self.paths[0])\n", "        self.buf = read_shard(self.paths[0])[:500]\n"),
        ("                self.shard = (self.shard + 1) % len(self.paths)\n                self.buf = read_shard(self.paths[self.shard])\n",
         "                self.shard += 1\n                self.buf = read_shard(self.paths[self.shard])[:500]\n"),
    )
    original.write_text(changed.read_text())
    changed.write_text(changed.read_text().replace("import copy\n", "import copy  # as it was\n"))
    result = verify(original, changed, batches=6, world_size=1)
    assert result.identical, result.difference
    assert any("IndexError: list index out of range" in note and "(16 x " in note and "tried before: 4 x " in note for note in result.notes), result.notes
