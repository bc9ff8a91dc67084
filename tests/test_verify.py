"""verify: identical on every fixture the tool patches, and it catches broken prefetchers."""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import open_files
from patcher.cli import EXIT_FAILED, EXIT_OK, main
from patcher.patch import patch_source
from patcher.read.source import read_script, render
from patcher.proof.harness import load_module, loaded_script_names, unload
from patcher.proof.verify import CannotVerify, verify

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def patched(tmp_path: Path, name: str, breakage=None) -> tuple[Path, Path]:
    original = FIXTURES / f"{name}.py"
    script = read_script(original)
    source = patch_source(script.source).source
    if breakage is not None:
        old, new = breakage
        assert old in source, "the runtime changed; update this test's breakage"
        source = source.replace(old, new, 1)
    out = tmp_path / f"{name}_patched.py"
    out.write_text(render(script, source, rewrap=False))
    return original, out


@pytest.mark.parametrize("name", ["tokenstream_readable", "shuffled_minified", "coprime_dataclass", "curriculum", "document_packing", "wrapped_lzma_raw", "generator_toplevel"])
def test_identical_on_patched_fixtures(tmp_path, name):
    original, out = patched(tmp_path, name)
    result = verify(original, out, batches=24, world_size=2)
    assert result.identical, result.difference
    warmup = 0 if name == "generator_toplevel" else 4  # one construction: no warm-up rebuild
    assert result.batches_compared == 2 * (24 + warmup)


def test_the_last_loaders_own_pool_ends_with_it_and_is_not_waited_for(tmp_path, monkeypatch):
    # document_packing's loader keeps a ThreadPoolExecutor(1), whose worker ends when the
    # loader is collected. verify drops each side's last loader before it waits for the
    # threads left running: none is left, and no rank waits out the 3 s grace.
    import patcher.proof.rank_compare as rank_compare

    left = []
    wait = rank_compare.still_alive
    monkeypatch.setattr(rank_compare, "still_alive", lambda *a: left.append(sorted(t.name for t in wait(*a))) or [])
    result = verify(*patched(tmp_path, "document_packing"), batches=4, world_size=2)
    assert result.identical, result.difference
    assert left and left == [[]] * len(left), left


def test_threads_of_a_kind_the_original_leaves_running_are_not_waited_for():
    # The original's warm-up loader left one `worker-N` thread running: the patched side's
    # is excused, and its join never called; a second one of that kind is waited for.
    import collections

    from patcher.proof.compare import still_alive

    class Thread:
        def __init__(self, name):
            self.name, self.joins = name, 0

        def is_alive(self):
            return True

        def join(self, timeout):
            self.joins += 1

    excused = collections.Counter({"worker-": 1})  # (`thread_kind`: the name without its digits)
    one = Thread("worker-1")
    assert still_alive({one}, 0.2, excused) == [] and one.joins == 0
    two = [Thread("worker-1"), Thread("worker-2")]
    assert len(still_alive(set(two), 0.2, excused)) == 1 and sum(t.joins for t in two) > 0


# Anchored where next_batch (templates/prefetch_lean.py) has copied a batch out of
# its slot and freed the slot (every batch: the producer builds them all).
# Taking one more: the next message read, its batch copied out and its slot freed.
_TAKE = "_hand_out(message[1], message[2], self.slots, self.lent, self.device, self.copy_stream)"
_FREED = f"        return {_TAKE}\n"
_HANDED = f"        batch = {_TAKE}\n"
_TAKE_ANOTHER = f"message = _receive(self.conn, self.slots, self.lent); batch = {_TAKE}"
SWAP_TWO = (
    _FREED,
    _HANDED + "        self.k = getattr(self, 'k', 0) + 1\n"
    "        if self.k == 4:\n"
    f"            held = batch; {_TAKE_ANOTHER}; self.held = held\n"
    "        elif self.k == 5:\n"
    "            batch = self.held\n"
    + "        return batch\n",
)
DROP_ONE = (
    _FREED,
    _HANDED + "        self.k = getattr(self, 'k', 0) + 1\n"
    "        if self.k == 6:\n"
    f"            {_TAKE_ANOTHER}\n"
    + "        return batch\n",
)
IGNORE_CHANGED_ARG = (
    "item = _each_tensor(item, lambda t, n=args[self._reshape_arg]: t.reshape(-1, n))",
    "pass",
)


