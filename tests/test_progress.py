"""Progress and colour: on a terminal only, never with --json, always on stderr."""

from __future__ import annotations

import io
import sys

from patcher import progress
from patcher.progress import coloured_diff, file_bar, running_clock, wanted


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_terminal_and_never_with_json():
    assert wanted(False, _Terminal())
    assert not wanted(True, _Terminal())
    assert not wanted(False, io.StringIO())


def test_disabled_bar_and_clock_write_nothing(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with file_bar(3, enabled=False) as bar:
        bar.update(3)
    with running_clock("verify", enabled=False):
        pass
    assert err.getvalue() == ""


def test_enabled_bar_shows_files_done_of_total_and_the_file_in_hand(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with file_bar(3, enabled=True) as bar:
        bar.set_postfix_str("records/a/train_gpt.py")
        bar.update(2)
    assert "2/3" in err.getvalue() and "records/a/train_gpt.py" in err.getvalue()


def test_running_clock_shows_the_label(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with running_clock("verify x.py", enabled=True, every_s=0.01):
        pass
    assert "verify x.py" in err.getvalue()


def test_coloured_diff_marks_each_kind_of_line():
    lines = ["--- a (original)\n", "+++ a (patched)\n", "@@ -1 +1 @@\n", "-old\n", "+new\n", " same\n"]
    out = list(coloured_diff(lines))
    assert out == [
        f"{progress.BOLD}--- a (original){progress.RESET}\n",
        f"{progress.BOLD}+++ a (patched){progress.RESET}\n",
        f"{progress.CYAN}@@ -1 +1 @@{progress.RESET}\n",
        f"{progress.RED}-old{progress.RESET}\n",
        f"{progress.GREEN}+new{progress.RESET}\n",
        " same\n",
    ]
