"""One command, one GPU, at most 9 minutes: does the patch do on a GPU what it claims?

    python bench/gpu_proof.py --inputs .gpu_inputs --out $OUT [--deadline 540]
    python bench/gpu_proof.py --dry-run            # CI: every stage on the CPU, tiny sizes

`bench/gpu_prepare.py` makes `--inputs` beforehand, on a machine with network: the real
scripts a developer has at hand with their patched outputs, the wheels the GPU machine
lacks, and a manifest with the hash of the patcher that made the outputs. The GPU
machine needs nothing else: no network, no libcst of its own.

Stages, each a child process time-boxed to its budget (or what is left before
`--deadline`), in order of expected information per second; each box and where its
seconds come from is in `BUDGET_BASIS` (and in results.json). Each stage is recorded in
`results.json` (exit code, seconds, figures, the end of its stderr), rewritten after
every stage, and the end-to-end and ab stages after every run. A stage that cannot get
its minimum time is skipped and recorded as skipped; a failed stage never stops the others.

0. probe: GPU, driver, torch, triton and Python versions, /dev/shm; installs the wheels
   brought along into `/tmp/gpu-proof-site` for the later stages.
1. nanochat end to end (`bench/gpu_e2e.py`): `scripts/base_train.py` at depth 4 on
   synthetic parquet shards with the byte tokenizer stand-in, `nanochat/dataloader.py`
   original against patched, alternated runs; step time from base_train's own `dt`
   (it synchronises each step), with its resolution. Where the patched side is slower,
   one profiled run a side (copies, the compute stream's gap before each, runtime calls).
2. sanitizer: one process under PyTorch's CUDA stream sanitizer (a planted race must be
   reported, then the injected pieces must report none, each between markers so a
   hang is named), then the CUDA-only tests in the time left (skipped on a CPU).
3. registered slot (`bench/gpu_registered.py`): the process producer's hand-out on
   CUDA with `pinned_slots` (an option no patch passes yet), H2D straight from slot
   memory registered as pinned: batches exact behind a
   queued load, the slot lent until its copies' event completed, a failed registration
   kept off the training thread; host ms per hand-out (registered, the default
   pinned copy, the original's pageable `.to()`), and per H2D on the copy stream against
   the compute stream at 64 KB, 1 MB and 8 MB.
4. ab: `patch-prefetch ab` on parameter-golf's root `train_gpt.py` at 524,288 tokens a
   step, one compile cache; its resolution (ab's interval) beside the figure, or why
   there is none. A patched run whose producer fell back fails its stage.
5. modded-nanogpt end to end (`bench/gpu_e2e.py`): HEAD `train_gpt.py` with
   WORLD_SIZE=1 (8 micro-steps), stopped within its first training stage, FlashAttention 3
   and tiktoken's file stood in (`bench/shims/offline`), original against patched;
   step time from the change in the script's own `train_time` (no sync added); the
   warm-up compile time it saw.
6. ab on a ShuffledSequenceLoader (SDClip) record at 524,288 tokens.
7. generator: modded-nanogpt's `distributed_data_generator`, original against patched,
   `.send()` once a micro-step behind a GPU load (`bench/gpu_loaders.py generator`).
8. module: nanochat's data-loader module, original against patched, `next()` behind a
   GPU load, with `torch.device("cuda", 0)` and with "cuda" (`bench/gpu_loaders.py module`).
9. premise: host milliseconds blocked by `.to("cuda", non_blocking=True)` from pageable
   and pinned memory, compute stream idle and busy, at 64 KB, 1 MB and 8 MB, and through
   the injected pieces; a profiler pass names each H2D memcpy's kind, stream and overlap.

`--dry-run` runs every stage on the CPU at tiny sizes, on the bundled fixtures (prepared
by `gpu_prepare.py --fixtures` into a temporary folder), and also checks what the GPU run
depends on: the wheel set installs into a fresh target for the GPU machine's Python, the
inputs exist, the output folder holds at most `MAX_OUT_FILES` files of at most 16 MiB,
and `DEVICE_COMMAND` fits the 2,000 characters a device command may have.
Exit 0 when every stage that ran passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
SITE = Path("/tmp/gpu-proof-site")
# The command a developer sends to the GPU machine (its repository root is the cwd).
DEVICE_COMMAND = "PYTHONUNBUFFERED=1 python3 bench/gpu_proof.py --inputs .gpu_inputs --out $OUT --deadline 540"
DEVICE_COMMAND_LIMIT = 2000
MAX_OUT_FILES, MAX_OUT_BYTES = 8, 16 * 1024 * 1024
# Every toggle a default patch can add, off: the original code paths in the patched file.
TOGGLES_OFF = {
    "TRAIN_PREFETCH": "0",
    "TRAIN_COPY_STREAM": "0",
    "TRAIN_PINNED_STAGING": "0",
    "VAL_PREFETCH": "0",
    "VAL_COPY_STREAM": "0",
}
# The GPU-only tests (each skips on a CPU).
CUDA_TESTS = [
    "tests/test_prefetch_iterator.py::test_cuda_items_identical_on_the_copy_stream",
    "tests/test_step_timing.py::test_breakdown_times_a_real_h2d_copy",
    "tests/test_templates.py::test_h2d_cuda_values_after_sync",
    "tests/test_templates.py::test_prefetch_to_cuda_exact",
    "tests/test_val_templates.py::test_cuda_batches_match_after_the_copy",
]
STAGE_FILE = "stage.json"
# How many seconds a stage's child has: it sizes its work to fit (fewer runs, steps, reps).
BUDGET_VARIABLE = "GPU_PROOF_BUDGET_S"


def stage_budget() -> float:
    """The running stage's time box in seconds (infinite outside the runner)."""
    return float(os.environ.get(BUDGET_VARIABLE, "inf"))


@dataclass(frozen=True)
class Stage:
    """One stage: `key` names it in results.json; `budget_s` is its time box on a GPU
    (seconds), `min_s` the least time worth starting it with; `dry_budget_s` its box in
    a dry run."""

    key: str
    title: str
    budget_s: float
    min_s: float
    dry_budget_s: float = 120.0


