"""The producer runs through the training loop in the conditions real scripts create.

Each test takes fixtures/tokenstream_readable.py, adds one condition to the ORIGINAL (a
`torch.compile`d model, a thread of the script's own, two ranks under torchrun, a
`seq_len` that changes during the run, which takes the thread runtime), patches it with
the default patch, and runs original and patched. Half-way through training, after the
warm-up steps and the loader's rebuild, each rank of the patched run says what it runs
(its pid and its threads' names) and waits on a FIFO while the test looks at it: its
producer is there (a forked child process, the lean runtime's thread `prefetch
train_loader`, or the thread runtime's `train-prefetch`). Then both runs finish, and
their step and loss lines must be the same, bit for bit.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patcher.patch import patch_source
from processes import children, descendants, read_lines, session
from patcher.proof.shards import write_shards

REPO = Path(__file__).resolve().parents[1]
ORIGINAL = (REPO / "fixtures" / "tokenstream_readable.py").read_text(encoding="utf-8")
RUN_S = 240  # a run that takes longer has hung (a compiled model compiles for tens of seconds here)
ITERATIONS = 8

# Half-way through the training loop (after the warm-up and the loader's rebuild), each
# rank writes `observe RANK PID FORKS THREAD...` to stderr (one write: ranks share it) and
# blocks reading its FIFO until the test writes a line to it. FORKS counts the
# `os.fork()` calls of the rank's process so far. Only where OBSERVE_DIR is set: the
# original runs through.
OBSERVE = (
    "        step_loss = 0.0\n",
    "        if step == args.iterations // 2 and os.environ.get('OBSERVE_DIR'):\n"
    "            os.write(2, ' '.join(['observe', str(rank), str(os.getpid()), str(len(FORKS))] + [t.name.replace(' ', '_') for t in __import__('threading').enumerate()]).encode() + b'\\n')\n"
    "            open(os.path.join(os.environ['OBSERVE_DIR'], f'{rank}.go')).read()\n"
    "        step_loss = 0.0\n",
)
COUNT_FORKS = ("import os\n", "import os\nFORKS = []\nos.register_at_fork(after_in_parent=lambda: FORKS.append(1))\n")
COMPILED = (
    "    embeddings = [base_model.wte.weight, base_model.wpe.weight]\n",
    "    model = torch.compile(model)\n    embeddings = [base_model.wte.weight, base_model.wpe.weight]\n",
)
# Every rank logs, each line with its rank: the loss of a step is the rank's own loss on
# its own batch. A line and its newline go in one write, so that the ranks' lines do not
# interleave on the stdout they share.
EVERY_RANK_LOGS = (
    ("master_process = rank == 0", "master_process = True"),
    ("print(msg, flush=True)", 'print(f"rank{rank} {msg}\\n", end="", flush=True)'),
)
# An idle thread of the script's own (a heartbeat), started before the loader is built.
OWN_THREAD = (
    "    train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)\n\n    def lr_scale",
    "    __import__('threading').Thread(target=__import__('threading').Event().wait, name='heartbeat', daemon=True).start()\n"
    "    train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)\n\n    def lr_scale",
)

# A curriculum: the training loop's `seq_len` halves on odd steps (the loader only
# reshapes with it), so the plan takes the thread runtime, `seq_len` applied at hand-out.
CURRICULUM = (
    "            x, y = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)\n"
    "            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == \"cuda\"):\n"
    "                loss = model(x, y)\n",
    "            x, y = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len // (1 + step % 2), grad_accum_steps)\n"
    "            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == \"cuda\"):\n"
    "                loss = model(x, y)\n",
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    shards = tmp_path_factory.mktemp("shards")
    write_shards(shards, train_shards=3, val_shards=1, tokens_per_shard=4096, vocab_size=128, seed=0, bos_id=1)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(DATA_PATH=str(shards), ITERATIONS=str(ITERATIONS), WARMUP_STEPS="2", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    return env


def scripts(tmp_path: Path, *edits: tuple[str, str], thread: bool = False) -> tuple[Path, Path]:
    """The original with `edits` (each old text occurs once) and the observation point,
    and its default patch (which must give the forked producer, or the thread runtime
    where `thread`). Returns (original, patched)."""
    source = ORIGINAL
    for old, new in (*edits, OBSERVE, COUNT_FORKS):
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    result = patch_source(source)
    assert ("class _Worker" in result.source) == thread and "class _PrefetchLoader" in result.source, [n.reason for n in result.notes]
    original, patched = tmp_path / "original.py", tmp_path / "patched.py"
    original.write_text(source, encoding="utf-8")
    patched.write_text(result.source, encoding="utf-8")
    return original, patched


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def nothing_left_running():
    """Whatever a test started is killed with all its descendants (torchrun's ranks,
    which run in sessions of their own, and their producers) when the test ends."""
    yield
    while STARTED:
        proc = STARTED.pop()
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


class Run:
    """A command in a session of its own; stdout and stderr read on threads of the test."""

    def __init__(self, command: list[str], env: dict, cwd: Path):
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        STARTED.append(self.proc)
        self.stdout, self.stderr, self.lines, self.readers = read_lines(self.proc, "stderr")
        self.deadline = time.monotonic() + RUN_S

    def observations(self, ranks: int) -> dict[int, tuple[int, list[str]]]:
        """Wait for `ranks` observe lines: {rank: (pid, forks so far, thread names)}."""
        seen = {}
        while len(seen) < ranks:
            try:
                line = self.lines.get(timeout=max(0.0, self.deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no observation within {RUN_S} s: {self.stdout[-5:]} {self.stderr[-30:]}")
            if line.startswith("observe "):
                _, rank, pid, forks, *threads = line.split()
                seen[int(rank)] = (int(pid), int(forks), threads)
        return seen

    def finish(self) -> int:
        """Wait for the exit and for the end of its output. Returns the exit code."""
        try:
            code = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {RUN_S} s: {self.stderr[-30:]}")
        for reader in self.readers:  # both pipes end with the process (and its producers)
            reader.join(max(1.0, self.deadline - time.monotonic()))
        return code

    def step_lines(self) -> list[str]:
        return [line for line in self.stdout if line.startswith(("step:", "final "))]


def run_observed(original: Path, patched: Path, env: dict, tmp_path: Path, ranks: int = 1) -> tuple[Run, Run, dict]:
    """Run both (under torchrun with `ranks` > 1); hold the patched run's ranks half-way
    and return what each was running then: {rank: (pid, forks so far, thread names, child pids)}."""
    observe = tmp_path / "observe"
    observe.mkdir()
    for rank in range(ranks):
        os.mkfifo(observe / f"{rank}.go")
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    runs = [Run(launcher + [str(original)], env, tmp_path)]
    if ranks > 1:  # one torchrun job at a time (see conftest's one_torchrun_at_a_time)
        runs[0].finish()
    runs.append(Run(launcher + [str(patched)], {**env, "OBSERVE_DIR": str(observe)}, tmp_path))
    seen = runs[1].observations(ranks)
    held = {rank: (pid, forks, threads, children(pid)) for rank, (pid, forks, threads) in seen.items()}
    for rank in range(ranks):
        with open(observe / f"{rank}.go", "w") as go:
            go.write("go\n")
    return runs[0], runs[1], held


def assert_same_training(original: Run, patched: Run) -> None:
    for run in (original, patched):
        assert run.finish() == 0, run.stderr[-20:]
    assert len([line for line in original.step_lines() if line.startswith("step:")]) == ITERATIONS, original.stdout[-10:]
    assert patched.step_lines() == original.step_lines()


def test_a_compiled_model_and_a_rebuilt_loader_keep_the_forked_producer(env, tmp_path):
    # torch.compile on the CPU leaves inductor's compile pool running when the loader is
    # built again after the warm-up: the producer forked at the first batch, before the
    # compile, is reset, not forked again. Caches off: a cache hit compiles nothing and
    # starts no pool, and the condition under test would not arise. (The original cannot
    # take the patched run's compiled code from a shared cache: the MLP form differs, and
    # the two compiled forms training alike is part of what this test shows.)
    original, patched, held = run_observed(*scripts(tmp_path, COMPILED), {**env, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}, tmp_path)
    pid, forks, threads, child_pids = held[0]
    assert any(name.startswith("ThreadPoolExecutor") for name in threads), f"no compile pool running: {threads}"
    assert child_pids, f"no producer process half-way through training; threads {threads}"
    assert forks == 1, f"{forks} forks: the rebuild forked again"
    assert not [line for line in patched.stderr if line.startswith("prefetch:")], patched.stderr[-10:]
    assert_same_training(original, patched)


def test_a_thread_of_the_scripts_own_means_a_producer_thread(env, tmp_path):
    # A fork would lack the heartbeat thread: the batches are built ahead on a thread.
    original, patched, held = run_observed(*scripts(tmp_path, OWN_THREAD), env, tmp_path)
    pid, forks, threads, child_pids = held[0]
    assert forks == 0 and threads.count("prefetch_train_loader") == 1, (forks, threads)
    assert "prefetch_train_loader" in threads and "heartbeat" in threads, threads
    assert [line for line in patched.stderr if line.startswith("prefetch:")] == [
        "prefetch: threads running ['heartbeat']: a forked producer would not have them; train_loader prefetches on a thread (TRAIN_PREFETCH=0 silences this)"]
    assert_same_training(original, patched)


def test_two_ranks_under_torchrun_each_keep_a_forked_producer(env, tmp_path, one_torchrun_at_a_time):
    # Each rank trains on the original's batches of that rank, and at the end no producer
    # is left running.
    original, patched, held = run_observed(*scripts(tmp_path, *EVERY_RANK_LOGS), env, tmp_path, ranks=2)
    for rank, (pid, forks, threads, child_pids) in held.items():
        assert child_pids, f"rank {rank}: no producer process half-way through training; threads {threads}"
        assert forks == 1, f"rank {rank}: {forks} forks: the rebuild forked again"
    assert not [line for line in patched.stderr if "prefetch:" in line], patched.stderr[-10:]
    for run in (original, patched):
        assert run.finish() == 0, run.stderr[-20:]
        assert session(run.proc.pid, alive=True) == []

    def per_rank(run: Run) -> dict[str, list[str]]:
        ranks: dict[str, list[str]] = {}
        for line in run.stdout:
            if line.startswith(("rank0 ", "rank1 ")) and line[6:].startswith(("step:", "final ")):
                ranks.setdefault(line[4], []).append(line[6:])
        return ranks

    ranks = per_rank(original)
    assert sorted(ranks) == ["0", "1"] and all(len([line for line in r if line.startswith("step:")]) == ITERATIONS for r in ranks.values()), ranks
    assert ranks["0"] != ranks["1"]  # the ranks train on different batches
    assert per_rank(patched) == ranks


def test_two_ranks_under_torchrun_each_keep_the_thread_runtimes_producer(env, tmp_path, one_torchrun_at_a_time):
    # The thread runtime (a `seq_len` curriculum): each rank's producer thread runs through
    # the loop after the rebuild, and no rank forks.
    original, patched, held = run_observed(*scripts(tmp_path, CURRICULUM, thread=True), env, tmp_path, ranks=2)
    for rank, (pid, forks, threads, child_pids) in held.items():
        assert forks == 0 and threads.count("train-prefetch") == 1, f"rank {rank}: {forks} forks, threads {threads}"
    assert not [line for line in patched.stderr if "prefetch:" in line], patched.stderr[-10:]
    assert_same_training(original, patched)
