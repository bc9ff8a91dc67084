"""The command line's conventions, as ruff and black users expect them.

`--diff` alone writes nothing; `--json` stdout is one JSON document whatever the mode;
`-` is stdin and stdout; several INPUTs go to `--out-dir`; `-q`; `--color` and
`NO_COLOR`; `--version`; exit codes in `--help`; no input file is exit 5; Ctrl-C in tree
mode says what was written; `check` reports every file; `unwrap` gives a wrapped
record's payload back byte for byte; the review diff is of the payloads, readable.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from patcher import cli, tree
from patcher.check.stubs import summarise
from patcher.cli import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_CHECK_FAILED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_FILES, EXIT_NOTHING, EXIT_OK, main
from patcher.colour import use_colour
from patcher.read.source import read_script
from patcher.review import readable_runtime

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
READABLE = FIXTURES / "tokenstream_readable.py"
MINIFIED = FIXTURES / "shuffled_minified.py"
WRAPPED = sorted(FIXTURES.glob("wrapped_*.py"))


def run(argv, capsys, check=False):
    argv = [str(a) for a in argv]
    if not check and argv and argv[0] not in ("check", "verify", "bench", "unwrap"):
        argv.append("--no-check")  # the check has tests of its own; keep these fast
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


class _Stdin:
    """A stand-in for sys.stdin whose `.buffer` holds `data`."""

    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)


# --------------------------------------------------------------------------- --diff, -o


@pytest.mark.parametrize("extra", [[], ["-o", os.devnull]], ids=["diff-alone", "diff-to-devnull"])
def test_diff_alone_prints_the_diff_on_stdout_and_writes_nothing(tmp_path, capsys, monkeypatch, extra):
    script = tmp_path / "train_gpt.py"
    shutil.copy(READABLE, script)
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run([script, "--diff", *extra], capsys)
    assert code == EXIT_OK
    assert files_under(tmp_path) == {"train_gpt.py"}  # no output, no backup, no temporary
    assert script.read_bytes() == READABLE.read_bytes()
    assert stdout.startswith(f"--- {script} (original)\n+++ {script} (patched")
    assert "\n+    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader(" in stdout  # the construction, rewritten
    assert all(line[:1] in " +-@\\" for line in stdout.splitlines()[2:])  # nothing but the diff: `patch` can apply it
    assert "nothing written" in stderr and "applied" in stderr


def test_diff_applies_to_the_original_as_the_written_output(tmp_path, capsys):
    # For a plain, readable script the review diff is exactly the change written.
    out = tmp_path / "out.py"
    code, stdout, _ = run([READABLE, "-o", out, "--diff"], capsys)
    assert code == EXIT_OK
    original, patched = READABLE.read_text().splitlines(True), out.read_text().splitlines(True)
    rebuilt, at = [], 0
    lines = stdout.splitlines(True)[2:]
    for line in lines:
        if line.startswith("@@"):
            start = int(line.split()[1].split(",")[0][1:]) - 1
            rebuilt.extend(original[at:start])
            at = start
        elif line.startswith("-"):
            at += 1
        elif line.startswith("+"):
            rebuilt.append(line[1:])
        else:
            rebuilt.append(original[at])
            at += 1
    rebuilt.extend(original[at:])
    assert rebuilt == patched


def test_no_output_without_diff_is_a_usage_error(capsys):
    code, _, stderr = run([READABLE], capsys)
    assert code == EXIT_BAD_INPUT and "--diff" in stderr


# --------------------------------------------------------------------------- --json


JSON_MODES = ("file", "diff-alone", "diff-and-output", "diff-devnull", "nothing-to-patch", "bad-input", "no-output", "tree", "empty-dir", "pattern-without-match", "check-one", "check-several")


def _json_modes(tmp_path: Path) -> dict:
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    return {
        "file": ([READABLE, "-o", tmp_path / "o1.py"], EXIT_OK),
        "diff-alone": ([READABLE, "--diff"], EXIT_OK),
        "diff-and-output": ([MINIFIED, "--diff", "-o", tmp_path / "o2.py"], EXIT_OK),
        "diff-devnull": ([READABLE, "--diff", "-o", os.devnull], EXIT_OK),
        "nothing-to-patch": ([FIXTURES / "no_loader.py", "-o", tmp_path / "o3.py"], EXIT_NOTHING),
        "bad-input": ([bad, "-o", tmp_path / "o4.py"], EXIT_BAD_INPUT),
        "no-output": ([READABLE], EXIT_BAD_INPUT),
        "tree": ([READABLE, MINIFIED, "--out-dir", tmp_path / "out", "--jobs", "1"], EXIT_OK),
        "empty-dir": ([empty, "--out-dir", tmp_path / "out2"], EXIT_NO_FILES),
        "pattern-without-match": ([str(tmp_path / "nowhere" / "*.py"), "--out-dir", tmp_path / "out3"], EXIT_NO_FILES),
        "check-one": (["check", READABLE, "--no-import"], EXIT_OK),
        "check-several": (["check", READABLE, bad, MINIFIED, "--no-import"], EXIT_BAD_INPUT),
    }


@pytest.mark.parametrize("mode", JSON_MODES)
def test_json_stdout_is_one_document_in_every_mode(tmp_path, capsys, mode):
    modes = _json_modes(tmp_path)
    assert set(modes) == set(JSON_MODES)
    argv, expected = modes[mode]
    code, stdout, _ = run([*argv, "--json"], capsys)
    assert code == expected
    document = json.loads(stdout)  # one document: nothing before or after it
    assert isinstance(document, dict)
    if "diff" in mode:
        assert document["diff"].startswith("--- ") and "\n+++ " in document["diff"]
        assert document["written"] is (mode == "diff-and-output")
    if expected in (EXIT_BAD_INPUT, EXIT_NO_FILES) and not mode.startswith("check"):
        assert document["exit_code"] == expected and document["error"]
    if mode == "check-several":
        files = document["files"]
        assert [Path(f["file"]).name for f in files] == ["tokenstream_readable.py", "bad.py", "shuffled_minified.py"]
        assert files[1]["ok"] is False and "bad.py:1" in files[1]["error"]
        assert files[0]["compile"]["ok"] and files[2]["compile"]["ok"]


def test_json_with_stdout_output_keeps_the_script_on_stdout(capsys):
    code, stdout, stderr = run([READABLE, "-o", "-", "--json", "--diff"], capsys)
    assert code == EXIT_OK
    compile(stdout, "stdout", "exec")
    assert json.loads(stderr)["diff"].startswith("--- ")


# --------------------------------------------------------------------------- stdin, several paths, no files


def test_stdin_to_stdout(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin(READABLE.read_bytes()))
    code, stdout, stderr = run(["-"], capsys)
    assert code == EXIT_OK
    compile(stdout, "stdout", "exec")
    assert "_make_train_loader(" in stdout and "<stdin> -> -" in stderr


def test_stdin_bad_input_names_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin(b"def f(:\n"))
    code, stdout, stderr = run(["-", "-o", "-"], capsys)
    assert code == EXIT_BAD_INPUT and stdout == ""
    assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith("patch-prefetch: error: <stdin>:1: ")


def test_several_paths_go_under_out_dir_by_their_common_directory(tmp_path, capsys):
    records = tmp_path / "records"
    for name, fixture in (("a", READABLE), ("b/deeper", MINIFIED)):
        (records / name).mkdir(parents=True)
        shutil.copy(fixture, records / name / "train_gpt.py")
    (records / "b" / "deeper" / "helper.py").write_text("x = 1\n")
    out = tmp_path / "out"
    code, stdout, _ = run([records / "a" / "train_gpt.py", records / "b", "--out-dir", out, "--json", "--jobs", "1"], capsys)
    assert code == EXIT_OK
    assert sorted(r["file"] for r in json.loads(stdout)["files"]) == ["a/train_gpt.py", "b/deeper/train_gpt.py"]
    assert {p for p in files_under(out) if p.endswith(".py")} == {"a/train_gpt.py", "b/deeper/train_gpt.py"}
    assert "_make_train_loader(" in (out / "b" / "deeper" / "train_gpt.py").read_text()


def test_diff_in_tree_mode_prints_every_files_diff_and_writes_nothing(tmp_path, capsys):
    records = tmp_path / "records"
    for name, fixture in (("a", READABLE), ("b", MINIFIED), ("c", FIXTURES / "no_loader.py")):
        (records / name).mkdir(parents=True)
        shutil.copy(fixture, records / name / "train_gpt.py")
    before = files_under(tmp_path)
    code, stdout, stderr = run([records, "--diff", "--jobs", "2"], capsys)
    assert code == EXIT_OK and files_under(tmp_path) == before  # nothing written
    # stdout is the diffs alone, in path order, each the single-file command's own
    singles = []
    for name in ("a", "b"):
        single_code, single, _ = run([records / name / "train_gpt.py", "--diff"], capsys)
        singles.append(single.replace(str(records / name / "train_gpt.py"), f"{name}/train_gpt.py"))
    assert stdout == "".join(singles) and stdout.startswith("--- a/train_gpt.py (original)")
    rows = {line.split()[0]: line for line in stderr.splitlines() if line.startswith(("a/", "b/", "c/"))}
    assert "patched (diff)" in rows["a/train_gpt.py"] and "nothing to patch" in rows["c/train_gpt.py"]
    # with --json: one document, each file's diff inside it
    code, stdout, _ = run([records, "--diff", "--json", "--jobs", "1"], capsys)
    files = {r["file"]: r for r in json.loads(stdout)["files"]}
    assert files["a/train_gpt.py"]["diff"] == singles[0] and files["c/train_gpt.py"]["diff"] == ""
    # with --out-dir: written, and the diffs shown all the same
    code, stdout, _ = run([records, "--diff", "--out-dir", tmp_path / "out", "--jobs", "1"], capsys)
    assert stdout == "".join(singles) and (tmp_path / "out" / "a" / "train_gpt.py").is_file()


def test_a_quoted_pattern_is_expanded(tmp_path, capsys):
    (tmp_path / "r1").mkdir()
    shutil.copy(READABLE, tmp_path / "r1" / "train_gpt.py")
    out = tmp_path / "out"
    code, stdout, _ = run([str(tmp_path / "r*" / "train_gpt.py"), "--out-dir", out, "--json"], capsys)
    assert code == EXIT_OK and [r["file"] for r in json.loads(stdout)["files"]] == ["train_gpt.py"]


@pytest.mark.parametrize("what", ["empty-dir", "glob-matches-nothing-in-dir", "pattern-matches-nothing"])
def test_no_input_file_is_exit_5_and_writes_nothing(tmp_path, capsys, what):
    root = tmp_path / "records"
    root.mkdir()
    if what == "glob-matches-nothing-in-dir":
        (root / "model.py").write_text("x = 1\n")
    target = str(tmp_path / "nowhere*" / "train_gpt.py") if what == "pattern-matches-nothing" else root
    out = tmp_path / "out"
    code, stdout, stderr = run([target, "--out-dir", out], capsys)
    assert code == EXIT_NO_FILES
    assert stdout == "" and len(stderr.strip().splitlines()) == 1 and "nothing written" in stderr
    assert not out.exists()


# --------------------------------------------------------------------------- -q, --color, --version, --help


def test_quiet_prints_nothing_but_errors(tmp_path, capsys):
    code, stdout, stderr = run([READABLE, "-o", tmp_path / "out.py", "-q"], capsys)
    assert code == EXIT_OK and stdout == stderr == "" and (tmp_path / "out.py").exists()
    code, stdout, stderr = run([READABLE, MINIFIED, "--out-dir", tmp_path / "tree", "-q", "--jobs", "1"], capsys)
    assert code == EXIT_OK and stdout == stderr == ""
    code, _, stderr = run([tmp_path / "missing.py", "-o", tmp_path / "x.py", "-q"], capsys)
    assert code == EXIT_BAD_INPUT and "missing.py" in stderr


def test_quiet_turns_off_tree_progress(tmp_path, capsys, monkeypatch):
    shown = []
    real = tree.file_bar
    monkeypatch.setattr(tree, "wanted", lambda json_output: True)  # as on a terminal
    monkeypatch.setattr(tree, "file_bar", lambda total, enabled: shown.append(enabled) or real(total, False))
    for flag in ([], ["-q"]):
        run([READABLE, "--out-dir", tmp_path / f"out{len(flag)}", *flag], capsys)
    assert shown == [True, False]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    "mode, no_color, tty, expected",
    [
        ("auto", "", True, True),
        ("auto", "1", True, False),
        ("auto", "", False, False),
        ("always", "1", False, True),  # an explicit flag wins over NO_COLOR
        ("never", "", True, False),
    ],
)
def test_colour_choice(mode, no_color, tty, expected):
    stream = _Terminal() if tty else io.StringIO()
    assert use_colour(mode, stream, {"NO_COLOR": no_color}) is expected


def test_colour_of_the_diff_follows_the_flag_and_no_color(capsys, monkeypatch):
    _, always, _ = run([READABLE, "--diff", "--color", "always"], capsys)
    _, plain, _ = run([READABLE, "--diff"], capsys)  # a pipe: no colour
    assert "\x1b[32m+" in always and "\x1b[" not in plain
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert main([str(READABLE), "--diff", "--no-check"]) == EXIT_OK
    assert "\x1b[" not in sys.stdout.getvalue() and "+++ " in sys.stdout.getvalue()


def test_version(capsys):
    code, stdout, _ = run(["--version"], capsys)
    assert code == EXIT_OK and stdout.startswith("patch-prefetch ") and len(stdout.split()) == 2


def test_help_documents_every_exit_code(capsys):
    code, stdout, _ = run(["--help"], capsys)
    assert code == EXIT_OK
    table = stdout[stdout.index("exit codes:") :]
    for exit_code in (EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOTHING, EXIT_CHECK_FAILED, EXIT_NO_FILES, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE):
        assert f"\n  {exit_code} " in table
    assert "--diff" in stdout and "--quiet" in stdout and "NO_COLOR" in stdout


# --------------------------------------------------------------------------- Ctrl-C, check


class _InterruptingBar:
    """A progress bar that raises KeyboardInterrupt (Ctrl-C) once the first file is done."""

    def __init__(self, total, enabled):
        self.done = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.done += n
        if self.done:
            raise KeyboardInterrupt

    def set_postfix_str(self, text):
        pass


def test_ctrl_c_in_tree_mode_says_what_was_written_and_what_was_not(tmp_path, capsys, monkeypatch):
    root = tmp_path / "records"
    # The largest file goes first; one worker: it is written, the other two are not started.
    for name, fixture in (("a_big", READABLE), ("b_small", MINIFIED), ("c_small", MINIFIED)):
        (root / name).mkdir(parents=True)
        shutil.copy(fixture, root / name / "train_gpt.py")
    monkeypatch.setattr(tree, "file_bar", _InterruptingBar)
    out = tmp_path / "out"
    code, stdout, stderr = run([root, "--out-dir", out, "--jobs", "1"], capsys)
    assert code == EXIT_INTERRUPTED and stdout == ""
    assert "interrupted after 1 of 3 files" in stderr
    assert f"written under {out}: 1: a_big/train_gpt.py" in stderr
    assert "not started: 2: b_small/train_gpt.py, c_small/train_gpt.py" in stderr
    assert stderr.rstrip().endswith("patch-prefetch: interrupted")
    assert {p for p in files_under(out) if p.endswith(".py")} == {"a_big/train_gpt.py"}


def test_check_reports_every_file_past_a_bad_one(tmp_path, capsys):
    bad = tmp_path / "train_bad.py"
    bad.write_text("x = (\n")
    code, stdout, stderr = run(["check", bad, READABLE, "--no-import"], capsys)
    assert code == EXIT_BAD_INPUT
    assert f"{bad}:1: bad input (exit 2)" in stdout and f"{READABLE}: ok" in stdout
    assert stderr.count("patch-prefetch: error: ") == 1


def test_stub_lists_are_summarised():
    stubbed = ["flash_attn_interface", "triton"] + [f"triton.m{i}" for i in range(16)] + ["fused.a", "fused.b"]
    assert summarise(stubbed) == ["flash_attn_interface", "triton.* (17 modules)", "fused.a", "fused.b"]
    assert summarise([]) == []


# --------------------------------------------------------------------------- unwrap, review diff


def _make_wrapped():
    spec = importlib.util.spec_from_file_location("make_wrapped", FIXTURES / "make_wrapped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("wrapped", WRAPPED, ids=lambda p: p.name)
def test_unwrap_round_trip(tmp_path, capsys, wrapped):
    make = _make_wrapped()
    source_name, builder = next((src, fn) for out, src, fn in make.TARGETS if out == wrapped.name)
    out = tmp_path / "payload.py"
    code, _, stderr = run(["unwrap", wrapped, "-o", out], capsys)
    assert code == EXIT_OK and str(out) in stderr
    assert out.read_bytes() == (FIXTURES / source_name).read_bytes()  # the payload, byte for byte
    assert getattr(make, builder)(out.read_bytes()) == wrapped.read_text()  # wrapping it again gives the record back
    code, stdout, _ = run(["unwrap", wrapped], capsys)  # default: stdout
    assert code == EXIT_OK and stdout == out.read_text()


def test_unwrap_refuses_a_plain_script_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "payload.py"
    code, stdout, stderr = run(["unwrap", READABLE, "-o", out], capsys)
    assert code == EXIT_NOTHING and "not a compressed exec wrapper" in stderr and not out.exists()
    code, _, stderr = run(["unwrap", tmp_path / "missing.py"], capsys)
    assert code == EXIT_BAD_INPUT and "missing.py" in stderr


def test_review_diff_of_a_wrapped_record_is_of_its_payloads_with_the_runtime_readable(tmp_path, capsys):
    wrapped = FIXTURES / "wrapped_lzma_raw.py"
    out = tmp_path / "out.py"
    code, stdout, _ = run([wrapped, "-o", out, "--diff"], capsys)
    assert code == EXIT_OK
    payload = read_script(wrapped).source.splitlines()
    piece = wrapped.read_text().splitlines()[2][-40:]  # a base85 line of the wrapper
    assert piece not in stdout
    removed = [line[1:] for line in stdout.splitlines()[2:] if line.startswith("-")]
    assert removed and all(line in payload for line in removed)  # the payload's own lines
    assert "injected runtime shown formatted; written minified" in stdout.splitlines()[1]
    assert "+def _h2d(tensor, device, copy_stream=True):" in stdout  # formatted in the diff
    written = read_script(out)
    assert "def _h2d(tensor,device,copy_stream=True):" in written.source  # minified in the file
    # The formatted runtime is the same code as the one written.
    runtime = written.source[written.source.index("# patch-prefetch") :]
    runtime = runtime[: runtime.index("\nclass Hyperparameters")] + "\n"
    assert ast.dump(ast.parse(readable_runtime(runtime))) == ast.dump(ast.parse(runtime))
    assert readable_runtime(runtime).startswith("# patch-prefetch ")