# Each stage's box on the GPU, from what the first GPU run (NVIDIA H200, 2026-11-27,
# bench/results/gpu_proof_h200_2026-11-27.json, "H200 run" below) and the hand-run `ab`
# of that day (docs/measurements.md) recorded; "estimate" where nothing was measured.
# The stages run in order of expected information per second: a stage whose minimum no
# longer fits before --deadline is skipped and recorded as such.
BUDGET_BASIS = {
    "0_probe": "8.0 s in the H200 run (torch import, nvidia-smi, 4 wheels installed)",
    "1_nanochat_e2e": "a run = start-up ~8 s (the probe's torch import and CUDA init) + the model's compile (~30 s for the first run, estimate: "
                      "under the root script's >= 32 s a run, as stage 5a's 4 runs of 25 steps at 163 ms did not finish in 145 s; ~10 s with the shared cache, estimate) "
                      "+ the patched producer's start 4.3-4.8 s (stage 4, H200 run) + 40 steps of 2 micro-steps: the original builds a B=32 T=2048 batch "
                      "on the host after the queue drains (24 ms a next() with device 'cuda', stage 4) behind ~15 ms of d4 micro-step (estimate): ~80 ms a step, "
                      "patched ~50 ms (bounded by the producer's ~24 ms a batch): 3 s; 4 runs (2 a side, a between-run interval) ~ 46 + 3 x 26 = 124 s",
    "2_sanitizer": "one sanitizer process (torch import and CUDA init ~8 s, the pieces and the planted race ~3 s) + the 5 CUDA-only tests in pytest (~15 s, estimate); "
                   "the H200 run's 40 s box held two sanitizer processes and the tests and timed out; now the process gets at most 25 s, the tests the rest",
    "3_registered_slot": "estimate (never run on a GPU): torch import and CUDA init ~8 s (the probe's), 4 forked producers' starts ~1 s, "
                         "200 batches behind a 5 ms load ~1.2 s, 3 x 42 timed hand-outs and 6 x 42 timed copies behind a 5 ms load ~2.5 s: ~13 s; boxed at 30 s",
    "4_ab_root": "one run a side at 524,288 tokens: 652 ms a step (163 ms at 131,072 tokens, ab by hand on the H200, x4) x 25 steps (5 warm-up + 20) = 16 s, "
                 "+ >= 32 s compile and start-up (first run; ~12 s with the shared cache, estimate) + shards and tokenizer ~5 s: ~81 s",
    "5_modded_e2e": "what is left (the script's own message: ~7 minutes of warm-up compile on the first execution, on 8 H100s; no H200 figure): "
                    "the stage records the warm-up compile time it saw, and step times if a run gets through it",
    "6_ab_sdclip": "as 4_ab_root at 524,288 tokens (the record's step is of the same order; no H200 figure)",
    "7_generator": "19.9 s in the H200 run (120 sends)",
    "8_module": "22.2 s in the H200 run (25 batches a case)",
    "9_premise": "12.8 s in the H200 run (reps 10)",
}
STAGES = [
    Stage("0_probe", "probe and install", 15, 8, 60),
    Stage("1_nanochat_e2e", "nanochat scripts/base_train.py end to end: step dt, original vs patched dataloader", 140, 70, 60),
    Stage("2_sanitizer", "CUDA stream sanitizer and the CUDA-only tests", 40, 25, 60),
    Stage("3_registered_slot", "registered-slot H2D (cudaHostRegister, no host copy)", 30, 15, 60),
    Stage("4_ab_root", "ab: root train_gpt.py at 524,288 tokens, original vs patched", 100, 80, 60),
    Stage("5_modded_e2e", "modded-nanogpt train_gpt.py end to end, WORLD_SIZE=1: step time, original vs patched", 230, 150, 60),
    Stage("6_ab_sdclip", "ab: SDClip record at 524,288 tokens, original vs patched", 100, 80, 60),
    Stage("7_generator", "modded-nanogpt generator: host ms per send", 22, 15, 60),
    Stage("8_module", "nanochat loader module: host ms per next()", 25, 20, 60),
    Stage("9_premise", "host ms blocked by H2D copies, and where they run", 15, 10, 60),
]


# --------------------------------------------------------------------------- runner


def run_stages(inputs: Path, out: Path, deadline_s: float, dry_run: bool, only: list[str] | None = None, budgets: dict[str, float] | None = None) -> dict:
    """Run every stage in its own child process, in order, within `deadline_s` seconds
    of wall time from now; write `out/results.json` after each.

    Returns: the results dict: "started" (ISO time), "dry_run", "deadline_s", "inputs"
    (the manifest), "stages": {key: {"title", "status" ("ok", "failed", "skipped",
    "timed out"), "rc", "seconds", "figures" (the stage's own JSON), "stderr_tail"}}.
    `only`: stage keys or their leading numbers ("2", "5a"); `budgets`: seconds by the
    same names, replacing a stage's `budget_s` (a stage sizes its work to its budget).
    """
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    manifest_path = inputs / "manifest.json"
    results = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": dry_run,
        "deadline_s": deadline_s,
        "command": " ".join(sys.argv),
        "inputs": json.loads(manifest_path.read_text()) if manifest_path.exists() else None,
        "budgets": {stage.key: {"budget_s": stage.budget_s, "min_s": stage.min_s, "basis": BUDGET_BASIS.get(stage.key)} for stage in STAGES},
        "stages": {},
    }
    for stage in STAGES:
        if only and not _named(stage, only):
            continue
        left = deadline_s - (time.monotonic() - start)
        budget = stage.dry_budget_s if dry_run else next((v for k, v in (budgets or {}).items() if _named(stage, [k])), stage.budget_s)
        if left <= 0 or (not dry_run and left < min(stage.min_s, budget)):
            results["stages"][stage.key] = {"title": stage.title, "status": "skipped", "why": f"{left:.0f} s left before the deadline, the stage needs {stage.min_s:.0f} s"}
        else:
            results["stages"][stage.key] = _run_stage(stage, inputs, min(budget, left), dry_run)
        row = results["stages"][stage.key]
        print(f"[{time.monotonic() - start:6.1f} s] {stage.key}: {row['status']} {_headline(row)}", flush=True)
        results["elapsed_s"] = round(time.monotonic() - start, 1)
        _write_json(out / "results.json", results)
    return results


