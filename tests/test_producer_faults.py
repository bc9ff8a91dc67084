"""What real scripts do that the forked producer (templates/prefetch_lean.py) survives.

Each test takes fixtures/tokenstream_readable.py, adds one hazard to the ORIGINAL with a
small text edit (a thread pool that reads the shards, the script's own SIGTERM handler,
a raw `os.fork()` whose child exits, a tiny /dev/shm, a training loop that waits), patches
it with `patch_source` (the default patch: the lean runtime), runs original and patched
side by side, each in a session of its own, and asserts that the patched run ends as the
original does (the same step and loss lines, the same exit code) within a bounded time,
with no process of its session left behind (no orphan, no zombie) and nothing left in
/dev/shm. Where the hazard forbids a forked producer, the patched run says so in one line
on stderr and builds that loader's batches ahead on a thread instead.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patcher.patch import patch_source
from processes import children, read_lines, session
from patcher.proof.shards import write_shards

REPO = Path(__file__).resolve().parents[1]
ORIGINAL = (REPO / "fixtures" / "tokenstream_readable.py").read_text(encoding="utf-8")
RUN_S = 60  # a run that takes longer has hung: its session is killed and the test fails
FALLBACK = "; train_loader prefetches on a thread (TRAIN_PREFETCH=0 silences this)"

IMPORT_SYS = ("import random\n", "import random\nimport signal\nimport sys\n")
# At step 2 the training loop prints "paused" and waits for a line on stdin: the test
# looks at the producer meanwhile (it has filled its slots long before).
PAUSE = ("        step_loss = 0.0\n", '        if step == 2:\n            print("paused", flush=True)\n            sys.stdin.readline()\n        step_loss = 0.0\n')


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    shards = tmp_path_factory.mktemp("shards")
    write_shards(shards, train_shards=3, val_shards=1, tokens_per_shard=2048, vocab_size=128, seed=0, bos_id=1)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")}
    env.update(DATA_PATH=str(shards), ITERATIONS="8", WARMUP_STEPS="2", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    return env


def _edited(source: str, edits) -> str:
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


def scripts(tmp_path: Path, *edits: tuple[str, str], unseen: tuple = ()) -> tuple[Path, Path]:
    """The original with `edits` (old, new: each old text occurs once) applied, and its
    default patch, written to `tmp_path`. `unseen` edits are made to the original and to
    the patched output alike, after patching: a hazard the survey did not see (the
    runtime's own checks are then all that stands between it and a hang). Returns
    (original, patched)."""
    source = _edited(ORIGINAL, edits)
    result = patch_source(source)
    # The hazard is under test only where the patch gives the forked producer.
    assert "class _PrefetchLoader" in result.source and "def _produce" in result.source, [n.reason for n in result.notes]
    original, patched = tmp_path / "original.py", tmp_path / "patched.py"
    original.write_text(_edited(source, unseen), encoding="utf-8")
    patched.write_text(_edited(result.source, unseen), encoding="utf-8")
    return original, patched


class Script:
    """A command run in a session of its own; its stdout and stderr are read line by
    line on threads of the test, so that a test can wait for a line."""

    def __init__(self, command: list[str], env: dict, cwd: Path):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.stdout, self.stderr, self.lines, self.readers = read_lines(self.proc, "stdout")

    def wait_for(self, text: str) -> None:
        """Return once the script has printed the line `text`; fail after RUN_S."""
        deadline = self.started + RUN_S
        while True:
            try:
                if self.lines.get(timeout=max(0.0, deadline - time.monotonic())) == text:
                    return
            except queue.Empty:
                self.kill()
                pytest.fail(f"no line {text!r} within {RUN_S} s: {self.stdout[-5:]} {self.stderr[-20:]}")

    def quiet_for(self, seconds: float) -> bool:
        """Whether the script prints nothing for `seconds` (a bounded wait for a line)."""
        try:
            self.lines.get(timeout=seconds)
        except queue.Empty:
            return True
        return False

    def finish(self, stdin: str = "") -> tuple[int, float]:
        """Send `stdin`, wait for the exit. Returns (exit code, seconds since the start).
        A script that has not exited by RUN_S after its start has hung: its session is
        killed and the test fails."""
        try:
            self.proc.stdin.write(stdin)
            self.proc.stdin.close()
        except BrokenPipeError:  # exited already
            pass
        try:
            code = self.proc.wait(timeout=max(0.0, self.started + RUN_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"hung: still running after {RUN_S} s; stdout {self.stdout[-5:]}, stderr {self.stderr[-20:]}")
        for reader in self.readers:
            reader.join(RUN_S)
        return code, time.monotonic() - self.started

    def kill(self) -> None:
        for pid in session(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def outcome(self) -> list[str]:
        """The lines that the original and the patched script print alike (no timing, no
        line of the patched script's toggles)."""
        return [line for line in self.stdout if not line.startswith(("train_time:", "patch_prefetch "))]


def run_both(original: Path, patched: Path, env: dict, tmp_path: Path, command=lambda script: [sys.executable, str(script)]) -> tuple[Script, Script]:
    """Start both scripts at once (they run side by side)."""
    return Script(command(original), env, tmp_path), Script(command(patched), env, tmp_path)


def assert_same_end(original: Script, patched: Script, original_code: int, patched_code: int) -> None:
    """The patched run ended as the original: the same lines and exit code, and no process
    of its session is left (the training process reaps its producer before it exits)."""
    assert patched_code == original_code == 0, (patched.stderr[-30:], original.stderr[-30:])
    assert patched.outcome() == original.outcome()
    assert [line for line in patched.outcome() if line.startswith("step:")], "no training step ran"
    assert "Traceback" not in "\n".join(patched.stderr), patched.stderr[-30:]
    assert not session(patched.proc.pid), f"left behind: {session(patched.proc.pid)}"


def prefetch_lines(script: Script) -> list[str]:
    return [line for line in script.stderr if line.startswith("prefetch:")]


# --------------------------------------------------------------------------- 1. threads at fork time

# A module-level pool reads every shard (the validation shards too, so its thread runs
# before the training loader is built). A child forked with that thread alive would
# wait forever for the first shard it reads: the pool's thread is not in the child.
SHARD_POOL = (
    ("import numpy as np\n", "import numpy as np\nfrom concurrent.futures import ThreadPoolExecutor\n"),
    ("def read_shard(path: Path) -> Tensor:\n",
     "SHARD_READER = ThreadPoolExecutor(1)\n\n\n"
     "def read_shard(path: Path) -> Tensor:\n    return SHARD_READER.submit(read_shard_here, path).result()\n\n\n"
     "def read_shard_here(path: Path) -> Tensor:\n"),
)


def test_a_loader_that_uses_a_thread_pool_prefetches_on_a_thread_and_says_so(env, tmp_path):
    # The survey refuses a loader it sees reaching a pool; one it cannot see (here: added
    # after patching) meets the runtime's check at the fork.
    original, patched = run_both(*scripts(tmp_path, unseen=SHARD_POOL), env, tmp_path)
    original_code, _ = original.finish()
    patched_code, seconds = patched.finish()
    assert_same_end(original, patched, original_code, patched_code)
    # One line for the loader variable, although it is built twice (the warm-up reset).
    assert len(prefetch_lines(patched)) == 1, patched.stderr
    assert re.fullmatch(r"prefetch: threads running \['ThreadPoolExecutor-\d+_0'\]: a forked producer would not have them" + re.escape(FALLBACK), prefetch_lines(patched)[0])
    assert seconds < RUN_S


# A loader slower than a training step: whenever the loop ends, the producer is inside a
# torch op that released the GIL.
SLOW_BATCH = ("        mine = chunk[self.rank * span : (self.rank + 1) * span].long()\n",
              "        mine = chunk[self.rank * span : (self.rank + 1) * span].long()\n        torch.ones(2000, 2000) @ torch.ones(2000, 2000)\n")


def test_a_producer_thread_inside_a_torch_op_at_exit_lets_the_run_exit_cleanly(env, tmp_path):
    # A daemon thread that takes the GIL back while Python finalizes is ended by
    # pthread_exit, which a C++ frame turns into std::terminate: exit code 134 after
    # every line of a finished run. The exit hook stops the thread and joins it.
    env = dict(env, ITERATIONS="3")
    original, patched = run_both(*scripts(tmp_path, unseen=(*SHARD_POOL, SLOW_BATCH)), env, tmp_path)
    original_code, _ = original.finish()
    patched_code, _ = patched.finish()
    assert prefetch_lines(patched) and prefetch_lines(patched)[0].endswith(FALLBACK)
    assert_same_end(original, patched, original_code, patched_code)


# --------------------------------------------------------------------------- 2. the script's signal handlers

SIGTERM_HANDLER = ("    master_process = rank == 0\n", '    master_process = rank == 0\n    signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM: carrying on", flush=True))\n')


def _signal_masks(pid: int) -> dict[str, int]:
    """{"SigCgt": caught, "SigIgn": ignored, ...}: the signal masks in /proc/<pid>/status (bit n-1: signal n)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return {name: int(fields[name], 16) for name in ("SigCgt", "SigIgn")}


def test_the_producer_runs_the_default_signal_handlers_not_the_scripts(env, tmp_path):
    # With the script's SIGTERM handler in the child, a SIGTERM the child is sent (at
    # exit, or to the whole process group) would be ignored there: the producer would
    # never leave. The child restores SIG_DFL for SIGTERM, SIGINT and SIGHUP.
    original, patched = run_both(*scripts(tmp_path, IMPORT_SYS, SIGTERM_HANDLER, PAUSE), env, tmp_path)
    original_code, _ = original.finish("\n")
    patched.wait_for("paused")
    (producer,) = children(patched.proc.pid)
    assert _signal_masks(patched.proc.pid)["SigCgt"] & 1 << signal.SIGTERM - 1  # the script's handler is installed
    masks = _signal_masks(producer)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        assert not (masks["SigCgt"] | masks["SigIgn"]) & 1 << signum - 1, f"the producer catches or ignores {signum.name}"
    patched_code, seconds = patched.finish("\n")
    assert_same_end(original, patched, original_code, patched_code)
    assert not prefetch_lines(patched) and seconds < RUN_S
    with pytest.raises(ProcessLookupError):  # reaped, not a zombie
        os.kill(producer, 0)


# --------------------------------------------------------------------------- 3. forks in the script

# A raw fork whose child exits through sys.exit: Python's exit in that child runs the exit
# hooks it inherited, which must not touch the training process's producer.
RAW_FORK = ("        step_loss = 0.0\n",
            "        if step == 2:\n            child = os.fork()\n            if child == 0:\n                sys.exit(0)\n"
            "            os.waitpid(child, 0)\n        step_loss = 0.0\n")


def test_a_child_the_script_forks_and_exits_leaves_the_producer_alone(env, tmp_path):
    original, patched = run_both(*scripts(tmp_path, IMPORT_SYS, RAW_FORK), env, tmp_path)
    original_code, _ = original.finish()
    patched_code, seconds = patched.finish()
    assert_same_end(original, patched, original_code, patched_code)
    assert not prefetch_lines(patched) and seconds < RUN_S


# --------------------------------------------------------------------------- 4. small shared memory

SHM_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def private_shm():
    """Skips unless this user may mount a tmpfs on /dev/shm in a mount namespace of its own."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare command")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={SHM_BYTES} tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
    if probe.returncode:
        pytest.skip(f"cannot mount a private /dev/shm (unshare -m, mount -t tmpfs): {probe.stderr.strip()}")


def test_too_little_shared_memory_keeps_the_forked_producer_and_leaks_nothing(env, tmp_path, private_shm):
    # 4,096 int64 tokens per micro-batch for x and for y: one slot is 64 KB, two would not
    # fit in a 64 KB /dev/shm (a container's is 64 MB). The slots are an anonymous file
    # (memfd), not bound by /dev/shm's size: the forked producer runs, with no line, and
    # nothing is left there (no named semaphore either).
    env = dict(env, TRAIN_BATCH_TOKENS="8192", ITERATIONS="4")
    original, patched = scripts(tmp_path)  # unchanged: the hazard is the machine's
    shell = f'mount -t tmpfs -o size={SHM_BYTES} tmpfs /dev/shm || exit 97; "$0" "$1"; code=$?; ls -A /dev/shm > "$1.shm"; exit $code'
    both = run_both(original, patched, env, tmp_path, lambda script: ["unshare", "-m", "sh", "-c", shell, sys.executable, str(script)])
    codes = [script.finish() for script in both]
    assert_same_end(both[0], both[1], codes[0][0], codes[1][0])
    assert not prefetch_lines(both[1])
    assert Path(f"{patched}.shm").read_text() == "", "left in /dev/shm"
    assert codes[1][1] < RUN_S


# --------------------------------------------------------------------------- 5. busy while idle


def _wakeups_and_cpu(pid: int) -> tuple[int, int]:
    """(voluntary context switches: times it went to sleep, user + system CPU time in clock ticks) of `pid`."""
    status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(status["voluntary_ctxt_switches"]), int(stat[11]) + int(stat[12])


def test_a_producer_with_full_slots_sleeps(env, tmp_path):
    # While the loop waits (here on stdin), the producer has filled its slots: it polls
    # for a few ms, then sleeps on its socket 50 ms at a time, waking only to see
    # whether the training process is still there (polling every 0.5 ms: ~2,000 wake-ups a second).
    original, patched = run_both(*scripts(tmp_path, IMPORT_SYS, PAUSE), env, tmp_path)
    original_code, _ = original.finish("\n")
    patched.wait_for("paused")
    (producer,) = children(patched.proc.pid)
    wakeups, cpu = _wakeups_and_cpu(producer)
    window = 1.0
    assert patched.quiet_for(window)  # the measuring window: the script is paused, its producer idle
    wakeups, cpu = (after - before for after, before in zip(_wakeups_and_cpu(producer), (wakeups, cpu)))
    ticks = os.sysconf("SC_CLK_TCK")
    assert wakeups < 60 * window, f"{wakeups} wake-ups in {window} s"
    assert cpu <= 0.03 * ticks * window, f"{cpu / ticks:.3f} s of CPU in {window} s"
    patched_code, _ = patched.finish("\n")
    assert_same_end(original, patched, original_code, patched_code)
