"""Faults of the minifier's worker (patcher/minify_worker.py, driven by patcher/code_size.py):
killed, stopped, or blocked on its own warnings. The command ends within a bound and
says in one line what happened; it never waits silently.

The record counts its code minified (its own size function names pyminify), so the
command counts code bytes through the worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


from processes import children, exits_within, read_lines

from patcher import code_size
from patcher.code_size import DEFAULT_MINIFY_FLAGS, CountError, Counting, MinifyWorker

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

SIZE_FUNCTION = '''
import lzma, base64, subprocess
def _code_size(code):
    minified = subprocess.run(["pyminify", "--no-rename-locals", "--remove-literal-statements", "-"], input=code, capture_output=True).stdout
    return len(base64.b85encode(lzma.compress(minified)))
'''


def _minified_record(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "train_gpt.py"
    path.write_text((FIXTURES / "tokenstream_readable.py").read_text() + SIZE_FUNCTION + extra)
    return path


def _command(script: Path, out: Path, env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "patcher.cli", str(script), "-o", str(out), "--no-check"]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _worker_of(pid: int, seconds: float = 15.0) -> int:
    """The pid of the minifier's worker that process `pid` starts, as soon as it runs."""
    for _ in range(int(seconds / 0.01)):
        for child in children(pid):
            try:
                if b"minify_worker.py" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
            except OSError:  # gone meanwhile
                pass
        assert not exits_within(pid, 0.01), "the command ended before it started the minifier's worker"
    raise AssertionError(f"no minifier's worker under {pid} within {seconds} s")


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_worker_killed_before_it_answers_ends_the_command_with_one_line(tmp_path):
    script, out = _minified_record(tmp_path), tmp_path / "out.py"
    proc = _command(script, out)
    try:
        worker = _worker_of(proc.pid)
        os.kill(worker, signal.SIGSTOP)  # from here on it cannot answer
        os.kill(worker, signal.SIGKILL)  # as the kernel's out-of-memory killer does
        assert exits_within(proc.pid, 20), "the command still waits for a count from a worker that was killed"
        _, err = proc.communicate()
    finally:
        _end(proc)
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert str(script) in last and "code bytes" in last and f"minifier's worker (pid {worker}) was killed by SIGKILL" in last and last.endswith("; nothing written")
    assert not out.exists()  # the output is written once counted: nothing is on disk


def test_a_stopped_worker_is_said_once_and_the_command_goes_on_when_it_is_continued(tmp_path):
    script, out = _minified_record(tmp_path), tmp_path / "out.py"
    proc = _command(script, out)
    try:
        worker = _worker_of(proc.pid)
        os.kill(worker, signal.SIGSTOP)
        _, err, lines, readers = read_lines(proc, "stderr")
        line = lines.get(timeout=10)  # said while it waits, not after the bound
        assert f"minifier's worker (pid {worker}) is stopped" in line and f"up to {code_size.ANSWER_BOUND_S:g} s" in line and f"kill -CONT {worker}" in line
        os.kill(worker, signal.SIGCONT)
        assert exits_within(proc.pid, 20)
        proc.wait()
        for reader in readers:
            reader.join(5)
    finally:
        _end(proc)
    assert proc.returncode == 0 and out.exists()
    assert sum("is stopped" in line for line in err) == 1


def test_a_worker_that_does_not_answer_within_the_bound_is_ended_and_said(monkeypatch, capfd):
    monkeypatch.setattr(code_size, "ANSWER_BOUND_S", 1.0, raising=False)
    worker = MinifyWorker()
    pid = next(c for c in children(os.getpid()) if b"minify_worker.py" in Path(f"/proc/{c}/cmdline").read_bytes())
    os.kill(pid, signal.SIGSTOP)  # before it has even imported the minifier: no answer can come
    outcome: list = []

    def wait() -> None:
        try:
            outcome.append(pending.result())
        except CountError as error:
            outcome.append(error)

    try:
        pending = worker.count(Counting("minified", DEFAULT_MINIFY_FLAGS), "x = 1\n")
        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive(), "the count still waits for a stopped worker"
        assert isinstance(outcome[0], CountError)
        message = str(outcome[0])
        assert f"no answer from the minifier's worker (pid {pid}) in 1 s" in message and "stopped" in message
        assert exits_within(pid, 5)  # ended, not left stopped
    finally:
        worker.abandon()
    assert "\n" not in message


def test_a_worker_with_many_warnings_does_not_block_on_its_stderr(tmp_path):
    # Python 3.12 warns of each invalid escape sequence when the worker parses the script;
    # PYTHONWARNINGS=always does the same here. 64 KB of warnings fill a pipe.
    escapes = "".join(f'P{i} = "\\d{i}"\n' for i in range(800))
    script, out = _minified_record(tmp_path, escapes), tmp_path / "out.py"
    proc = _command(script, out, env=dict(os.environ, PYTHONWARNINGS="always"))
    try:
        _, err, _, _ = read_lines(proc, "stdout")
        assert exits_within(proc.pid, 30), "the command waits for a worker blocked on writing its warnings"
        proc.wait()
    finally:
        _end(proc)
    assert proc.returncode == 0 and out.exists()


def test_the_running_clock_ends_when_the_terminal_takes_no_output(monkeypatch):
    # A terminal under flow control (Ctrl-S) or a stalled pseudo-terminal blocks the
    # clock's refresh in its write: the block's end must not wait for that write.
    import io

    from patcher import progress

    ticking, release = threading.Event(), threading.Event()
    runner: list[threading.Thread] = []

    class Stalled(io.StringIO):
        def isatty(self):
            return True

        def write(self, text):
            if threading.current_thread() not in runner:  # the clock's ticker
                ticking.set()
                release.wait(30)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Stalled())

    def run() -> None:
        with progress.running_clock("patching", enabled=True, every_s=0.01):
            ticking.wait(10)  # until a refresh hangs in its write

    try:
        runner.append(threading.Thread(target=run, daemon=True))
        runner[0].start()
        runner[0].join(10)
        assert not runner[0].is_alive(), "the clock waits for a refresh that cannot write"
    finally:
        release.set()