def _named(stage: Stage, names: list[str]) -> bool:
    """True when `names` holds the stage's key or its leading number ("5a")."""
    return stage.key in names or stage.key.split("_")[0] in names


def _run_stage(stage: Stage, inputs: Path, timeout_s: float, dry_run: bool) -> dict:
    """One stage in a child process (`--stage KEY`), killed with its process group past
    `timeout_s`. Returns its row for results.json."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-proof-{stage.key}-") as work:
        command = [sys.executable, str(Path(__file__).resolve()), "--stage", stage.key, "--inputs", str(inputs), "--work", work]
        if dry_run:
            command.append("--dry-run")
        began = time.monotonic()
        with open(Path(work) / "stderr.txt", "w+") as stderr:
            env = {**_stage_env(), BUDGET_VARIABLE: str(round(timeout_s, 1))}
            child = subprocess.Popen(command, stdout=stderr, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
            try:
                rc = child.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                _kill_group(child)
                rc, timed_out = child.wait(), True
            finally:
                _kill_group(child)  # anything the stage left behind in its group
            stderr.seek(0)
            text = stderr.read()
        figures_path = Path(work) / STAGE_FILE
        figures = json.loads(figures_path.read_text()) if figures_path.exists() else None
    status = "timed out" if timed_out else ("ok" if rc == 0 else "skipped" if rc == SKIPPED_RC else "failed")
    row = {
        "title": stage.title,
        "status": status,
        "rc": rc,
        "seconds": round(time.monotonic() - began, 1),
        "timeout_s": round(timeout_s, 1),
        "figures": figures,
        "stderr_tail": text[-3000:],
    }
    if status == "skipped":
        row["why"] = (figures or {}).get("skipped", "")
    return row


def _stage_env() -> dict:
    """The children's environment: the installed wheels and the repository importable."""
    paths = [str(ROOT)] + ([str(SITE)] if SITE.exists() else []) + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _headline(row: dict) -> str:
    """A stage's one-line summary: its own "headline" figure, or why it did not run."""
    if row["status"] == "skipped":
        return row["why"]
    figures = row.get("figures") or {}
    headline = figures.get("headline") or ""
    if row["status"] != "ok" and not headline:
        headline = (row.get("stderr_tail") or "").strip().splitlines()[-1:] or [""]
        headline = headline[0][:300]
    return f"({row['seconds']} s) {headline[:600]}"


def _write_json(path: Path, data: dict) -> None:
    """Written whole or not at all: a stage killed mid-write leaves the last version."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- stages
# Each runs in its own process and writes `work/stage.json`; "headline" is its summary.


class StageFailed(Exception):
    """The stage ran and its result is a failure (a goal it checks is not met)."""


class StageSkipped(Exception):
    """The stage has nothing to run here (one line why); recorded as skipped."""


SKIPPED_RC = 3
_STARTED = time.monotonic()  # this stage process's start: what is left of its box is counted from here


def stage_left() -> float:
    """Seconds left of the running stage's box."""
    return stage_budget() - (time.monotonic() - _STARTED)


