"""Hostile input and hostile surroundings: backups, output targets, caps, crashes, signals."""

from __future__ import annotations

import base64
import bz2
import contextlib
import faulthandler
import gzip
import io
import json
import lzma
import os
import random
import signal
import stat
import string
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path

import pytest

from patch_tables import TINY
from processes import gone, readable_within
from patcher import tree
from patcher.read import source
from patcher.read import wrapper as wrapper_codec
from patcher.check.check import check_file
from patcher.cli import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_OK, build_check_parser, build_parser, main
from patcher.patch_file import FileOptions
from patcher.read.source import MAX_PIECES, MAX_SOURCE_BYTES, _longest_operator_run, output_problem, read_script
from patcher.read.wrapper import decompress_capped

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ROOT = Path(__file__).resolve().parent.parent


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("patch-prefetch: error: "), err
    assert "Traceback" not in err
    return lines[0]


def wrapper(code: str, width: int | None = None, quotes=('"',)) -> str:
    encoded = base64.b85encode(lzma.compress(code.encode())).decode()
    if width is None:
        literal = f'"{encoded}"'
    else:
        pieces = [encoded[i : i + width] for i in range(0, len(encoded), width)]
        literal = "".join(f"{quotes[i % len(quotes)]}{p}{quotes[i % len(quotes)]}" for i, p in enumerate(pieces))
    return f"import lzma as L,base64 as B\nexec(L.decompress(B.b85decode({literal})))\n"


def snapshot(folder: Path) -> dict:
    return {p.name: (p.read_bytes() if p.is_file() else stat.S_IFMT(p.lstat().st_mode)) for p in folder.iterdir()}


# --------------------------------------------------------------------------- 1. --in-place backups


