"""End-to-end step time on one GPU, original against patched, as the user runs the script.

Used by `bench/gpu_proof.py`'s end-to-end stages (nanochat's `scripts/base_train.py`,
modded-nanogpt's `train_gpt.py`); the trees they run are built from the inputs
`bench/gpu_prepare.py` copied (their code is not part of this repository) or, in a dry
run, from the miniatures in `fixtures/nanochat_tree/` and `fixtures/generator_shards.py`.

What is measured and how:
- Each side is the script run as its own process, unchanged but for the data loader
  (nanochat: `nanochat/dataloader.py` original or patched; modded-nanogpt: `train_gpt.py`
  original or patched). The runs alternate original, patched, original, ... while the
  stage's time box allows one more (each run's length predicted from that side's last).
  All runs of a stage share one inductor and triton cache, so only the first pays the
  whole compile; each run's start-up (to its first step line) is reported apart.
- A step's time is read from the script's own log, never from a sync we add:
  `dt` (nanochat's `base_train` synchronises every step and prints each step's `dt`),
  `cumulative` (modded-nanogpt prints its running `train_time` without a sync: step
  time is its change over windows of `WINDOW` steps), or `arrival` (a miniature that
  prints no time: the host clock when each step line arrives; the miniatures sync each
  step through `loss.item()`).
- `compare` gives each run's median step with its within-run spread, the ratio
  patched / original, its 95 % interval on the log scale (never negative), and the
  resolution: the half-width of that interval, the smallest difference these runs could
  detect. With two or more runs a side the interval is between runs (Welch); with one
  run a side it is within the runs (steps as samples): run-to-run drift is then not in
  it, and no faster/slower verdict is given.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
WINDOW = 5  # steps per window for cumulative and arrival times
# nanochat base_train: `step 00012/00040 (30.00%) | loss: ... | dt: 123.45ms | ...`
NANOCHAT_STEP = re.compile(r"^step (\d+)/(\d+) .*\| dt: ([\d.]+)ms")
# modded-nanogpt: `step:12/1285 train_time:3456ms step_avg:288.00ms`
MODDED_STEP = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms")
# the miniatures: `step:12 train_loss:...`
FIXTURE_STEP = re.compile(r"^step:(\d+) train_loss:")
# What a patched script prints when its producer did not start (the run is then not a result).
FALLBACK_MARKERS = ("runs without prefetch", "runs in the training process")
# Lines whose arrival time marks a phase of a run (modded-nanogpt's warm-up compile).
PHASE_MARKS = {"warmup_started": "Sampling steps", "warmup_done": "Resetting Model"}


def parse_step(line: str, pattern: re.Pattern, kind: str, arrived_ms: float) -> tuple[int, float] | None:
    """(step, value) of one log line, or None. `kind` "dt": the value is the step's own
    time (ms); "cumulative": the running train time (ms); "arrival": `arrived_ms`, the
    host clock when the line arrived."""
    found = pattern.match(line)
    if not found:
        return None
    step = int(found.group(1))
    return step, (arrived_ms if kind == "arrival" else float(found.group(3)))


def step_samples(values: dict[int, float], kind: str, warmup: int) -> list[float]:
    """Steady-state step times (ms) from one run's parsed values {step: value}.

    "dt": the values of the steps after `warmup`; "cumulative" and "arrival": the change
    over each window of `WINDOW` consecutive logged steps after `warmup`, per step.
    Returns [] when too few steps were logged."""
    steps = sorted(s for s in values if s > warmup)
    if kind == "dt":
        return [values[s] for s in steps]
    out = []
    for i in range(0, len(steps) - WINDOW, WINDOW):
        first, last = steps[i], steps[i + WINDOW]
        out.append((values[last] - values[first]) / (last - first))
    return out


def _t975(df: float) -> float:
    """The 97.5 % quantile of Student's t (scipy where installed, else the normal's)."""
    try:
        from scipy.stats import t

        return float(t.ppf(0.975, df))
    except ImportError:
        return statistics.NormalDist().inv_cdf(0.975)


def run_stats(samples: list[float]) -> dict:
    """One run: {"median_ms", "n", "spread_pct": (p90 - p10) / median in %}."""
    ordered = sorted(samples)
    median = statistics.median(ordered)
    p10, p90 = ordered[int(0.1 * (len(ordered) - 1))], ordered[int(0.9 * (len(ordered) - 1))]
    return {"median_ms": round(median, 3), "n": len(ordered), "spread_pct": round(100 * (p90 - p10) / median, 2) if median else None}


def compare(runs_a: list[list[float]], runs_b: list[list[float]]) -> dict:
    """Original (a) against patched (b) from each run's steady step times (ms).

    Returns {"ratio" (b / a, geometric means of the run medians), "interval" [lo, hi]
    (95 %, on the log ratio), "resolution_pct" (the interval's half-width in %: a
    difference under it cannot be seen with these runs), "basis" ("between runs" or
    "within one run each"), "verdict" (words)}. Raises ValueError when a side has no
    run with samples."""
    runs_a, runs_b = [r for r in runs_a if len(r) >= 2], [r for r in runs_b if len(r) >= 2]
    if not runs_a or not runs_b:
        raise ValueError("a side has no run with two or more steady steps")
    la = [math.log(statistics.median(r)) for r in runs_a]
    lb = [math.log(statistics.median(r)) for r in runs_b]
    log_ratio = statistics.fmean(lb) - statistics.fmean(la)
    if len(la) >= 2 and len(lb) >= 2:
        va, vb = statistics.variance(la) / len(la), statistics.variance(lb) / len(lb)
        df = (va + vb) ** 2 / ((va**2 / (len(la) - 1)) + (vb**2 / (len(lb) - 1))) if va + vb > 0 else len(la) + len(lb) - 2
        basis = f"between runs ({len(la)} original, {len(lb)} patched)"
    else:
        # Steps as samples: the median's standard error ~ 1.2533 sd / sqrt(n) for each run.
        steps_a, steps_b = [math.log(x) for r in runs_a for x in r], [math.log(x) for r in runs_b for x in r]
        va, vb = (1.2533**2) * statistics.variance(steps_a) / len(steps_a), (1.2533**2) * statistics.variance(steps_b) / len(steps_b)
        df = len(steps_a) + len(steps_b) - 2
        basis = "within one run each (steps as samples; run-to-run drift not included)"
    half = _t975(max(df, 1.0)) * math.sqrt(va + vb)
    ratio, lo, hi = math.exp(log_ratio), math.exp(log_ratio - half), math.exp(log_ratio + half)
    resolution = 100 * (math.exp(half) - 1)
    change = f"{100 * (ratio - 1):+.2f} %"
    if basis.startswith("within"):
        verdict = f"patched / original {ratio:.4f} ({change}); one run each: no verdict, a difference under {resolution:.2f} % could not be seen within these runs"
    elif hi < 1:
        verdict = f"patched faster: {change} (95 % interval {100 * (lo - 1):+.2f} .. {100 * (hi - 1):+.2f} %)"
    elif lo > 1:
        verdict = f"patched slower: {change} (95 % interval {100 * (lo - 1):+.2f} .. {100 * (hi - 1):+.2f} %)"
    else:
        verdict = f"no difference seen ({change}); a difference under {resolution:.2f} % cannot be seen with these runs"
    return {"ratio": round(ratio, 5), "interval": [round(lo, 5), round(hi, 5)], "resolution_pct": round(resolution, 3), "basis": basis, "verdict": verdict}


def run_side(command: list[str], env: dict, cwd: Path, pattern: re.Pattern, kind: str, stop_step: int, timeout_s: float) -> dict:
    """Run one training process until its step `stop_step` line (then stop it and its
    children) or its end, or `timeout_s`.

    Returns {"values" {step: value}, "first_step_s" (start to the first step line: the
    start-up and compile), "marks" {PHASE_MARKS name: seconds from the start}, "wall_s",
    "rc" (0 when it reached `stop_step`), "cut_off" (stopped at `timeout_s` before it),
    "fell_back" (a FALLBACK_MARKERS line was
    printed), "prefetch_lines", "log_tail"}."""
    began = time.perf_counter()
    values: dict[int, float] = {}
    first = None
    lines: list[str] = []
    marks: dict[str, float] = {}
    said: list[str] = []
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watchdog = threading.Timer(timeout_s, _kill_group, (proc,))
    watchdog.start()
    reached = False
    try:
        for line in proc.stdout:  # a silent child is ended by the watchdog
            now = time.perf_counter()
            lines.append(line)
            del lines[:-60]
            if "prefetch:" in line or any(m in line for m in FALLBACK_MARKERS):
                said.append(line.strip()[:300])
            for name, text in PHASE_MARKS.items():
                if text in line and name not in marks:
                    marks[name] = round(now - began, 1)
            parsed = parse_step(line.strip(), pattern, kind, 1000 * (now - began))
            if parsed:
                first = first if first is not None else now - began
                values[parsed[0]] = parsed[1]
                if parsed[0] >= stop_step:
                    reached = True
                    break
    finally:
        watchdog.cancel()
        _kill_group(proc)
        proc.wait()
        proc.stdout.close()
    fell_back = any(m in line for line in said for m in FALLBACK_MARKERS)
    cut_off = not reached and time.perf_counter() - began >= timeout_s - 0.5
    return {"cut_off": cut_off, "values": values, "first_step_s": round(first, 1) if first is not None else None, "marks": marks, "wall_s": round(time.perf_counter() - began, 1), "rc": 0 if reached else proc.returncode, "fell_back": fell_back, "prefetch_lines": said[:5], "log_tail": "".join(lines)[-1500:]}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group: the script and the producers it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def alternate(sides: dict, budget_s: float, pattern: re.Pattern, kind: str, stop_step: int, warmup: int, max_runs: int, on_run=None) -> dict:
    """Alternate the two `sides` ({"original": (command, env, cwd), "patched": ...}) while
    another run is predicted to fit in `budget_s` (its side's last wall time, or the other
    side's), at most `max_runs` in all. `on_run(report)` after each run (a checkpoint).

    Returns {"runs": [{"side", "first_step_s", "wall_s", "rc", "steady": run_stats, ...}],
    "comparison": compare(...) or {"why"}, "stopped": why the alternation ended}."""
    began = time.monotonic()
    report: dict = {"runs": [], "comparison": None, "stopped": None}
    samples: dict[str, list[list[float]]] = {"original": [], "patched": []}
    last_wall: dict[str, float] = {}
    for index in range(max_runs):
        side = ("original", "patched")[index % 2]
        left = budget_s - (time.monotonic() - began)
        predicted = last_wall.get(side, last_wall.get("original", 0.0))
        if index >= 2 and predicted > left - 3:
            report["stopped"] = f"the next run ({side}, about {predicted:.0f} s) would not fit in the {left:.0f} s left"
            break
        command, env, cwd = sides[side]
        run = run_side(command, env, cwd, pattern, kind, stop_step, timeout_s=max(left - 2, 1.0))
        steady = step_samples(run.pop("values"), kind, warmup)
        last_wall[side] = run["wall_s"]
        row = {"side": side, **run, "steady": run_stats(steady) if steady else None}
        if run["rc"] != 0 or not steady or (side == "patched" and run["fell_back"]):
            report["runs"].append(row)
            why = "its producer fell back" if run["rc"] == 0 and steady else f"cut off by the box after {run['wall_s']:.0f} s, before step {stop_step}" if run["cut_off"] else f"it did not reach step {stop_step} (exit {run['rc']})"
            report["stopped"] = f"run {index + 1} ({side}): {why}"
            break
        del row["log_tail"]
        report["runs"].append(row)
        samples[side].append(steady)
        try:
            report["comparison"] = compare(samples["original"], samples["patched"])
        except ValueError as why:
            report["comparison"] = {"why": str(why)}
        if on_run:
            on_run(report)
    else:
        report["stopped"] = f"{max_runs} runs done"
    return report


def headline(report: dict, what: str) -> str:
    """One line: each side's median step, the comparison and its resolution."""
    runs = report["runs"]
    by = {side: [r["steady"]["median_ms"] for r in runs if r["side"] == side and r.get("steady")] for side in ("original", "patched")}
    first = [r["first_step_s"] for r in runs if r.get("first_step_s") is not None]
    comparison = report.get("comparison") or {}
    sides = "; ".join(f"{side} {', '.join(f'{m:.2f}' for m in ms) or '-'} ms" for side, ms in by.items())
    starts = f"; start-up to the first step, run by run (one compile cache): {', '.join(f'{s:.0f}' for s in first)} s" if first else ""
    return f"{what}: step (median of each run) {sides}: {comparison.get('verdict') or comparison.get('why') or report.get('stopped')}{starts}"


# --------------------------------------------------------------------------- trees


def shared_caches(work: Path) -> dict:
    """Environment giving every run of a stage one inductor and one triton cache."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache"), "TRITON_CACHE_DIR": str(work / "triton_cache")}


def build_tree(source: Path, dest: Path, files: dict[str, Path]) -> Path:
    """Copy the tree `source` to `dest` and put `files` ({relative path: file}) in it."""
    shutil.copytree(source, dest, dirs_exist_ok=True)
    for relative, path in files.items():
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return dest


def offline_stand_ins(work: Path, names: list[str], always: list[str] = ()) -> Path:
    """A folder with `bench/shims/offline`'s stand-ins for the modules of `names` this
    Python cannot import, and for those of `always` (whose real version would reach
    the network). Returns the folder (prepend it to PYTHONPATH)."""
    import importlib.util

    folder = work / "stand_ins"
    folder.mkdir(exist_ok=True)
    for name in names:
        if name in always or importlib.util.find_spec(name) is None:
            shutil.copyfile(BENCH / "shims" / "offline" / f"{name}.py", folder / f"{name}.py")
    return folder


def python_path(*paths) -> str:
    return os.pathsep.join([str(p) for p in paths if p] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def profile_child(trace: str, argv: list[str]) -> int:
    """Run `argv` (`-m MODULE ARGS...` or `SCRIPT ARGS...`) as __main__ under
    torch.profiler (CUDA activity) and write the Chrome trace to `trace`."""
    import runpy

    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.argv = argv[1:] if argv[0] == "-m" else argv
    with profile(activities=[ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]) as prof:
        try:
            if argv[0] == "-m":
                sys.argv[0] = argv[1]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    prof.export_chrome_trace(trace)
    return 0


def profile_summary(command: list[str], env: dict, cwd: Path, timeout_s: float) -> dict:
    """One run of `command` (a `python ...` command that ends by itself) under the
    profiler: `gpu_train.summarise_h2d` of its trace (copies: pageable or pinned, stream,
    overlap with compute; the compute stream's idle gap before each copy; the host's
    CUDA runtime calls), or {"why"} when it did not finish."""
    import json

    trace = cwd / "trace.json"
    wrapped = [command[0], str(Path(__file__).resolve()), "--profile-child", str(trace), *command[1:]]
    try:
        done = subprocess.run(wrapped, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"why": f"the profiled run did not finish in {timeout_s:.0f} s"}
    if done.returncode != 0 or not trace.exists():
        return {"why": f"the profiled run exited {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1][:300]}"}
    sys.path.insert(0, str(BENCH))
    import gpu_train

    summary = gpu_train.summarise_h2d(json.loads(trace.read_text()))
    summary["groups"] = summary["groups"][:6]
    return summary


if __name__ == "__main__":
    if sys.argv[1:2] == ["--profile-child"]:
        sys.exit(profile_child(sys.argv[2], sys.argv[3:]))
    print(__doc__)


# --------------------------------------------------------------------------- stages
# Sizes: (real GPU, dry run). The dry run shows the stage's code working on miniatures.
NANOCHAT = {"real": {"depth": 4, "B": 32, "T": 2048, "accum": 2, "steps": 40, "warmup": 10, "docs": 8000, "max_runs": 6}, "dry": {"depth": 1, "B": 2, "T": 64, "accum": 2, "steps": 14, "warmup": 3, "docs": 600, "max_runs": 2}}
MODDED = {"real": {"steps": 40, "warmup": 10, "train_tokens": 16_000_000, "val_tokens": 11_000_000, "max_runs": 4}, "dry": {"steps": 24, "warmup": 4, "train_tokens": 60_000, "val_tokens": 4_096, "max_runs": 2}}


LAST_SIDES: dict = {}  # the last stage's {side: (command, env, cwd)}, for `profile_command`


def profile_command(figures: dict, side: str, work: Path, steps: int = 15) -> tuple[list[str], dict, Path]:
    """The last nanochat stage's command for `side`, at `steps` iterations (a short
    profiled run: its trace holds every step), run in `work/profile_SIDE`."""
    command, env, cwd = LAST_SIDES[side]
    command = list(command)
    command[command.index("--num-iterations") + 1] = str(steps)
    folder = work / f"profile_{side}"
    folder.mkdir(exist_ok=True)
    return command, {**env, "PYTHONPATH": python_path(cwd) + os.pathsep + env.get("PYTHONPATH", "")}, folder


class StageError(Exception):
    """The stage cannot run (one line why) or its result is a failure."""


def _pair(manifest: dict, inputs: Path, name: str) -> tuple[dict, Path, Path]:
    tree, entry = (manifest.get("trees") or {}).get(name), (manifest.get("scripts") or {}).get(name)
    if not tree or not entry:
        raise StageError(f"no {name} tree or script in {inputs}: run bench/gpu_prepare.py with --{name}-git (or --fixtures)")
    return tree, inputs / entry["original"], inputs / entry["patched"]


def nanochat_stage(inputs: Path, work: Path, dry_run: bool, budget_s: float, manifest: dict, on_run=None) -> dict:
    """nanochat's `scripts/base_train.py` end to end on one GPU, `nanochat/dataloader.py`
    original against patched, on synthetic parquet shards with the byte tokenizer
    stand-in; the step time is base_train's own per-step `dt` (it synchronises each
    step). Returns the stage's figures ("sizes", "report" of `alternate`, "headline")."""
    from patcher.proof.module_bench import write_corpus

    tree, original, patched = _pair(manifest, inputs, "nanochat")
    size = NANOCHAT["dry" if dry_run else "real"]
    sides = {}
    base = work / "nanochat_base"
    data = base / "base_data_climbmix"
    data.mkdir(parents=True, exist_ok=True)
    write_corpus(data, docs=size["docs"])  # three files; nanochat's loader keeps the last for val
    stand_ins = offline_stand_ins(work, ["wandb", "requests", "yaml"])
    command_args = ["--run", "dummy", "--depth", str(size["depth"]), "--max-seq-len", str(size["T"]), "--device-batch-size", str(size["B"]),
                    "--total-batch-size", str(size["B"] * size["T"] * size["accum"]), "--num-iterations", str(size["steps"]),
                    "--eval-every", "-1", "--core-metric-every", "-1", "--sample-every", "-1", "--window-pattern", "L"]
    if dry_run:
        command_args += ["--device-type", "cpu"]
    for side, loader in (("original", original), ("patched", patched)):
        root = build_tree(inputs / tree["dir"], work / f"nanochat_{side}", {"nanochat/dataloader.py": loader, "nanochat/tokenizer.py": BENCH / "shims" / "nanochat_tokenizer.py"})
        env = {**os.environ, **shared_caches(work), "NANOCHAT_BASE_DIR": str(base), "PYTHONPATH": python_path(root, stand_ins), "PYTHONUNBUFFERED": "1"}
        if dry_run:
            env["OMP_NUM_THREADS"] = "1"
        sides[side] = ([sys.executable, "-m", "scripts.base_train", *command_args], env, root)
    LAST_SIDES.update(sides)
    figures = {"sizes": size, "command": " ".join(sides["original"][0][1:]), "tree": {k: tree.get(k) for k in ("git", "commit")}, "stand_ins": sorted(p.stem for p in stand_ins.glob("*.py")) + ["nanochat.tokenizer (bytes)"],
               "step_time": "base_train's own dt (torch.cuda.synchronize() before and after each step)"}
    report = alternate(sides, budget_s, NANOCHAT_STEP, "dt", size["steps"] - 1, size["warmup"], size["max_runs"], on_run=lambda r: on_run and on_run({**figures, "report": r, "headline": headline(r, "nanochat base_train")}))
    figures["report"] = report
    figures["headline"] = headline(report, f"nanochat base_train d{size['depth']}, B={size['B']} T={size['T']} x{size['accum']} micro-steps")
    return figures