def stage_probe(inputs: Path, work: Path, dry_run: bool) -> dict:
    """GPU, driver, versions, /dev/shm; installs the wheels brought along (or, in a dry
    run, checks that they install into a fresh target for the GPU machine's Python)."""
    import torch

    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "dev_shm_bytes": shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else None,
    }
    try:
        import triton

        figures["triton"] = triton.__version__
    except ImportError:
        figures["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu", "--format=csv,noheader"], capture_output=True, text=True)
        figures["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    wheels = sorted((inputs / "wheels").glob("*.whl"))
    figures["wheels"] = [w.name for w in wheels]
    if not wheels:
        raise StageFailed(f"no wheels in {inputs / 'wheels'}: run bench/gpu_prepare.py")
    if dry_run:
        target = work / "site"
        # The GPU machine's interpreter: CPython 3.12 on x86-64 (see gpu_prepare.WHEEL_PLATFORMS).
        from gpu_prepare import WHEEL_PLATFORMS, WHEEL_PYTHON

        platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--only-binary=:all:", "--target", str(target), "--python-version", WHEEL_PYTHON, "--implementation", "cp", *platforms, *map(str, wheels)]
    else:
        target = SITE
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(target), *map(str, wheels)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise StageFailed(f"the wheels do not install into {target}: {done.stderr.strip()[-500:]}")
    figures["installed_into"] = str(target)
    figures["installed"] = sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info"))
    modules = {name.split(".")[0] for name in figures["installed"]}  # a package, or a module's file
    missing = [name for name in ("libcst", "pyflakes", "python_minifier", "brotli") if name not in modules]
    if missing:
        raise StageFailed(f"the wheel set lacks {', '.join(missing)}")
    gpu = figures.get("gpu") or "no GPU"
    figures["headline"] = f"{gpu}, torch {figures['torch']} (CUDA {figures['cuda_runtime']}), triton {figures['triton']}, Python {figures['python']}, /dev/shm {(figures['dev_shm_bytes'] or 0) / 2**30:.1f} GiB; {len(wheels)} wheels installed"
    return figures


def stage_premise(inputs: Path, work: Path, dry_run: bool) -> dict:
    """Host ms blocked per H2D copy call: pageable vs pinned, compute stream idle vs busy,
    at 64 KB, 1 MB and 8 MB; then through `_h2d` (copy stream) and `_pinned_h2d` (a pinned
    copy, then `_h2d`). Then a profiler pass over the same calls. On a CPU (dry run) the same loops
    run against host memory and the figures mean nothing: they only exercise the code."""
    import torch

    from patcher.templates.copy_stream import _h2d
    from patcher.templates.pinned_staging import _pinned_h2d

    cuda = torch.cuda.is_available() and not dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sizes = {"64KB": 64 << 10, "1MB": 1 << 20, "8MB": 8 << 20} if not dry_run else {"64KB": 64 << 10}
    reps = (20 if stage_budget() >= 40 else 10) if cuda else 3
    load = _GpuLoad(device, target_ms=20.0 if cuda else 0.0)
    calls = {
        "to_pageable": lambda host, pinned: host.to(device, non_blocking=True),
        "to_pinned": lambda host, pinned: pinned.to(device, non_blocking=True),
        "h2d_copy_stream_pinned": lambda host, pinned: _h2d(pinned, device),
        "pinned_h2d_from_pageable": lambda host, pinned: _pinned_h2d(host, device),
    }
    table = {}
    for size_name, nbytes in sizes.items():
        host = torch.randint(0, 2**15, (nbytes // 2,), dtype=torch.int16)
        pinned = host.pin_memory() if cuda else host.clone()
        for call_name, call in calls.items():
            for busy in (False, True):
                samples = []
                for _ in range(reps):
                    _sync(device)
                    if busy:
                        load.queue()
                    began = time.perf_counter()
                    out = call(host, pinned)
                    samples.append((time.perf_counter() - began) * 1e3)
                    _sync(device)
                    if not torch.equal(out.cpu(), host):
                        raise StageFailed(f"{call_name} at {size_name}: the copy differs from its source")
                table[f"{size_name}/{call_name}/{'busy' if busy else 'idle'}"] = _quantiles(samples)
    figures = {"device": str(device), "load_ms": load.measured_ms, "reps": reps, "host_ms": table}
    figures["profile"] = _profile_copies(device, load, calls, sizes) if cuda else None
    key = "1MB" if "1MB" in sizes else next(iter(sizes))
    pageable, staged = table[f"{key}/to_pageable/busy"]["median"], table[f"{key}/pinned_h2d_from_pageable/busy"]["median"]
    figures["headline"] = f"{key} busy: host blocked {pageable:.3f} ms by a pageable .to(), {table[f'{key}/to_pinned/busy']['median']:.3f} ms pinned, {staged:.3f} ms through _pinned_h2d (load {load.measured_ms:.1f} ms queued)"
    return figures


class _GpuLoad:
    """Matmuls queued on the current stream, about `target_ms` of GPU time, calibrated
    once with CUDA events: a compute stream busy as in a training step."""

    def __init__(self, device, target_ms: float):
        import torch

        self.count, self.measured_ms = 0, 0.0
        if device.type != "cuda" or target_ms <= 0:
            return
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            self.a @ self.a
        start.record()
        for _ in range(10):
            self.a @ self.a
        end.record()
        torch.cuda.synchronize()
        per = start.elapsed_time(end) / 10
        self.count = max(1, round(target_ms / per))
        self.measured_ms = round(per * self.count, 3)

    def queue(self) -> None:
        for _ in range(self.count):
            self.a @ self.a


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _quantiles(samples: list[float]) -> dict:
    """{"median", "p90", "max", "mean"} of `samples` (ms), rounded to µs."""
    ordered = sorted(samples)
    return {
        "median": round(ordered[len(ordered) // 2], 4),
        "p90": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
        "mean": round(sum(ordered) / len(ordered), 4),
    }


def _profile_copies(device, load, calls, sizes) -> dict:
    """Each call once at 1 MB behind the load, under torch.profiler; each H2D memcpy's
    source kind (pageable or pinned), stream, and overlap with compute (bench/gpu_train's
    `summarise_h2d`), keyed by the call that made it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import gpu_train

    nbytes = sizes.get("1MB", next(iter(sizes.values())))
    host = torch.randint(0, 2**15, (nbytes // 2,), dtype=torch.int16)
    pinned = host.pin_memory()
    summary = {}
    for name, call in calls.items():
        for _ in range(2):  # first use makes streams and pinned blocks
            load.queue()
            call(host, pinned)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                load.queue()
                call(host, pinned)
            torch.cuda.synchronize()
        trace_path = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
        found = gpu_train.summarise_h2d(trace)
        summary[name] = {
            "compute_stream": found["compute_stream"],
            "copies": [
                {"source": "pinned" if "Pinned" in g["name"] else "pageable" if "Pageable" in g["name"] else g["name"], "stream": g["stream"], "on_compute_stream": g["stream"] == found["compute_stream"], "bytes": g["bytes"], "count": g["count"], "overlap_frac": g["overlap_frac"]}
                for g in found["groups"]
            ],
        }
    return summary


def stage_sanitizer(inputs: Path, work: Path, dry_run: bool) -> dict:
    """The CUDA stream sanitizer: a planted race (must be found), the injected pieces
    (must be clean), the patched root script's first eager steps where the budget allows
    (must be clean); then the CUDA-only tests in the time left."""
    import torch

    figures: dict = {}
    cuda = torch.cuda.is_available() and not dry_run
    problems: list[str] = []
    if not cuda:
        _run_cuda_tests(figures, problems, cuda, stage_budget())
        from patcher.proof.host_cuda import cuda_on_host

        with cuda_on_host():  # the pieces' code paths, without the sanitizer
            for piece in SANITIZED_PIECES:
                _sanitized_piece(piece, torch.device("cuda", 0))
        figures["sanitizer"] = f"not run: needs CUDA (dry run); the pieces it drives ({', '.join(SANITIZED_PIECES)}) ran on host memory"
        figures["headline"] = f"CUDA tests: {figures['cuda_tests']['summary']}; sanitizer not run (no CUDA), its cases ran on host memory"
        if problems:
            raise _Failed(figures, problems)
        return figures
    # One process, one torch import: the planted race (the positive control), then each
    # piece between markers, so a piece that hangs is named by the last marker seen.
    timeout = max(5.0, min(25.0, stage_left() - 15))  # the rest is the CUDA tests
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--sanitize-case", "all"], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_stage_env())
        text, rc = done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        text, rc = (expired.stderr or b"").decode(errors="replace") if isinstance(expired.stderr, bytes) else (expired.stderr or ""), None
    planted, _, pieces = text.partition(_PIECES_MARK)
    started = [line.split(":", 1)[1] for line in pieces.splitlines() if line.startswith("piece started:")]
    ended = [line.split(":", 1)[1] for line in pieces.splitlines() if line.startswith("piece done:")]
    checks = {
        "planted_race": {"races": planted.count(_RACE_TEXT)},
        "pieces": {"rc": rc, "races": pieces.count(_RACE_TEXT), "done": ended, "hung_in": started[-1] if rc is None and started and (not ended or started[-1] != ended[-1]) else None, "tail": text[-800:] if rc != 0 else ""},
        "timeout_s": round(timeout, 1),
    }
    figures["sanitizer_cases"] = checks
    _write_json(work / STAGE_FILE, {**figures, "headline": f"cut off after the sanitizer cases: {checks}"})
    if checks["planted_race"]["races"] == 0:
        problems.append("the planted race was not reported: the sanitizer does not see races here, so its silence on the pieces proves nothing")
    if checks["pieces"]["races"] or rc != 0 or len(ended) != len(SANITIZED_PIECES):
        problems.append(f"the injected pieces ({', '.join(SANITIZED_PIECES)}): {checks['pieces']['races']} races, exit {rc}, done {ended}" + (f", hung in {checks['pieces']['hung_in']} past {timeout:.0f} s" if checks["pieces"]["hung_in"] else ""))
    figures["script"] = _sanitize_root_script(inputs, work) if stage_budget() >= 90 else {"skipped": f"a {stage_budget():.0f} s budget leaves no time for the script (needs 90 s)"}
    _run_cuda_tests(figures, problems, cuda, stage_left() - 2)
    if figures["script"].get("races") or figures["script"].get("rc"):
        problems.append(f"patched root script under the sanitizer: {figures['script'].get('races')} races, exit {figures['script'].get('rc')}")
    found = checks["planted_race"]["races"]
    clean = checks["pieces"]["races"]

    figures["headline"] = f"CUDA tests: {figures['cuda_tests']['summary']}; planted race reported {found}x; races in the injected pieces: {clean}; in the patched root script ({figures['script'].get('steps')} steps): {figures['script'].get('races')}"
    if problems:
        raise _Failed(figures, problems)
    return figures


def _run_cuda_tests(figures: dict, problems: list, cuda: bool, timeout_s: float) -> None:
    """The GPU-only tests (`CUDA_TESTS`) in pytest, within `timeout_s` seconds: on a GPU
    none may skip."""
    try:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, min(timeout_s, 240)))
    except subprocess.TimeoutExpired:
        figures["cuda_tests"] = {"rc": None, "summary": f"not finished in {timeout_s:.0f} s"}
        problems.append(f"CUDA tests: not finished in the {timeout_s:.0f} s left")
        return
    figures["cuda_tests"] = {"rc": tests.returncode, "summary": (tests.stdout.strip().splitlines() or [""])[-1], "tail": tests.stdout[-1500:]}
    if tests.returncode != 0 or (cuda and "skipped" in figures["cuda_tests"]["summary"]):
        problems.append(f"CUDA tests: {figures['cuda_tests']['summary']} (on a GPU none may skip)")


class _Failed(StageFailed):
    """A failure that still carries the stage's figures."""

    def __init__(self, figures: dict, problems: list[str]):
        super().__init__("; ".join(problems))
        self.figures = figures


def sanitize_case(case: str) -> int:
    """Run one case under the CUDA stream sanitizer in this process (`--sanitize-case`).
    The sanitizer raises on the first race it finds and prints it; exit 0 when the case
    ran through."""
    import torch
    from torch.cuda import _sanitizer

    _sanitizer.enable_cuda_sanitizer()
    device = torch.device("cuda", 0)
    # The planted race: written on a side stream, read on the compute stream with no wait_stream.
    try:
        side = torch.cuda.Stream()
        value = torch.zeros(1 << 20, device=device)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            value.add_(1)
        (value * 2).sum()
        torch.cuda.synchronize()
    except Exception as error:  # the sanitizer raises on the race it reports
        print(f"planted race raised: {error}", file=sys.stderr, flush=True)
    print(_PIECES_MARK, file=sys.stderr, flush=True)
    for piece in SANITIZED_PIECES:
        print(f"piece started:{piece}", file=sys.stderr, flush=True)
        _sanitized_piece(piece, device)
        torch.cuda.synchronize()
        print(f"piece done:{piece}", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    return 0


_PIECES_MARK = "--- the injected pieces ---"
_RACE_TEXT = "CSAN detected a possible data race"
# The injected pieces run under the sanitizer: the copy stream, pinned staging, a staged batch.
SANITIZED_PIECES = ("copy_stream", "pinned_staging", "staged_batch")


def _sanitized_piece(case: str, device) -> None:
    """Drive one injected piece as a training loop does: copy, then use on the compute stream."""
    import torch

    from patcher.templates.copy_stream import _h2d
    from patcher.templates.pinned_staging import _pinned_h2d
    from patcher.templates.staging import _stage

    if case == "copy_stream":
        for step in range(6):
            host = torch.full((1 << 18,), step, dtype=torch.int64).pin_memory()
            x = _h2d(host, device)
            (x * 2).sum().item()
    elif case == "pinned_staging":
        for step in range(8):
            host = torch.full((1 << 18,), step, dtype=torch.int32)
            x = _pinned_h2d(host, device)
            assert int((x - step).abs().sum()) == 0
    elif case == "staged_batch":
        for step in range(6):
            batch = (torch.full((4, 1024), step, dtype=torch.int64), {"y": torch.full((4, 1024), step + 1, dtype=torch.int64)})
            staged = _stage(batch, pin=True)
            x, y = _h2d(staged[0], device), _h2d(staged[1]["y"], device)
            ((x + 1) == y).all().item()


def _sanitize_root_script(inputs: Path, work: Path) -> dict:
    """The patched root script, a few eager steps at a small batch, under the sanitizer
    (bench/gpu_train's `--sanitizer-child`)."""
    import gpu_train

    scripts = _inputs_of(inputs, "root")
    if scripts is None:
        return {"skipped": "no root script in the inputs"}
    steps = 4
    paths = gpu_train.write_data(work, (steps + 10) * 65536, vocab_size=1024)
    env = {"DATA_PATH": paths["data_path"], "TOKENIZER_PATH": paths["tokenizer_path"], "VOCAB_SIZE": "1024", "ITERATIONS": str(steps), "WARMUP_STEPS": "1", "TRAIN_BATCH_TOKENS": "65536", "VAL_LOSS_EVERY": "0", "TRAIN_LOG_EVERY": "1", "MAX_WALLCLOCK_SECONDS": "0", "TORCHDYNAMO_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    run = gpu_train.run_variant(scripts[1], env, work / "sanitizer_run", timeout_s=120, sanitizer=True)
    return {"rc": run["rc"], "steps": run["steps"], "races": run.pop("stderr").count(gpu_train._RACE), "log_tail": run["log_tail"][-1200:]}


def stage_loaders(kind: str, name: str, load_ms: float):
    """Stages 3 and 4: `bench/gpu_loaders.py KIND` on the inputs named `name`."""

    def stage(inputs: Path, work: Path, dry_run: bool) -> dict:
        scripts = _inputs_of(inputs, name)
        if scripts is None:
            raise StageFailed(f"no {name} script in {inputs}")
        out = work / f"{kind}.json"
        command = [sys.executable, str(BENCH / "gpu_loaders.py"), kind, str(scripts[0]), str(scripts[1]), "--json", str(out), "--load-ms", str(load_ms)]
        if dry_run:
            command.append("--dry-run")
        elif kind == "module" and stage_budget() < 60:
            command += ["--steps", "25"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=_stage_env())
        figures = json.loads(out.read_text()) if out.exists() else {}
        figures["rc"], figures["stdout_tail"] = done.returncode, done.stdout[-1500:]
        figures["headline"] = _loaders_headline(figures) if figures.get("host_ms") else (done.stdout.strip().splitlines() or [""])[-1][:300]
        problems = []
        if done.returncode != 0:
            problems.append(f"gpu_loaders.py {kind} exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
        fell_back = [case for case, seen in (figures.get("producer") or {}).items() if not seen.get("ran")]
        if fell_back:
            problems.append(f"the patched module's producer did not run in {', '.join(fell_back)}")
        if problems:
            raise _Failed(figures, problems)
        return figures

    return stage


def _waited(ratio: float) -> str:
    """The words for a host-wait ratio patched / original (this script runs before the
    package is installed, so it keeps its own copy of bench's rule)."""
    return "the patched side waited as long" if round(ratio, 2) == 1.0 else f"the patched side waited {'less' if ratio < 1 else 'longer'}"


def _loaders_headline(figures: dict) -> str:
    """"host ms per call (mean): original X, patched Y (xR)" per case, and the exactness."""
    host = figures["host_ms"]
    cases = host if "original" not in host else {"": host}
    parts = []
    for case, sides in cases.items():
        original, patched = sides["original"]["mean"], sides["patched"]["mean"]
        ratio = f"patched / original {patched / original:.3f}: {_waited(patched / original)}" if original and patched is not None else "-"
        parts.append(f"{case + ': ' if case else ''}original {original} ms, patched {patched} ms ({ratio})")
    exact = "every batch exact" if figures.get("exact") else f"DIFFERS: {figures.get('first_difference')}"
    return f"host ms per {'send' if figures.get('stage') == 'generator' else 'next()'} (mean) behind {figures.get('load_ms')} ms of GPU load: {'; '.join(parts)}; {figures.get('batches_compared')} batches, {exact}"


def stage_ab(name: str, runs: int, steps: int, env: dict, env_b: dict | None = None, tokens: int = 524288, vocab: int = 1024):
    """Stages 4 and 6: `patch-prefetch ab` on the inputs named `name`, on synthetic shards,
    at `tokens` a step: `runs` runs a side where the box holds them (160 s), else one;
    every run shares one inductor and triton cache (only the first pays the whole
    compile). The figures carry ab's interval half-width as the resolution where it has
    one (two or more runs a side), and say so where it has none."""

    def stage(inputs: Path, work: Path, dry_run: bool) -> dict:
        import gpu_train

        scripts = _inputs_of(inputs, name)
        if scripts is None:
            raise StageFailed(f"no {name} script in {inputs}")
        n_runs, n_steps, batch = (1, 4, 1024 if vocab > 1024 else 2048) if dry_run else (runs, steps, tokens)  # dry: one run each shows the stage works
        if not dry_run and stage_budget() < 160:  # a short box: one run a side, at the tokens asked
            n_runs = 1
        warmup = 2 if dry_run else 5
        data_tokens = (n_steps + 2 * warmup + 4) * batch
        if dry_run:  # the fixtures read no tokenizer; sentencepiece is not a dependency
            from patcher.proof.shards import write_shards

            data = work / "data"
            write_shards(data, train_shards=2, val_shards=1, tokens_per_shard=data_tokens // 2 + 1, vocab_size=vocab, seed=0)
            paths = {"data_path": str(data), "data_dir": str(work), "tokenizer_path": str(work / "none.model")}
        else:
            paths = gpu_train.write_data(work, data_tokens, vocab_size=vocab)
        common = {"DATA_PATH": paths["data_path"], "DATA_DIR": paths["data_dir"], "TOKENIZER_PATH": paths["tokenizer_path"], "VOCAB_SIZE": str(vocab), "TRAIN_BATCH_TOKENS": str(batch), "WARMUP_STEPS": str(warmup), "MAX_WALLCLOCK_SECONDS": "0", "OMP_NUM_THREADS": "1" if dry_run else os.environ.get("OMP_NUM_THREADS", "8"), **_shared_caches(work), **env}
        if not dry_run and gpu_train.needs_attention_shim():
            common["PYTHONPATH"] = os.pathsep.join([str(gpu_train.SHIMS), _stage_env()["PYTHONPATH"]])
        from patcher.ab import AbError, run_ab

        figures = {"runs_each": n_runs, "steps": n_steps, "tokens_per_step": batch, "env_b": env_b or {}, "runs_so_far": []}
        if not dry_run and gpu_train.needs_attention_shim():
            figures["note"] = "attention through bench/shims' stand-in (scaled_dot_product_attention), not FlashAttention 3"

        within: dict = {"a": [], "b": []}

        def checkpoint(result, total: int) -> None:  # a stage cut off at its box keeps its runs
            figures["runs_so_far"].append(result.as_dict())
            steady = _ab_steady(getattr(result, "points", None))
            if steady:
                within[result.side].append(steady)
            figures["headline"] = f"cut off after {len(figures['runs_so_far'])} of {total} runs: " + ", ".join(f"{r['label']} {r['step_ms']} ms" for r in figures["runs_so_far"])
            _write_json(work / STAGE_FILE, figures)

        try:
            # a dry run's fixtures log no cumulative time: a line each step; a GPU run keeps ab's
            # default (a line every 20 steps: the real scripts log their first 10 steps too)
            report = run_ab(str(scripts[0]), str(scripts[1]), runs=n_runs, steps=n_steps, cwd=str(work), env=common, env_b=env_b, on_run=checkpoint,
                            **({"log_every": 1} if dry_run else {}))
        except AbError as error:
            raise _Failed(figures, [f"ab: {str(error)[:400]}"]) from None
        figures["ab"] = report
        del figures["runs_so_far"]
        half = report.get("pct_half")
        figures["resolution_pct"] = half
        figures["resolution"] = f"a difference under {half:.2f} % cannot be seen with these runs (ab's 95 % interval)" if isinstance(half, (int, float)) else "none between runs: one run a side gives no between-run interval (the box held no more)"
        if within["a"] and within["b"]:
            import gpu_e2e

            figures["within_runs"] = gpu_e2e.compare(within["a"], within["b"])
            if not isinstance(half, (int, float)):
                figures["resolution"] += f"; within the runs (steps as samples, drift not included): {figures['within_runs']['resolution_pct']:.2f} %"
        figures["headline"] = f"mean step {report['mean_ms']['a']} ms original, {report['mean_ms']['b']} ms {'patched' if not env_b else 'patched, toggles off'} at {batch:,} tokens: {report['verdict']}; resolution: {figures['resolution']}"
        problems = []
        if not env_b and report.get("fallbacks"):
            problems.append(f"the patched script's producer fell back: {report['fallbacks']}")
        if problems:
            raise _Failed(figures, problems)
        return figures

    return stage


def _ab_steady(points) -> list[float]:
    """Steady step times (ms) from an ab run's log points [(step, ms)]: per-step values,
    or windows of a cumulative train time (non-decreasing values), after step 2; [] when
    the run has none (ab's runs give their points to the checkpoint)."""
    import gpu_e2e

    try:
        values = {int(step): float(ms) for step, ms in points or [] if ms is not None}
    except (TypeError, ValueError):
        return []
    ordered = [values[k] for k in sorted(values)]
    cumulative = len(ordered) > 2 and all(b >= a for a, b in zip(ordered, ordered[1:])) and ordered[-1] > 1.5 * ordered[0]
    return gpu_e2e.step_samples(values, "cumulative" if cumulative else "dt", warmup=2)


def _shared_caches(work: Path) -> dict:
    """One inductor and one triton cache for every run of a stage."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache"), "TRITON_CACHE_DIR": str(work / "triton_cache")}


def stage_e2e(which: str):
    """Stages 1 and 5: `bench/gpu_e2e.py`'s nanochat or modded-nanogpt run, alternated,
    in what is left of the box. A run that fails, or a patched run whose producer fell
    back, fails the stage (its figures say which run and keep the log's end). Where the
    patched side came out slower and the box holds it, one profiled run a side
    (`gpu_e2e.profile_summary`: copies, the compute stream's gap before each copy, the
    host's CUDA runtime calls) goes with the figures."""

    def stage(inputs: Path, work: Path, dry_run: bool) -> dict:
        import gpu_e2e

        manifest = json.loads((inputs / "manifest.json").read_text())
        run = gpu_e2e.nanochat_stage if which == "nanochat" else gpu_e2e.modded_stage
        try:
            figures = run(inputs, work, dry_run, stage_left() - 3, manifest, on_run=lambda f: _write_json(work / STAGE_FILE, f))
        except gpu_e2e.StageError as error:
            raise StageFailed(str(error)) from None
        report = figures["report"]
        failed = [r for r in report["runs"] if (r["rc"] != 0 and not r.get("cut_off")) or r.get("fell_back") or (r["rc"] == 0 and not r.get("steady"))]
        comparison = report.get("comparison") or {}
        cuda = not dry_run and _cuda()
        if cuda and not failed and comparison.get("ratio", 0) > 1 and which == "nanochat":
            patched = next(r for r in reversed(report["runs"]) if r["side"] == "patched")
            figures["profile"] = {}
            for side in ("patched", "original"):
                if stage_left() < patched["wall_s"] + 10:
                    figures["profile"][side] = {"why": f"not run: {stage_left():.0f} s left of the box"}
                    continue
                command, env, cwd = gpu_e2e.profile_command(figures, side, work)
                figures["profile"][side] = gpu_e2e.profile_summary(command, env, cwd, timeout_s=stage_left() - 3)
        if failed:
            raise _Failed(figures, [report["stopped"] or "a run failed"])
        measured = [r for r in report["runs"] if r.get("steady") and r["rc"] == 0]
        if {r["side"] for r in measured} != {"original", "patched"}:
            raise _Failed(figures, [f"no comparison: {len(measured)} measured run in the box ({report['stopped']})"])
        return figures

    return stage


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def stage_registered_slot(inputs: Path, work: Path, dry_run: bool) -> dict:
    """The registered-slot hand-out on a real device (`bench/gpu_registered.py`); in a
    dry run, the same code on host memory (`cuda_on_host`) at tiny sizes."""
    import torch

    import gpu_registered
    from patcher.proof.host_cuda import cuda_on_host

    cuda = torch.cuda.is_available() and not dry_run
    with cuda_on_host() if not cuda else contextlib.nullcontext():
        device = torch.device("cuda", 0)
        load = _GpuLoad(device, target_ms=5.0 if cuda else 0.0)
        if cuda:
            figures = gpu_registered.run(device, load, batches=200, shape=(16, 2048), sizes={"64KB": 64 << 10, "1MB": 1 << 20, "8MB": 8 << 20}, reps=40)
        else:
            figures = gpu_registered.run(device, load, batches=12, shape=(2, 64), sizes={"64KB": 64 << 10}, reps=3, real=False)
    figures["device"] = str(torch.cuda.get_device_name(0)) if cuda else "cpu (cuda_on_host)"
    figures["load_ms"] = load.measured_ms
    ms, exact = figures["hand_out_ms"], figures["exact"]
    figures["headline"] = (f"{exact['batches'] - exact['differ']}/{exact['batches']} batches exact, registered {exact['registered']}; hand-out p50 "
                           f"{ms['registered']['p50']:.3f} ms registered, {ms['default_pinned_copy']['p50']:.3f} ms the default (a pinned copy first), "
                           f"{ms['original_pageable_to']['p50']:.3f} ms the original's pageable .to() (behind a {load.measured_ms:.1f} ms load)")
    if figures["problems"]:
        raise _Failed(figures, figures["problems"])
    return figures


def _inputs_of(inputs: Path, name: str) -> tuple[Path, Path] | None:
    """(original, patched) paths of the input `name` in the manifest, or None."""
    manifest_path = inputs / "manifest.json"
    if not manifest_path.exists():
        return None
    entry = json.loads(manifest_path.read_text()).get("scripts", {}).get(name)
    if not entry:
        return None
    return inputs / entry["original"], inputs / entry["patched"]


_AB_STEPS = 20
STAGE_FUNCTIONS = {
    "0_probe": lambda inputs, work, dry_run: stage_probe(inputs, work, dry_run),
    "1_nanochat_e2e": lambda inputs, work, dry_run: stage_e2e("nanochat")(inputs, work, dry_run),
    "2_sanitizer": lambda inputs, work, dry_run: stage_sanitizer(inputs, work, dry_run),
    "3_registered_slot": lambda inputs, work, dry_run: stage_registered_slot(inputs, work, dry_run),
    "4_ab_root": stage_ab("root", runs=2, steps=_AB_STEPS, env={}),
    "5_modded_e2e": lambda inputs, work, dry_run: stage_e2e("modded")(inputs, work, dry_run),
    "6_ab_sdclip": stage_ab("sdclip", runs=2, steps=_AB_STEPS, env={}, vocab=8192),
    # GPU time queued before each call: about a micro-step of each on one H100.
    "7_generator": stage_loaders("generator", "modded", load_ms=20.0),
    "8_module": stage_loaders("module", "nanochat", load_ms=50.0),
    "9_premise": lambda inputs, work, dry_run: stage_premise(inputs, work, dry_run),
}


def run_one_stage(key: str, inputs: Path, work: Path, dry_run: bool) -> int:
    """`--stage KEY`: run it, write `work/stage.json`; exit 0 ok, 1 failed."""
    sys.path.insert(0, str(BENCH))
    try:
        figures = STAGE_FUNCTIONS[key](inputs, work, dry_run)
        rc = 0
    except StageSkipped as skipped:
        figures = {"skipped": str(skipped), "headline": f"skipped: {skipped}"}
        rc = SKIPPED_RC
    except StageFailed as failure:
        figures = getattr(failure, "figures", {})
        figures["failure"] = str(failure)
        figures.setdefault("headline", f"FAILED: {failure}")
        figures["headline"] = f"FAILED: {failure} | {figures['headline']}" if not figures["headline"].startswith("FAILED") else figures["headline"]
        print(f"{key}: {failure}", file=sys.stderr)
        rc = 1
    _write_json(work / STAGE_FILE, figures)
    return rc


# --------------------------------------------------------------------------- dry run


def dry_run_checks(inputs: Path, out: Path, results: dict) -> list[str]:
    """What the GPU run depends on beyond its stages. Returns the problems found."""
    problems = []
    if len(DEVICE_COMMAND) > DEVICE_COMMAND_LIMIT:
        problems.append(f"the device command is {len(DEVICE_COMMAND)} characters, over {DEVICE_COMMAND_LIMIT}")
    manifest = results.get("inputs") or {}
    for name, entry in (manifest.get("scripts") or {}).items():
        for role in ("original", "patched"):
            if not (inputs / entry[role]).exists():
                problems.append(f"input {name} {role} missing: {inputs / entry[role]}")
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > MAX_OUT_FILES:
        problems.append(f"{len(files)} files in {out}, over {MAX_OUT_FILES}")
    problems += [f"{p} is {p.stat().st_size} bytes, over {MAX_OUT_BYTES}" for p in files if p.stat().st_size > MAX_OUT_BYTES]
    return problems


def _budgets(items: list[str], parser: argparse.ArgumentParser) -> dict[str, float]:
    """`--budget STAGE=SECONDS` items as {stage: seconds}."""
    budgets = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            parser.error(f"--budget {item}: expected STAGE=SECONDS")
    return budgets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", default=None, help="folder made by bench/gpu_prepare.py (default .gpu_inputs; with --dry-run, the fixtures prepared into a temporary folder)")
    parser.add_argument("--out", default=None, help="where results.json goes (default: $OUT, else a temporary folder)")
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds of wall time for all stages (default 540: 9 minutes)")
    parser.add_argument("--dry-run", action="store_true", help="every stage on the CPU at tiny sizes, on the bundled fixtures (CI)")
    parser.add_argument("--only", action="append", help="run only this stage (its key or number, e.g. 5a_ab_root or 2); repeatable")
    parser.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS", help="a stage's time box instead of its default (e.g. 5a=120); repeatable")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--sanitize-case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sanitize_case:
        return sanitize_case(args.sanitize_case)
    if args.stage:
        return run_one_stage(args.stage, Path(args.inputs), Path(args.work), args.dry_run)
    if (args.inputs is not None or not args.dry_run) and not (Path(args.inputs or ROOT / ".gpu_inputs") / "manifest.json").is_file():
        print(f"gpu_proof: {args.inputs or ROOT / '.gpu_inputs'}: no manifest.json (make the inputs with bench/gpu_prepare.py)", file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-proof-out-"))
    with tempfile.TemporaryDirectory(prefix="gpu-proof-inputs-") as scratch:
        inputs = Path(args.inputs or ROOT / ".gpu_inputs")
        if args.dry_run and args.inputs is None:
            sys.path.insert(0, str(BENCH))
            from gpu_prepare import prepare

            inputs = Path(scratch)
            prepare(inputs, fixtures=True, wheels=True)
        results = run_stages(inputs, out, args.deadline, args.dry_run, args.only, _budgets(args.budget, parser))
        problems = dry_run_checks(inputs, out, results) if args.dry_run else []
    for problem in problems:
        print(f"dry run: {problem}", flush=True)
    failed = [key for key, row in results["stages"].items() if row["status"] in ("failed", "timed out")]
    print(f"results: {out / 'results.json'}; stages failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