def test_in_place_twice_keeps_the_original_backup(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    original = (FIXTURES / "tokenstream_readable.py").read_text()
    script.write_text(original)
    assert run([script, "--in-place", "--no-check"], capsys)[0] == EXIT_OK
    patched = script.read_text()
    assert patched != original and (tmp_path / "train_gpt.py.orig").read_text() == original
    stamp = script.stat().st_mtime_ns
    code, out, _ = run([script, "--in-place", "--no-check"], capsys)
    assert code == EXIT_OK and "already patched" in out
    assert (tmp_path / "train_gpt.py.orig").read_text() == original  # the original, not the patched text
    assert script.read_text() == patched and script.stat().st_mtime_ns == stamp  # not even rewritten
    assert sorted(os.listdir(tmp_path)) == ["train_gpt.py", "train_gpt.py.orig"]


def test_in_place_refuses_an_existing_backup(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    script.write_text(TINY)
    backup = tmp_path / "train_gpt.py.orig"
    backup.write_text("something the user keeps\n")
    code, _, err = run([script, "--in-place", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT
    assert "train_gpt.py.orig" in one_line_error(err)
    assert backup.read_text() == "something the user keeps\n" and script.read_text() == TINY


# --------------------------------------------------------------------------- 2. output targets


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _directory(path: Path) -> Path:
    path.mkdir()
    return path


def _read_only(path: Path) -> Path:
    path.write_text("keep me\n")
    path.chmod(0o444)
    return path


def _char_device(path: Path) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null twin, inside tmp only
    except (PermissionError, OSError) as error:
        pytest.skip(f"cannot make a device node here: {error}")
    return path


@pytest.mark.parametrize("make", [_fifo, _directory, _read_only, _char_device], ids=["fifo", "directory", "read-only", "char-device"])
def test_output_that_is_not_a_writable_regular_file_is_refused(tmp_path, capsys, make):
    script = tmp_path / "train_gpt.py"
    script.write_text(TINY)
    target = make(tmp_path / "target")
    before = snapshot(tmp_path)
    code, _, err = run([script, "-o", target, "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT
    assert "target" in one_line_error(err)
    assert snapshot(tmp_path) == before


def test_in_place_on_a_read_only_input_is_refused(tmp_path, capsys):
    script = _read_only(tmp_path / "train_gpt.py")
    script.chmod(0o644)
    script.write_text(TINY)
    script.chmod(0o444)
    code, _, err = run([script, "--in-place", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT and "read-only" in one_line_error(err)
    assert script.read_text() == TINY and not (tmp_path / "train_gpt.py.orig").exists()


def test_dev_null_is_judged_without_being_touched():
    # output_problem only stats; nothing here writes to /dev/null.
    assert output_problem("/dev/null") == "is a character device, not a regular file"
    assert output_problem("/nonexistent-dir-for-sure/x.py").startswith("directory ")


def test_write_atomic_refuses_a_fifo(tmp_path):
    fifo = _fifo(tmp_path / "f")
    with pytest.raises(PermissionError):
        source.write_atomic(fifo, "x = 1\n")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and os.listdir(tmp_path) == ["f"]


# --------------------------------------------------------------------------- 3. caps


def test_decompression_bomb_is_refused_without_inflating(tmp_path, capsys):
    bomb = tmp_path / "train_gpt.py"
    blob = lzma.compress(b" " * (MAX_SOURCE_BYTES + 1))
    bomb.write_text(f"import lzma as L,base64 as B\nexec(L.decompress(B.b85decode({base64.b85encode(blob).decode()!r})))\n")
    for argv in ([bomb, "-o", tmp_path / "out.py", "--no-check"], ["check", bomb], ["verify", bomb, bomb]):
        code, _, err = run(argv, capsys)
        assert code == EXIT_BAD_INPUT
        assert "decompresses to more than" in err and "Traceback" not in err
    assert not (tmp_path / "out.py").exists()


@pytest.mark.parametrize("codec", ["lzma-xz", "lzma-raw", "lzma-multi", "zlib", "zlib-raw", "bz2-multi", "gzip-multi"])
def test_capped_decompression_equals_the_codec(codec):
    data = b"print('hello')\n" * 200
    raw = {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2}]}
    name, kwargs, blob = {
        "lzma-xz": ("lzma", {}, lzma.compress(data) + b"trailing garbage"),
        "lzma-raw": ("lzma", raw, lzma.compress(data, **raw)),
        "lzma-multi": ("lzma", {}, lzma.compress(data) + lzma.compress(data[:50])),
        "zlib": ("zlib", {}, zlib.compress(data) + b"tail"),
        "zlib-raw": ("zlib", {"wbits": -15}, zlib.compressobj(9, zlib.DEFLATED, -15).compress(data) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()),
        "bz2-multi": ("bz2", {}, bz2.compress(data) + bz2.compress(data[:7])),
        "gzip-multi": ("gzip", {}, gzip.compress(data) + gzip.compress(data[:9])),
    }[codec]
    module = {"lzma": lzma, "zlib": zlib, "bz2": bz2, "gzip": gzip}[name]
    if codec == "zlib-raw":
        expected = zlib.decompress(blob, -15)
    else:
        expected = module.decompress(blob, **kwargs)
    assert decompress_capped(name, blob, kwargs, len(expected)) == expected
    with pytest.raises(wrapper_codec._TooLarge):
        decompress_capped(name, blob, kwargs, len(expected) - 1)
    with pytest.raises((lzma.LZMAError, zlib.error, OSError, EOFError)):
        decompress_capped(name, blob[: len(blob) // 3], kwargs, 10**6)


def test_input_over_the_size_cap_is_refused(tmp_path, capsys):
    big = tmp_path / "train_gpt.py"
    big.write_text("x = 1  # padding\n" * (MAX_SOURCE_BYTES // 16 + 1))
    code, _, err = run([big, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT and "larger than" in one_line_error(err)


def test_nested_parentheses_do_not_crash_the_parser(tmp_path):
    # In a child: before the fix, libcst's native parser died with SIGSEGV here.
    deep = tmp_path / "train_gpt.py"
    deep.write_text("x = " + "(" * 5000 + "1" + ")" * 5000 + "\n")
    proc = subprocess.run([sys.executable, "-m", "patcher.cli", "check", str(deep), "--no-import"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == EXIT_BAD_INPUT, proc
    assert "nested too deeply" in one_line_error(proc.stderr)


@pytest.mark.parametrize(
    "code",
    [
        "x = " + "(" * 5000 + "1" + ")" * 5000 + "\n",
        "x = " + "+".join(["1"] * 10_000) + "\n",  # quadratic in libcst before
        "x = " + "f(" * 200 + "1" + ")" * 200 + "\n",
        "x = " + "-" * 5000 + "1\n",
    ],
    ids=["parens", "long-sum", "deep-calls", "unary"],
)
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_deep_code_is_refused_in_one_line(tmp_path, capsys, code, wrapped):
    script = tmp_path / "train_gpt.py"
    script.write_text(wrapper(code) if wrapped else code)
    code_, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code_ == EXIT_BAD_INPUT
    line = one_line_error(err)
    assert "nested" in line and ("wrapped payload" in line) == wrapped
    assert not (tmp_path / "out.py").exists()


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "wrapped"])
def test_a_long_operator_run_in_a_syntax_error_is_refused_without_libcst(tmp_path, capsys, monkeypatch, wrapped):
    # CPython gives no tree to measure (the indent is wrong), and libcst would take
    # many minutes on 20,000 terms: Python's own syntax error is reported instead.
    import libcst

    def never(*args, **kwargs):
        raise AssertionError("libcst parsed the payload")

    code = "def f():\n    pass\nx = " + "+".join(["1"] * 20_000) + "\n    y = 2\n"
    script = tmp_path / "train_gpt.py"
    script.write_text(wrapper(code) if wrapped else code)
    if not wrapped:  # a wrapper file itself is parsed with libcst; its payload is not
        monkeypatch.setattr(libcst, "parse_module", never)
    code_, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    line = one_line_error(err)
    assert code_ == EXIT_BAD_INPUT
    assert "syntax error: unexpected indent" in line and "a run of 19999 binary operators at line 3" in line
    assert ("wrapped payload line 4" in line) == wrapped
    assert not (tmp_path / "out.py").exists()


@pytest.mark.parametrize(
    "make, line, message",
    [
        # A byte flip turned a character of the encoded literal into a backslash (found by the fuzz run).
        pytest.param(lambda: wrapper(TINY).replace('b85decode("', 'b85decode("8_AV\\xD$', 1), 2, "(unicode error)", id="wrapper-literal"),
        pytest.param(lambda: TINY + 'NAME = "\\N{NO SUCH CHARACTER}"\n', 7, "(unicode error)", id="str"),
        pytest.param(lambda: TINY + "\n\nDATA = b'\\x4'\n", 9, "(value error)", id="bytes-escape"),
        pytest.param(lambda: TINY + "DATA = b'caf\u00e9'\n", 7, "bytes can only contain ASCII", id="bytes-non-ascii"),
    ],
)
def test_a_string_literal_python_cannot_decode_is_a_syntax_error(tmp_path, capsys, make, line, message):
    # libcst parses such a literal and fails only when its value is read: Python's own
    # error, with the literal's line, and nothing written.
    script = tmp_path / "train_gpt.py"
    script.write_text(make())
    before = snapshot(tmp_path)
    code, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    error = one_line_error(err)
    assert code == EXIT_BAD_INPUT
    assert f"train_gpt.py:{line}:" in error and f"syntax error: {message}" in error
    assert snapshot(tmp_path) == before
    code, _, err = run(["check", script, "--no-import"], capsys)
    assert code == EXIT_BAD_INPUT and "Traceback" not in err and message in err


@pytest.mark.parametrize(
    "text, run",
    [
        pytest.param("x = f(1+2, 3+4+5)\n", 2, id="a-comma-ends-a-run"),
        pytest.param("x = " + "+".join(["(1)"] * 50) + "\n", 49, id="bracketed-operands-continue-it"),
        pytest.param("x = [1 +\n2 + 3]\ny = a and b or c\n", 2, id="across-lines-in-brackets-and-boolean"),
        pytest.param('x = "never closed\n', 0, id="does-not-tokenize"),
    ],
)
def test_longest_operator_run(text, run):
    assert _longest_operator_run(text)[0] == run


def test_per_file_time_limit_and_dying_workers_in_tree_mode(tmp_path, monkeypatch):
    root = tmp_path / "records"
    for name in ("a_ok", "b_segv", "c_hang", "d_ok"):
        (root / name).mkdir(parents=True)
        (root / name / "train_gpt.py").write_text(TINY)
    real = tree.patch_one

    def fake(source_path, target, relative, options, diff=False):  # runs in the (forked) worker
        if relative.startswith("b_segv"):
            # The worker is forked from pytest, whose faulthandler would print "Fatal Python
            # error" and a traceback on the terminal; the crash is the point, not the noise.
            faulthandler.disable()
            os.kill(os.getpid(), signal.SIGSEGV)
        if relative.startswith("c_hang"):
            threading.Event().wait()  # never returns: only the time limit ends it
        return real(source_path, target, relative, options, diff)

    monkeypatch.setattr(tree, "patch_one", fake)
    rows = {r.file.split("/")[0]: r for r in tree.patch_tree(root, tmp_path / "out", jobs=2, options=FileOptions(check=False), file_timeout=2)}
    assert rows["a_ok"].status == rows["d_ok"].status == "written"
    assert rows["b_segv"].status == "crash" and "SIGSEGV" in rows["b_segv"].error
    assert rows["c_hang"].status == "timed out" and "2 s" in rows["c_hang"].error
    assert (tmp_path / "out" / "d_ok" / "train_gpt.py").exists()
    assert not (tmp_path / "out" / "b_segv" / "train_gpt.py").exists()


# --------------------------------------------------------------------------- 5. wrapper literals


def test_many_small_pieces_are_refused_not_called_a_syntax_error(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    rng = random.Random(0)
    noise = "".join(rng.choice(string.ascii_letters) for _ in range(9000))  # incompressible
    text = wrapper(TINY + "# " + noise + "\n", width=2)
    assert text.count('"') // 2 > MAX_PIECES
    script.write_text(text)
    code, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT
    line = one_line_error(err)
    assert "implicitly concatenated pieces" in line and "syntax error" not in line


def test_rewrap_that_would_need_too_many_pieces_is_refused_in_one_line(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    rng = random.Random(1)
    noise = "".join(rng.choice(string.ascii_letters) for _ in range(2700))  # incompressible padding
    text = wrapper((FIXTURES / "tokenstream_readable.py").read_text() + "# " + noise + "\n", width=3)
    assert 2800 < text.count('"') // 2 <= MAX_PIECES  # readable; the patched payload needs more pieces
    script.write_text(text)
    code, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT and "--no-rewrap" in one_line_error(err)
    assert not (tmp_path / "out.py").exists()
    assert run([script, "-o", tmp_path / "out.py", "--no-check", "--no-rewrap"], capsys)[0] == EXIT_OK


def test_pieces_with_mixed_quotes_and_escapes_round_trip(tmp_path, capsys):
    encoded = base64.b85encode(lzma.compress(TINY.encode())).decode()
    pieces = [encoded[i : i + 8] for i in range(0, len(encoded), 8)]
    quotes = ['"', "'", '"""', "'''"]
    literal = "\n".join(f"{quotes[i % 4]}{p}{quotes[i % 4]}" for i, p in enumerate(pieces))
    literal = literal.replace("J", "\\x4a", 1) if "J" in encoded else literal
    script = tmp_path / "train_gpt.py"
    script.write_text(f"import lzma as L,base64 as B\nexec(L.decompress(B.b85decode(\n{literal}\n)))\n")
    code, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code == EXIT_OK, err
    assert "h * h" in read_script(tmp_path / "out.py").source


def test_bytes_and_str_pieces_mixed_are_one_line(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    script.write_text('import lzma as L,base64 as B\nexec(L.decompress(B.b85decode(b"abc" "def")))\n')
    code, _, err = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT and one_line_error(err)


# --------------------------------------------------------------------------- 6. signals, pipes, style


def test_closed_stdout_exits_quietly(tmp_path):
    script = tmp_path / "train_gpt.py"
    script.write_text(TINY)
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: the first write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "patcher.cli", str(script), "-o", "-", "--diff", "--no-check"], stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT)
    finally:
        os.close(write_end)
    assert proc.returncode == EXIT_BROKEN_PIPE and proc.stderr == b""


def test_ctrl_c_is_one_line_and_exit_130_and_kills_the_smoke(tmp_path):
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    script = tmp_path / "train_gpt.py"
    script.write_text(
        "import os, time\n"
        "with open(os.environ['PP_READY'], 'w') as f:\n"
        "    f.write(str(os.getpid()))\n"
        "time.sleep(300)\n"
        "if __name__ == '__main__':\n"
        "    pass\n"
    )
    fd = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)
    proc = subprocess.Popen([sys.executable, "-m", "patcher.cli", "check", str(script), "--timeout", "300"], env=dict(os.environ, PP_READY=str(ready)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        data = b""
        while not data:  # the smoke child writes its pid once it runs the script
            assert readable_within(fd, 120), "the import smoke never started"
            data = os.read(fd, 100)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(fd)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED
    assert err.decode().strip() == "patch-prefetch: interrupted"
    assert gone(int(data))


def test_crlf_and_bom_are_kept(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    script.write_bytes(("\ufeff" + TINY).replace("\n", "\r\n").encode())
    out = tmp_path / "out.py"
    assert run([script, "-o", out, "--no-check"], capsys)[0] == EXIT_OK
    data = out.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf")
    assert data.count(b"\n") == data.count(b"\r\n") > TINY.count("\n")  # a line was added, CRLF too


def test_crlf_payload_of_a_wrapper_is_kept(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    script.write_text(wrapper(TINY.replace("\n", "\r\n")))
    out = tmp_path / "out.py"
    assert run([script, "-o", out, "--no-check"], capsys)[0] == EXIT_OK
    payload = read_script(out).source
    assert "h * h" in payload and payload.count("\n") == payload.count("\r\n")


# --------------------------------------------------------------------------- 7. what the check runs


def test_help_and_readme_say_the_import_smoke_runs_code():
    for parser in (build_parser(), build_check_parser()):
        text = " ".join(parser.format_help().split())
        assert "child Python process" in text and "--no-import" in text and "scratch working directory" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "runs the script's definitions" in readme and "--no-import" in readme


def test_no_import_compiles_only(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\nif __name__ == '__main__':\n    pass\n")
    code, out, _ = run(["check", script, "--no-import", "--json"], capsys)
    assert code == EXIT_OK and json.loads(out)["import"] is None and not marker.exists()
    code, out, _ = run(["check", script, "--no-import"], capsys)
    assert code == EXIT_OK and "not run (compiled only" in out and not marker.exists()
    code, out, _ = run(["check", script], capsys)
    assert "ran the script's definitions in a child process" in out and marker.exists()


def test_main_command_timeout_and_scratch_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train_gpt.py"
    record = tmp_path / "cwd.txt"
    script.write_text(
        f"import os, time\nopen({str(record)!r}, 'w').write(os.getcwd())\n" + TINY + "time.sleep(300)\n"
        "if __name__ == '__main__':\n    pass\n"
    )
    code, out, _ = run([script, "-o", tmp_path / "out.py", "--timeout", "4", "--json"], capsys)
    report = json.loads(out)
    assert report["check"]["import"]["error"] == "timed out after 4 s"
    assert code == 4
    cwd = record.read_text()
    assert Path(cwd) != tmp_path and not Path(cwd).exists()  # a scratch directory, removed


def test_processes_the_script_starts_in_a_new_session_do_not_outlive_the_smoke(tmp_path):
    script = tmp_path / "train_gpt.py"
    pid_file = tmp_path / "pid"
    script.write_text(
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "if __name__ == '__main__':\n    pass\n"
    )
    result = check_file(script, timeout=60)
    assert result.imports is not None and result.imports.ok, result.imports
    assert gone(int(pid_file.read_text()))


# --------------------------------------------------------------------------- 8. fuzz (quick; bench/fuzz.py is the long run)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SEEDS = [TINY, wrapper(TINY), wrapper(TINY, width=16, quotes=('"', "'"))]
_POOL = ["(", ")", "[", ":", ",", "=", "lambda", "def ", "\n", "    ", "\\", '"', "'", "#", "\r\n", "\ufeff", "((((((((", "é"]


@st.composite
def _mutated(draw):
    text = draw(st.sampled_from(_SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["delete", "insert", "swap", "truncate", "flip", "deep"]))
        if op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)) :]
        elif op == "insert":
            text = text[:at] + draw(st.sampled_from(_POOL)) + text[at:]
        elif op == "swap":
            other = draw(st.integers(0, len(text)))
            a, b = sorted((at, other))
            text = text[:a] + text[b : b + 4] + text[a + 4 : b] + text[a : a + 4] + text[b + 4 :] if b - a >= 4 else text
        elif op == "truncate":
            text = text[:at]
        elif op == "flip" and at < len(text):
            text = text[:at] + chr(draw(st.integers(33, 126))) + text[at + 1 :]
        elif op == "deep":
            text = text[:at] + "\nx = " + "(" * 300 + ")" * 300 + "\n" + text[at:]
    return text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_mutated())
def test_fuzz_patch_never_crashes_or_writes_on_failure(text):
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "train_gpt.py", Path(tmp) / "out.py"
        data = text.encode("utf-8", "surrogatepass")
        src.write_bytes(data)
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main([str(src), "-o", str(out), "--no-check"])
        assert code in (0, 2, 3), err.getvalue()
        assert "Traceback" not in err.getvalue()
        assert src.read_bytes() == data
        assert out.exists() == (code == 0)
        if code == 2:
            assert len(err.getvalue().strip().splitlines()) == 1
