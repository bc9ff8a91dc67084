"""Processes and descriptors in tests: waiting with a deadline instead of a sleep, and
what this process holds open.

poll, not select: select refuses descriptors above FD_SETSIZE (1024), and a pytest
worker that has run hundreds of tests can hold that many.
"""
from __future__ import annotations

import os
import select
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


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`, zombies included (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return found


def descendants(pid: int) -> list[int]:
    """Every process below `pid` in the process tree."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found
