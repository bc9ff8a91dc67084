"""What runs beside the patch: the minifier's worker (count and compile verdict), the
check's prewarmed import child, and that neither is left running or changes a result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import python_minifier
import pytest

from patcher.check import import_smoke
from patcher.code_size import CountError, Counting, minified_wrapper_bytes
from patcher.patch_file import FileOptions, patch_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
WORKER = Path(__file__).resolve().parent.parent / "patcher" / "minify_worker.py"

SIZE_FUNCTION = '''
import lzma, base64, subprocess
def _code_size(code):
    minified = subprocess.run(["pyminify", "--no-rename-locals", "--remove-literal-statements", "-"], input=code, capture_output=True).stdout
    return len(base64.b85encode(lzma.compress(minified)))
'''


def test_the_worker_minifies_as_the_pyminify_command_does():
    # The command line, not the library call: its own argument defaults and its fallback.
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    flags = ["--no-rename-locals", "--remove-literal-statements", "--prefer-single-line"]
    command = subprocess.run([sys.executable, "-m", "python_minifier", *flags, "-"], input=source.encode(), capture_output=True, check=True).stdout
    import base64
    import lzma

    expected = len(b'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("') + len(base64.b85encode(lzma.compress(command))) + len(b'")))\n')
    assert minified_wrapper_bytes(source, tuple(flags), "lzma") == expected
    assert command != python_minifier.minify(source).encode()  # the flags matter, so the test can tell


def test_a_minifier_failure_is_one_line():
    reply = subprocess.run([sys.executable, str(WORKER), "lzma"], input=b"def f(:\n", capture_output=True).stdout.decode().splitlines()
    assert json.loads(reply[-1])["error"].startswith("SyntaxError")
    with pytest.raises(CountError, match="pyminify failed: SyntaxError"):
        minified_wrapper_bytes("def f(:\n")
    counting = Counting("minified", ("--no-rename-locals",), "lzma")
    with counting.session() as session:  # a failed count does not stop the next one
        bad, good = session.start("x = (1,\n", "x = (1,\n"), session.start("x = 1\n", "x = 1\n")
        with pytest.raises(CountError):
            bad.result()
        assert good.result() == minified_wrapper_bytes("x = 1\n", ("--no-rename-locals",))


def test_a_transform_that_breaks_the_syntax_is_told_from_an_input_that_needs_a_newer_python(tmp_path):
    from patcher.patch_file import _compile_like_input
    from patcher.read.source import Script

    old = Script(tmp_path / "a.py", "x = 1\n", "x = 1\n")
    _compile_like_input(old, "x = 1\ny = 2\n")  # compiles: nothing to say
    with pytest.raises(RuntimeError, match="patched source does not compile: line 2"):
        _compile_like_input(old, "x = 1\ny = (\n")
    newer = Script(tmp_path / "b.py", "match = (\n", "match = (\n")  # not valid here either
    _compile_like_input(newer, "match = (\ny = 2\n")  # the input does not compile: no bug of ours


def _children_running() -> list[str]:
    """This process's child processes, as `pid args` lines, less those that an earlier
    test in the same worker left on purpose (multiprocessing's resource tracker)."""
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(__import__("os").getpid())], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "ps -ww -o" not in line and "multiprocessing.resource_tracker" not in line]


def _new_children(before: list[str]) -> list[str]:
    """Children of this process running now that were not running at `before`."""
    return sorted(set(_children_running()) - set(before))


def test_a_checked_patch_of_a_minified_record_counts_and_checks_as_before(tmp_path):
    before = _children_running()  # what other tests in this worker left running (a resource tracker, a gateway)
    source = (FIXTURES / "tokenstream_readable.py").read_text() + SIZE_FUNCTION  # after its __future__ import
    path = tmp_path / "train_gpt.py"
    path.write_text(source)
    checked = patch_file(path, tmp_path / "checked.py", FileOptions())
    plain = patch_file(path, tmp_path / "plain.py", FileOptions(check=False))
    assert checked.report["code_bytes"] == plain.report["code_bytes"]
    assert checked.report["code_bytes"]["counted_as"] == "minified"
    assert checked.report["code_bytes"]["after"] == minified_wrapper_bytes(plain.patched, ("--no-rename-locals", "--remove-literal-statements"))
    assert (tmp_path / "checked.py").read_text() == (tmp_path / "plain.py").read_text()
    assert checked.check is not None and checked.check.imports is not None and checked.check.imports.ok
    assert import_smoke._warm is None and not _new_children(before)


