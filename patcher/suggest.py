"""Did you mean: argparse's parser with one suggestion for a mistyped flag or choice,
for the command and its pre-commit hook alike (argparse's own `suggest_on_error` comes
with Python 3.14, for choices only). Imports only the standard library, so that the hook
starts fast."""

from __future__ import annotations

import argparse
import difflib
import sys


def close_to(word: str, candidates) -> str | None:
    """The candidate `word` is most likely a typo of (difflib's ratio of at least 0.6), or None."""
    found = difflib.get_close_matches(word, [str(c) for c in candidates], n=1)
    return found[0] if found else None


class SuggestingParser(argparse.ArgumentParser):
    """argparse's parser, with "did you mean" for a mistyped flag or choice (argparse's
    own `suggest_on_error` exists from Python 3.14 on, and covers choices only)."""

    def __init__(self, *args, **kwargs):
        if sys.version_info >= (3, 14):
            kwargs.setdefault("suggest_on_error", False)  # one suggestion, ours, on every version
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        # argparse's own parse_args, with a suggestion for the first mistyped flag
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
            hints = (close_to(word.split("=", 1)[0], flags) for word in extras if word.startswith("--"))
            hint = next((f"; did you mean {h}?" for h in hints if h is not None), "")
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def _check_value(self, action, value):
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as error:
            meant = close_to(value, action.choices) if isinstance(value, str) and action.choices else None
            if meant is None:
                raise
            raise argparse.ArgumentError(action, f"{error.message}; did you mean {meant}?") from None
