"""Step time on one CUDA GPU, original vs patched, and where the H2D copies run.

    python bench/gpu_train.py ORIGINAL PATCHED [--steps 200] [--train-batch-tokens 131072]
        [--variants original,patched,...] [--profile-steps 30] [--work-dir DIR] [--json FILE]

For a parameter-golf-shaped script: hyperparameters read from the environment
(`DATA_PATH` and `TOKENIZER_PATH`, or `DATA_DIR` holding `datasets/fineweb10B_spV/`
and `tokenizers/fineweb_V_bpe.model` as the 2026-04 records read it; `VOCAB_SIZE`,
`ITERATIONS`, `TRAIN_BATCH_TOKENS`, `WARMUP_STEPS`, `VAL_LOSS_EVERY`,
`MAX_WALLCLOCK_SECONDS`, ...), a SentencePiece tokenizer, and either a
`step:N/N val_loss:... train_time:...ms step_avg:...ms` line after the last step (the
root script) or a `N/N train_loss: ... train_time: ...m tok/s: T` line at the last
step (the 2026-04 records: step_avg is then `TRAIN_BATCH_TOKENS / T`, the same
average over the training time). A run is stopped once its last step's line is out:
what follows (quantization, evaluation) is not what is measured. Where FlashAttention
3's `flash_attn_interface` is not installed, runs get `bench/shims/`'s stand-in
(attention through `scaled_dot_product_attention`, the same on both sides), and the
report says so.
`PATCHED` is the output of `patch-prefetch ORIGINAL -o PATCHED`, made beforehand (this
script needs torch, numpy and sentencepiece, not libcst).

1. Writes synthetic shards in the real format into `--work-dir` (`patcher.proof.shards`;
   enough train tokens for the run, so no shard is read twice) and trains a
   SentencePiece tokenizer of `VOCAB_SIZE` (1024) pieces on synthetic words.
2. Runs each variant as its own process (`python SCRIPT`, world size 1) and reads
   `step_avg` of the last step, the train losses, and the patched script's
   `step_timing` lines where a variant turns them on:
   - `original`: the original script;
   - `patched`: the patched script with its defaults (prefetch, copy stream);
   - `patched_wait`: patched, `TRAINING_TIMING_BREAKDOWN=2` (main-thread data wait,
     no synchronisation);
   - `patched_off_wait`: patched, `TRAIN_PREFETCH=0 TRAIN_COPY_STREAM=0
     TRAINING_TIMING_BREAKDOWN=2`: the original's data path, timed the same way;
   - `patched_breakdown`: patched, `TRAINING_TIMING_BREAKDOWN=1` (every phase
     synchronised: batch CPU ms, H2D ms, forward, backward, optimizer);
   - `toggles_off`: patched, every toggle 0: the original code paths in the patched
     file (what is left is the MLP form and the injected code's presence);
   - `prefetch_only`: patched, `TRAIN_PREFETCH=1` and every other toggle 0;
   - `prefetch_copy_stream`: patched, `TRAIN_PREFETCH=1 TRAIN_COPY_STREAM=1`, the
     validation toggles 0.
   With `--repeats N`, the variants of `--repeat-variants` (default original and
   patched) run N times, alternated (one round is every variant once, the later rounds
   the repeated ones); each variant reports its median step_avg and the spread (max -
   min) over its runs, and the ratio of medians against the original.
3. With `--profile-steps N > 0`, runs the original and the patched script again for N
   steps under `torch.profiler` (CUDA activity) and summarises every host-to-device
   memcpy (`summarise_h2d`): stream, pinned or pageable source, bytes, and how much
   of its time a kernel on another stream overlapped.

4. With `--sanitizer-steps N > 0`, runs the patched script for N steps under PyTorch's
   CUDA stream sanitizer (what `TORCH_CUDA_SANITIZER=1` turns on, here in the training
   process only; eager: `TORCHDYNAMO_DISABLE=1`) and counts the data races it reports:
   a missing `wait_stream` or `record_stream` passes every CPU test and every byte
   comparison, not this.

Prints step_avg of every variant as a ratio against the original's. This is a
benchmark: nothing here is asserted; the test suite checks `summarise_h2d` and the
log parsing on hand-made inputs.
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import io
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {
    "original": ("original", {}),
    "patched": ("patched", {}),
    "patched_wait": ("patched", {"TRAINING_TIMING_BREAKDOWN": "2", "TRAINING_TIMING_EVERY": "20"}),
    "patched_off_wait": (
        "patched",
        {"TRAIN_PREFETCH": "0", "TRAIN_COPY_STREAM": "0", "TRAINING_TIMING_BREAKDOWN": "2", "TRAINING_TIMING_EVERY": "20"},
    ),
    "patched_breakdown": ("patched", {"TRAINING_TIMING_BREAKDOWN": "1", "TRAINING_TIMING_EVERY": "20"}),
    "toggles_off": ("patched", {"TRAIN_PREFETCH": "0", "TRAIN_COPY_STREAM": "0", "VAL_PREFETCH": "0", "VAL_COPY_STREAM": "0"}),
    "prefetch_only": ("patched", {"TRAIN_PREFETCH": "1", "TRAIN_COPY_STREAM": "0", "VAL_PREFETCH": "0", "VAL_COPY_STREAM": "0"}),
    "prefetch_copy_stream": ("patched", {"TRAIN_PREFETCH": "1", "TRAIN_COPY_STREAM": "1", "VAL_PREFETCH": "0", "VAL_COPY_STREAM": "0"}),
}
DEFAULT_VARIANTS = "original,patched"
SHIMS = Path(__file__).resolve().parent / "shims"
# What the CUDA stream sanitizer prints for each race it finds.
_RACE = "CSAN detected a possible data race"

# The script's own log lines, as parameter-golf's train_gpt.py writes them.
_LAST_STEP = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) val_bpb:(\S+) train_time:(\d+)ms step_avg:([\d.]+)ms")
_TRAIN_LOSS = re.compile(r"^step:(\d+)/\d+ train_loss:(\S+) ")
_TIMING = re.compile(r"^step_timing step:(\d+) (.*)$")
# The 2026-04 records' lines: `N/M train_loss: X train_time: Ym tok/s: T`, `N/M val_loss: X val_bpb: Y`.
_FAMILY_TRAIN = re.compile(r"^(\d+)/(\d+) train_loss: (\S+) train_time: \S+ tok/s: ([\d.]+)")
_FAMILY_VAL = re.compile(r"^(\d+)/(\d+) val_loss: \S+ val_bpb: (\S+)")


def is_last_step_line(line: str) -> bool:
    """True for the line a run's measurement ends with: the root script's
    `step:N/N val_loss:... step_avg:` line, or a 2026-04 record's `N/N train_loss:` line."""
    for pattern in (_LAST_STEP, _FAMILY_TRAIN):
        if (found := pattern.match(line)) and found.group(1) == found.group(2):
            return True
    return False


