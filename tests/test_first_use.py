"""What a new user meets first: mistyped words, Ctrl-C at start-up, errors said once,
the input named before the output, verdicts that match their figures, the size cap.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import patcher
from patcher.cli import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, main
from patcher.code_size import ARTIFACT_CAP
from processes import exits_within, readable_within

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
READABLE = FIXTURES / "tokenstream_readable.py"
WRAPPED = FIXTURES / "wrapped_lzma_raw.py"
REPO = Path(patcher.__file__).resolve().parent.parent  # where the package under test lives


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- did you mean


@pytest.mark.parametrize(
    "argv, suggestion",
    [
        pytest.param(["verfy", "a.py", "b.py"], "did you mean verify?", id="subcommand-several-inputs"),
        pytest.param(["chek", "a.py"], "did you mean check?", id="subcommand"),
        pytest.param(["bech", "a.py", "--json"], "did you mean bench?", id="subcommand-json"),
        pytest.param([READABLE, "--skp", "mlp_fusion", "-o", "out.py"], "did you mean --skip?", id="flag"),
        pytest.param([READABLE, "--skip", "mlp_fusin", "-o", "out.py"], "did you mean mlp_fusion?", id="choice"),
        pytest.param(["check", READABLE, "--no-imprt"], "did you mean --no-import?", id="subcommand-flag"),
        pytest.param(["verify", "a.py", "b.py", "--world-sise", "2"], "did you mean --world-size?", id="verify-flag"),
    ],
)
def test_a_mistyped_word_gets_did_you_mean(tmp_path, capsys, monkeypatch, argv, suggestion):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(argv, capsys)
    assert code == EXIT_BAD_INPUT
    assert suggestion in err and "several INPUTs" not in err
    assert err.rstrip().splitlines()[-1].startswith("patch-prefetch")  # the error is the last line
    if "--json" in argv:
        assert suggestion in json.loads(out)["error"]
    assert os.listdir(tmp_path) == []  # nothing written


def test_a_mistyped_subcommand_is_told_from_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["chek", "-o", "out.py", "--no-check"], capsys)
    assert code == EXIT_BAD_INPUT and err.strip() == "patch-prefetch: error: chek: no such file, nor a subcommand; did you mean check?"
    shutil.copy(READABLE, tmp_path / "chek")  # a file of that name is an INPUT
    code, _, err = run(["chek", "-o", "out.py", "--no-check"], capsys)
    assert code == EXIT_OK and "did you mean" not in err and (tmp_path / "out.py").is_file()
    code, _, err = run(["check.py", "-o", "out2.py"], capsys)  # a path, not a word: no suggestion
    assert code == EXIT_BAD_INPUT and "check.py: no such file" in err and "did you mean" not in err


# --------------------------------------------------------------------------- Ctrl-C while importing

# Installed through PYTHONPATH into the command's process: when MODULE is first imported
# it says so on fd READY and blocks on fd HOLD, whose other end the test never writes,
# until SIGINT ends the read (the signal handler raises KeyboardInterrupt there).
SITECUSTOMIZE = '''
import os, sys

class _Hold:
    def __init__(self):
        self.fired = False

    def find_spec(self, name, path=None, target=None):
        if name == os.environ["HOLD_MODULE"] and not self.fired:
            self.fired = True
            os.write(int(os.environ["HOLD_READY"]), b"importing\\n")
            os.read(int(os.environ["HOLD_FD"]), 1)
        return None

sys.meta_path.insert(0, _Hold())
'''


def _console_script(tmp_path: Path) -> Path:
    """The `patch-prefetch` launcher as pip writes it, from the installed entry point."""
    (point,) = [e for e in entry_points(group="console_scripts") if e.name == "patch-prefetch"]
    module, attr = point.value.split(":")
    launcher = tmp_path / "patch-prefetch"
    launcher.write_text(f"import sys\nfrom {module} import {attr}\nif __name__ == '__main__':\n    sys.exit({attr}())\n")
    return launcher


@pytest.mark.parametrize("module", ["argparse", "libcst"], ids=["stdlib-import", "libcst-import"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_130(tmp_path, module):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), HOLD_MODULE=module, HOLD_READY=str(ready_w), HOLD_FD=str(hold_r))
    proc = subprocess.Popen([sys.executable, str(_console_script(tmp_path)), "--version"], env=env, pass_fds=(ready_w, hold_r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(ready_w)
    os.close(hold_r)
    try:
        assert readable_within(ready_r, 30), "the command never reached the import"
        assert os.read(ready_r, 64) == b"importing\n"
        proc.send_signal(signal.SIGINT)
        assert exits_within(proc.pid, 30)
        out, err = proc.communicate()
    finally:
        proc.kill()
        proc.wait()
        os.close(ready_r)
        os.close(hold_w)
    assert "Traceback" not in err and err.splitlines() == ["patch-prefetch: interrupted"]
    assert proc.returncode == EXIT_INTERRUPTED and out == ""


def _ctrl_c_turned_into_key_error(*args, **kwargs):
    """What libcst's position metadata does when Ctrl-C lands inside it: its `finally`
    raises KeyError while the KeyboardInterrupt unwinds, one per nesting level."""
    try:
        raise KeyboardInterrupt
    finally:
        raise KeyError("IndentedBlock(...)")


def test_ctrl_c_that_a_library_turned_into_another_error_is_one_line_and_130(capsys, monkeypatch):
    from patcher.check import check

    monkeypatch.setattr(check, "undefined_names", _ctrl_c_turned_into_key_error)
    assert main(["check", str(READABLE), "--no-import"]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.splitlines() == ["patch-prefetch: interrupted"] and "KeyError" not in err


def test_ctrl_c_turned_into_another_error_in_a_tree_worker_stops_the_tree(tmp_path, monkeypatch):
    """In tree mode the same error is a Ctrl-C, not a "crash" row for the file."""
    from patcher import tree
    from patcher.patch_file import FileOptions

    monkeypatch.setattr(tree, "patch_file", _ctrl_c_turned_into_key_error)
    with pytest.raises(KeyboardInterrupt):
        tree.patch_one(str(READABLE), None, "x.py", FileOptions())
    monkeypatch.setattr(tree, "patch_file", lambda *a, **k: {}["a bug"])
    assert tree.patch_one(str(READABLE), None, "x.py", FileOptions()).status == "crash"


# --------------------------------------------------------------------------- errors said once, input first


def test_check_of_a_bad_file_says_its_error_once_on_a_terminal(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n    pass\n")
    # stdout and stderr on one destination, as on a terminal
    done = subprocess.run([sys.executable, "-m", "patcher.cli", "check", str(bad), "--no-import"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, timeout=60)
    assert done.returncode == EXIT_BAD_INPUT
    assert done.stdout.count("bad.py:1") == 1, done.stdout
    assert len(done.stdout.splitlines()) == 1


def test_a_missing_input_is_named_before_a_missing_output(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["nope.py", "--json"], capsys)
    assert code == EXIT_BAD_INPUT
    assert json.loads(out)["error"] == "nope.py: no such file" and err.strip() == "patch-prefetch: error: nope.py: no such file"
    code, _, err = run(["nope.py", "-o", tmp_path / "no_dir" / "out.py"], capsys)
    assert code == EXIT_BAD_INPUT and "nope.py: no such file" in err and "no_dir" not in err


# --------------------------------------------------------------------------- demo and bench verdicts


def _bench_report(original_step_ms: float, patched_step_ms: float, data_ms: float) -> dict:
    """A bench report (the real `_report` and `step_report`) from constant per-step figures."""
    from patcher.proof import bench, timing

    steps, warmup = 40, 3
    spans = [[original_step_ms] * (steps + warmup), [patched_step_ms] * (steps + warmup)]
    waits = [[data_ms] * (steps + warmup), [data_ms * 2.7] * (steps + warmup)]
    work = [[18.0] * (steps + warmup), [18.2] * (steps + warmup)]
    report = bench._report("train_gpt.py", steps, warmup, 20.0, "op-bound", 2, waits, work, [900.0, 400.0])
    report.update(timing.step_report([s[warmup:] for s in spans], [w[warmup:] for w in waits]))
    report.update(ops_per_step=5000, torch_threads=1, pageable_h2d=False, op="add", op_numel=0, alternate_every=1)
    return report


def test_bench_says_not_met_with_advice_and_its_ratios_read_patched_over_original():
    from patcher.proof import bench

    # the user's run: the patched step longer, the original's data time small
    report = _bench_report(20.0, 20.35, 0.2)
    assert report["step_goal_met"] is False and report["recovered_share"] < -1
    stream = io.StringIO()
    bench.print_table(report, stream)
    lines = stream.getvalue().splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.strip().startswith("verdict:"))
    assert "not met" in lines[verdict] and "recovered as a shorter step" in lines[verdict]
    assert "longer" in lines[verdict]  # the patched step, said the right way round
    assert lines[verdict + 1].strip().startswith("advice:") and "too small to hide" in lines[verdict + 1]
    assert "original / patched" not in stream.getvalue()
    assert "patched / original" in stream.getvalue() and "slowed by -" not in stream.getvalue()


def test_bench_says_met_only_where_its_figures_earn_it():
    from patcher.proof import bench

    stream = io.StringIO()
    bench.print_table(_bench_report(24.0, 20.1, 4.0), stream)  # 3.9 of 4 ms recovered
    verdict = [line for line in stream.getvalue().splitlines() if line.strip().startswith("verdict:")]
    assert len(verdict) == 1 and "goal met" in verdict[0] and "not met" not in verdict[0]
    assert "advice:" not in stream.getvalue()


@pytest.mark.parametrize("patched_ms", [20.6, 19.4], ids=["patched-slower", "patched-faster"])
def test_demo_ok_is_about_exactness_and_its_ratio_is_not_a_pass(capsys, monkeypatch, patched_ms):
    from patcher import demo

    monkeypatch.setattr(demo, "write_shards", lambda directory: None)
    monkeypatch.setattr(demo, "run_script", lambda path, data_dir, **env: ["step:1 train_loss:5.0", "step:2 train_loss:4.5"])
    report = {"steps": 100, "ops_per_step": 20000, "mean_step_ms_original": 20.0, "mean_step_ms_patched": patched_ms, "mean_data_ms_original": 1.3}
    monkeypatch.setitem(sys.modules, "patcher.proof.bench", types.SimpleNamespace(run_bench=lambda *a, **k: report))
    assert demo.main(["a.py", "b.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    ratio = next(line for line in lines if "patched / original" in line)
    assert f"{patched_ms / 20.0:.2f}" in ratio and ("slower" if patched_ms > 20 else "faster") in ratio
    assert "the demo checks exactness, not speed" in ratio
    assert not any("data time leaves the step" in line for line in lines)  # no claim before the figure
    assert lines[-1].startswith("demo: OK: ") and "bit-identical" in lines[-1]
    assert not any(word in lines[-1] for word in ("faster", "slower", "ratio"))


# --------------------------------------------------------------------------- the artifact cap


def test_without_submission_json_the_cap_is_said_unchecked(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    shutil.copy(READABLE, script)
    code, out, _ = run([script, "-o", tmp_path / "out.py", "--no-check"], capsys)
    assert code == EXIT_OK
    (line,) = [line for line in out.splitlines() if "16,000,000" in line]
    assert "not checked" in line and "no submission.json" in line
    before, after = out.split("code bytes, raw: the UTF-8 bytes of the code: ")[1].split(" (")[0].split(" -> ")
    assert f"{before} -> {after}" in line
    # a wrapped record, counted as the wrapper file: the same note, in the JSON report
    shutil.copy(WRAPPED, script)
    code, out, _ = run([script, "-o", tmp_path / "out2.py", "--no-check", "--json"], capsys)
    report = json.loads(out)
    cb = report["code_bytes"]
    assert code == EXIT_OK and report["cap_checked"] is False and "artifact" not in report
    assert "not checked" in report["cap_note"] and f"{cb['before']} -> {cb['after']}" in report["cap_note"] and cb["after"] > cb["before"]


def test_over_the_cap_says_it_was_written_and_which_skip_fits(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    shutil.copy(READABLE, script)
    (tmp_path / "submission.json").write_text(json.dumps({"artifact_bytes": ARTIFACT_CAP - 12_500}))
    out = tmp_path / "out.py"
    code, _, err = run([script, "-o", out, "--no-check"], capsys)
    assert code == EXIT_CHECK_FAILED and out.is_file()
    line = err.strip()
    assert "\n" not in line and f"written to {out}" in line
    assert "brings it under" in line
    skip = line.rsplit("; --skip ", 1)[1].split()[0]
    code, stdout, _ = run([script, "-o", tmp_path / "fits.py", "--no-check", "--skip", skip, "--json"], capsys)
    assert code == EXIT_OK and json.loads(stdout)["artifact"]["over"] == 0  # the advice holds


def test_over_the_cap_before_the_patch_says_no_skip_helps(tmp_path, capsys):
    script = tmp_path / "train_gpt.py"
    shutil.copy(READABLE, script)
    (tmp_path / "submission.json").write_text(json.dumps({"artifact_bytes": ARTIFACT_CAP + 10}))
    code, _, err = run([script, "--diff", "--no-check"], capsys)
    assert code == EXIT_CHECK_FAILED
    line = err.strip().splitlines()[-1]
    assert line.startswith("patch-prefetch: error: ") and "nothing written" in line and "no --skip brings it under" in line
