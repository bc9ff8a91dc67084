"""The fuzz harness (bench/fuzz.py): a seeded slice ends clean, a planted crash or hang is
caught; and the inputs its long run found, each as a small case of its own."""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import io
import lzma
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from patcher.cli import main
from patcher.read.source import read_script
from patcher.read.wrapper import build_literal, encode_payload, render_module

ROOT = Path(__file__).resolve().parent.parent


def _fuzz():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "bench" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz"] = module  # dataclasses of the module look themselves up here
    spec.loader.exec_module(module)
    return module


fuzz = _fuzz()


def _patch(argv: list) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


SLICE = dict(count=16, seed=7, check_every=0, repatch_every=3, check_cmd_every=8, verify_every=0)


def _options(tmp_path, **kw):
    return fuzz.Options(**{"failures": tmp_path / "failures", "progress": False, **kw})


def _first_compiling(seed: int) -> int:
    """Number of the first input of `seed` that compiles (so the patch reaches the survey)."""
    maker = fuzz.Maker(seed)
    return next(i for i in range(100) if maker.make(i).valid)


# --------------------------------------------------------------------------- the harness


def test_slice_ends_without_traceback_or_hang(tmp_path):
    report = fuzz.run_fuzz(_options(tmp_path, **SLICE))
    assert report["inputs"] == SLICE["count"]
    assert (report["tracebacks"], report["hangs"], report["failures"]) == (0, 0, 0), report["failed inputs"]
    assert sum(report["exits"]["patch"].values()) == SLICE["count"] and report["exits"]["repatch"]
    assert report["verdict"].startswith(f"{SLICE['count']} inputs (seed {SLICE['seed']}, inputs 0-{SLICE['count'] - 1}): 0 tracebacks in 0 inputs, 0 hangs")
    # the slice reaches the transforms (statement mutations give valid Python) and bad input alike
    assert report["exits"]["patch"].get("0") and report["exits"]["patch"].get("2")


def test_inputs_are_made_again_from_seed_and_number():
    a, b = fuzz.Maker(3), fuzz.Maker(3)
    later = a.make(5).data
    assert b.make(5).data == later and b.make(4).data == a.make(4).data  # whatever was made before
    assert fuzz.Maker(4).make(5).data != later


def test_planted_traceback_is_reported_with_its_input(tmp_path, monkeypatch, capsys):
    def broken(module, index=None):
        raise KeyError("planted in the survey")

    monkeypatch.setattr("patcher.families.registry.judge", broken)  # the forked commands inherit it
    n = _first_compiling(7)
    code = fuzz.main(["--seed", "7", "--start", str(n), "--count", "1", "--failures", str(tmp_path), "--check-cmd-every", "0", "--verify-every", "0"])
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[-1].startswith(f"1 inputs (seed 7, inputs {n}-{n}): 1 tracebacks in 1 inputs, 0 hangs")
    [saved] = tmp_path.glob("*-patch-traceback.py")
    assert saved.read_bytes() == fuzz.Maker(7).make(n).data
    assert "KeyError: 'planted in the survey'" in saved.with_suffix(".txt").read_text()
    assert f"--start {n} --count 1" in saved.with_suffix(".txt").read_text()


def test_planted_hang_is_killed_and_reported(tmp_path, monkeypatch):
    def stuck(module, index=None):
        threading.Event().wait()

    monkeypatch.setattr("patcher.families.registry.judge", stuck)
    n = _first_compiling(7)
    report = fuzz.run_fuzz(_options(tmp_path, seed=7, start=n, count=1, timeout=1.0, check_every=0, check_cmd_every=0, repatch_every=0, verify_every=0))
    assert (report["hangs"], report["tracebacks"]) == (1, 0)
    assert report["exits"]["patch"] == {"hang": 1}
    assert 1.0 <= report["times"]["patch"]["max s"] < 5


# --------------------------------------------------------------------------- inputs the long run found


def _wrapped_at_preset_0(tmp_path, payload: str) -> Path:
    literal = base64.b85encode(lzma.compress(payload.encode(), preset=0)).decode()
    src = tmp_path / "train_gpt.py"
    src.write_text(f'import lzma as L,base64 as B\n__wrapper_size__=0\nexec(L.decompress(B.b85decode("{literal}")))\n')
    return src


def test_wrapper_size_below_the_shrink_of_the_file(tmp_path):
    # Packed at lzma preset 0, the payload shrinks when re-packed at preset 9: with
    # `__wrapper_size__=0` the distance kept from the file size would make it negative.
    payload = "".join(f"v{i} = {i * 7919 % 1000}  # value {i}\n" for i in range(300))
    src = _wrapped_at_preset_0(tmp_path, payload)
    w = read_script(src).wrapper
    text = render_module(w, build_literal(w, encode_payload(w, payload)))
    assert len(text.encode()) < len(src.read_bytes())  # the case: the file shrank
    assert text.splitlines()[1] == f"__wrapper_size__={len(text.encode())}"  # no size is negative: the file's own
    out = tmp_path / "out.py"
    out.write_text(text)
    assert read_script(out).source == payload


@pytest.mark.parametrize("fixture", ["generator_toplevel.py", "distributed_data_loader.py"])
def test_thread_runner_output_is_already_patched(tmp_path, fixture):
    # A data generator or a DistributedDataLoader gets a thread runner (`_prefetch_iterator`,
    # `_prefetch_next_batch`) and no `_make_train_loader`: patching the output again must
    # say so and change nothing, not report "nothing to patch" (exit 3).
    once, twice = tmp_path / "once.py", tmp_path / "twice.py"
    assert _patch([ROOT / "fixtures" / fixture, "-o", once, "--no-check", "-q"])[0] == 0
    code, out, err = _patch([once, "-o", twice, "--no-check"])
    assert code == 0 and "already patched" in out, out + err
    assert twice.read_bytes() == once.read_bytes()


def test_wrapper_size_placeholder_patches_end_to_end(tmp_path):
    # The whole command on such a record: the round-trip check accepts the file's own
    # size (before: RuntimeError "rendered __wrapper_size__ lost its relation to the file size").
    # A Python 3.12-only f-string: py310_fstrings rewrites it, so the wrapper is rendered.
    payload = 'd = {"k": 1}\nprint(f"{d["k"]}")\n' + "".join(f"v{i} = {i * 7919 % 1000}  # value {i}\n" for i in range(300))
    src = _wrapped_at_preset_0(tmp_path, payload)
    code, out, err = _patch([src, "-o", tmp_path / "out.py", "--no-check"])
    assert "Traceback" not in err and code == 0, err


def test_future_import_inside_a_function_is_checked_without_a_traceback(tmp_path):
    # pyflakes asserts on a `from __future__` that only the compiler rejects.
    src = tmp_path / "train.py"
    src.write_text("import torch\n\ndef f():\n    from __future__ import annotations\n")
    code, out, err = _patch(["check", src, "--no-import"])
    assert "Traceback" not in out + err and code in (0, 1, 2, 4), out + err


def test_a_syntax_warning_does_not_come_before_the_one_line_error(tmp_path):
    src = tmp_path / "train.py"
    src.write_text("x = 1if\n")
    # In a fresh process: a warning is shown once per place, so an earlier test's would hide it.
    run = subprocess.run([sys.executable, "-m", "patcher.cli", str(src), "-o", str(tmp_path / "out.py")], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "SyntaxWarning" not in run.stderr, run.stderr