def parse_log(text: str, train_batch_tokens: int | None = None) -> dict:
    """Read one run's stdout.

    Takes: text: str, the script's stdout; train_batch_tokens: tokens a step, to turn a
    2026-04 record's `tok/s` into a step time.
    Returns: dict with "step_avg_ms" (float, of the last `step:N/N val_loss` line, or
    `train_batch_tokens / tok/s` of a record's last `N/N train_loss:` line, in ms; or
    None), "train_time_ms" (int or None), "steps" (int or None), "val_bpb" (float or
    None), "train_loss" ({step: float}), and "timing": one dict per `step_timing step:`
    line, its `name_ms:value` fields as floats (`h2d_ms:-` left out) plus "step".
    """
    out: dict = {"step_avg_ms": None, "train_time_ms": None, "steps": None, "val_bpb": None, "train_loss": {}, "timing": []}
    for line in text.splitlines():
        if m := _FAMILY_TRAIN.match(line):
            out["train_loss"][int(m.group(1))] = float(m.group(3))
            if m.group(1) == m.group(2) and train_batch_tokens:
                avg = train_batch_tokens * 1000.0 / float(m.group(4))
                out.update(steps=int(m.group(1)), step_avg_ms=round(avg, 2), train_time_ms=round(avg * int(m.group(1))))
        elif m := _FAMILY_VAL.match(line):
            out["val_bpb"] = float(m.group(3))
        elif m := _LAST_STEP.match(line):
            if m.group(1) == m.group(2):
                out.update(steps=int(m.group(1)), val_bpb=float(m.group(4)), train_time_ms=int(m.group(5)), step_avg_ms=float(m.group(6)))
        elif m := _TRAIN_LOSS.match(line):
            out["train_loss"][int(m.group(1))] = float(m.group(2))
        elif m := _TIMING.match(line):
            fields = {"step": int(m.group(1))}
            for item in m.group(2).split():
                name, _, value = item.partition(":")
                try:
                    fields[name] = float(value)
                except ValueError:
                    pass
            out["timing"].append(fields)
    return out