def test_the_prewarmed_import_child_imports_as_a_fresh_one(tmp_path, monkeypatch):
    before = _children_running()  # what other tests in this worker left running (a resource tracker, a gateway)
    path = tmp_path / "train_gpt.py"
    path.write_text((FIXTURES / "tokenstream_readable.py").read_text())
    taken = []
    take = import_smoke._take_warm
    monkeypatch.setattr(import_smoke, "_take_warm", lambda *args: taken.append(take(*args)) or taken[-1])
    warm = patch_file(path, tmp_path / "warm.py", FileOptions())
    assert len(taken) == 1 and taken[0] is not None  # the smoke ran in the prewarmed child
    monkeypatch.setattr(import_smoke, "prewarm", lambda: None)
    fresh = patch_file(path, tmp_path / "fresh.py", FileOptions())
    for result in (warm, fresh):
        result.check.imports.seconds = 0.0
    assert taken[1] is None and warm.check.imports.as_dict() == fresh.check.imports.as_dict()
    assert warm.check.imports.as_path == str(path.resolve())
    assert import_smoke._warm is None and not _new_children(before)


def test_a_prewarmed_child_that_no_check_takes_is_ended(tmp_path):
    before = _children_running()  # what other tests in this worker left running (a resource tracker, a gateway)
    path = tmp_path / "train_gpt.py"
    path.write_text("import os\nprint(os.getcwd())\n")  # nothing to patch: nothing written, nothing checked
    result = patch_file(path, tmp_path / "out.py", FileOptions())
    assert result.status == "nothing to patch" and result.check is None
    assert import_smoke._warm is None and not _new_children(before)


def test_a_worker_launched_for_a_script_that_does_not_count_minified_is_ended(tmp_path):
    # The text names pyminify (a comment), so a minifier worker starts before the parse;
    # libcst then finds no size function: the worker is ended, with its threads.
    import threading

    before, threads = _children_running(), set(threading.enumerate())
    path = tmp_path / "train_gpt.py"
    path.write_text("# counted with pyminify by the organisers\n" + (FIXTURES / "tokenstream_readable.py").read_text())
    result = patch_file(path, tmp_path / "out.py", FileOptions(check=False))
    assert result.report["code_bytes"]["counted_as"] == "raw"
    assert not _new_children(before) and set(threading.enumerate()) <= threads


def test_the_early_worker_counts_a_minified_record_as_a_late_one_does(tmp_path, monkeypatch):
    from patcher import code_size, patch_file as patch_file_module

    path = tmp_path / "train_gpt.py"
    path.write_text((FIXTURES / "tokenstream_readable.py").read_text() + SIZE_FUNCTION)
    early = patch_file(path, tmp_path / "early.py", FileOptions(check=False))
    monkeypatch.setattr(patch_file_module, "early_worker", lambda text: None)  # the worker starts at the first count
    late = patch_file(path, tmp_path / "late.py", FileOptions(check=False))
    assert early.report["code_bytes"] == late.report["code_bytes"] and early.report["code_bytes"]["counted_as"] == "minified"
    whole = code_size.Counting("minified", ("--no-rename-locals", "--remove-literal-statements"), "lzma")
    assert early.report["code_bytes"]["after"] == whole.count(early.patched, early.patched)


def test_an_edit_rebuilds_only_the_ancestors_of_what_it_changes():
    import libcst as cst

    from patcher.families.registry import judge
    from patcher.transforms.base import Context, ReplaceNodes, replace_nodes

    source = "def main():\n    a = 1\n    for i in range(3):\n        b = f(i)\n    c = 2\n"
    module = cst.parse_module(source)
    ctx = Context(judge(module), set())
    block = module.body[0].body
    loop = block.body[1]
    call = loop.body.body[0].body[0].value
    new = replace_nodes(module, {call: cst.parse_expression("g(i)")}, ctx)
    assert new.code == source.replace("f(i)", "g(i)")
    assert new.code == module.visit(ReplaceNodes({call: cst.parse_expression("g(i)")})).code  # as a full pass writes it
    new_block = new.body[0].body
    assert new_block.body[0] is block.body[0] and new_block.body[2] is block.body[2]  # siblings kept, not rebuilt
    assert new_block.body[1] is not loop and ctx.resolve(loop) is new_block.body[1]  # the path rebuilt and tracked
    assert ctx.resolve(block.body[0]) is block.body[0]
