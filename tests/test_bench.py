"""bench runs on a fixture and reports what it promises (no timing assertions)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from processes import open_files
from patcher.proof import bench, timing
from patcher.cli import bench_main as main
from patcher.proof.bench import run_bench
from patcher.proof.harness import loaded_script_names
from patcher.templates import prefetch_loader

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KEYS = {
    "wait_ms_original_p50", "wait_ms_patched_p50", "wait_ms_original_p99", "wait_ms_patched_p99",
    "wait_ms_original_max", "wait_ms_patched_max", "wait_ms_original_total", "wait_ms_patched_total",
    "wait_ratio_patched_over_original", "producer_batches_per_s_original", "producer_batches_per_s_patched",
    "main_thread_slowdown_pct", "steps", "compute_ms", "main_thread", "script", "torch_threads",
}


def test_report_has_the_documented_keys_and_consistent_values(tmp_path):
    threads_before = torch.get_num_threads()
    report = run_bench(FIXTURES / "tokenstream_readable.py", steps=20, compute_ms=1, shard_tokens=50_000, data_dir=str(tmp_path))
    assert KEYS <= set(report)
    assert report["steps"] == 20
    for side in ("original", "patched"):
        assert 0 <= report[f"wait_ms_{side}_p50"] <= report[f"wait_ms_{side}_p99"] <= report[f"wait_ms_{side}_max"] <= report[f"wait_ms_{side}_total"]
    if report["wait_ms_original_total"]:  # every ratio reads patched / original
        assert report["wait_ratio_patched_over_original"] == pytest.approx(report["wait_ms_patched_total"] / report["wait_ms_original_total"], abs=1e-3)
    assert report["producer_batches_per_s_patched"] > 0
    assert isinstance(report["main_thread_slowdown_pct"], float)
    assert len(list(tmp_path.glob("fineweb_train_*.bin"))) == 3  # kept for the next run
    assert report["torch_threads"] == 1 and torch.get_num_threads() == threads_before  # restored
    # On the CUDA path the original's two `.to(device, non_blocking=True)` copy from
    # pageable memory (each makes the host wait on a GPU); the patched hand-out stages
    # each tensor in pinned memory and copies asynchronously.
    census = {k: report[k] for k in report if "copies_per_batch" in k}
    assert census == {"blocking_copies_per_batch_original": 2.0, "async_copies_per_batch_original": 0.0, "blocking_copies_per_batch_patched": 0.0, "async_copies_per_batch_patched": 2.0}


def test_json_output_and_idle_mode(tmp_path, capsys):
    code = main([str(FIXTURES / "shuffled_minified.py"), "--steps", "10", "--compute-ms", "1", "--shard-tokens", "50000", "--main-thread", "idle", "--data-dir", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["main_thread"] == "idle" and report["main_thread_slowdown_pct"] is None


def test_script_without_loader_is_one_line_exit_2(capsys):
    assert main([str(FIXTURES / "no_loader.py"), "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing to benchmark" in err


def test_a_shuffled_loader_reports_the_default_producer_against_the_original(tmp_path):
    # One producer rate: the default patch's (the forked producer), with its ratio to the
    # original's; no other producer variant is measured.
    report = run_bench(FIXTURES / "shuffled_minified.py", steps=6, compute_ms=1, shard_tokens=50_000, shards=16, data_dir=str(tmp_path), producer_batches=10)
    assert {key for key in report if key.startswith("producer_")} == {"producer_batches_per_s_original", "producer_batches_per_s_patched", "producer_ratio"}
    assert report["producer_batches_per_s_original"] > 0 and report["producer_batches_per_s_patched"] > 0
    # ratios are printed to 3 decimals: a small ratio is checked to that precision
    assert report["producer_ratio"] == pytest.approx(report["producer_batches_per_s_patched"] / report["producer_batches_per_s_original"], rel=1e-2, abs=1e-3)
    assert len(list(tmp_path.glob("fineweb_train_*.bin"))) == 16


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")
def test_a_run_lets_its_scripts_and_their_shared_slots_go(tmp_path):
    # The lean producer's slots are shared memory that its loader holds until it is
    # freed; a process that ran several benches (a test run) kept every run's open.
    before, modules = open_files(), loaded_script_names()
    report = run_bench(FIXTURES / "shuffled_minified.py", steps=4, compute_ms=1, shard_tokens=50_000, data_dir=str(tmp_path), producer_batches=5)
    assert report["producer_batches_per_s_patched"] > 0
    assert {f for f in open_files() - before if "/dev/shm/" in f or str(tmp_path) in f} == set()
    assert loaded_script_names() == modules

# --- op-bound mode: the step, not only the wait ---------------------------------------

STEP_KEYS = {
    f"{stat}_{kind}_ms_{side}" for stat in ("mean", "median", "p99") for kind in ("step", "data") for side in ("original", "patched")
} | {"recovered_share", "step_goal_met", "ops_per_step"}


@pytest.mark.parametrize("overhead_ms, per_op_ms, target_ms", [(0.0, 0.0013, 19.0), (0.4, 0.003, 20.0), (3.0, 0.0005, 5.0), (0.02, 0.00001, 2.0)])
def test_op_calibration_reaches_the_target_within_its_tolerance(overhead_ms, per_op_ms, target_ms):
    # A deterministic stand-in for the op loop's time: a fixed cost per run plus a cost per op.
    calls = []

    def run(ops):
        calls.append(ops)
        return overhead_ms + per_op_ms * ops

    ops = timing.calibrate_ops(target_ms, run)
    assert abs(run(ops) - target_ms) <= timing.OP_CALIBRATION_TOLERANCE * target_ms
    assert all(n >= 1 for n in calls)


def test_op_calibration_of_an_unreachable_target_returns_one_op():
    # Every run costs more than the target: the fewest ops, no endless loop.
    assert timing.calibrate_ops(1.0, lambda ops: 5.0 + 0.001 * ops) == 1


def test_op_loop_runs_the_requested_torch_ops():
    a, b, out = timing._op_tensors()
    assert timing.op_loop(7, (a, b, out)) == 7
    assert torch.equal(out, a + b)


def test_step_report_arithmetic_on_known_inputs():
    spans = [[20.0, 22.0, 30.0], [20.0, 21.0, 22.0]]
    data = [[1.0, 2.0, 6.0], [0.1, 0.1, 0.1]]
    r = timing.step_report(spans, data)
    assert r["mean_step_ms_original"] == 24.0 and r["mean_step_ms_patched"] == 21.0
    assert r["median_step_ms_original"] == 22.0 and r["median_step_ms_patched"] == 21.0
    assert r["mean_data_ms_original"] == 3.0 and r["median_data_ms_original"] == 2.0
    assert r["p99_step_ms_original"] == pytest.approx(22.0 + 0.98 * 8.0)  # numpy's linear interpolation
    assert r["recovered_share"] == 1.0  # 3 ms shorter a step, of 3 ms data
    assert r["step_goal_met"] is True
    # Shorter on average, but the median step is longer: not met.
    r = timing.step_report([[20.0, 20.0, 30.0], [20.5, 20.5, 20.5]], data)
    assert r["recovered_share"] == pytest.approx((70 / 3 - 20.5) / 3.0, abs=1e-4) and r["step_goal_met"] is False
    # A patched step longer than the original's: a negative share; no data time: no share.
    assert timing.step_report([[20.0], [21.0]], [[2.0], [0.0]])["recovered_share"] == -0.5
    assert timing.step_report([[20.0], [21.0]], [[0.0], [0.0]])["recovered_share"] is None


class _RecordingLoader:
    """A loader whose `next_batch` notes the thread it runs on."""

    def __init__(self):
        self.threads, self.count = [], 0

    def next_batch(self, n):
        self.threads.append(threading.get_ident())
        self.count += 1
        return torch.full((n,), self.count)


def test_alternate_builds_the_original_inline_and_the_patched_on_a_worker():
    original, inner = _RecordingLoader(), _RecordingLoader()
    build = [lambda: original, lambda: prefetch_loader._PrefetchLoader(lambda device: inner, "cpu", queue_depth=2)]
    steps = []
    waits, work, spans = bench._alternate(build, (4,), 6, lambda: steps.append(1) or 0.5)
    main = threading.main_thread().ident
    assert original.threads == [main] * 6
    assert inner.threads and main not in inner.threads
    assert len(steps) == 12 and work == [[0.5] * 6, [0.5] * 6]
    for side in (0, 1):
        assert len(waits[side]) == len(spans[side]) == 6
        assert all(span >= wait for span, wait in zip(spans[side], waits[side]))


def test_op_bound_report(tmp_path, capsys):
    code = main([str(FIXTURES / "tokenstream_readable.py"), "--steps", "12", "--compute-ms", "1", "--shard-tokens", "50000", "--main-thread", "op-bound", "--data-dir", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["main_thread"] == "op-bound"
    assert KEYS | STEP_KEYS <= set(report)
    assert report["ops_per_step"] >= 1 and isinstance(report["main_thread_slowdown_pct"], float)
    for side in ("original", "patched"):
        assert report[f"mean_step_ms_{side}"] >= report[f"mean_data_ms_{side}"] > 0
        assert report[f"median_data_ms_{side}"] == pytest.approx(report[f"wait_ms_{side}_p50"], abs=1e-3)
    data_ms = report["mean_data_ms_original"]
    expected = (report["mean_step_ms_original"] - report["mean_step_ms_patched"]) / data_ms
    # The report's means are rounded to 4 decimals and the share comes from the unrounded
    # ones: allow what that rounding can move the share by (it grows as the data time shrinks).
    rounding = (abs(expected) * 5e-5 + 1e-4) / data_ms + 1e-4
    assert report["recovered_share"] == pytest.approx(expected, abs=rounding)
    code = main([str(FIXTURES / "tokenstream_readable.py"), "--steps", "6", "--compute-ms", "1", "--shard-tokens", "50000", "--main-thread", "op-bound", "--data-dir", str(tmp_path)])
    assert code == 0 and "recovered as a shorter step" in capsys.readouterr().out


def test_the_pageable_h2d_copy_is_charged_to_the_original_alone():
    batch = (torch.arange(6).reshape(2, 3), [torch.ones(2)], 7)
    staged = bench._stage_pageable(batch)
    assert type(staged) is tuple and type(staged[1]) is list and staged[2] == 7
    for got, want in ((staged[0], batch[0]), (staged[1][0], batch[1][0])):
        assert torch.equal(got, want) and got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
    original, inner, staged_sides = _RecordingLoader(), _RecordingLoader(), []

    def stage(batch):
        staged_sides.append(batch)
        return bench._stage_pageable(batch)

    build = [lambda: original, lambda: prefetch_loader._PrefetchLoader(lambda device: inner, "cpu", queue_depth=2)]
    bench._alternate(build, (4,), 5, lambda: 0.0, stage_original=stage)
    assert [int(b[0]) for b in staged_sides] == [1, 2, 3, 4, 5]  # the original's five batches, none of the patched side's


def test_pageable_h2d_is_in_the_report(tmp_path, capsys):
    argv = [str(FIXTURES / "tokenstream_readable.py"), "--steps", "6", "--compute-ms", "1", "--shard-tokens", "50000", "--main-thread", "op-bound", "--data-dir", str(tmp_path)]
    assert main(argv + ["--pageable-h2d", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pageable_h2d"] is True
    assert main(argv + ["--pageable-h2d"]) == 0
    assert "the original charged its pageable H2D's host copy" in capsys.readouterr().out
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pageable_h2d"] is False