def timing_means(timing: list[dict], skip_first: int = 10) -> dict:
    """Mean of every `*_ms` field over the `step_timing` lines after step `skip_first`.

    Takes: timing: `parse_log(...)["timing"]`; skip_first: steps left out (compile and
    allocator warm-up). Returns: {field: mean ms} (empty when no line qualifies); for
    data-wait lines also "data_wait_mean_ms" = last `data_wait_total_ms` / its step.
    """
    rows = [row for row in timing if row["step"] > skip_first]
    if not rows:
        return {}
    names = sorted({k for row in rows for k in row if k.endswith("_ms") and k != "data_wait_total_ms"})
    means = {name: sum(row.get(name, 0.0) for row in rows) / len(rows) for name in names}
    last = timing[-1]
    if "data_wait_total_ms" in last and last["step"] > 0:
        means["data_wait_mean_ms"] = last["data_wait_total_ms"] / last["step"]
    return means


def summarise_h2d(trace: dict) -> dict:
    """Summarise the host-to-device memcpys of a `torch.profiler` Chrome trace.

    Takes: trace: the parsed JSON of `prof.export_chrome_trace(...)`: "traceEvents", of
    which kernels have cat "kernel" and copies cat "gpu_memcpy", each with "ts" and
    "dur" (µs) and args "stream" (and "bytes" for copies).
    Returns: dict with "compute_stream" (the stream with the most kernel time, or None)
    and "groups": one dict per (stream, copy name, bytes) with "stream", "name",
    "bytes" (per copy), "count", "total_us", "overlapped_us" (time during which a
    kernel ran on another stream) and "overlap_frac" (overlapped_us / total_us),
    most frequent first; "window": `_window` of the most frequent group (the training
    batches), or None.
    """
    kernels: dict[int, list[tuple[float, float]]] = {}
    copies: dict[tuple, list[tuple[float, float]]] = {}
    runtime: list[tuple[str, float, float]] = []
    for event in trace.get("traceEvents", []):
        cat, args = event.get("cat"), event.get("args") or {}
        if event.get("ph") == "X" and cat == "cuda_runtime":
            runtime.append((event.get("name", ""), float(event["ts"]), float(event.get("dur", 0.0))))
            continue
        if event.get("ph") != "X" or "stream" not in args:
            continue
        span = (float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)))
        if cat == "kernel":
            kernels.setdefault(int(args["stream"]), []).append(span)
        elif cat == "gpu_memcpy" and "HtoD" in event.get("name", ""):
            copies.setdefault((int(args["stream"]), event["name"], int(args.get("bytes", -1))), []).append(span)
    busy = {stream: sum(end - start for start, end in spans) for stream, spans in kernels.items()}
    compute_stream = max(busy, key=busy.get) if busy else None
    groups = []
    # Kernel time on the streams other than a copy's, merged once per copy stream.
    others_of = {stream: _union([span for s, spans_s in kernels.items() if s != stream for span in spans_s]) for stream, _, _ in copies}
    for (stream, name, nbytes), spans in copies.items():
        others = others_of[stream]
        total = sum(end - start for start, end in spans)
        overlapped = sum(_covered(others, span) for span in spans)
        groups.append(
            {
                "stream": stream,
                "name": name,
                "bytes": nbytes,
                "count": len(spans),
                "total_us": round(total, 3),
                "overlapped_us": round(overlapped, 3),
                "overlap_frac": round(overlapped / total, 4) if total > 0 else 0.0,
            }
        )
    groups.sort(key=lambda g: (-g["count"], -g["bytes"]))
    summary = {"compute_stream": compute_stream, "groups": groups, "window": None}
    if groups and compute_stream is not None:
        summary["window"] = _window(groups[0], copies, kernels[compute_stream], runtime)
    return summary


