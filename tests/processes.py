"""Processes and descriptors in tests: waiting with a deadline instead of a sleep, and
what this process holds open.

poll, not select: select refuses descriptors above FD_SETSIZE (1024), and a pytest
worker that has run hundreds of tests can hold that many.
"""
from __future__ import annotations

import os
import queue
import select
import subprocess
import threading
from pathlib import Path
from typing import IO, Union


def readable_within(source: Union[int, IO], seconds: float) -> bool:
    """Whether `source` (a descriptor or a file object) turns readable within `seconds`."""
    poller = select.poll()
    poller.register(source, select.POLLIN)
    return bool(poller.poll(seconds * 1000))


def exits_within(pid: int, seconds: float) -> bool:
    """Whether process `pid` exits within `seconds` (or is gone already): a pidfd
    becomes readable when its process has exited."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return readable_within(handle, seconds)
    finally:
        os.close(handle)


def gone(pid: int) -> bool:
    """Whether process `pid` has exited: a zombie (not yet reaped by its parent) or no
    longer in /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def open_files() -> set[str]:
    """What this process's descriptors point at (paths; pipes and sockets as `pipe:[n]`).
    Linux: reads /proc/self/fd."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return out


def _with_stat_field(index: int, value: int, alive: bool = False) -> list[int]:
    """The pids, zombies included unless `alive`, whose /proc stat field `index` (counted
    after the command's closing parenthesis: 0 the state, 1 the parent, 3 the session) is `value`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = entry.isdigit() and Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if fields and int(fields[index]) == value and not (alive and fields[0] == "Z"):
                found.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return found


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`, zombies included (from /proc)."""
    return _with_stat_field(1, pid)


def session(sid: int, alive: bool = False) -> list[int]:
    """The pids of the processes of session `sid` (from /proc): zombies included, or with
    `alive` only those that have not exited."""
    return _with_stat_field(3, sid, alive)


def read_lines(proc: subprocess.Popen, queued: str) -> tuple[list[str], list[str], queue.Queue, list[threading.Thread]]:
    """Read `proc`'s stdout and stderr line by line on daemon threads of the test.
    Returns (stdout lines, stderr lines, a queue that gets each line of the `queued`
    stream, "stdout" or "stderr", as it comes, the reader threads, started)."""
    lines: queue.Queue = queue.Queue()
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=_read, args=(stream, into, lines if name == queued else None), daemon=True)
               for name, stream, into in (("stdout", proc.stdout, out), ("stderr", proc.stderr, err))]
    for reader in readers:
        reader.start()
    return out, err, lines, readers


def _read(stream, into: list, lines) -> None:
    for line in stream:
        into.append(line.rstrip("\n"))
        if lines is not None:
            lines.put(into[-1])


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the process tree."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found
