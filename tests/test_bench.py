"""bench runs on a fixture and reports what it promises (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from patcher.bench import main, run_bench

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KEYS = {
    "wait_ms_original_p50", "wait_ms_patched_p50", "wait_ms_original_p99", "wait_ms_patched_p99",
    "wait_ms_original_max", "wait_ms_patched_max", "wait_ms_original_total", "wait_ms_patched_total",
    "ratio", "producer_batches_per_s_original", "producer_batches_per_s_patched",
    "main_thread_slowdown_pct", "steps", "compute_ms", "main_thread", "script", "torch_threads",
}


def test_report_has_the_documented_keys_and_consistent_values(tmp_path):
    threads_before = torch.get_num_threads()
    report = run_bench(FIXTURES / "tokenstream_readable.py", steps=20, compute_ms=1, shard_tokens=50_000, data_dir=str(tmp_path))
    assert KEYS <= set(report)
    assert report["steps"] == 20
    for side in ("original", "patched"):
        assert 0 <= report[f"wait_ms_{side}_p50"] <= report[f"wait_ms_{side}_p99"] <= report[f"wait_ms_{side}_max"] <= report[f"wait_ms_{side}_total"]
    assert report["ratio"] > 0
    assert report["producer_batches_per_s_patched"] > 0
    assert isinstance(report["main_thread_slowdown_pct"], float)
    assert len(list(tmp_path.glob("fineweb_train_*.bin"))) == 3  # kept for the next run
    assert report["torch_threads"] == 1 and torch.get_num_threads() == threads_before  # restored


def test_json_output_and_idle_mode(tmp_path, capsys):
    code = main([str(FIXTURES / "shuffled_minified.py"), "--steps", "10", "--compute-ms", "1", "--shard-tokens", "50000", "--main-thread", "idle", "--data-dir", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["main_thread"] == "idle" and report["main_thread_slowdown_pct"] is None


def test_script_without_loader_is_one_line_exit_2(capsys):
    assert main([str(FIXTURES / "no_loader.py"), "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing to benchmark" in err


def test_producer_variants_for_a_shuffled_loader(tmp_path):
    # One run reports the original, one worker with the script's own next_batch, one
    # worker with the numpy assembly and N workers, each with its ratio to the original.
    report = run_bench(FIXTURES / "shuffled_minified.py", steps=6, compute_ms=1, shard_tokens=50_000, shards=16, data_dir=str(tmp_path), workers=2, producer_batches=10)
    assert report["workers"] == 2 and report["assembly"] == "numpy"
    for name in ("python", "numpy", "workers"):
        assert report[f"producer_batches_per_s_{name}"] > 0
        assert report[f"producer_ratio_{name}"] == pytest.approx(report[f"producer_batches_per_s_{name}"] / report["producer_batches_per_s_original"], rel=1e-2)
    assert report["producer_batches_per_s_patched"] == report["producer_batches_per_s_workers"]
    assert report["producer_ratio_workers_vs_1"] == pytest.approx(report["producer_batches_per_s_workers"] / report["producer_batches_per_s_numpy"], rel=1e-2)
    assert len(list(tmp_path.glob("fineweb_train_*.bin"))) == 16


def test_other_families_report_one_python_worker(tmp_path):
    report = run_bench(FIXTURES / "tokenstream_readable.py", steps=4, compute_ms=1, shard_tokens=50_000, data_dir=str(tmp_path), workers=2, producer_batches=5)
    assert report["workers"] == 1 and report["assembly"] == "python"
    assert report["producer_batches_per_s_numpy"] is None and report["producer_batches_per_s_workers"] is None
    assert report["producer_ratio_workers_vs_1"] is None
    assert report["producer_batches_per_s_patched"] == report["producer_batches_per_s_python"]
