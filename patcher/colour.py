"""`--color auto|always|never`: whether the diff and the summaries are coloured.

`auto` colours a stream that is a terminal, unless `NO_COLOR` is set to anything but
the empty string (https://no-color.org); `always` colours even into a pipe or a file
(and wins over `NO_COLOR`, as an explicit flag should); `never` never does.
"""

from __future__ import annotations

import os

RED, GREEN, YELLOW, CYAN, BOLD, RESET = "\x1b[31m", "\x1b[32m", "\x1b[33m", "\x1b[36m", "\x1b[1m", "\x1b[0m"
CHOICES = ("auto", "always", "never")


def use_colour(mode: str, stream, environ=None) -> bool:
    """True when text written to `stream` is to be coloured under `--color mode`.

    mode: "auto" | "always" | "never". environ: the environment to read `NO_COLOR`
    from (default `os.environ`). Raises ValueError for another mode.
    """
    if mode not in CHOICES:
        raise ValueError(f"--color {mode!r}: one of {', '.join(CHOICES)}")
    if mode != "auto":
        return mode == "always"
    if (os.environ if environ is None else environ).get("NO_COLOR", ""):
        return False
    return bool(getattr(stream, "isatty", None)) and stream.isatty()


def paint(text: str, colour: str | None, enabled: bool) -> str:
    """`text` wrapped in the escape `colour` (one of the constants here) and a reset,
    or `text` itself when not `enabled` or `colour` is None."""
    return f"{colour}{text}{RESET}" if enabled and colour else text
