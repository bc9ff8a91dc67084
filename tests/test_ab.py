"""`patch-prefetch ab`: log parsing per format, the statistics, and whole comparisons of
tiny stand-in training scripts (they print synthetic timings from their environment:
no sleeps, so every figure is known), plus one real run of the fixture and its patch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from patcher import ab
from patcher.cli import main
from processes import exits_within

ROOT = Path(__file__).resolve().parent.parent

# One line of each format, as the real scripts print it (the time is whatever the
# template holds), and what it must read as: (completed steps, ms).
REAL_LINES = [
    pytest.param("step:12/50 train_loss:3.1234 train_time:2461ms step_avg:205.08ms", None, "parameter-golf", (12, 2461.0), id="parameter-golf-root"),
    pytest.param("12/50 train_loss: 3.1234 train_time: 0.0m tok/s: 4000000", 1_000_000, "parameter-golf 2026-04 records", (12, 3000.0), id="records-tok-s"),
    pytest.param("step:12/1285 train_time:684ms step_avg:57.00ms", None, "modded-nanogpt", (12, 684.0), id="modded-nanogpt"),
    pytest.param(
        "step 00011/00050 (22.00%) | loss: 5.123456 | lrm: 1.00 | dt: 123.45ms | tok/sec: 4,246,000 | bf16_mfu: 51.00 | epoch: 1 | total time: 0.02m | eta: 1.2m",
        None, "nanochat base_train", (12, 123.45), id="nanochat-dt",
    ),
    pytest.param("step:12 train_loss:3.25", None, "step lines timed on arrival", (12, None), id="fixture-arrival"),
]


def _match(line: str, tokens):
    for fmt in ab.LOG_FORMATS:
        parsed = fmt.parse(line, tokens)
        if parsed is not None:
            return fmt.name, parsed
    return None, None


@pytest.mark.parametrize("line, tokens, name, expected", REAL_LINES)
def test_each_format_reads_its_real_line(line, tokens, name, expected):
    assert _match(line, tokens) == (name, expected)


@pytest.mark.parametrize(
    "line",
    [
        "step:0/50 val_loss:6.9 val_bpb:4.1 train_time:0ms step_avg:0.02ms",  # validation, not a step
        "step:0/1285 val_loss:10.8 train_time:0ms step_avg:0.03ms",
        "50/50 val_loss: 2.9 val_bpb: 1.1",
        "warmup_step:3/20",
        "Step 00250 | Validation bpb: 0.912345",
    ],
    ids=["pg-val", "modded-val", "records-val", "warmup", "nanochat-val"],
)
def test_other_lines_are_not_step_lines(line):
    assert _match(line, 1000) == (None, None)


def test_records_line_without_tokens_has_no_ms():
    assert ab.LOG_FORMATS[1].parse("3/9 train_loss: 2.0 train_time: 0.0m tok/s: 10", None) == (3, None)


def test_custom_regex_names_its_first_group():
    fmt = ab.custom_format(r"iter (\d+) loss")
    assert fmt.kind == "arrival" and fmt.parse("iter 7 loss 2.0", None) == (7, None)
    timed = ab.custom_format(r"it=(?P<step>\d+) t=(?P<ms>[\d.]+)")
    assert timed.kind == "cumulative" and timed.parse("it=4 t=40.5", None) == (4, 40.5)
    with pytest.raises(ab.AbError, match="needs a group"):
        ab.custom_format(r"iter \d+")
    with pytest.raises(ab.AbError, match="not a regular expression"):
        ab.custom_format(r"iter (\d+")


def test_step_ms_cumulative_is_the_median_window_after_skip():
    points = [(1, 500.0), (2, 600.0), (3, 700.0), (4, 810.0), (5, 900.0)]  # step 1: compilation
    assert ab.windows(points, "cumulative", skip=1) == ([100.0, 100.0, 110.0, 90.0], 4)
    assert ab.step_ms(points, "cumulative", skip=1) == (100.0, 4)
    assert ab.step_ms(points, "cumulative", skip=3) == (100.0, 2)
    # one slow window (a shard load) moves the median, not the level, of the run
    assert ab.step_ms([(0, 0.0), (10, 1000.0), (20, 2000.0), (30, 3900.0), (40, 4900.0)], "cumulative", skip=0) == (100.0, 40)
    # a log every other step: the last point at or before the skip is the base
    assert ab.step_ms([(2, 600.0), (4, 800.0), (6, 1000.0)], "cumulative", skip=3) == (100.0, 4)
    assert ab.step_ms([(1, 5.0)], "cumulative", skip=0) == (None, 0)


def test_step_ms_per_step_is_the_median_after_skip():
    assert ab.step_ms([(1, 900.0), (2, 100.0), (3, 110.0)], "per_step", skip=1) == (105.0, 2)
    assert ab.step_ms([(1, 900.0), (2, 100.0), (3, 110.0), (4, 500.0)], "per_step", skip=1) == (110.0, 3)
    assert ab.step_ms([(1, 900.0)], "per_step", skip=1) == (None, 0)


def test_default_skip():
    assert ab.default_skip(50) == 10 and ab.default_skip(3) == 1 and ab.default_skip(2) == 1


JITTER = [0.0, 0.4, -0.4, 0.2, -0.2]


def test_compare_planted_ten_percent_slower_is_slower():
    a = [100.0 * (1 + j / 100) for j in JITTER]
    b = [110.0 * (1 + j / 100) for j in reversed(JITTER)]
    stats = ab.compare(a, b)
    assert stats["ratio"] == pytest.approx(1.1) and stats["p"] < 0.001
    assert stats["ci_ratio"][0] > 1.09 and stats["ci_ratio"][1] < 1.11
    assert ab.verdict(stats, 5).startswith("slower by 10.0 % ± ")
    assert ab.verdict(ab.compare(b, a), 5).startswith("faster by 9.1 % ± ")


def test_compare_noise_is_no_difference_and_says_what_could_not_be_seen():
    a, b = [100.0, 101.0, 99.0], [100.5, 99.5, 100.2]
    stats = ab.compare(a, b)
    assert stats["ci_ratio"][0] < 1 < stats["ci_ratio"][1] and stats["p"] > 0.05
    words = ab.verdict(stats, 3)
    assert words.startswith("no difference within noise (") and "3 runs each" in words and "p = 0.92" in words
    # (t_.975 + t_.8) * the log ratio's standard error: about 3.6 % for these runs
    assert 2.0 < stats["resolution_pct"] < 5.0 and f"a difference under {ab._pct(stats['resolution_pct'])} % cannot be seen with these runs" in words


def test_the_interval_of_a_ratio_is_never_negative():
    # Two patched runs of 396 and 1,069 ms against originals of about 7 ms (contention):
    # a linear interval on the difference went below zero; the log ratio's cannot.
    stats = ab.compare([7.1, 6.9, 7.0], [396.0, 1069.0, 700.0])
    assert stats["ci_ratio"][0] > 0 and stats["ci_ratio"][0] < stats["ratio"] < stats["ci_ratio"][1]
    assert ab.verdict(stats, 3).startswith("slower by ")
    noisy = ab.compare([7.1, 6.9], [396.0, 1069.0])
    assert noisy["resolution_pct"] > ab.NOISY_PCT and ab.verdict(noisy, 2).startswith("too noisy to say anything (")


def test_one_run_each_gives_no_verdict_only_a_within_run_resolution():
    stats = ab.compare([100.0], [103.0], within=([100.0, 101.0, 99.0, 100.0], [103.0, 102.0, 104.0, 103.0]))
    assert stats["p"] is None and stats["ci_ratio"] is None and stats["basis"] == "within one run each"
    words = ab.verdict(stats, 1)
    assert words.startswith("no verdict from one run each (ratio 1.0300") and "faster" not in words and "slower" not in words
    assert "from each run's windows alone" in words


def test_a_run_far_from_its_side_is_flagged():
    runs = [ab.RunResult(index=i + 1, side="ab"[i % 2], label="x", script="s", step_ms=ms, spread_pct=1.0)
            for i, ms in enumerate([100.0, 100.0, 100.5, 100.2, 99.8, 99.9, 140.0, 100.1])]
    ab.flag_outliers(runs)
    assert [r.index for r in runs if r.outlier] == [7] and runs[6].outlier.startswith("level 140.000")


def test_compare_without_spread():
    assert ab.compare([100.0, 100.0], [110.0, 110.0])["p"] == 0.0
    assert ab.compare([100.0, 100.0], [110.0, 110.0])["resolution_pct"] == 0.0
    same = ab.compare([100.0, 100.0], [100.0, 100.0])
    assert same["p"] == 1.0 and ab.verdict(same, 2).startswith("no difference within noise")


def test_verdict_says_the_fallback():
    stats = ab.compare([100.0, 100.5], [99.0, 99.4])
    assert ab.verdict(stats, 2, fallbacks=1, patched_runs=2).endswith("; the producer fell back in 1 of 2 patched runs (those ran without prefetch)")


def test_env_order_and_sides():
    base = {"ITERATIONS": "20000", "HOME": "/h"}
    a = ab.run_env(7, {"TRAIN_LOG_EVERY": "5"}, {"TRAIN_PREFETCH": "0"}, "a", base)
    b = ab.run_env(7, {"TRAIN_LOG_EVERY": "5"}, {"TRAIN_PREFETCH": "0"}, "b", base)
    assert a["ITERATIONS"] == "7" and a["VAL_LOSS_EVERY"] == "0" and a["TRAIN_LOG_EVERY"] == "5" and a["HOME"] == "/h"
    assert "TRAIN_PREFETCH" not in a and b["TRAIN_PREFETCH"] == "0"
    with pytest.raises(ab.AbError, match="--env-b 'X'"):
        ab.parse_assignments(["X"], "--env-b")


def test_nanochat_gets_num_iterations(tmp_path):
    script = tmp_path / "base_train.py"
    script.write_text('parser.add_argument("--num-iterations", type=int, default=-1)\n')
    assert ab.step_args(script, 30, []) == ["--num-iterations=30"]
    assert ab.step_args(script, 30, ["--num-iterations=99"]) == []
    other = tmp_path / "train_gpt.py"
    other.write_text("ITERATIONS = 1\n")
    assert ab.step_args(other, 30, []) == []


# A stand-in training script: prints STAND_IN_FORMAT's step lines with a synthetic
# step time STAND_IN_MS (times a per-run jitter taken from a counter file), for
# STAND_IN_TOTAL steps (default ITERATIONS); optionally a fallback line, a crash, a
# padding line after each step (so that it cannot run ahead of the reader), a hang,
# and a marker file written where the real scripts evaluate.
STAND_IN = r'''
import os, sys, time
env = os.environ
fmt = env["STAND_IN_FORMAT"]
counter = env.get("STAND_IN_COUNTER")
run = 0
if counter:
    run = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(run + 1))
jitter = [0.0, 0.4, -0.4, 0.2, -0.2][run % 5]
ms = float(env.get("STAND_IN_MS", "100")) * (1 + jitter / 100)
total = int(env.get("STAND_IN_TOTAL", env.get("ITERATIONS", "20")))
tokens = int(env.get("TRAIN_BATCH_TOKENS", "0") or 0)
print("model_params:123", flush=True)
if env.get("STAND_IN_FALLBACK"):
    print("prefetch: cannot fork after threads started; train_loader runs without prefetch (TRAIN_PREFETCH=0 silences this)", file=sys.stderr, flush=True)
for step in range(1, total + 1):
    if step == int(env.get("STAND_IN_CRASH_AT", "0")):
        print("Traceback (most recent call last):", file=sys.stderr)
        print("RuntimeError: CUDA out of memory (stand-in)", file=sys.stderr, flush=True)
        sys.exit(3)
    if step == int(env.get("STAND_IN_HANG_AT", "0")):
        if env.get("STAND_IN_PID"):
            open(env["STAND_IN_PID"], "w").write(str(os.getpid()))
        while True:
            time.sleep(60)
    t = 900.0 + step * ms  # cumulative; step 1 also pays a compilation
    line = {
        "pg": f"step:{step}/{total} train_loss:2.5000 train_time:{t:.1f}ms step_avg:{t / step:.2f}ms",
        "records": f"{step}/{total} train_loss: 2.5000 train_time: {t / 60000:.1f}m tok/s: {step * tokens / (t / 1000):.0f}",
        "modded": f"step:{step}/{total} train_time:{t:.1f}ms step_avg:{t / step:.2f}ms",
        "nanochat": f"step {step - 1:05d}/{total:05d} ({100 * (step - 1) / total:.2f}%) | loss: 2.500000 | lrm: 1.00 | dt: {(ms + (900 if step == 1 else 0)):.2f}ms | tok/sec: 1,000 | bf16_mfu: 1.00 | epoch: 1 | total time: 0.00m",
        "none": f"iteration {step} done",
    }[fmt]
    print(line, flush=True)
    if env.get("STAND_IN_PAD"):
        print("#" * int(env["STAND_IN_PAD"]), flush=True)
if env.get("STAND_IN_MARKER"):
    open(env["STAND_IN_MARKER"], "w").write("evaluation ran")
print("final val_loss:2.0", flush=True)
'''


@pytest.fixture
def stand_ins(tmp_path):
    """(original, patched): two copies of the stand-in."""
    paths = []
    for name in ("original.py", "patched.py"):
        path = tmp_path / name
        path.write_text(STAND_IN)
        paths.append(path)
    return tuple(paths)


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["ab", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def counters(tmp_path) -> list[str]:
    return ["--env", f"STAND_IN_COUNTER={tmp_path / 'count_a'}", "--env-b", f"STAND_IN_COUNTER={tmp_path / 'count_b'}"]


@pytest.mark.parametrize(
    "fmt, name",
    [("pg", "parameter-golf"), ("records", "parameter-golf 2026-04 records"), ("modded", "modded-nanogpt"), ("nanochat", "nanochat base_train")],
)
def test_planted_ten_percent_slower_patched_is_slower(stand_ins, tmp_path, capsys, fmt, name):
    code, out, err = run_cli(
        capsys, *stand_ins, "--runs", 3, "--steps", 20, "--json", "--env", f"STAND_IN_FORMAT={fmt}", "--env", "TRAIN_BATCH_TOKENS=524288",
        "--env-b", "STAND_IN_MS=110", *counters(tmp_path),
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["format"] == {"a": name, "b": name}
    assert [r["side"] for r in report["runs"]] == ["a", "b"] * 3  # alternated
    expected_a = [100.0 * (1 + j / 100) for j in JITTER[:3]]
    assert report["step_ms"]["a"] == pytest.approx(expected_a, abs=0.06)  # train_time is printed to 0.1 ms
    assert report["step_ms"]["b"] == pytest.approx([1.1 * v for v in expected_a], abs=0.06)
    assert report["ratio"] == pytest.approx(1.1, abs=0.002) and report["p"] < 0.01
    assert report["verdict"].startswith("slower by 10.0 % ± ") and "3 runs each; a difference under " in report["verdict"]
    assert report["skip"] == 4 and all(r["steps_measured"] == 16 and r["stopped_at_steps"] for r in report["runs"])
    assert report["fallbacks"] == 0 and report["commands"]["a"][1:] == [str(stand_ins[0].resolve())]


def test_text_report_names_format_runs_and_verdict(stand_ins, tmp_path, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 2, "--steps", 10, "--env", "STAND_IN_FORMAT=pg", "--env-b", "STAND_IN_MS=90", *counters(tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    assert "log format: parameter-golf" in lines[0] and "stopped at step 10, the first 2 steps left out" in lines[0]
    assert sum(" ms/step  (steps measured 8, spread ±" in line for line in lines) == 4
    assert "producer fell back in 0 of 2 patched runs" in out
    assert lines[-1].startswith("verdict: patched faster by 10.0 % ± ")
    assert "ab: run 2/4 patched: 90.000 ms/step" in err


def test_same_script_is_no_difference(stand_ins, tmp_path, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 3, "--steps", 10, "--json", "--env", "STAND_IN_FORMAT=modded", *counters(tmp_path))
    assert code == 0, err
    assert json.loads(out)["verdict"].startswith("no difference within noise (ratio 1.0000, ")


def test_one_run_each_has_no_confidence_interval_and_no_verdict(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 10, "--json", "--env", "STAND_IN_FORMAT=pg", "--env-b", "STAND_IN_MS=103")
    report = json.loads(out)
    assert code == 0 and report["p"] is None and report["ci"] is None and report["resolution_basis"] == "within one run each"
    assert report["verdict"].startswith("no verdict from one run each (ratio 1.0300")


def test_producer_fallback_is_quoted_and_counted(stand_ins, tmp_path, capsys):
    code, out, err = run_cli(
        capsys, *stand_ins, "--runs", 2, "--steps", 10, "--env", "STAND_IN_FORMAT=pg", "--env-b", "STAND_IN_MS=99", "--env-b", "STAND_IN_FALLBACK=1", *counters(tmp_path)
    )
    assert code == 0, err
    assert "producer fell back in 2 of 2 patched runs" in out
    assert out.count("PRODUCER FELL BACK") == 2
    assert "      prefetch: cannot fork after threads started; train_loader runs without prefetch" in out
    assert "the producer fell back in 2 of 2 patched runs" in out.splitlines()[-1]
    code, out, _ = run_cli(capsys, *stand_ins, "--runs", 2, "--steps", 10, "--json", "--env", "STAND_IN_FORMAT=pg", "--env-b", "STAND_IN_FALLBACK=1")
    report = json.loads(out)
    assert report["fallbacks"] == 2 and [r["fell_back"] for r in report["runs"]] == [False, True, False, True]
    assert report["runs"][1]["prefetch_lines"][0].startswith("prefetch: cannot fork")


def test_crashing_run_exits_2_naming_it(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 3, "--steps", 10, "--env", "STAND_IN_FORMAT=pg", "--env-b", "STAND_IN_CRASH_AT=4")
    assert code == 2 and out == ""
    line = err.strip().splitlines()[-1]
    assert len(err.strip().splitlines()) == 2  # run 1's progress line, then the error
    assert line.startswith(f"patch-prefetch ab: error: run 2 (patched, {stand_ins[1]}) failed: exit code 3 before step 10 (reached step 3)")
    assert "RuntimeError: CUDA out of memory (stand-in)" in line


def test_run_is_stopped_at_steps(stand_ins, tmp_path, capsys):
    marker = tmp_path / "evaluated"
    # 1000 steps, each followed by more than a pipe's worth of padding: the stand-in
    # cannot run ahead of ab's reader, so only the kill keeps it from the marker.
    code, out, err = run_cli(
        capsys, *stand_ins, "--runs", 1, "--steps", 6, "--json", "--env", "STAND_IN_FORMAT=pg", "--env", "STAND_IN_TOTAL=1000",
        "--env", "STAND_IN_PAD=100000", "--env", f"STAND_IN_MARKER={marker}",
    )
    assert code == 0, err
    report = json.loads(out)
    assert not marker.exists()
    assert [(r["steps_reached"], r["stopped_at_steps"], r["returncode"]) for r in report["runs"]] == [(6, True, None)] * 2


def test_run_that_ends_early_by_itself_is_measured(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 10, "--json", "--env", "STAND_IN_FORMAT=pg", "--env", "STAND_IN_TOTAL=8")
    report = json.loads(out)
    assert code == 0, err
    assert [(r["steps_reached"], r["stopped_at_steps"], r["returncode"]) for r in report["runs"]] == [(8, False, 0)] * 2


def test_unrecognised_output_exits_2_with_a_sample(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 5, "--env", "STAND_IN_FORMAT=none")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"patch-prefetch ab: error: {stand_ins[0]}: no step line recognised")
    assert "iteration 5 done | final val_loss:2.0" in line


def test_step_regex_reads_an_unknown_format(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 5, "--json", "--env", "STAND_IN_FORMAT=none", "--step-regex", r"iteration (\d+) done")
    assert code == 0, err
    assert json.loads(out)["format"]["a"] == r"--step-regex iteration (\d+) done"


def test_tok_s_log_needs_tokens_per_step(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 5, "--env", "STAND_IN_FORMAT=records", "--env", "TRAIN_BATCH_TOKENS=")
    assert code == 2 and "give TRAIN_BATCH_TOKENS with --env or --tokens-per-step" in err
    # the stand-in reads its own TRAIN_BATCH_TOKENS: here the same, given twice
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 5, "--json", "--env", "STAND_IN_FORMAT=records", "--env", "TRAIN_BATCH_TOKENS=1000", "--tokens-per-step", 1000)
    assert code == 0, err and json.loads(out)["step_ms"]["a"] == pytest.approx([100.0], abs=0.01)


def test_timeout_is_a_failed_run(stand_ins, capsys):
    code, out, err = run_cli(capsys, *stand_ins, "--runs", 1, "--steps", 5, "--timeout", 1, "--env", "STAND_IN_FORMAT=pg", "--env", "STAND_IN_HANG_AT=3")
    assert code == 2 and "run 1 (original" in err and "no step 5 within --timeout (reached step 2)" in err


@pytest.mark.parametrize(
    "args, says",
    [
        (["missing.py", "{b}"], "missing.py: no such file"),
        (["{a}", "{b}", "--runs", "0"], "--runs 0: needs at least 1"),
        (["{a}", "{b}", "--steps", "5", "--skip", "5"], "--skip 5: must be at least 0 and below --steps 5"),
        (["{a}", "{b}", "--env", "NOEQUALS"], "--env 'NOEQUALS': expected NAME=VALUE"),
        (["{a}", "{b}", "--cwd", "{a}"], "--cwd is not a directory"),
        (["{a}", "{b}", "--python", "/nonexistent/python3"], "--python /nonexistent/python3: no such interpreter"),
    ],
    ids=["missing-file", "no-runs", "skip-all", "bad-env", "cwd-file", "no-python"],
)
def test_bad_input_is_one_line_exit_2(stand_ins, capsys, args, says):
    code, out, err = run_cli(capsys, *[a.format(a=stand_ins[0], b=stand_ins[1]) for a in args])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err


def test_bad_input_with_json_is_a_document(stand_ins, capsys):
    code, out, err = run_cli(capsys, "missing.py", stand_ins[1], "--json")
    assert code == 2 and json.loads(out) == {"error": "missing.py: no such file", "exit_code": 2}


def test_script_args_after_double_dash(tmp_path, capsys):
    script = tmp_path / "args.py"
    script.write_text("import sys\nfor s in range(1, 6): print(f'step:{s}/5 train_time:{10 * s}ms step_avg:10.00ms')\nprint('ARGS', sys.argv[1:], file=sys.stderr)\nsys.exit(0 if sys.argv[1:] == ['--depth=4', 'x'] else 9)\n")
    code, out, err = run_cli(capsys, script, script, "--runs", 1, "--steps", 6, "--json", "--", "--depth=4", "x")
    assert code == 0, err
    assert json.loads(out)["commands"]["b"][-2:] == ["--depth=4", "x"]


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_a_stop_signal_kills_the_running_script_first(stand_ins, tmp_path, stop):
    # SIGTERM (a scheduler, `timeout`) and SIGHUP (a closed terminal) as Ctrl-C: the
    # script's process group (its producer with it) is killed, and ab says "interrupted".
    pid_file = tmp_path / "pid"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "patcher.cli", "ab", *map(str, stand_ins), "--runs", "1", "--steps", "5", "--env", "STAND_IN_FORMAT=pg", "--env", "STAND_IN_HANG_AT=3", "--env", f"STAND_IN_PID={pid_file}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        child = int(pid_file.read_text())
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err
    assert exits_within(child, 10)


def test_real_fixture_and_its_patch(tmp_path, capsys, monkeypatch):
    from patcher.proof.shards import write_shards
    from patcher.ab import COMPILE_CACHES

    for name in COMPILE_CACHES:  # a caller without a cache of its own (inductor sets one in a process that compiled: an earlier test's)
        monkeypatch.delenv(name, raising=False)

    patched = tmp_path / "patched.py"
    original = ROOT / "fixtures" / "tokenstream_readable.py"
    assert main([str(original), "-o", str(patched), "-q"]) == 0
    capsys.readouterr()
    shards = tmp_path / "shards"
    write_shards(shards)
    # The fixture's step lines carry no cumulative time: timed on arrival, a line each step.
    code, out, err = run_cli(capsys, original, patched, "--runs", 2, "--steps", 6, "--log-every", 1, "--json", "--env", f"DATA_PATH={shards}", "--env", "OMP_NUM_THREADS=1", "--cwd", tmp_path)
    assert code == 0, err
    report = json.loads(out)
    assert report["format"] == {"a": "step lines timed on arrival", "b": "step lines timed on arrival"}
    assert [(r["side"], r["steps_reached"], r["stopped_at_steps"], r["steps_measured"]) for r in report["runs"]] == [("a", 6, True, 5), ("b", 6, True, 5)] * 2
    assert all(ms > 0 for side in "ab" for ms in report["step_ms"][side])
    assert report["fallbacks"] == 0 and report["p"] is not None and "2 runs each" in report["verdict"]
    assert any("timed on arrival, which adds whatever sync the log line makes" in w for w in report["warnings"])
    assert len(report["first_step_s"]["a"]) == 2 and report["compile_cache"].startswith("shared by both sides")


# Counts every `Tensor.item()` (a host-device sync on a GPU) of a process into a file.
SYNC_COUNTER = r"""
import os
if os.environ.get("SYNC_COUNT_FILE"):
    import torch
    _item = torch.Tensor.item
    def item(self):
        with open(os.environ["SYNC_COUNT_FILE"], "a") as out:
            out.write("item\n")
        return _item(self)
    torch.Tensor.item = item
