"""bench runs on a fixture and reports what it promises (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

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
