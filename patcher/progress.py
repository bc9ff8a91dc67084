"""What a long run shows on a terminal: a progress bar, a running clock, a coloured diff.

All of it goes to stderr and only when stderr is a terminal and the output is not
`--json`, so pipes, files and the JSON reports stay as they were.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterable, Iterator

from tqdm import tqdm

RED, GREEN, CYAN, BOLD, RESET = "\x1b[31m", "\x1b[32m", "\x1b[36m", "\x1b[1m", "\x1b[0m"


def wanted(json_output: bool, stream=None) -> bool:
    """True when progress may be shown: `stream` (stderr) is a terminal and not `--json`."""
    stream = sys.stderr if stream is None else stream
    return not json_output and hasattr(stream, "isatty") and stream.isatty()


def file_bar(total: int, enabled: bool) -> tqdm:
    """A bar of files done out of `total`, with the elapsed time; `set_postfix_str` names the file in hand."""
    return tqdm(total=total, unit="file", file=sys.stderr, disable=not enabled, leave=False, mininterval=0, **_size())


def _size() -> dict:
    """tqdm's size arguments: follow the terminal on stderr, or 80 x 24 where it reports
    no size (a pseudo-terminal without one would otherwise hide the bar)."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return {}
    return {"dynamic_ncols": True} if size.columns and size.lines else {"ncols": 80, "nrows": 24}


@contextmanager
def running_clock(label: str, enabled: bool, every_s: float = 0.5) -> Iterator[None]:
    """Show `label` and the elapsed time on stderr while the block runs (refreshed every `every_s`)."""
    if not enabled:
        yield
        return
    bar = tqdm(total=None, file=sys.stderr, bar_format="{desc} {elapsed}", desc=label, leave=False, **_size())
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        # The ticker ends after at most one refresh; a refresh still running after a few
        # ticks is a write to a terminal that takes no output (flow control, a stalled
        # pseudo-terminal): nothing can be said there, so the bar is left as it stands
        # (closing it would write, and wait for the ticker's lock).
        ticker.join(max(1.0, 4 * every_s))
        if not ticker.is_alive():
            bar.close()


def coloured_diff(lines: Iterable[str]) -> Iterator[str]:
    """The lines of a unified diff with git's colours: headers bold, hunks cyan, - red, + green."""
    for line in lines:
        if line.startswith(("---", "+++")):
            yield f"{BOLD}{line.rstrip(chr(10))}{RESET}\n"
        elif line.startswith("@@"):
            yield f"{CYAN}{line.rstrip(chr(10))}{RESET}\n"
        elif line.startswith("-"):
            yield f"{RED}{line.rstrip(chr(10))}{RESET}\n" if line.endswith("\n") else f"{RED}{line}{RESET}"
        elif line.startswith("+"):
            yield f"{GREEN}{line.rstrip(chr(10))}{RESET}\n" if line.endswith("\n") else f"{GREEN}{line}{RESET}"
        else:
            yield line