"""


# A miniature of the root script's loop: the loss accumulates on the device and only a
# log line (`step % TRAIN_LOG_EVERY == 0`) calls `.item()`, a host-device sync on a GPU.
ROOT_STYLE_LOOP = r"""
import os, time, torch
iterations, every = int(os.environ.get("ITERATIONS", 20000)), int(os.environ.get("TRAIN_LOG_EVERY", 200))
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = time.perf_counter()
for step in range(1, iterations + 1):
    train_loss = torch.zeros(())
    loss = model(torch.ones(4, 8)).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
    train_loss += loss.detach()
    if every > 0 and step % every == 0:
        ms = 1000 * (time.perf_counter() - start)
        print(f"step:{step}/{iterations} train_loss:{train_loss.item():.4f} train_time:{ms:.0f}ms step_avg:{ms / step:.2f}ms", flush=True)
"""


def test_ab_adds_no_sync_per_step_to_a_fixture_run(tmp_path):
    # The same run three ways: as a user runs it (a line every 200 steps), with ab's
    # environment, and with a planted TRAIN_LOG_EVERY=1 (what ab used to set): ab may add
    # one sync a window of log_every steps, never one a step.
    from concurrent.futures import ThreadPoolExecutor

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SYNC_COUNTER)
    script = tmp_path / "train_gpt.py"
    script.write_text(ROOT_STYLE_LOOP)
    steps = 40
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tmp_path / "site"))
    envs = {
        "user": {**base, "ITERATIONS": str(steps)},
        "ab": ab.run_env(steps, {}, {}, "a", base),
        "planted": ab.run_env(steps, {"TRAIN_LOG_EVERY": "1"}, {}, "a", base),
    }

    def syncs(name: str) -> int:
        count = tmp_path / f"{name}.count"
        done = subprocess.run([sys.executable, str(script)], env={**envs[name], "SYNC_COUNT_FILE": str(count)}, capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return len(count.read_text().splitlines()) if count.exists() else 0

    with ThreadPoolExecutor(3) as pool:
        counted = dict(zip(envs, pool.map(syncs, envs)))
    allowed = -(-steps // ab.DEFAULT_LOG_EVERY)  # one a window
    assert counted["ab"] - counted["user"] <= allowed, counted
    assert counted["planted"] - counted["user"] > allowed, f"the count cannot see a sync a step: {counted}"


def test_python_runs_both_scripts_with_the_training_environments_interpreter(tmp_path, capsys):
    """--python: the runs use that interpreter (here a wrapper that marks its runs), not
    the one running patch-prefetch."""
    script = tmp_path / "steps.py"
    script.write_text("import os, sys\nif os.environ.get('VIA_WRAPPER') != '1': sys.exit(9)\nfor s in range(1, 6): print(f'step:{s}/5 train_time:{10 * s}ms step_avg:10.00ms')\n")
    wrapper = tmp_path / "python-of-training"
    wrapper.write_text(f"#!/bin/sh\nVIA_WRAPPER=1 exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    code, out, err = run_cli(capsys, script, script, "--runs", 1, "--steps", 4, "--json", "--python", wrapper)
    assert code == 0, err
    assert json.loads(out)["commands"]["a"][0] == str(wrapper)
    code, out, err = run_cli(capsys, script, script, "--runs", 1, "--steps", 4, "--json")
    assert code == 2  # without it the runs use this interpreter, and the script refuses