@pytest.mark.parametrize(
    "name, breakage, phase, batch",
    [
        pytest.param("tokenstream_readable", SWAP_TWO, "warmup", 3, id="swaps-two-batches"),
        pytest.param("shuffled_minified", None, None, None, id="control-minified-unbroken"),
        # The hand-out's count spans the warm-up: the rebuild resets the same loader (train batch 1 is its 5th slot).
        pytest.param("tokenstream_readable", DROP_ONE, "train", 1, id="drops-one-batch"),
        pytest.param("curriculum", IGNORE_CHANGED_ARG, "train", 5, id="ignores-a-changed-seq-len"),
    ],
)
def test_catches_a_broken_prefetch(tmp_path, capsys, name, breakage, phase, batch):
    original, out = patched(tmp_path, name, breakage)
    code = main(["verify", str(original), str(out), "--batches", "16"])
    stdout = capsys.readouterr().out
    if breakage is None:
        assert code == EXIT_OK
        return
    assert code == EXIT_FAILED
    result = verify(original, out, batches=16)
    assert not result.identical
    assert (result.difference.rank, result.difference.phase, result.difference.batch) == (0, phase, batch)
    assert "the patched loader raised" not in result.difference.what, result.difference  # the breakage runs, and differs
    assert f"rank 0, {phase} batch {batch}" in stdout


SKIP_ONE_ITEM = (
    "        value, ready = item\n",
    "        value, ready = item\n"
    "        self._taken = getattr(self, '_taken', 0) + 1\n"
    "        if self._taken == 6:\n"
    "            worker.queue.room()\n"
    "            return next(self)\n",
)


def test_catches_a_generator_that_skips_an_item(tmp_path):
    original, out = patched(tmp_path, "generator_toplevel", SKIP_ONE_ITEM)
    result = verify(original, out, batches=16)
    assert not result.identical
    assert (result.difference.rank, result.difference.phase, result.difference.batch) == (0, "train", 5)


IGNORE_SENT_VALUE = (
    "        if value is None:\n            return next(self)\n        if not self._sent:",
    "        if True:  # a broken send: the value is dropped\n            return next(self)\n        if not self._sent:",
)


def test_generator_compared_across_a_send_of_new_parameters(tmp_path):
    original, out = patched(tmp_path, "generator_toplevel")
    result = verify(original, out, batches=16)
    assert result.identical
    assert any(".send(...)` of (1024, 32) (the script's values)" in n for n in result.notes)
    assert any("stage changes at item 8 of 16" in n for n in result.notes)
    assert result.exercised[0].startswith("1 stage change (the script's")


def test_catches_a_generator_that_ignores_a_sent_value(tmp_path):
    original, out = patched(tmp_path, "generator_toplevel", IGNORE_SENT_VALUE)
    result = verify(original, out, batches=16)
    assert not result.identical
    # items before the send match; the first item after it was built with the old size
    assert (result.difference.rank, result.difference.phase, result.difference.batch) == (0, "train", 8)


def test_generator_ranks_read_their_own_span(tmp_path):
    # dist.get_rank() inside the generator answers the simulated rank: rank 1's first
    # item is not rank 0's (a harness that ignored ranks would compare rank 0 twice).
    from patcher.proof.harness import SimulatedDist, load_definitions
    from patcher.proof.recipes import IteratorRecipe
    from patcher.check.import_smoke import definitions_only

    source = (FIXTURES / "generator_toplevel.py").read_text()
    module = load_definitions(definitions_only(source), "generator_toplevel.py")
    assert "train_loader" not in vars(module) and "distributed_data_generator" in vars(module)  # no training ran
    recipe = IteratorRecipe.from_source(source, patch_source(source).source)
    assert recipe.original == ["distributed_data_generator(args.train_files, args.num_tokens, args.seq_len)"]
    assert recipe.patched[0].startswith("_prefetch_iterator(lambda: distributed_data_generator(")
    from patcher.proof.shards import write_shards

    write_shards(tmp_path, bos_id=1)
    module.__dict__["device"] = "cpu"
    firsts = []
    for rank in (0, 1):
        module.__dict__["dist"] = SimulatedDist(rank, 2)
        generator = recipe.evaluate(f"distributed_data_generator({str(tmp_path / 'fineweb_train_*.bin')!r}, 512, 32)", module)
        firsts.append(next(generator)[0])
    assert not torch.equal(firsts[0], firsts[1])


