"""The command line: outputs, reports, exit codes, and bad input that overwrites nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from patcher.cli import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_FAILED, EXIT_NOTHING, EXIT_OK, main
from patcher.read.source import read_script

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def run(argv, capsys, check=False):
    argv = [str(a) for a in argv]
    if not check and argv and argv[0] not in ("check", "verify", "bench"):
        argv.append("--no-check")  # the check has tests of its own; keep these fast
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_patch_writes_output_and_json_report(tmp_path, capsys):
    out = tmp_path / "out.py"
    code, stdout, _ = run([FIXTURES / "tokenstream_readable.py", "-o", out, "--json"], capsys)
    assert code == EXIT_OK
    report = json.loads(stdout)
    # The default patch: what makes a run faster; the diagnostics only when asked for.
    assert report["applied"] == ["train_prefetch", "copy_stream", "mlp_fusion", "val_prefetch", "env_toggles"]
    assert report["wrapped"] is False
    assert report["code_bytes"]["after"] == len(out.read_bytes()) > report["code_bytes"]["before"]
    assert {"input", "output", "applied", "skipped", "code_bytes", "wrapped"} <= set(report)
    assert "_make_train_loader(" in out.read_text()
    assert "import patcher" not in out.read_text() and "from patcher.templates" not in out.read_text()


@pytest.mark.parametrize(
    "options, diagnostics",
    [
        pytest.param([], [], id="default-leaves-the-loop-calls-alone"),
        pytest.param(["--with", "step_timing"], ["step_timing"], id="with-one"),
        pytest.param(["--diagnostics"], ["step_timing", "val_bytecount"], id="all-that-apply"),
    ],
)
def test_diagnostics_are_opt_in(tmp_path, capsys, options, diagnostics):
    out = tmp_path / "out.py"
    code, stdout, _ = run([FIXTURES / "tokenstream_readable.py", "-o", out, "--json", *options], capsys)
    assert code == EXIT_OK
    applied = json.loads(stdout)["applied"]
    assert [f for f in applied if f in ("step_timing", "val_bytecount", "val_progress")] == diagnostics
    assert ("_step_timer" in out.read_text()) == ("step_timing" in diagnostics)


def test_wrapped_input_is_rewrapped_in_the_same_style(tmp_path, capsys):
    src = FIXTURES / "wrapped_lzma_raw.py"
    out = tmp_path / "out.py"
    code, stdout, _ = run([src, "-o", out, "--json"], capsys)
    assert code == EXIT_OK and json.loads(stdout)["wrapped"] is True
    original, patched = read_script(src), read_script(out)
    assert patched.wrapped and patched.wrapper.codec == original.wrapper.codec == "lzma"
    assert patched.wrapper.decompress_kwargs == original.wrapper.decompress_kwargs
    assert "_make_train_loader(" in patched.source
    assert out.read_text().splitlines()[0] == src.read_text().splitlines()[0]
    size_line = out.read_text().splitlines()[1]
    assert size_line.startswith("__wrapper_size__=") and int(size_line.split("=")[1]) == len(out.read_bytes())


def test_no_rewrap_writes_plain_source(tmp_path, capsys):
    out = tmp_path / "out.py"
    code, _, _ = run([FIXTURES / "wrapped_lzma_oneline.py", "-o", out, "--no-rewrap"], capsys)
    assert code == EXIT_OK
    assert "class DistributedTokenLoader" in out.read_text()


def test_stdout_output_and_diff(tmp_path, capsys):
    code, stdout, stderr = run([FIXTURES / "shuffled_minified.py", "-o", "-", "--diff"], capsys)
    assert code == EXIT_OK
    compile(stdout, "stdout", "exec")
    assert "+++ " in stderr and "-\t\ttrain_loader=ShuffledSequenceLoader(h,device)" in stderr


def test_already_patched_says_so_and_changes_nothing(tmp_path, capsys):
    once, twice = tmp_path / "once.py", tmp_path / "twice.py"
    assert run([FIXTURES / "tokenstream_readable.py", "-o", once], capsys)[0] == EXIT_OK
    code, stdout, _ = run([once, "-o", twice], capsys)
    assert code == EXIT_OK
    assert "already patched" in stdout
    assert twice.read_bytes() == once.read_bytes()


def test_nothing_to_patch_exits_3_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.py"
    code, stdout, _ = run([FIXTURES / "no_loader.py", "-o", out], capsys)
    assert code == EXIT_NOTHING
    assert "nothing to patch" in stdout
    assert not out.exists()


def test_in_place_keeps_a_backup(tmp_path, capsys):
    target = tmp_path / "train_gpt.py"
    original = (FIXTURES / "tokenstream_readable.py").read_text()
    target.write_text(original)
    assert run([target, "--in-place"], capsys)[0] == EXIT_OK
    assert (tmp_path / "train_gpt.py.orig").read_text() == original
    assert "_make_train_loader(" in target.read_text()


def test_only_and_skip(tmp_path, capsys):
    out = tmp_path / "out.py"
    code, stdout, _ = run([FIXTURES / "tokenstream_readable.py", "-o", out, "--only", "mlp_fusion", "--json"], capsys)
    assert code == EXIT_OK and json.loads(stdout)["applied"] == ["mlp_fusion", "env_toggles"]
    code, stdout, _ = run([FIXTURES / "tokenstream_readable.py", "-o", out, "--skip", "mlp_fusion", "--json"], capsys)
    assert "mlp_fusion" not in json.loads(stdout)["applied"]


def _bad_inputs(tmp_path: Path):
    empty = tmp_path / "empty.py"
    empty.write_text("")
    binary = tmp_path / "binary.py"
    binary.write_bytes(b"\x00\x01\x02\xff")
    syntax = tmp_path / "syntax.py"
    syntax.write_text("import torch\n\ndef f(:\n    pass\n")
    corrupt = tmp_path / "corrupt.py"
    corrupt.write_text('import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("not-lzma-data")))\n')
    return {
        "empty": (empty, "empty"),
        "binary": (binary, "binary"),
        "syntax": (syntax, ":3"),
        "corrupt-wrapper": (corrupt, ":2"),
        "missing": (tmp_path / "missing.py", "missing.py"),
    }


@pytest.mark.parametrize("case", ["empty", "binary", "syntax", "corrupt-wrapper", "missing"])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, capsys, case):
    path, must_contain = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out.py"
    code, stdout, stderr = run([path, "-o", out], capsys)
    assert code == EXIT_BAD_INPUT
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and str(path.name) in lines[0] and must_contain in lines[0]
    assert "Traceback" not in stderr
    assert not out.exists()


def test_output_equal_to_input_is_refused(tmp_path, capsys):
    target = tmp_path / "train_gpt.py"
    target.write_text((FIXTURES / "tokenstream_readable.py").read_text())
    before = target.read_bytes()
    code, _, stderr = run([target, "-o", target], capsys)
    assert code == EXIT_BAD_INPUT and "output path is the input path" in stderr
    assert target.read_bytes() == before


def test_usage_error_exits_2(capsys):
    assert main([]) == EXIT_BAD_INPUT
    assert main([str(FIXTURES / "tokenstream_readable.py")]) == EXIT_BAD_INPUT  # no -o


def test_console_script_runs(tmp_path):
    out = tmp_path / "out.py"
    done = subprocess.run(
        [sys.executable, "-m", "patcher.cli", str(FIXTURES / "coprime_dataclass.py"), "-o", str(out), "--no-check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "applied  train_prefetch" in done.stdout


def test_patch_then_check_reports_and_passes(tmp_path, capsys):
    out = tmp_path / "out.py"
    code, stdout, _ = run([FIXTURES / "shuffled_minified.py", "-o", out, "--json"], capsys, check=True)
    report = json.loads(stdout)
    assert code == EXIT_OK
    assert report["check"]["compile"]["ok"] and report["check"]["import"]["ok"]


def test_failed_check_exits_4_but_writes(tmp_path, capsys):
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    broken = tmp_path / "train_gpt.py"
    broken.write_text(source.replace('if __name__ == "__main__":', 'raise RuntimeError("import-time failure")\nif __name__ == "__main__":'))
    out = tmp_path / "out.py"
    code, stdout, _ = run([broken, "-o", out], capsys, check=True)
    assert code == EXIT_CHECK_FAILED
    assert out.exists() and "_make_train_loader(" in out.read_text()
    assert "FAILED" in stdout and "RuntimeError" in stdout


def test_check_subcommand_exit_codes(tmp_path, capsys):
    good = FIXTURES / "coprime_dataclass.py"
    pep701 = tmp_path / "train_gpt.py"
    pep701.write_text('import os\nnames = ["a"]\nprint(f"{", ".join(names)}")\n')
    code, stdout, _ = run(["check", good, "--json"], capsys)
    assert code == EXIT_OK and json.loads(stdout)["compile"]["ok"]
    code, stdout, _ = run(["check", good, pep701], capsys)
    if "grammar check only" in stdout:
        pytest.skip("no real Python 3.10 here")
    assert code == EXIT_FAILED and f"{pep701}: FAILED" in stdout and "PEP 701" in stdout
    assert run(["check", tmp_path / "missing.py"], capsys)[0] == EXIT_BAD_INPUT


def test_verify_subcommand(tmp_path, capsys):
    out = tmp_path / "out.py"
    assert run([FIXTURES / "tokenstream_readable.py", "-o", out], capsys)[0] == EXIT_OK
    code, stdout, _ = run(["verify", FIXTURES / "tokenstream_readable.py", out, "--batches", "16", "--json"], capsys)
    assert code == EXIT_OK and json.loads(stdout)["identical"] is True
    code, _, stderr = run(["verify", FIXTURES / "no_loader.py", FIXTURES / "no_loader.py"], capsys)
    assert code == EXIT_NOTHING and "nothing to verify" in stderr


def test_producer_toggles_only_on_request(tmp_path, capsys):
    # The tuning toggle costs code bytes: a default patch leaves it out, the flag adds it
    # (on the same forked runtime), and the byte report counts it.
    fixture = FIXTURES / "shuffled_minified.py"
    reports = {}
    for flag in ([], ["--producer-toggles"]):
        out = tmp_path / f"out{len(flag)}.py"
        code, stdout, _ = run([fixture, "-o", out, "--json", "--no-byte-breakdown", *flag], capsys)
        assert code == EXIT_OK
        reports[bool(flag)] = (json.loads(stdout), read_script(out).source)
    (plain, plain_src), (tuned, tuned_src) = reports[False], reports[True]
    assert "TRAIN_PREFETCH_QUEUE" not in plain_src and "TRAIN_PREFETCH_QUEUE" in tuned_src
    for src in (plain_src, tuned_src):  # the lean runtime's child process, either way
        assert "def _produce(" in src and "host_copy" not in src
    assert tuned["code_bytes"]["after"] > plain["code_bytes"]["after"]
