"""bench/gpu_train.py: log parsing, the H2D trace summary, and the runner on a stand-in script.

The GPU run itself needs CUDA; these check the parts that turn its output into figures.
"""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_train", ROOT / "bench" / "gpu_train.py")
gpu_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_train)

LOG = """\
warmup_step:20/20
step:1/3 train_loss:6.9516 train_time:120ms step_avg:120.00ms
step_timing mode:breakdown every:20 (synchronising every phase; forced off: TRAIN_PREFETCH, TRAIN_COPY_STREAM)
step_timing step:1 batch_cpu_ms:9.00 h2d_ms:- forward_ms:90.00 step_ms:300.00
step:2/3 train_loss:5.5000 train_time:320ms step_avg:160.00ms
step_timing step:11 batch_cpu_ms:2.00 h2d_ms:1.00 forward_ms:50.00 step_ms:200.00
step_timing step:12 batch_cpu_ms:4.00 h2d_ms:3.00 forward_ms:70.00 step_ms:220.00
step:3/3 val_loss:2.1000 val_bpb:0.6648 train_time:630ms step_avg:210.35ms
step:3/3 train_loss:1.2500 train_time:600ms step_avg:200.00ms
"""


def _kernel(ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}


def _copy(ts, dur, stream, nbytes, kind="Pinned"):
    return {"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy HtoD ({kind} -> Device)", "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": nbytes}}


def test_parse_log_reads_the_last_step_line_losses_and_timing():
    report = gpu_train.parse_log(LOG)
    assert report["step_avg_ms"] == 210.35  # the val line of the last step, not a train_loss line
    assert (report["steps"], report["train_time_ms"], report["val_bpb"]) == (3, 630, 0.6648)
    assert report["train_loss"] == {1: 6.9516, 2: 5.5, 3: 1.25}
    assert [row["step"] for row in report["timing"]] == [1, 11, 12]
    assert "h2d_ms" not in report["timing"][0]  # `h2d_ms:-` is no figure


def test_timing_means_leave_out_the_first_steps():
    means = gpu_train.timing_means(gpu_train.parse_log(LOG)["timing"], skip_first=10)
    assert means == {"batch_cpu_ms": 3.0, "forward_ms": 60.0, "h2d_ms": 2.0, "step_ms": 210.0}
    wait = [{"step": 5, "data_wait_ms": 0.1, "data_wait_total_ms": 4.0}, {"step": 20, "data_wait_ms": 0.2, "data_wait_total_ms": 10.0}]
    assert gpu_train.timing_means(wait)["data_wait_mean_ms"] == 0.5


def test_summarise_h2d_groups_copies_by_stream_and_measures_overlap():
    trace = {
        "traceEvents": [
            _kernel(0, 10, 7),
            _kernel(12, 10, 7),
            _kernel(40, 5, 7),
            _kernel(100, 1, 9),  # a short side-stream kernel: stream 7 stays the compute stream
            _copy(5, 4, 13, 100),  # fully under the kernel at 0..10
            _copy(30, 4, 13, 100),  # the compute stream idle: no overlap, 8 us after its last kernel
            _copy(8, 4, 7, 8, "Pageable"),  # on the compute stream itself: never "overlapped"
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 32, "dur": 3, "args": {}},
        ]
    }
    summary = gpu_train.summarise_h2d(trace)
    assert summary["compute_stream"] == 7
    pinned, pageable = summary["groups"]
    assert (pinned["stream"], pinned["count"], pinned["total_us"], pinned["overlapped_us"], pinned["overlap_frac"]) == (13, 2, 8.0, 4.0, 0.5)
    assert (pageable["stream"], pageable["overlapped_us"]) == (7, 0.0)
    window = summary["window"]  # the second half of the pinned copies: the one at 30
    assert (window["start_us"], window["end_us"], window["compute_busy_frac"], window["idle_before_copy_us"]) == (30.0, 34.0, 0.0, 8.0)
    assert window["runtime"] == [{"name": "cudaStreamSynchronize", "count": 1, "total_us": 3.0}]


def test_summarise_h2d_without_copies():
    assert gpu_train.summarise_h2d({"traceEvents": [_kernel(0, 1, 7)]}) == {"compute_stream": 7, "groups": [], "window": None}


STAND_IN = """\
import os, sys
steps = int(os.environ["ITERATIONS"])
assert os.path.exists(os.environ["TOKENIZER_PATH"]) and os.path.isdir(os.environ["DATA_PATH"])
avg = 100.0 if os.environ.get("TRAIN_PREFETCH", "1") == "1" and "{marker}" == "patched" else 120.0
for step in range(1, steps + 1):
    print(f"step:{{step}}/{{steps}} train_loss:{{1.0 / step:.4f}} train_time:1ms step_avg:1.00ms")
print(f"step:{{steps}}/{{steps}} val_loss:2.0 val_bpb:0.5 train_time:{{int(avg * steps)}}ms step_avg:{{avg:.2f}}ms")
"""


def test_runner_runs_every_variant_with_the_run_settings(tmp_path):
    variants = "original,patched,patched_off_wait"
    for marker in ("original", "patched"):
        (tmp_path / f"{marker}.py").write_text(STAND_IN.format(marker=marker))
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"stand-in")
    out = tmp_path / "report.json"
    argv = [str(tmp_path / "original.py"), str(tmp_path / "patched.py"), "--steps", "4", "--train-batch-tokens", "64"]
    argv += ["--variants", variants, "--work-dir", str(tmp_path / "work"), "--tokenizer-path", str(tokenizer), "--json", str(out)]
    assert gpu_train.main(argv) == 0
    report = json.loads(out.read_text())
    runs = report["variants"]
    assert list(runs) == ["original", "patched", "patched_off_wait"]
    assert [runs[name]["step_avg_ms"] for name in runs] == [120.0, 100.0, 120.0]  # the toggles reached the process
    assert all(run["rc"] == 0 and run["steps"] == 4 for run in runs.values())
    assert runs["patched"]["train_loss"] == {"1": 1.0, "2": 0.5, "3": 0.3333, "4": 0.25}
    # two train shards holding every token the run reads (warm-up included), and one val shard
    data = tmp_path / "work" / f"data_{(4 + 20 + 2) * 64}"
    assert sorted(p.name for p in data.iterdir()) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin"]


def test_runner_rejects_an_unknown_variant(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_train.main(["a.py", "b.py", "--variants", "original,nonsense", "--work-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown variant nonsense" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written