DDL_TOP_LEVEL = """
import glob, os
from dataclasses import dataclass
import numpy as np
import torch

def _load_data_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    return np.fromfile(path, dtype="<u2", count=int(header[2]), offset=1024)

class DistributedDataLoader:
    def __init__(self, pattern, B, T, process_rank, num_processes):
        self.B, self.T, self.rank, self.n = B, T, process_rank, num_processes
        self.files = sorted(glob.glob(pattern))
        assert self.files, pattern
        self.reset()

    def reset(self):
        self.shard = -1
        self.advance()

    def advance(self):
        self.shard = (self.shard + 1) % len(self.files)
        self.pos = self.rank * self.B * self.T
        self.tokens = _load_data_shard(self.files[self.shard])

    def next_batch(self):
        B, T = self.B, self.T
        buf = torch.tensor(self.tokens[self.pos : self.pos + B * T + 1].astype(np.int32), dtype=torch.long)
        self.pos += B * T * self.n
        if self.pos + B * T * self.n + 1 >= len(self.tokens):
            self.advance()
        return buf[:-1].view(B, T).cuda(), buf[1:].view(B, T).cuda()

@dataclass
class Hyperparameters:
    input_bin: str = "data/fineweb10B/fineweb_train_*.bin"
    batch_size: int = 4
    sequence_length: int = 64

args = Hyperparameters()
ddp_rank = int(os.environ["RANK"])
ddp_world_size = int(os.environ["WORLD_SIZE"])
B, T = args.batch_size, args.sequence_length
train_loader = DistributedDataLoader(args.input_bin, B, T, ddp_rank, ddp_world_size)
for step in range(100):
    x, y = train_loader.next_batch()
    raise SystemExit("training must not run in verify")
"""


def test_top_level_script_with_a_loader_that_moves_batches_itself(tmp_path):
    original = tmp_path / "train_gpt2.py"
    original.write_text(DDL_TOP_LEVEL)
    out = tmp_path / "patched.py"
    out.write_text(patch_source(DDL_TOP_LEVEL).source)
    assert "_prefetch_next_batch(lambda" in out.read_text()
    result = verify(original, out, batches=16)
    assert result.identical, result.difference
    broken = out.read_text().replace(
        "        batch = next(self._ahead)\n", "        batch = next(self._ahead)\n        if len(self._history) == 3:\n            batch = next(self._ahead)\n", 1
    )
    out.write_text(broken)
    result = verify(original, out, batches=16)
    assert (result.difference.rank, result.difference.batch) == (0, 3)


def test_cannot_verify_a_script_without_loader(tmp_path):
    from patcher.proof.verify import NothingToVerify

    with pytest.raises(NothingToVerify, match="byte-identical to"):
        verify(FIXTURES / "no_loader.py", FIXTURES / "no_loader.py")
    patched = tmp_path / "patched.py"  # a runtime name, but still no loader to drive
    patched.write_text((FIXTURES / "no_loader.py").read_text() + "\n_make_train_loader = None\n")
    with pytest.raises(CannotVerify, match="no loader|no training loader"):
        verify(FIXTURES / "no_loader.py", patched)


HANG_ON_NEXT = (
    "        worker = self._worker\n        item = _next_built(worker)\n",
    "        worker = self._worker\n        threading.Event().wait()  # a broken hand-out: waits forever\n        item = _next_built(worker)\n",
)


