"""The review diff of minified records and the patch report: a long changed line marked
inside, the shown runtime proved to be the written one, each thing said once, and check
warnings the original has too marked as such."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest

from patcher import cli
from patcher.check.check import check_file, compare_with_original
from patcher.cli import EXIT_OK, main
from patcher.read.source import read_script
from patcher.transforms.base import Note

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
MINIFIED = FIXTURES / "shuffled_minified.py"
TOGGLE = "{+;train_prefetch=int(os.environ.get('TRAIN_PREFETCH',1))"


def diff_of(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def minified_diff() -> str:
    """What `--diff` of the minified fixture prints on stdout (nothing is written or checked)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main([str(MINIFIED), "--diff", "--color", "never"]) == EXIT_OK
    return out.getvalue()


def test_a_long_changed_line_is_shown_as_its_changed_spans(minified_diff):
    out = minified_diff
    lines = out.splitlines()
    marked = [line for line in lines if TOGGLE in line]
    assert len(marked) == 1, "the toggles appended to Hyperparameters, marked inside the line"
    # One line for the pair, only the change and a little context: not two 1.3 KB lines.
    assert marked[0].startswith("~") and len(marked[0]) < 400 and "…" in marked[0]
    assert not any(line.startswith(("-class Hyperparameters", "+class Hyperparameters")) for line in lines)
    assert "+import dataclasses, pickle" in out  # short lines: the unified diff as before


def test_word_diff_is_coloured_when_colour_is_on(capsys):
    code, out, _ = diff_of([MINIFIED, "--diff", "--color", "always"], capsys)
    assert code == EXIT_OK
    assert "\x1b[32m{+;train_prefetch=" in out  # the inserted span green, as git colours it


def test_shown_runtime_is_re_minified_and_compared_with_the_written_one(minified_diff):
    out = minified_diff
    assert "re-minified: the bytes written" in out.splitlines()[1]


def test_a_shown_runtime_other_than_the_written_one_is_said_and_the_written_shown(capsys, monkeypatch):
    real = cli.patch_file
    minified, spaced = "def _h2d(tensor,device,copy_stream=True):", "def _h2d(tensor, device, copy_stream=True):"

    def written_otherwise(*args, **kwargs):
        # Written bytes the minifier would not write: the same code, spaced.
        done = real(*args, **kwargs)
        assert minified in done.patch.runtime
        done.patch = replace(done.patch, runtime=done.patch.runtime.replace(minified, spaced))
        done.patched = done.patched.replace(minified, spaced)
        return done

    monkeypatch.setattr(cli, "patch_file", written_otherwise)
    code, out, _ = diff_of([MINIFIED, "--diff"], capsys)
    assert code == EXIT_OK
    header = out.splitlines()[1]
    assert "shown as written" in header and "differ" in header
    assert f"\n+{spaced}\n+\tdevice=torch.device(device)\n" in out  # the written text, not a formatted one


def test_a_reason_given_for_two_sites_is_printed_once():
    reason = "distributed_data_generator builds each batch on the caller's thread: not run ahead"
    notes = [Note("train_prefetch", False, reason, 2271), Note("train_prefetch", False, reason, 2306), Note("copy_stream", True, "copies on the copy stream", 2271)]

    class Patch:
        already_patched, changed = False, True

    Patch.notes = notes
    report = {"input": "train_gpt.py", "output": "out.py", "wrapped": False, "seconds": 1.0, "code_bytes": {"counted": "raw", "before": 1, "after": 2, "by_feature": {}}}
    stream = io.StringIO()
    cli._print_report(report, Patch, stream)
    text = stream.getvalue()
    assert text.count(reason) == 1
    assert "(lines 2271, 2306)" in text
    assert "copies on the copy stream (line 2271)" in text


def test_a_check_warning_the_original_has_too_is_marked(tmp_path):
    for name in ("helper", "other"):
        (tmp_path / f"{name}.py").write_text("X = 1\n")
    original = tmp_path / "train_gpt.py"
    original.write_text("import helper\nx = helper.X\n")
    patched = tmp_path / "patched.py"
    patched.write_text("import os\nimport helper\nimport other\nx = helper.X + other.X\n")
    result = compare_with_original(check_file(patched, run_import=False), read_script(original), run_import=False)
    shared = [w for w in result.warnings if "imports helper" in w]
    new = [w for w in result.warnings if "imports other" in w]
    assert len(shared) == 1 and shared[0].endswith("(the original too)")
    assert len(new) == 1 and "original" not in new[0]
    stream = io.StringIO()
    cli._print_check(result, stream, indent="  ")
    assert "imports helper, which is helper.py beside the script; the submission must be one file (the original too)" in stream.getvalue()