def _window(group: dict, copies: dict, compute_spans: list, runtime: list) -> dict:
    """Compute-stream activity over the second half of the most frequent group's copies.

    Returns: "start_us"/"end_us", "compute_busy_frac" (kernel time on the compute stream
    / window), "idle_before_copy_us" (median gap between the compute stream's last kernel
    end and each copy's start; 0 when a kernel ran at the copy's start) and "runtime":
    the host's CUDA runtime calls in the window, most total time first (name, count,
    total_us).
    """
    spans = sorted(copies[(group["stream"], group["name"], group["bytes"])])
    # The second half: the first copies come before compilation and warm-up.
    spans = spans[len(spans) // 2 :]
    start, end = spans[0][0], spans[-1][1]
    busy = _union(compute_spans)
    busy_us = _covered(busy, (start, end))
    gaps = []
    for copy_start, _ in spans:
        i = bisect.bisect_right(busy, (copy_start, float("inf"))) - 1
        if i >= 0:  # no kernel before the copy: no gap to speak of
            gaps.append(max(0.0, copy_start - busy[i][1]))
    calls: dict[str, list[float]] = {}
    for name, ts, dur in runtime:
        if start <= ts <= end:
            calls.setdefault(name, []).append(dur)
    top = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {
        "start_us": start,
        "end_us": end,
        "compute_busy_frac": round(busy_us / (end - start), 4) if end > start else 0.0,
        "idle_before_copy_us": round(sorted(gaps)[len(gaps) // 2], 3) if gaps else None,
        "runtime": [{"name": name, "count": len(d), "total_us": round(sum(d), 1)} for name, d in top],
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _covered(union: list[tuple[float, float]], span: tuple[float, float]) -> float:
    """Length of `span` covered by the disjoint sorted intervals `union`."""
    start, end = span
    i = max(bisect.bisect_right(union, (start, float("inf"))) - 1, 0)
    covered = 0.0
    while i < len(union) and union[i][0] < end:
        covered += max(0.0, min(end, union[i][1]) - max(start, union[i][0]))
        i += 1
    return covered


def write_data(work_dir: Path, train_tokens: int, vocab_size: int = 1024, tokenizer_path: str | None = None) -> dict:
    """Synthetic shards and tokenizer for a run (kept across calls when present), laid out
    as both kinds of script read them.

    Takes: work_dir: folder; train_tokens: tokens the run reads (warm-up included),
    written as two train shards so a shard boundary is crossed; vocab_size: pieces of
    the tokenizer and bound of the token ids; tokenizer_path: a SentencePiece model to
    use instead of training one.
    Returns: {"data_dir": DATA_DIR, "data_path": DATA_DIR/datasets/fineweb10B_sp{V},
    "tokenizer_path": DATA_DIR/tokenizers/fineweb_{V}_bpe.model} (str paths).
    """
    from patcher.proof.shards import write_shards

    data_dir = work_dir / f"data_{train_tokens}_{vocab_size}"
    data = data_dir / "datasets" / f"fineweb10B_sp{vocab_size}"
    if not (data / "fineweb_val_000000.bin").exists():
        per_shard = train_tokens // 2 + 1
        write_shards(data, train_shards=2, val_shards=0, tokens_per_shard=per_shard, vocab_size=vocab_size, seed=0)
        # A small val split keeps the final evaluation short.
        write_shards(data, train_shards=0, val_shards=1, tokens_per_shard=1 << 20, vocab_size=vocab_size, seed=1)
    tokenizer = data_dir / "tokenizers" / f"fineweb_{vocab_size}_bpe.model"
    if not tokenizer.exists():
        tokenizer.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.write_bytes(Path(tokenizer_path).read_bytes() if tokenizer_path else _train_tokenizer(vocab_size))
    return {"data_dir": str(data_dir), "data_path": str(data), "tokenizer_path": str(tokenizer)}


def _train_tokenizer(vocab_size: int) -> bytes:
    """A SentencePiece BPE model of exactly `vocab_size` pieces, trained on random words."""
    import sentencepiece as spm

    rng = random.Random(0)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(3000)]
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(20000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type="bpe", byte_fallback=True, minloglevel=2
    )
    return model.getvalue()


def run_variant(script: Path, env: dict, cwd: Path, profile_trace: Path | None = None, timeout_s: float = 900, train_batch_tokens: int | None = None, sanitizer: bool = False) -> dict:
    """Run one training process until its last step's line (`is_last_step_line`), then
    stop it and its children: what a script does after training is not measured.

    Returns parse_log's dict plus "rc" (0 when stopped after its last step line), "wall_s",
    "log_tail" (the end of stdout and stderr) and "stderr" (all of it).
    """
    command = [sys.executable, str(script)]
    if profile_trace is not None:
        command = [sys.executable, __file__, "--profile-child", str(script), str(profile_trace)]
    if sanitizer:
        command = [sys.executable, __file__, "--sanitizer-child", str(script)]
    cwd.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    lines, finished = [], False
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(command, env={**os.environ, **env}, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        watchdog = threading.Timer(timeout_s, _kill_group, (proc,))
        watchdog.start()
        try:
            for line in proc.stdout:
                lines.append(line)
                if is_last_step_line(line) and profile_trace is None:
                    finished = True
                    break
        finally:
            watchdog.cancel()
            if finished or proc.poll() is None:
                _kill_group(proc)
            proc.wait()
            proc.stdout.close()
        stderr.seek(0)
        errors = stderr.read()
    stdout = "".join(lines)
    report = parse_log(stdout, train_batch_tokens)
    report.update(rc=0 if finished else proc.returncode, wall_s=round(time.perf_counter() - start, 1), log_tail=(stdout + errors)[-3000:], stderr=errors)
    return report


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` (the script and any child it forked)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def summarise_runs(runs: list[dict]) -> dict:
    """One variant's runs: {"runs", "step_avg_ms" (median), "spread_ms" (max - min),
    "step_avg_ms_runs", "rc" (the first non-zero, else 0), "steps", "val_bpb",
    "train_loss" (of the first run), "timing_means" (of the first run)}; step_avg_ms is
    None when no run gave one."""
    avgs = [run["step_avg_ms"] for run in runs if run.get("step_avg_ms") is not None]
    first = runs[0]
    return {
        "step_avg_ms": statistics.median(avgs) if avgs else None,
        "spread_ms": round(max(avgs) - min(avgs), 2) if avgs else None,
        "step_avg_ms_runs": avgs,
        "rc": next((run["rc"] for run in runs if run["rc"] != 0), 0),
        "steps": first.get("steps"),
        "val_bpb": first.get("val_bpb"),
        "train_loss": first.get("train_loss", {}),
        "timing_means": first.get("timing_means", {}),
        "runs": runs,
    }


def run_plan(variants: list[str], repeat: list[str], repeats: int) -> list[str]:
    """The order of the runs: every variant once, then `repeats - 1` more rounds of the
    variants in `repeat` (those of them in `variants`), so that those alternate."""
    again = [v for v in variants if v in repeat]
    return list(variants) + again * max(repeats - 1, 0)


def log_every(steps: int) -> int:
    """TRAIN_LOG_EVERY for a run of `steps`: the largest divisor of `steps` up to 20, so
    that the last step logs its line (a 2026-04 record logs a step only at multiples)."""
    return max(d for d in range(1, 21) if steps % d == 0)


def needs_attention_shim() -> bool:
    """True when FlashAttention 3's `flash_attn_interface` cannot be imported here."""
    return importlib.util.find_spec("flash_attn_interface") is None


def _sanitizer_child(script: str) -> int:
    """Run `script` as __main__ under PyTorch's CUDA stream sanitizer, in this process only.

    Not `TORCH_CUDA_SANITIZER=1`: that would leave the sanitizer on in a forked producer
    child too, where its per-op `torch.cuda.current_stream()` initialises CUDA, which a
    forked child cannot do; the producer child runs no CUDA, so it has nothing to check.
    """
    import runpy

    from torch.cuda import _sanitizer

    _sanitizer.enable_cuda_sanitizer()
    os.register_at_fork(after_in_child=_sanitizer.cuda_sanitizer.disable)
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")
    return 0


def _profile_child(script: str, trace_path: str) -> int:
    """Run `script` as __main__ under torch.profiler (CUDA activity), write the trace."""
    import runpy

    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.argv = [script]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runpy.run_path(script, run_name="__main__")
    torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--profile-child"]:
        return _profile_child(argv[1], argv[2])
    if argv[:1] == ["--sanitizer-child"]:
        return _sanitizer_child(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original")
    parser.add_argument("patched")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--train-batch-tokens", type=int, default=131072, help="TRAIN_BATCH_TOKENS (default 131072: a small config)")
    parser.add_argument("--vocab-size", type=int, default=1024, help="VOCAB_SIZE, of the tokenizer and the shards (default 1024, the root script's; 8192 for the SP8192 records)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)} (default {DEFAULT_VARIANTS})")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each --repeat-variants variant, alternated (default 1)")
    parser.add_argument("--repeat-variants", default=DEFAULT_VARIANTS, help=f"the variants --repeats applies to (default {DEFAULT_VARIANTS}); the others run once")
    parser.add_argument("--sanitizer-steps", type=int, default=0, help="run the patched script this many steps under PyTorch's CUDA stream sanitizer, in the training process only (0: not)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile original and patched for this many steps (0: no profile)")
    parser.add_argument("--work-dir", default=None, help="shards, tokenizer and run folders (default: a temporary folder)")
    parser.add_argument("--tokenizer-path", default=None, help="SentencePiece model to use (default: train one of --vocab-size pieces; needs sentencepiece)")
    parser.add_argument("--keep-trace", default=None, help="folder to write the gzipped profiler traces into")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    repeat = [v for v in args.repeat_variants.split(",") if v]
    unknown = [v for v in variants + repeat if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    scripts = {"original": Path(args.original).resolve(), "patched": Path(args.patched).resolve()}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-train-")).resolve()
    tokens = (args.steps + 2 * args.warmup_steps + 2) * args.train_batch_tokens  # a record's loop warm-up doubles it
    paths = write_data(work, tokens, vocab_size=args.vocab_size, tokenizer_path=args.tokenizer_path)
    base_env = {
        "DATA_PATH": paths["data_path"],
        "DATA_DIR": paths["data_dir"],
        "TOKENIZER_PATH": paths["tokenizer_path"],
        "VOCAB_SIZE": str(args.vocab_size),
        "ITERATIONS": str(args.steps),
        "WARMUP_STEPS": str(args.warmup_steps),
        "TRAIN_BATCH_TOKENS": str(args.train_batch_tokens),
        "VAL_LOSS_EVERY": "0",
        "TRAIN_LOG_EVERY": str(log_every(args.steps)),
        "MAX_WALLCLOCK_SECONDS": "0",
        "PYTHONUNBUFFERED": "1",
    }
    shim = needs_attention_shim()
    if shim:
        base_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIMS), os.environ.get("PYTHONPATH", "")) if p)
        print("flash_attn_interface is not installed: runs use bench/shims' stand-in (scaled_dot_product_attention)", flush=True)
    report: dict = {"steps": args.steps, "train_batch_tokens": args.train_batch_tokens, "attention_shim": shim, "plan": run_plan(variants, repeat, args.repeats), "variants": {}, "profiles": {}}
    runs: dict[str, list[dict]] = {}
    for index, name in enumerate(report["plan"]):
        which, extra = VARIANTS[name]
        run = run_variant(scripts[which], {**base_env, **extra, "RUN_ID": f"{name}_{index}"}, work / f"run_{name}_{index}", train_batch_tokens=args.train_batch_tokens)
        run["timing_means"] = timing_means(run.pop("timing"))
        run.pop("stderr")  # its end is in log_tail
        runs.setdefault(name, []).append(run)
        print(f"{name:20} rc={run['rc']} step_avg={run['step_avg_ms']} ms wall={run['wall_s']} s timing={run['timing_means']}", flush=True)
        if run["rc"] != 0 or run["step_avg_ms"] is None:
            print(run["log_tail"], flush=True)
    report["variants"] = {name: summarise_runs(variant_runs) for name, variant_runs in runs.items()}
    if args.sanitizer_steps > 0:
        env = {**base_env, "ITERATIONS": str(args.sanitizer_steps), "WARMUP_STEPS": "2", "TORCHDYNAMO_DISABLE": "1", "RUN_ID": "sanitizer"}
        env["TRAIN_LOG_EVERY"] = str(log_every(args.sanitizer_steps))
        run = run_variant(scripts["patched"], env, work / "run_sanitizer", train_batch_tokens=args.train_batch_tokens, sanitizer=True)
        races = run.pop("stderr").count(_RACE)  # all of it: each race comes with stack traces longer than log_tail
        report["sanitizer"] = {"rc": run["rc"], "steps": run["steps"], "races": races, "log_tail": run["log_tail"]}
        print(f"sanitizer: rc={run['rc']} steps={run['steps']} data races reported: {races}", flush=True)
        if run["rc"] != 0 or races:
            print(run["log_tail"], flush=True)
    if args.profile_steps > 0:
        for which in ("original", "patched"):
            trace = work / f"trace_{which}.json"
            env = {**base_env, "ITERATIONS": str(args.profile_steps), "WARMUP_STEPS": "2", "RUN_ID": f"profile_{which}"}
            run = run_variant(scripts[which], env, work / f"run_profile_{which}", profile_trace=trace, train_batch_tokens=args.train_batch_tokens)
            run.pop("stderr")
            if run["rc"] != 0:
                print(run["log_tail"], flush=True)
                continue
            summary = summarise_h2d(json.loads(trace.read_text()))
            report["profiles"][which] = summary
            report["profiles"][which]["step_avg_ms"] = run["step_avg_ms"]
            print(f"profile {which}: step_avg {run['step_avg_ms']} ms under the profiler, compute stream {summary['compute_stream']}", flush=True)
            for group in summary["groups"][:6]:
                print(f"  {group}", flush=True)
            print(f"  window: {summary['window']}", flush=True)
            if args.keep_trace:
                import gzip

                Path(args.keep_trace, f"trace_{which}.json.gz").write_bytes(gzip.compress(trace.read_bytes()))
    _print_ratios(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))
    return 0


def _print_ratios(report: dict) -> None:
    base = report["variants"].get("original", {}).get("step_avg_ms")
    for name, run in report["variants"].items():
        avg = run.get("step_avg_ms")
        ratio = f"{avg / base:.3f}x" if avg and base else "-"
        spread = f" spread {run['spread_ms']} ms over {len(run['step_avg_ms_runs'])} runs" if len(run.get("step_avg_ms_runs", [])) > 1 else ""
        print(f"{name:20} step_avg {avg} ms (median){spread}  vs original {ratio}  val_bpb {run.get('val_bpb')}")
    if report.get("attention_shim"):
        print("(attention through bench/shims' stand-in, not FlashAttention 3: step times are not the record's own)")


if __name__ == "__main__":
    sys.exit(main())
