"""Timing primitives of the benchmarks: the simulated training step (idle, a GIL-busy
Python loop, or an op-bound loop of small torch ops calibrated to the step time) and
the step report (step and data time per side, the share of the data time recovered).

Shared by `bench.py` (a training script's loader) and `module_bench.py` (a data-loader
module's generators); neither imports the other.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

PYTHON_WORK_MS = 5.0
MAIN_THREAD_MODES = ("idle", "gil-busy", "op-bound")
# The op-bound step's calibration stops once one step is this close to compute_ms (relative).
OP_CALIBRATION_TOLERANCE = 0.03
# The op of the op-bound step's loop, by name (`--op`): what each call does to 16 (or
# `op_numel`) float32. `add-out` writes into a preallocated output; `add` and
# `mul-scalar` allocate their result, as most ops of a forward and backward pass do
# (on a GPU from the caching allocator, here from malloc); `mul-scalar` (`x = x * 1.0001`)
# also wraps a Python float into a tensor on every call.
OP_KINDS = ("add-out", "add", "mul-scalar")
# The default op-bound step: `torch.add(a, b)` on empty tensors, a new output tensor per
# op and no host data, the host's share of a CUDA op: Python, the dispatcher and the
# output's metadata (TensorImpl, StorageImpl) with the GIL released in between, while
# the data comes from the caching allocator and the compute runs on the GPU. With host
# data (`--op-numel 16`) every op also mallocs and frees its 64 bytes, which a CUDA op
# does not, and which makes the loaders' own allocations costlier (bench/op_ablation.py).
DEFAULT_OP = "add"
DEFAULT_OP_NUMEL = 0
# The share of the original's mean data time the patched step must recover (`step_goal_met`).
STEP_GOAL_SHARE = 0.8


class BenchError(Exception):
    """The script cannot be benchmarked (one line, says why)."""


def _calibrate_python_work(target_ms: float) -> int:
    """Loop count of `_python_work` that takes about `target_ms` here, alone."""
    loops = 1000
    while True:
        t0 = time.perf_counter()
        _python_work(loops)
        elapsed = (time.perf_counter() - t0) * 1e3
        if elapsed > 1.0:
            return max(1, int(loops * target_ms / elapsed))
        loops *= 4


def _python_work(loops: int) -> int:
    """Pure-Python work that holds the GIL (dict and list operations, like a launch loop)."""
    table, total = {}, 0
    for i in range(loops):
        table[i & 255] = i
        total += table.get((i * 7) & 255, 0)
    return total


def step_function(main_thread: str, compute_ms: float, op: str = DEFAULT_OP, op_numel: int = DEFAULT_OP_NUMEL, ops_per_step: int | None = None):
    """The simulated step for `main_thread` mode, calibrated here (before any worker runs).

    op, op_numel, ops_per_step (op-bound only): the op of the loop (OP_KINDS), its
    tensors' element count, and a fixed op count a step (None: calibrated to `compute_ms`).
    Returns `(step, ops)`: `step()` runs one step of about `compute_ms` ms and returns
    the ms of its main-thread work (Python work in gil-busy, the op loop in op-bound,
    0 when idle); `ops`: torch ops per step in op-bound mode, else None.
    """
    if main_thread == "op-bound":
        if op not in OP_KINDS:
            raise BenchError(f"--op must be one of {', '.join(OP_KINDS)}, not {op!r}")
        tensors = _op_tensors(op_numel)
        ops = ops_per_step or calibrate_ops(compute_ms, lambda n: _timed_op_loop(n, tensors, op))
        return (lambda: _timed_op_loop(ops, tensors, op)), ops
    work_loops = _calibrate_python_work(PYTHON_WORK_MS) if main_thread == "gil-busy" else 0
    return (lambda: _simulated_step(compute_ms, main_thread, work_loops)), None


def _op_tensors(numel: int = 16) -> tuple:
    """Two inputs and an output for the op loop: `numel` float32 each (`add-out` allocates nothing per op)."""
    return torch.ones(numel), torch.ones(numel), torch.empty(numel)


def op_loop(ops: int, tensors: tuple, kind: str = "add-out") -> int:
    """`ops` torch ops of `kind` (OP_KINDS) on `tensors = (a, b, out)`; returns `ops`.

    `add-out`: `torch.add(a, b, out=out)`; `add`: `torch.add(a, b)` (a new tensor per
    call); `mul-scalar`: `x = x * 1.0001` starting from `a` (a new tensor per call).
    Each call releases the GIL while torch runs it and takes it back after, as the
    launch of a CUDA kernel from Python does. Raises ValueError for an unknown kind.
    """
    a, b, out = tensors
    add = torch.add
    if kind == "add-out":
        for _ in range(ops):
            add(a, b, out=out)
    elif kind == "add":
        for _ in range(ops):
            add(a, b)
    elif kind == "mul-scalar":
        x = a
        for _ in range(ops):
            x = x * 1.0001
    else:
        raise ValueError(f"unknown op kind {kind!r}; choose from {', '.join(OP_KINDS)}")
    return ops


def _timed_op_loop(ops: int, tensors: tuple, kind: str = "add-out") -> float:
    t0 = time.perf_counter()
    op_loop(ops, tensors, kind)
    return (time.perf_counter() - t0) * 1e3


def calibrate_ops(target_ms: float, run, tolerance: float = OP_CALIBRATION_TOLERANCE, rounds: int = 12) -> int:
    """The op count whose run takes `target_ms` ms, within `tolerance` (relative) if reachable.

    Takes: target_ms: the step time to reach (ms); run: `ops -> ms`, runs the op loop
    with that many ops and returns its time (each estimate is the median of three runs,
    against a preemption in one); tolerance: stop once an estimate is within
    `tolerance * target_ms` of the target; rounds: at most this many corrections.
    Returns the op count (>= 1). The count is first grown until a run takes 1 ms, then
    scaled by target / measured until within tolerance, so a fixed cost per run (loop
    set-up) is corrected for too.
    """
    def measure(n):
        return statistics.median(run(n) for _ in range(3))

    ops = 256
    elapsed = measure(ops)
    while elapsed < 1.0 and ops < 1 << 26:
        ops *= 4
        elapsed = measure(ops)
    for _ in range(rounds):
        if abs(elapsed - target_ms) <= tolerance * target_ms:
            break
        ops = max(1, round(ops * target_ms / max(elapsed, 1e-9)))
        elapsed = measure(ops)
    return ops


def _simulated_step(compute_ms: float, main_thread: str, work_loops: int) -> float:
    """Run one simulated step; returns the ms spent in its Python work (0 when idle)."""
    start = time.perf_counter()
    spent = 0.0
    if main_thread == "gil-busy":
        _python_work(work_loops)
        spent = (time.perf_counter() - start) * 1e3
    rest = compute_ms / 1e3 - (time.perf_counter() - start)
    if rest > 0:
        time.sleep(rest)
    return spent


def step_report(spans: list, data: list) -> dict:
    """Step and data time per side, and the share of the data time recovered.

    Takes: spans, data: `[original, patched]` lists of ms per measured step (the whole
    step; the time in `next_batch`). Returns a dict of ms: `mean_step_ms_<side>`,
    `median_step_ms_<side>`, `p99_step_ms_<side>` and the same for `data`;
    `recovered_share`: `(mean_step_ms_original - mean_step_ms_patched) /
    mean_data_ms_original` (None when the original never waited); `step_goal_met`:
    the patched mean step at most the original's minus `STEP_GOAL_SHARE` of its mean
    data time, and the patched median step at most the original's.
    """
    out = {}
    for side, name in ((0, "original"), (1, "patched")):
        for kind, values in (("step", spans[side]), ("data", data[side])):
            values = np.asarray(values, dtype=np.float64)
            out[f"mean_{kind}_ms_{name}"] = round(float(values.mean()), 4)
            out[f"median_{kind}_ms_{name}"] = round(float(np.median(values)), 4)
            out[f"p99_{kind}_ms_{name}"] = round(float(np.percentile(values, 99)), 4)
    # From the unrounded means: the rounding of three values must not move the share.
    means = [float(np.mean(spans[0])), float(np.mean(spans[1]))]
    data_mean = float(np.mean(data[0]))
    saved = means[0] - means[1]
    out["recovered_share"] = round(saved / data_mean, 4) if data_mean > 0 else None
    out["step_goal_met"] = bool(saved >= STEP_GOAL_SHARE * data_mean and np.median(spans[1]) <= np.median(spans[0]))
    return out