def test_a_hanging_patched_generator_is_reported_not_waited_on(tmp_path, monkeypatch):
    import patcher.proof.verify

    monkeypatch.setattr(patcher.proof.verify, "DRAW_TIMEOUT_S", 1.0)
    original, out = patched(tmp_path, "generator_toplevel", HANG_ON_NEXT)
    with pytest.raises(CannotVerify, match=r"patched generator hangs here \(rank 0, train item 0\).*no batch after 1 s"):
        verify(original, out, batches=4)


def test_bos_id_read_from_the_script_and_web_length_documents(tmp_path):
    import types

    import numpy as np

    from patcher.proof.shards import read_shard, write_shards
    from patcher.proof.data import WEB_DOC_LEN_RANGE, script_bos_id as _script_bos_id

    script = types.ModuleType("script")
    assert _script_bos_id(script) is None
    script.BOS_ID = 50256
    script.ATTN_WINDOW = 128  # an int whose name does not say BOS is not taken
    assert _script_bos_id(script) == 50256
    files = write_shards(tmp_path, train_shards=1, val_shards=0, tokens_per_shard=200_000, vocab_size=50257, bos_id=50256, doc_len_range=WEB_DOC_LEN_RANGE)
    tokens = read_shard(files["train_files"][0])
    starts = np.flatnonzero(tokens == 50256)
    lengths = np.diff(starts)
    assert starts[0] == 0
    assert lengths.min() >= WEB_DOC_LEN_RANGE[0] and lengths.max() <= WEB_DOC_LEN_RANGE[1]


def test_a_name_reassigned_in_the_loop_is_evaluated_from_its_top_level_assignment():
    # modded-nanogpt: `step_batch_size = args.train_bs_schedule[0]`, the generator built
    # from it, then `step_batch_size = new_step_batch_size` inside the training loop.
    import libcst

    from patcher.proof.harness import HarnessError
    from patcher.proof.script_eval import evaluate_script_code
    from patcher.survey.survey import survey

    source = (
        "schedule = (8, 16)\n"
        "step_batch_size = schedule[0]\n"
        "loader = make(step_batch_size)\n"
        "for step in range(3):\n"
        "    step_batch_size = schedule[step % 2]\n"
        "if schedule:\n"
        "    other = 1\n"
        "else:\n"
        "    other = 2\n"
    )
    surveyed = survey(libcst.parse_module(source))
    scope = surveyed.collector.module_scope
    ns = {"schedule": (8, 16)}
    assert evaluate_script_code(surveyed, "step_batch_size * 2", ns, scope) == 16
    with pytest.raises(HarnessError):  # two conditional assignments, none at top level: no guess
        evaluate_script_code(surveyed, "other", {}, scope)


def test_a_local_changed_only_on_resume_is_evaluated_from_its_unconditional_assignment():
    # parameter-golf LegendreGPT: `resume_tokens_consumed = 0`, changed under
    # `if args.resume_from:`, then `DistributedTokenLoader(..., skip_tokens=resume_tokens_consumed)`.
    import libcst

    from patcher.proof.harness import HarnessError
    from patcher.proof.script_eval import evaluate_script_code
    from patcher.survey.survey import survey

    source = (
        "def main():\n"
        "    skip = 0\n"
        "    if args.resume_from:\n"
        "        skip = args.skip_tokens or 7\n"
        "    loader = make(skip)\n"
        "    for step in range(3):\n"
        "        skip += 1\n"
        "    if args.resume_from:\n"
        "        later = 1\n"
        "    else:\n"
        "        later = 2\n"
        "    twice = 1\n"
        "    twice = 2\n"
    )
    surveyed = survey(libcst.parse_module(source))
    main = next(s for n, s in surveyed.collector.scope_of.items() if isinstance(n, libcst.FunctionDef))
    assumed = []
    assert evaluate_script_code(surveyed, "skip + 100", {}, main, assumed=assumed) == 100
    assert assumed == ["`skip` = 0 (line 2), its unconditional assignment"]  # verify prints it
    for name in ("later", "twice"):  # no unconditional assignment, or two of them: no guess
        with pytest.raises(HarnessError):
            evaluate_script_code(surveyed, name, {}, main, assumed=assumed)
    assert len(assumed) == 1


