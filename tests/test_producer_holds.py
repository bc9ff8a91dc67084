"""The forked producer in a real patched script: what already holds when a run goes wrong.

`fixtures/tokenstream_readable.py` (the TokenStream family, forked producer
`templates/prefetch_lean.py`) is patched with `patch_source` and run on CPU on the
shards `patcher.proof.shards` writes. Each run is its own session, so that whatever
it leaves behind can be found by session id; the producer child is found through
/proc as the one child of the training process. Waits are bounded and on conditions
(a line in the output, a process exiting, read through a pidfd), never sleeps.

- The producer is killed: the run stops with one error naming the exit code.
- The training process is killed (SIGKILL), terminated (SIGTERM, what torchrun sends)
  or interrupted (SIGINT to it alone, or Ctrl-C: SIGINT to its process group, the
  producer included): it ends promptly, the producer
  is gone, and no shared memory either of them mapped is left in /dev/shm.
- The loader raises at batch N (a shard whose header claims more tokens than it holds,
  an error the script raises itself): the patched run fails at the same batch, with
  the same loss lines before it and the same exception.
- Two ranks under torchrun (gloo on CPU), every rank training on the original's batches:
  test_producer_where_users_train.py.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from processes import exits_within
from patcher.patch import patch_source
from patcher.proof.shards import HEADER_BYTES, write_shards

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "tokenstream_readable.py"
WAIT_S = 20.0  # the most any awaited line or exit may take on a loaded machine
PROMPT_S = 10.0  # the most a run may take to end after a signal or a dead producer
STEP = re.compile(r"^step:(\d+) train_loss:(\S+)$")
FORKED = "a child process forked once, at the first batch, builds the batches"


# ---------------------------------------------------------------- processes through /proc


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp,
    session, ...), or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def _processes() -> dict[int, list[str]]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                found[int(entry)] = fields
    return found


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    return sorted(p for p, f in _processes().items() if int(f[1]) == pid and f[0] != "Z")


def alive_in_session(session: int) -> list[int]:
    """The processes of `session` that have not exited (zombies have)."""
    return sorted(p for p, f in _processes().items() if int(f[3]) == session and f[0] != "Z")


def shared_memory_of(*pids: int) -> set[str]:
    """The shared files the processes `pids` map: /dev/shm paths (unlinked ones included)
    and anonymous ones (`/memfd:<name>`)."""
    paths = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(("/dev/shm/", "/memfd:")):
                paths.add(parts[5].removesuffix(" (deleted)"))
    return paths


class Run:
    """A script run in its own session; stdout read line by line on a thread, stderr kept.

    command: the arguments after the interpreter (a path, or `-m torch.distributed.run ...`);
    env: variables on top of this process's, with DATA_PATH and one torch thread.
    """

    def __init__(self, command: list[str], data: Path, **env: str):
        full = dict(os.environ, DATA_PATH=str(data), OMP_NUM_THREADS="1", **env)
        self.proc = subprocess.Popen([sys.executable, *command], env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self.stderr: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        self._err = threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr.append), daemon=True)
        self._err.start()

    @staticmethod
    def _pump(stream, put) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def line(self, pattern: re.Pattern, timeout: float = WAIT_S) -> re.Match:
        """The next stdout line that matches `pattern`; fails on timeout or end of output."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern.pattern} within {timeout} s; stdout so far: {self.seen[-5:]}") from None
            if line is None:
                self.lines.put(None)
                raise AssertionError(f"output ended before a line matching {pattern.pattern}: {self.seen[-5:]} {' '.join(filter(None, self.stderr))[-2000:]}")
            self.seen.append(line)
            found = pattern.match(line)
            if found:
                return found

    def finish(self, timeout: float = WAIT_S) -> tuple[int, list[str], str]:
        """Wait for the end (bounded): (return code, every stdout line, stderr)."""
        code = self.proc.wait(timeout=timeout)
        while True:
            line = self.lines.get(timeout=timeout)
            if line is None:
                break
            self.seen.append(line)
        self._err.join(timeout)
        return code, self.seen, "\n".join(line for line in self.stderr if line is not None)

    def close(self) -> None:
        """Kill the run's process group if it is still there (a failed test)."""
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=WAIT_S)


