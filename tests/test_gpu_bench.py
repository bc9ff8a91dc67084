"""bench/gpu_train.py: log parsing, the H2D trace summary, and the runner on a stand-in script.

The GPU run itself needs CUDA; these check the parts that turn its output into figures.
"""

import importlib.util
import json
from pathlib import Path

import pytest

from processes import exits_within

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
    # two train shards holding every token the run reads (both warm-ups included), and one
    # val shard, where DATA_PATH and DATA_DIR (the 2026-04 records' layout) point
    data_dir = tmp_path / "work" / f"data_{(4 + 2 * 20 + 2) * 64}_1024"
    data = data_dir / "datasets" / "fineweb10B_sp1024"
    assert sorted(p.name for p in data.iterdir()) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    assert (data_dir / "tokenizers" / "fineweb_1024_bpe.model").read_bytes() == b"stand-in"


def test_runner_rejects_an_unknown_variant(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_train.main(["a.py", "b.py", "--variants", "original,nonsense", "--work-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown variant nonsense" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


# A 2026-04 record's log: `N/M train_loss: ... tok/s: T`; step_avg = TRAIN_BATCH_TOKENS / T.
FAMILY_LOG = """\
warmup_step: 20/20
1/150 train_loss: 9.0111 train_time: 0.0m tok/s: 8242436
150/150 train_loss: 3.5000 train_time: 0.2m tok/s: 7864320
150/150 val_loss: 3.4000 val_bpb: 1.2345
"""


def test_parse_log_reads_a_records_tokens_per_second_as_its_step_time():
    report = gpu_train.parse_log(FAMILY_LOG, train_batch_tokens=786432)
    assert report["step_avg_ms"] == 100.0  # 786432 tokens / 7864320 tok/s
    assert (report["steps"], report["train_time_ms"], report["val_bpb"]) == (150, 15000, 1.2345)
    assert report["train_loss"] == {1: 9.0111, 150: 3.5}
    assert gpu_train.parse_log(FAMILY_LOG)["step_avg_ms"] is None  # no batch size, no step time


def test_the_last_step_line_of_either_kind_of_script():
    last = [line for line in (LOG + FAMILY_LOG).splitlines() if gpu_train.is_last_step_line(line)]
    assert last == ["step:3/3 val_loss:2.1000 val_bpb:0.6648 train_time:630ms step_avg:210.35ms", "150/150 train_loss: 3.5000 train_time: 0.2m tok/s: 7864320"]


def test_the_last_step_is_a_logged_step():
    assert [gpu_train.log_every(n) for n in (200, 150, 4, 17, 7919)] == [20, 15, 4, 17, 1]


def test_the_plan_alternates_the_repeated_variants():
    plan = gpu_train.run_plan(["original", "patched", "toggles_off"], ["original", "patched"], 3)
    assert plan == ["original", "patched", "toggles_off", "original", "patched", "original", "patched"]
    assert gpu_train.run_plan(["patched"], ["original", "patched"], 2) == ["patched", "patched"]


def test_summarise_runs_gives_the_median_and_the_spread():
    runs = [{"step_avg_ms": a, "rc": 0, "steps": 4} for a in (101.0, 99.0, 104.0)]
    summary = gpu_train.summarise_runs(runs + [{"step_avg_ms": None, "rc": 1}])
    assert (summary["step_avg_ms"], summary["spread_ms"], summary["step_avg_ms_runs"], summary["rc"]) == (101.0, 5.0, [101.0, 99.0, 104.0], 1)


STOPPED = """\
import os, threading
child = os.fork()
if child == 0:
    threading.Event().wait()  # a forked producer that never ends by itself
print(f"child {{child}}", flush=True)
print("step:2/2 val_loss:2.0 val_bpb:0.5 train_time:10ms step_avg:5.00ms", flush=True)
threading.Event().wait()  # what follows training (quantization, evaluation) is not measured
print("after", flush=True)
"""


def test_a_run_is_stopped_with_its_children_after_its_last_step_line(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(STOPPED.format())
    run = gpu_train.run_variant(script, {}, tmp_path / "run", timeout_s=60)
    assert run["rc"] == 0 and run["step_avg_ms"] == 5.0  # stopped by the runner, not by the timeout
    assert "after" not in run["log_tail"]
    assert exits_within(int(run["log_tail"].split("child ")[1].split()[0]), 10.0)  # the forked child went with it


def test_a_run_that_never_reaches_its_last_step_is_stopped_at_the_timeout(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import threading\nprint('step:1/2 train_loss:1.0 train_time:1ms step_avg:1.00ms', flush=True)\nthreading.Event().wait()\n")
    run = gpu_train.run_variant(script, {}, tmp_path / "run", timeout_s=1)
    assert run["rc"] == -9 and run["step_avg_ms"] is None


def test_repeats_and_the_sanitizer_run(tmp_path):
    for marker in ("original", "patched"):
        (tmp_path / f"{marker}.py").write_text(STAND_IN.format(marker=marker).replace("import os, sys\n", "import os, sys\n" + SANITIZER_RACE, 1))
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"stand-in")
    out = tmp_path / "report.json"
    argv = [str(tmp_path / "original.py"), str(tmp_path / "patched.py"), "--steps", "4", "--train-batch-tokens", "64", "--variants", "original,patched,prefetch_only"]
    argv += ["--repeats", "2", "--sanitizer-steps", "3", "--work-dir", str(tmp_path / "work"), "--tokenizer-path", str(tokenizer), "--json", str(out)]
    assert gpu_train.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["plan"] == ["original", "patched", "prefetch_only", "original", "patched"]
    runs = report["variants"]
    assert [len(runs[name]["step_avg_ms_runs"]) for name in runs] == [2, 2, 1]
    assert (runs["original"]["step_avg_ms"], runs["patched"]["step_avg_ms"], runs["prefetch_only"]["step_avg_ms"]) == (120.0, 100.0, 100.0)
    assert (report["sanitizer"]["steps"], report["sanitizer"]["races"]) == (3, 1)  # in the sanitizer's run only
    assert "sanitizer in a forked child: off" in report["sanitizer"]["log_tail"]


# Printed by the stand-in under the sanitizer (a dispatch mode on, eager), as CSAN prints a
# race (on stderr, before the last step's line, after which the run is stopped); a child it
# forks must run without the sanitizer (it would initialise CUDA there).
SANITIZER_RACE = """\
from torch.utils._python_dispatch import _get_current_dispatch_mode
if _get_current_dispatch_mode() is not None and os.environ.get("TORCHDYNAMO_DISABLE") == "1":
    reader, writer = os.pipe()
    if os.fork() == 0:
        os.write(writer, b"on" if _get_current_dispatch_mode() is not None else b"off")
        os._exit(0)
    print("CSAN detected a possible data race on tensor with data pointer 1", file=sys.stderr)
    print("  stack trace of the race\\n" * 400, file=sys.stderr)  # CSAN's traces outrun the log tail
    print(f"sanitizer in a forked child: {os.read(reader, 3).decode()}", file=sys.stderr)
"""


def test_the_attention_stand_in_is_attention_in_flash_attentions_layout():
    import torch

    spec = importlib.util.spec_from_file_location("flash_attn_interface", ROOT / "bench" / "shims" / "flash_attn_interface.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    flash_attn_func = shim.flash_attn_func

    torch.manual_seed(0)
    batch, seq_len, heads, kv_heads, dim = 2, 7, 4, 2, 8
    q = torch.randn(batch, seq_len, heads, dim)
    k, v = torch.randn(batch, seq_len, kv_heads, dim), torch.randn(batch, seq_len, kv_heads, dim)
    got = flash_attn_func(q, k, v, causal=True)
    # Reference: each query head reads kv head (head // 2); position t sees positions <= t.
    kk, vv = k.repeat_interleave(heads // kv_heads, dim=2), v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, kk) / dim**0.5
    scores = scores.masked_fill(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vv)
    assert got.shape == (batch, seq_len, heads, dim)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(flash_attn_func(q, k, v, causal=False), want, atol=1e-3)
    with pytest.raises(NotImplementedError):
        flash_attn_func(q, k, v, causal=True, window_size=(128, 0))
