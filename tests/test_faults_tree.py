"""Tree mode under faults: what a Ctrl-C (one, or the two that `timeout` sends) leaves on
disk and what the report says of it; symlink loops as INPUT, as `-o`, as `--out-dir`
and inside a tree.

A file's check is held open by a stand-in for the target interpreter (`--python PATH`):
it runs the real one, except for the compile of the file named `b_slow/train_gpt.py`,
where it writes its pid to a FIFO and waits. The tests signal the command once that
pid has come, so the Ctrl-C lands while that file is being checked, every time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


from patcher import tree
from patcher.cli import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, main
from patcher.patch_file import FileOptions
from patch_tables import TINY
from processes import exits_within, gone, read_lines, readable_within

ROOT = Path(__file__).resolve().parent.parent


def _held_check(tmp_path: Path) -> tuple[Path, Path, int]:
    """A tree of two scripts (the larger, `a_fast`, goes first with --jobs 1) and an
    interpreter whose compile of `b_slow/train_gpt.py` never ends. Returns (tree, the
    interpreter, a descriptor of the FIFO that gets the held compile's pid)."""
    root = tmp_path / "records"
    for name, text in (("a_fast", TINY + "# " + "x" * 200 + "\n"), ("b_slow", TINY)):
        (root / name).mkdir(parents=True)
        (root / name / "train_gpt.py").write_text(text)
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        'for arg; do last="$arg"; done\n'
        'case "$last" in\n'
        f'  */b_slow/train_gpt.py) echo $$ > "{ready}"; exec sleep 600;;\n'
        "esac\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return root, python, os.open(ready, os.O_RDONLY | os.O_NONBLOCK)


def _held_pid(fd: int) -> int:
    """The pid the held compile writes once it runs (the check of b_slow has begun)."""
    data = b""
    while not data.endswith(b"\n"):
        assert readable_within(fd, 60), "the check of b_slow/train_gpt.py never started"
        data += os.read(fd, 100)
    return int(data)


def _tree_command(root: Path, out: Path, python: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "patcher.cli", str(root), "--out-dir", str(out), "--jobs", "1", "--no-import", "--python", str(python), *extra]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _files(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if not p.is_dir()}


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_during_a_check_writes_nothing_of_that_file_and_says_so(tmp_path):
    root, python, fd = _held_check(tmp_path)
    out = tmp_path / "out"
    proc = _tree_command(root, out, python)
    try:
        held = _held_pid(fd)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED and stdout == ""
    # The file whose check was cut short is not on disk: nothing unchecked stands there.
    assert _files(out) == {"a_fast/train_gpt.py"}
    assert "stopped during its check, nothing written: 1: b_slow/train_gpt.py" in stderr
    assert f"written under {out}: 1: a_fast/train_gpt.py" in stderr
    assert "check ok: 1: a_fast/train_gpt.py" in stderr
    assert stderr.rstrip().endswith("patch-prefetch: interrupted")
    assert gone(held)


def test_repeated_sigint_keeps_the_summary_and_the_json_document(tmp_path):
    root, python, fd = _held_check(tmp_path)
    out = tmp_path / "out"
    proc = _tree_command(root, out, python, "--json")
    stdout, stderr, _, readers = read_lines(proc, "stderr")
    try:
        _held_pid(fd)
        # `timeout` forwards the terminal's Ctrl-C: a second SIGINT, and a third, while
        # the first one is being handled.
        while not exits_within(proc.pid, 0.02):
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        for reader in readers:
            reader.join(timeout=60)
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED
    assert len(stdout) == 1, stdout
    document = json.loads(stdout[0])
    assert document["interrupted"] is True and document["exit_code"] == EXIT_INTERRUPTED
    files = {f["file"]: f for f in document["files"]}
    assert files["a_fast/train_gpt.py"]["written"] is True and files["a_fast/train_gpt.py"]["check"] == "ok"
    assert files["b_slow/train_gpt.py"]["written"] is False and files["b_slow/train_gpt.py"]["status"] == "interrupted"
    assert "  stopped during its check, nothing written: 1: b_slow/train_gpt.py" in stderr
    assert stderr[-1] == "patch-prefetch: interrupted"
    assert _files(out) == {"a_fast/train_gpt.py"}


def test_ctrl_c_during_the_check_of_a_single_file_leaves_no_output(tmp_path):
    root, python, fd = _held_check(tmp_path)
    out = tmp_path / "out" / "b_slow"
    out.mkdir(parents=True)
    argv = [sys.executable, "-m", "patcher.cli", str(root / "b_slow" / "train_gpt.py"), "-o", str(out / "train_gpt.py"), "--no-import", "--python", str(python)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        held = _held_pid(fd)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
        _, stderr = proc.communicate(timeout=60)
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED and stderr.strip() == "patch-prefetch: interrupted"
    assert list(out.iterdir()) == []  # neither the unchecked output nor a temporary file
    assert gone(held)


def test_a_file_past_its_time_limit_in_its_check_is_not_left_written(tmp_path):
    root, python, fd = _held_check(tmp_path)
    (root / "a_fast" / "train_gpt.py").unlink()
    (root / "a_fast").rmdir()
    out = tmp_path / "out"
    proc = _tree_command(root, out, python, "--json", "--file-timeout", "2")
    try:
        held = _held_pid(fd)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
    (row,) = json.loads(stdout)["files"]
    assert row["status"] == "timed out" and "nothing written" in row["error"]
    assert not out.exists() or _files(out) == set()
    assert row["written"] is False
    assert gone(held)


def test_a_worker_killed_just_before_or_after_its_rename_is_reported_as_what_is_on_disk(tmp_path, monkeypatch):
    root = tmp_path / "records"
    for name in ("after_rename", "before_rename"):
        (root / name).mkdir(parents=True)
        (root / name / "train_gpt.py").write_text(TINY)
    real = tree.patch_one

    def held(source, target, relative, options, diff=False):  # runs in the (forked) worker
        channel = getattr(tree, "_CHANNEL", None)
        if relative.startswith("before_rename") and channel is not None:
            owner, tell = channel

            def tell_then_hang(event, value):
                tell(event, value)
                if event == "staged":  # the output is whole in its staging file; never renamed
                    threading.Event().wait()

            tree._CHANNEL = (owner, tell_then_hang)
        row = real(source, target, relative, options, diff)
        threading.Event().wait()  # renamed into place, never reported: the time limit ends it
        return row

    monkeypatch.setattr(tree, "patch_one", held)
    out = tmp_path / "out"
    rows = {r.file.split("/")[0]: r for r in tree.patch_tree(root, out, jobs=2, options=FileOptions(check=False), file_timeout=2)}
    assert _files(out) == {"after_rename/train_gpt.py"}  # no staging file left either
    after, before = rows["after_rename"], rows["before_rename"]
    assert after.status == before.status == "timed out"
    assert after.written and "after its output was written" in after.error
    assert not before.written and before.error.endswith("; nothing written")


# --------------------------------------------------------------------------- symlink loops


def _loop(path: Path) -> Path:
    path.symlink_to(path.name)
    return path


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_symlink_loop_as_input_is_bad_input(tmp_path, capsys):
    loop = _loop(tmp_path / "train_gpt.py")
    code = main([str(loop), "-o", str(tmp_path / "out.py"), "--no-check", "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == EXIT_BAD_INPUT
    assert _one_error_line(stderr) == f"patch-prefetch: error: {loop}: is a symlink loop; not read"
    assert json.loads(stdout) == {"error": f"{loop}: is a symlink loop; not read", "exit_code": EXIT_BAD_INPUT}
    assert not (tmp_path / "out.py").exists()


def test_a_symlink_loop_as_output_is_bad_input_and_left_alone(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    script.write_text(TINY)
    loop = _loop(tmp_path / "out.py")
    code = main([str(script), "-o", str(loop), "--no-check"])
    _, stderr = capsys.readouterr()
    assert code == EXIT_BAD_INPUT
    assert _one_error_line(stderr) == f"patch-prefetch: error: {loop}: cannot write output: is a symlink loop; nothing written"
    assert os.readlink(loop) == "out.py" and sorted(p.name for p in tmp_path.iterdir()) == ["out.py", "train_gpt.py"]


def test_a_symlink_loop_as_out_dir_is_bad_input(tmp_path, capsys):
    root = tmp_path / "records"
    root.mkdir()
    (root / "train_gpt.py").write_text(TINY)
    loop = _loop(tmp_path / "out")
    code = main([str(root), "--out-dir", str(loop), "--no-check"])
    _, stderr = capsys.readouterr()
    assert code == EXIT_BAD_INPUT
    assert _one_error_line(stderr) == f"patch-prefetch: error: {loop}: --out-dir is a symlink loop; nothing written"


def test_a_symlink_loop_inside_a_tree_is_skipped_and_the_rest_patched(tmp_path, capsys):
    root = tmp_path / "records"
    (root / "a").mkdir(parents=True)
    (root / "a" / "train_gpt.py").write_text(TINY)
    (root / "b").mkdir()
    (root / "b" / "train_gpt.py").symlink_to("train_x.py")
    (root / "b" / "train_x.py").symlink_to("train_gpt.py")
    out = tmp_path / "out"
    code = main([str(root), "--out-dir", str(out), "--no-check", "--json", "--jobs", "1"])
    stdout, _ = capsys.readouterr()
    assert code == EXIT_OK
    rows = {f["file"]: f for f in json.loads(stdout)["files"]}
    assert rows["a/train_gpt.py"]["status"] == "written" and rows["a/train_gpt.py"]["written"] is True
    for name in ("b/train_gpt.py", "b/train_x.py"):
        assert rows[name]["status"] == "skipped" and rows[name]["error"] == "is a symlink loop; not read" and rows[name]["failed"] is False
    assert _files(out) == {"a/train_gpt.py"}