@pytest.fixture
def runs():
    """`runs(command, data, **env)` starts a `Run`; whatever a failed test leaves running is killed."""
    started: list[Run] = []

    def start(command: list[str], data: Path, **env: str) -> Run:
        run = Run(command, data, **env)
        started.append(run)
        return run

    yield start
    for run in started:
        run.close()
        for pid in alive_in_session(run.pid):  # a producer a failed test left behind
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- scripts and data


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Three train shards of 2048 tokens and one validation shard, as `python -m patcher.proof.shards DIR` writes."""
    directory = tmp_path_factory.mktemp("shards")
    write_shards(directory)
    return directory


def patched_copy(source: str, directory: Path, name: str = "train_gpt.py") -> tuple[Path, Path]:
    """The original `source` and its patched version, written to `directory`; the patch
    must put the training loader on the forked producer."""
    result = patch_source(source)
    [note] = [n.reason for n in result.notes if n.feature == "train_prefetch"]
    assert note.startswith("`train_loader` built at line ") and f" prefetches; {FORKED}" in note, note
    original, patched = directory / name, directory / f"patched_{name}"
    original.write_text(source)
    patched.write_text(result.source)
    return original, patched


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> tuple[Path, Path]:
    return patched_copy(FIXTURE.read_text(encoding="utf-8"), tmp_path_factory.mktemp("scripts"))


# ---------------------------------------------------------------- the producer dies


def test_a_killed_producer_ends_the_run_with_one_error_naming_its_exit_code(scripts, data, runs):
    run = runs([str(scripts[1])], data, ITERATIONS="100000")
    run.line(STEP)
    [producer] = children(run.pid)
    os.kill(producer, signal.SIGKILL)  # as the OOM killer would
    killed = time.monotonic()
    code, lines, stderr = run.finish(PROMPT_S)
    took = time.monotonic() - killed
    assert code == 1, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last == f"RuntimeError: prefetch: producer exit code {-signal.SIGKILL}", stderr[-2000:]
    assert stderr.count("Traceback") == 1 and "x, y = train_loader.next_batch(" in stderr, stderr[-2000:]
    assert not any(line.startswith("final val_loss") for line in lines)
    assert exits_within(producer, 0) and alive_in_session(run.pid) == []
    print(f"producer killed: run exited {code} after {took:.2f} s: {last}")


# ---------------------------------------------------------------- the training process is stopped


@pytest.mark.parametrize(
    "how",
    ["SIGKILL", "SIGTERM", "SIGINT", "SIGINT to the process group"],
)
def test_a_stopped_training_process_leaves_no_producer_and_no_shared_memory(scripts, data, runs, how):
    before = set(os.listdir("/dev/shm"))
    run = runs([str(scripts[1])], data, ITERATIONS="100000")
    run.line(STEP)
    [producer] = children(run.pid)
    mapped = shared_memory_of(run.pid, producer)
    # The slots, mapped by both: an anonymous file, nothing named in /dev/shm to outlive them.
    assert mapped == {"/memfd:prefetch-slots"}, mapped
    sent = time.monotonic()
    if how == "SIGINT to the process group":  # Ctrl-C in a terminal: every process of the foreground group
        os.killpg(run.pid, signal.SIGINT)
    else:
        os.kill(run.pid, getattr(signal, how))
    expected = -signal.SIGINT if how.startswith("SIGINT") else -getattr(signal, how)  # CPython ends an uncaught KeyboardInterrupt by re-raising SIGINT
    code, _, stderr = run.finish(PROMPT_S)
    took = time.monotonic() - sent
    assert code == expected, stderr[-2000:]
    assert exits_within(producer, PROMPT_S), f"the producer {producer} outlived the training process ({how})"
    gone = time.monotonic() - sent
    assert alive_in_session(run.pid) == []
    new = set(os.listdir("/dev/shm")) - before
    # Other programs on this machine may use /dev/shm meanwhile: what counts is what these processes named.
    assert [name for name in new if f"_{run.pid}_" in name or f"_{producer}_" in name] == []
    print(f"{how}: training process ended in {took:.2f} s, producer gone after {gone:.2f} s, /dev/shm new entries: {sorted(new)}")


# ---------------------------------------------------------------- the loader raises at batch N


def truncated_shards(data: Path, directory: Path) -> Path:
    """A copy of `data` whose third train shard's header claims its 2048 tokens while
    the file holds 1000: the stream reaches it at the 8th batch after the warm-up."""
    shutil.copytree(data, directory)
    shard = directory / "fineweb_train_000002.bin"
    raw = shard.read_bytes()
    assert int(np.frombuffer(raw[:12], dtype="<i4")[2]) == 2048
    shard.write_bytes(raw[: HEADER_BYTES + 2 * 1000])
    return directory


SCRIPT_ERROR = (
    "    def next_batch(self, global_tokens: int, seq_len: int, grad_accum_steps: int) -> tuple[Tensor, Tensor]:\n",
    "    def next_batch(self, global_tokens: int, seq_len: int, grad_accum_steps: int) -> tuple[Tensor, Tensor]:\n"
    "        self.calls = getattr(self, 'calls', 0) + 1\n"
    "        if self.calls == int(os.environ.get('FAIL_AT_CALL', 0)):\n"
    "            raise ShardError(f'batch {self.calls} is corrupt', self.calls)\n",
)
ERROR_CLASS = (
    "class TokenStream:\n",
    "class ShardError(Exception):\n    pass\n\n\nclass TokenStream:\n",
)
# An exception whose class cannot be rebuilt from its args (its `__init__` takes two
# arguments, its args hold one): pickle would fail to rebuild it in the caller.
UNREBUILDABLE_ERROR_CLASS = (
    "class TokenStream:\n",
    "class ShardError(Exception):\n    def __init__(self, message, call):\n        super().__init__(f'{message} (call {call})')\n\n\nclass TokenStream:\n",
)


@pytest.mark.parametrize("failure", ["truncated shard", "error the script raises", "error whose class cannot be rebuilt"])
def test_a_loader_error_fails_the_patched_run_at_the_same_batch_with_the_same_exception(data, runs, tmp_path, failure):
    if failure == "truncated shard":
        original, patched = patched_copy(FIXTURE.read_text(encoding="utf-8"), tmp_path)
        shards, env = truncated_shards(data, tmp_path / "shards"), {}
        last_line = re.compile(r"^ValueError: \S+fineweb_train_000002\.bin: the header promises 2048 tokens, the file holds 1000$")
    else:
        source = FIXTURE.read_text(encoding="utf-8")
        for old, new in (SCRIPT_ERROR, ERROR_CLASS if failure == "error the script raises" else UNREBUILDABLE_ERROR_CLASS):
            assert source.count(old) == 1
            source = source.replace(old, new)
        original, patched = patched_copy(source, tmp_path)
        shards, env = data, {"FAIL_AT_CALL": "9"}  # the 9th batch after the warm-up: step 5
        last_line = re.compile(r"^ShardError: \('batch 9 is corrupt', 9\)$" if failure == "error the script raises" else r"^ShardError: batch 9 is corrupt \(call 9\)$")
    outcomes = []
    for script in (original, patched):  # at once: two cores
        outcomes.append(runs([str(script)], shards, **env))
    (code_o, lines_o, err_o), (code_p, lines_p, err_p) = (run.finish(WAIT_S) for run in outcomes)
    assert code_o == code_p == 1, (err_o[-1500:], err_p[-1500:])
    assert last_line.match(err_o.strip().splitlines()[-1]), err_o[-1500:]
    # The script's own exception arrives as itself (a class whose __init__ takes other
    # arguments than its args too: rebuilt without calling it), the producer's traceback
    # as its cause.
    assert err_p.strip().splitlines()[-1] == err_o.strip().splitlines()[-1], err_p[-2000:]
    assert "in next_batch" in err_p
    steps_o = [line for line in lines_o if STEP.match(line)]
    steps_p = [line for line in lines_p if STEP.match(line)]
    assert steps_p == steps_o and len(steps_o) == {"truncated shard": 3, "error the script raises": 4, "error whose class cannot be rebuilt": 4}[failure]
    for run in outcomes:
        assert alive_in_session(run.pid) == []
