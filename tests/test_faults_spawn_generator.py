"""templates/prefetch_lean.py's spawned start when the host gets in the way: no room for named
semaphores (a full /dev/shm), no descriptors to spare, an argument that pickles but does
not unpickle in the spawned process, and a run killed with SIGKILL (the whole process
group, or the training process alone).

A full /dev/shm is simulated where it strikes: `sem_open` writes the semaphore's file in
/dev/shm, so `_multiprocessing.SemLock` raises OSError(ENOSPC) (no tmpfs can be mounted
here). What a run holds in /dev/shm is read from its processes' maps and descriptors
(/proc): that names what is the run's, whatever other runs do with /dev/shm meanwhile.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import _multiprocessing
import multiprocessing
import multiprocessing.synchronize  # imported before SemLock is replaced: it reads SemLock's constants at import

import pytest
import torch

from patcher.templates.prefetch_lean import _spawn_generator
from tests.processes import exits_within, readable_within, session

REPO = Path(__file__).resolve().parents[1]

SOURCE = textwrap.dedent(
    '''
    import torch

    def gen(n, device="cpu", tokenizer=None):
        buffer = torch.empty(2, 3, dtype=torch.long, device=device)
        for k in range(n):
            buffer.copy_(torch.arange(6).view(2, 3) * (k + 1) + (tokenizer.offset if tokenizer is not None else 0))
            yield buffer[0], buffer[1], {"pq_idx": k // 3, "rg_idx": k % 3, "epoch": 1}

    def _load_tokenizer(path):
        raise FileNotFoundError(f"{path}: no vocabulary here")

    def gen_killed(n, device="cpu", tokenizer=None):
        import multiprocessing, os, signal
        if multiprocessing.parent_process() is not None:  # in the spawned producer: killed before its first batch
            os.kill(os.getpid(), signal.SIGKILL)
        yield from gen(n, device, tokenizer)

    class Locked:
        """Holds a lock: does not pickle."""
        offset = 2

        def __init__(self):
            import threading
            self.lock = threading.Lock()

    class Tokenizer:
        """Pickles, as a reference to its file; unpickling loads that file, absent in the spawned process."""
        offset = 5

        def __init__(self, path):
            self.path = path

        def __reduce__(self):
            return _load_tokenizer, (self.path,)
    '''
)


@pytest.fixture
def module(import_source):
    return import_source("spawn_faults", SOURCE)


def same(got, module, **arguments):
    want = [(a.clone(), b.clone(), dict(s)) for a, b, s in module.gen(**arguments)]
    return len(got) == len(want) and all(torch.equal(a, x) and torch.equal(b, y) and s == t for (a, b, s), (x, y, t) in zip(want, got))


def test_a_full_dev_shm_still_spawns_the_producer(module, monkeypatch, capfd):
    # sem_open on a full /dev/shm: ENOSPC, at the first next()
    def no_room(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_multiprocessing, "SemLock", no_room)
    generator = _spawn_generator(module.gen, {"n": 5, "device": "cpu", "tokenizer": None}, "device")
    got = [next(generator)]
    spawned = multiprocessing.active_children()
    got += [(a.clone(), b.clone(), s) for a, b, s in generator]
    assert same(got, module, n=5) and spawned and not multiprocessing.active_children()
    assert capfd.readouterr().err == ""


def test_no_descriptors_for_the_channel_runs_here_with_one_line(module, monkeypatch, capfd):
    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socket, "socketpair", no_descriptors)
    got = [(a.clone(), b.clone(), s) for a, b, s in _spawn_generator(module.gen, {"n": 4, "device": "cpu", "tokenizer": None}, "device")]
    assert same(got, module, n=4) and not multiprocessing.active_children()
    assert capfd.readouterr().err.splitlines() == [
        "prefetch: gen runs in the training process: no spawned producer (OSError: [Errno 24] Too many open files) (TRAIN_PREFETCH=0 silences this)"]


def test_an_argument_that_does_not_pickle_runs_here_with_the_scripts_own_main(module, capfd):
    # The spawn hides the script's __main__ while it starts the child; the fallback (and
    # the training that goes on between its batches) must see the script's own again.
    main, tokenizer = sys.modules["__main__"], module.Locked()
    generator = _spawn_generator(module.gen, {"n": 4, "device": "cpu", "tokenizer": tokenizer}, "device")
    a, b, s = next(generator)
    assert sys.modules["__main__"] is main
    got = [(a.clone(), b.clone(), s)] + [(a.clone(), b.clone(), s) for a, b, s in generator]
    assert same(got, module, n=4, tokenizer=tokenizer) and not multiprocessing.active_children()
    assert capfd.readouterr().err.splitlines() == [
        "prefetch: gen runs in the training process: no spawned producer (TypeError: cannot pickle '_thread.lock' object) (TRAIN_PREFETCH=0 silences this)"]


def test_an_argument_that_does_not_unpickle_in_the_producer_runs_here_with_one_line(module, capfd):
    tokenizer = module.Tokenizer("tokenizer.pkl")
    got = [(a.clone(), b.clone(), s) for a, b, s in _spawn_generator(module.gen, {"n": 4, "device": "cpu", "tokenizer": tokenizer}, "device")]
    assert same(got, module, n=4, tokenizer=tokenizer) and not multiprocessing.active_children()
    assert capfd.readouterr().err.splitlines() == [
        "prefetch: gen runs in the training process: its argument tokenizer does not unpickle in a spawned producer "
        "(FileNotFoundError: tokenizer.pkl: no vocabulary here) (TRAIN_PREFETCH=0 silences this)"]


def test_a_producer_killed_before_its_first_batch_runs_here_with_one_line(module, capfd):
    # as the out-of-memory killer would; or the child's own start failing (its traceback then precedes the line)
    got = [(a.clone(), b.clone(), s) for a, b, s in _spawn_generator(module.gen_killed, {"n": 4, "device": "cpu", "tokenizer": None}, "device")]
    assert same(got, module, n=4) and not multiprocessing.active_children()
    assert capfd.readouterr().err.splitlines() == [
        "prefetch: gen_killed runs in the training process: its spawned producer died before its first batch (exit code -9) (TRAIN_PREFETCH=0 silences this)"]


RUN = """
import sys
sys.path.insert(0, {path!r})
from {name} import gen
from patcher.templates.prefetch_lean import _spawn_generator
batches = _spawn_generator(gen, {{"n": 10**6, "device": "cpu", "tokenizer": None}}, "device")
next(batches)
print("ready", flush=True)
sys.stdin.read()
"""


def _in_dev_shm(pid):
    """The files of /dev/shm process `pid` maps or holds open."""
    held = set()
    try:
        held |= {line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line}
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if with_target.startswith("/dev/shm/"):
                held.add(with_target)
    except OSError:  # gone meanwhile
        pass
    return {path.removesuffix(" (deleted)") for path in held}


@pytest.mark.parametrize("killed", ["the process group", "the training process"])
def test_sigkill_leaves_nothing_in_dev_shm_and_no_warning(module, tmp_path, killed):
    """After SIGKILL of the whole group (the resource tracker too, which would have
    unlinked a named semaphore) or of the training process alone (the producer then
    leaves by itself), no file of /dev/shm the run held is left, and nothing warns."""
    script = tmp_path / "run.py"
    script.write_text(RUN.format(path=str(tmp_path), name=module.__name__))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    held = set()
    try:
        assert readable_within(proc.stdout, 60) and proc.stdout.readline() == "ready\n", proc.stderr.read() if proc.poll() is not None else ""
        run = session(proc.pid)
        assert len(run) >= 2  # the training process and its producer
        for pid in run:
            held |= _in_dev_shm(pid)
        if killed == "the process group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        assert all(exits_within(pid, 10) for pid in run)  # the producer leaves when the training process has gone
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        left = [path for path in held if os.path.exists(path)]
        for path in left:
            os.unlink(path)
    assert left == []
    assert "resource_tracker" not in err and "leaked" not in err, err
