"""The op-bound step's options and the user-style harness (bench/op_harness.py); no timing assertions."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from patcher.proof import bench, timing
from patcher.cli import bench_main as main
from patcher.proof.bench import run_bench
from patcher.proof.timing import BenchError

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_op_kind_runs_its_op():
    a, b, out = timing._op_tensors()
    a.fill_(2.0)
    assert timing.op_loop(3, (a, b, out), "add-out") == 3 and torch.equal(out, a + b)
    out.zero_()
    # The allocating kinds leave the preallocated output alone and the inputs unchanged.
    for kind in ("add", "mul-scalar"):
        assert timing.op_loop(5, (a, b, out), kind) == 5
        assert torch.equal(out, torch.zeros(16)) and torch.equal(a, torch.full((16,), 2.0))
    with pytest.raises(ValueError, match="unknown op kind"):
        timing.op_loop(1, (a, b, out), "matmul")


def test_op_tensors_have_the_requested_size():
    assert [t.numel() for t in timing._op_tensors(0)] == [0, 0, 0]
    assert [t.numel() for t in timing._op_tensors(4096)] == [4096] * 3
    assert all(t.dtype == torch.float32 for t in timing._op_tensors())


def test_the_default_op_is_an_allocating_op_without_host_data():
    # The default op-bound step models a CUDA op's host work: a new output tensor per
    # op (its metadata allocated on the host), no host data and no host compute.
    assert timing.DEFAULT_OP == "add" and timing.DEFAULT_OP_NUMEL == 0
    a, b, out = timing._op_tensors(timing.DEFAULT_OP_NUMEL)
    seen = []
    real_add = torch.add
    try:
        torch.add = lambda *args, **kwargs: seen.append(kwargs) or real_add(*args, **kwargs)
        timing.op_loop(4, (a, b, out), timing.DEFAULT_OP)
    finally:
        torch.add = real_add
    assert seen == [{}] * 4  # no out=: every call allocates its result


def test_a_fixed_op_count_skips_the_calibration(monkeypatch):
    monkeypatch.setattr(timing, "calibrate_ops", lambda *a, **k: pytest.fail("calibrated"))
    step, ops = timing.step_function("op-bound", 20.0, "add", 16, ops_per_step=25)
    assert ops == 25 and step() >= 0.0
    with pytest.raises(BenchError, match="--op must be one of"):
        timing.step_function("op-bound", 20.0, "matmul")


class _Sequence:
    """An inline loader that appends its name to a shared list at every `next_batch`."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def next_batch(self, n):
        self.calls.append(self.name)
        return torch.zeros(n)


@pytest.mark.parametrize("every, steps, expected", [
    (1, 3, "opopop"),
    (3, 7, "oooppp" "oooppp" "op"),
    (5, 4, "oooopppp"),
])
def test_alternation_runs_blocks_of_every_steps_a_side(every, steps, expected):
    calls = []
    build = [lambda: _Sequence("o", calls), lambda: _Sequence("p", calls)]
    drops = [[], []]
    waits, work, spans = bench._alternate(build, (2,), steps, lambda: 0.0, every=every, drops=drops)
    assert "".join(calls) == expected
    for side in (0, 1):
        assert len(waits[side]) == len(work[side]) == len(spans[side]) == len(drops[side]) == steps
        # The drop is part of the step, not of the wait.
        assert all(span >= wait + drop for span, wait, drop in zip(spans[side], waits[side], drops[side]))


def test_run_bench_reports_the_op_and_its_settings(tmp_path):
    threads_before = torch.get_num_threads()
    report = run_bench(FIXTURES / "tokenstream_readable.py", steps=6, main_thread="op-bound", shard_tokens=50_000,
                       data_dir=str(tmp_path), producer_batches=4, op="mul-scalar", op_numel=8, ops_per_step=50,
                       alternate_every=2, torch_threads=None)
    assert (report["op"], report["op_numel"], report["ops_per_step"], report["alternate_every"]) == ("mul-scalar", 8, 50, 2)
    assert report["torch_threads"] == threads_before == torch.get_num_threads()  # left as they were
    with pytest.raises(BenchError, match="--op must be one of"):
        run_bench(FIXTURES / "tokenstream_readable.py", main_thread="op-bound", op="matmul")


def test_the_cli_default_op_bound_step_and_its_options(tmp_path, capsys):
    argv = [str(FIXTURES / "tokenstream_readable.py"), "--steps", "5", "--compute-ms", "1", "--shard-tokens", "50000",
            "--main-thread", "op-bound", "--data-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["op"], report["op_numel"], report["alternate_every"]) == (timing.DEFAULT_OP, timing.DEFAULT_OP_NUMEL, 1)
    assert main(argv + ["--op", "add-out", "--op-numel", "16", "--ops-per-step", "30"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["op"], report["op_numel"], report["ops_per_step"]) == ("add-out", 16, 30)
    assert main(argv[:-1] + ["--op", "add-out"]) == 0
    assert "add-out" in capsys.readouterr().out  # the table says what the op loop ran


def test_the_user_style_harness_reports_both_sides(tmp_path):
    harness = _load("op_harness")
    report = harness.run_harness(str(FIXTURES / "tokenstream_readable.py"), steps=8, ops=40, op="add", warmup=2,
                                 data_dir=str(tmp_path), shard_tokens=50_000)
    assert report["ops_per_step"] == 40 and report["op"] == "add" and report["torch_threads"] >= 1
    for side in ("original", "patched"):
        assert report[f"mean_step_ms_{side}"] >= report[f"mean_data_ms_{side}"] > 0
    expected = (report["mean_step_ms_original"] - report["mean_step_ms_patched"]) / report["mean_data_ms_original"]
    assert report["recovered_share"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="unknown op"):
        harness.run_harness(str(FIXTURES / "tokenstream_readable.py"), op="matmul")


def _options(argv: list) -> dict:
    """`--name value` / `--flag` pairs of an op_harness command line as a dict."""
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i]], i = True, i + 1
    return out


def test_the_ablation_configs_change_one_factor_of_bench_each():
    ablation = _load("op_ablation")
    base = _options(ablation.CONFIGS["bench"])
    assert base["--torch-threads"] == "1" and base["--op"] == "add-out" and base["--compute-ms"] == "20"
    # The CUDA-like op (an allocating op without host data) changes the op and its size.
    factors = {"alloc-add-0": {"--op", "--op-numel"}}
    for name, argv in ablation.CONFIGS.items():
        if name in ("bench", "user", "user-threads-1"):
            continue
        options = _options(argv)
        changed = {key for key in base.keys() | options.keys() if base.get(key) != options.get(key)}
        # ops-15000 swaps the calibrated step for a fixed op count: two keys, one factor.
        expected = factors.get(name, {"--compute-ms", "--ops"} if name == "ops-15000" else None)
        assert changed == expected if expected else len(changed) == 1, (name, changed)
    # The user's harness is the harness's own defaults; user-threads-1 differs from it in the threads alone.
    assert ablation.CONFIGS["user"] == [] and _options(ablation.CONFIGS["user-threads-1"]) == {"--torch-threads": "1"}