def test_verify_drives_each_data_source_with_the_driver_its_plan_names():
    from patcher.families.registry import UNITS
    from patcher.proof.verify import DRIVERS, _planned_drivers

    assert {u.driver for u in UNITS} == set(DRIVERS)  # every driver a family names is defined, and none is dead
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    assert _planned_drivers((fixtures / "tokenstream_readable.py").read_text()) == {"loader_class"}
    assert _planned_drivers((fixtures / "generator_toplevel.py").read_text()) == {"generator"}
    # a staged generator is not run ahead, yet verify drives it: its plan names the driver too
    assert _planned_drivers((fixtures / "generator_shards.py").read_text()) == {"generator"}


def test_the_original_against_itself_is_refused_not_identical(tmp_path, capsys):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "tokenstream_readable.py"
    assert main(["verify", str(fixture), str(fixture)]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("patch-prefetch verify: nothing to verify: ") and "byte-identical to" in err[0]


def test_a_patch_without_training_prefetch_says_nothing_was_prefetched(tmp_path, capsys):
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "tokenstream_readable.py"
    patched = tmp_path / "patched.py"
    patched.write_text(patch_source(fixture.read_text(), {"val_prefetch", "env_toggles"}).source)
    assert main(["verify", str(fixture), str(patched), "--batches", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].endswith("; nothing was prefetched (train_prefetch was skipped): the training loader is the original's")
    assert verify(fixture, patched, batches=4).prefetched is False


def test_verify_runs_the_forked_producer_beside_the_harnesss_own_threads(tmp_path):
    # A test runner's or the progress clock's thread is running while verify loads the
    # scripts; the lean runtime must still fork (else verify proves the unprefetched path):
    # a runtime that gives a slot back while its batch's views live is caught.
    import threading

    fixture = FIXTURES / "tokenstream_readable.py"
    text = patch_source(fixture.read_text()).source
    lent = "lent[index] = weakref.ref(slot)"
    assert text.count(lent) == 1
    patched = tmp_path / "patched.py"
    patched.write_text(text.replace(lent, "lent[index] = lambda: None"))
    stop = threading.Event()
    clock = threading.Thread(target=stop.wait, name="harness-clock", daemon=True)
    clock.start()
    try:
        result = verify(fixture, patched, batches=16)
    finally:
        stop.set()
    assert not result.identical, result.notes


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("name", ["shuffled_minified", "generator_toplevel"])
def test_verify_lets_the_scripts_go(tmp_path, name):
    # shuffled_minified caches a memmap per shard in a module-level dict, and the
    # runtime registers an exit hook that would hold the module: a process verifying
    # many scripts (a test run) kept every verify's shards open.
    original, out = patched(tmp_path, name)
    files, modules = open_files(), loaded_script_names()
    assert verify(original, out, batches=8).identical
    assert {f for f in open_files() - files if "patch-prefetch-verify-" in f} == set()
    assert loaded_script_names() == modules


def test_unload_runs_the_exit_hooks_a_script_registered_once_last_first(monkeypatch):
    registered = []  # what reaches atexit: a library's hook, not the script's own
    monkeypatch.setattr(atexit, "register", lambda func, *args, **kwargs: registered.append(func))
    source = "import atexit\nCALLS = []\ndef hook(i):\n    CALLS.append(i)\nfor i in (1, 2):\n    atexit.register(hook, i)\natexit.register(CALLS.append, 'library')\n"
    module = load_module(source, "script.py")
    calls = module.CALLS
    assert calls == [] and module.__name__ in sys.modules  # held, not run, while loaded
    assert registered == [calls.append]
    unload(module)
    unload(module)
    assert calls == [2, 1] and module.__name__ not in sys.modules


def test_a_script_never_unloaded_has_its_exit_hooks_run_at_exit():
    code = (
        "from patcher.proof.harness import load_module\n"
        "load_module('import atexit\\natexit.register(lambda: print(\"hook ran\"))\\n', 'script.py')\n"
        "print('loaded')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=FIXTURES.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["loaded", "hook ran"]