def modded_stage(inputs: Path, work: Path, dry_run: bool, budget_s: float, manifest: dict, on_run=None) -> dict:
    """modded-nanogpt's `train_gpt.py` end to end on one GPU, original against patched:
    WORLD_SIZE=1 (the script then accumulates over 8 micro-steps), stopped after
    `steps` training steps (within its first training stage: a short schedule),
    FlashAttention 3 and tiktoken's file through `bench/shims/offline` (no network),
    synthetic shards. Step time: the change in the script's own `train_time` (no sync
    added) over windows of `WINDOW` steps; in a dry run (the miniature prints no time),
    the arrival of its step lines. Returns the stage's figures."""
    from patcher.proof.shards import write_shards

    tree, original, patched = _pair(manifest, inputs, "modded")
    size = MODDED["dry" if dry_run else "real"]
    data = work / "modded_data"
    shards = data if dry_run else data / "data" / "fineweb10B"
    bos = 1 if dry_run else 50256
    vocab = 128 if dry_run else 50257
    write_shards(shards, train_shards=2, val_shards=0, tokens_per_shard=size["train_tokens"] // 2, vocab_size=vocab, seed=0, bos_id=bos)
    write_shards(shards, train_shards=0, val_shards=1, tokens_per_shard=size["val_tokens"], vocab_size=vocab, seed=1, bos_id=bos)
    stand_ins = offline_stand_ins(work, ["kernels", "tiktoken"], always=["kernels", "tiktoken"]) if not dry_run else None
    sides = {}
    for side, script in (("original", original), ("patched", patched)):
        root = build_tree(inputs / tree["dir"], work / f"modded_{side}", {"train_gpt.py": script})
        env = {**os.environ, **shared_caches(work), "DATA_PATH": str(data), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
               "PYTHONPATH": python_path(root, stand_ins), "PYTHONUNBUFFERED": "1"}
        if dry_run:
            env["OMP_NUM_THREADS"] = "1"
        sides[side] = ([sys.executable, "train_gpt.py"], env, root)
    pattern, kind = (FIXTURE_STEP, "arrival") if dry_run else (MODDED_STEP, "cumulative")
    figures = {"sizes": size, "tree": {k: tree.get(k) for k in ("git", "commit")}, "world_size": 1,
               "stand_ins": [] if dry_run else ["kernels.get_kernel: FlashAttention 3 as scaled_dot_product_attention with a document/causal/window mask", "tiktoken gpt2: a synthetic byte table"],
               "step_time": "arrival of the miniature's step lines (it syncs each step through loss.item())" if dry_run else f"change in train_gpt.py's own train_time (perf_counter, no sync) over windows of {WINDOW} steps"}
    report = alternate(sides, budget_s, pattern, kind, size["steps"], size["warmup"], size["max_runs"], on_run=lambda r: on_run and on_run({**figures, "report": r, "headline": headline(r, "modded-nanogpt train_gpt.py")}))
    figures["report"] = report
    marks = [r.get("marks") for r in report["runs"] if r.get("marks")]
    if marks:
        figures["warmup_compile_s"] = [round(m["warmup_done"] - m.get("warmup_started", 0.0), 1) for m in marks if "warmup_done" in m]
    figures["headline"] = headline(report, "modded-nanogpt train_gpt.py, WORLD_SIZE=1 (8 micro-steps)") + (f"; warm-up compile {figures['warmup_compile_s']} s" if figures.get("warmup_compile_s") else "")
    return figures
