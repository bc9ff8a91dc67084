"""A host-bound step of small torch ops beside the original's and the patched training loader, as a user writes it.

    python bench/op_harness.py SCRIPT [--steps 300] [--ops 15000] [--op mul-scalar] [--torch-threads 0]
        [--every 1] [--warmup 0] [--drop-in-hand-out] [--pageable-h2d] [--data-dir DIR] [--json]

A reproduction of an op-bound harness written outside `patch-prefetch bench`: the two
loaders (rank 0 of 8, built by `patcher.proof.bench.bench_loaders` on synthetic shards)
are alternated, one step each (`--every N`: N steps each in turn), and every step is

    t0; x = loader.next_batch(*args); t1; 15,000 torch ops; t2

with the hand-out `t1 - t0` and the step `t2 - t0` (the previous batch freed at the
assignment, so inside the hand-out: `--drop-in-hand-out`, on by default). Defaults
are what such a harness has when nothing is set: torch's own CPU thread count
(`--torch-threads 0`), an allocating op (`x = x * 1.0001` on 16 float32), a fixed
op count instead of a calibrated step, and every step counted (`--warmup 0`).
Each default is an option, so that one factor at a time can be set to what
`patch-prefetch bench --main-thread op-bound` does (`bench/op_ablation.py`).

Prints, per side, the mean and median step and hand-out in ms, and the share of the
original's mean hand-out recovered as a shorter mean step:
`(mean step original - mean step patched) / mean hand-out original`, as bench does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patcher.proof.bench import _close, _stage_pageable, bench_loaders  # noqa: E402
from patcher.proof.timing import OP_KINDS, _op_tensors, _timed_op_loop, calibrate_ops, op_loop  # noqa: E402


def run_harness(
    script: str,
    steps: int = 300,
    ops: int = 15_000,
    op: str = "mul-scalar",
    op_numel: int = 16,
    torch_threads: int = 0,
    every: int = 1,
    warmup: int = 0,
    drop_in_hand_out: bool = True,
    pageable_h2d: bool = False,
    compute_ms: float | None = None,
    data_dir: str | None = None,
    shards: int = 3,
    shard_tokens: int = 100_000_000,
) -> dict:
    """Run the harness on `script`; returns a dict of ms and the recovered share.

    ops: torch ops a step (`compute_ms` given: calibrated to it instead); op, op_numel:
    the op (OP_KINDS) and its tensors' float32 count; torch_threads: torch's CPU
    threads (0: as torch starts, one per core); every: steps a side runs in turn;
    warmup: first steps of each side left out; drop_in_hand_out: the previous batch is
    freed inside the timed hand-out (by the assignment; else just before t0);
    pageable_h2d: the original's hand-out makes one host copy of its batch.
    Keys: `mean_step_ms_<side>`, `median_step_ms_<side>`, `mean_data_ms_<side>`,
    `median_data_ms_<side>` (side original or patched), `recovered_share`,
    `ops_per_step`, `torch_threads`. Raises ValueError for an unknown op.
    """
    if op not in OP_KINDS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OP_KINDS)}")
    with bench_loaders(script, shards, shard_tokens, 0, data_dir, torch_threads=torch_threads or None) as setup:
        threads = torch.get_num_threads()
        tensors = _op_tensors(op_numel)
        if compute_ms is not None:
            ops = calibrate_ops(compute_ms, lambda n: _timed_op_loop(n, tensors, op))
        loaders = [setup.build[0](), setup.build[1]()]
        data: list[list[float]] = [[], []]
        span: list[list[float]] = [[], []]
        held: list = [None, None]
        clock = time.perf_counter
        try:
            for block in range(0, steps, every):
                for side in (0, 1):
                    for _ in range(min(every, steps - block)):
                        if not drop_in_hand_out:
                            held[side] = None
                        t0 = clock()
                        held[side] = loaders[side].next_batch(*setup.args)
                        if side == 0 and pageable_h2d:
                            held[side] = _stage_pageable(held[side])
                        t1 = clock()
                        op_loop(ops, tensors, op)
                        t2 = clock()
                        data[side].append((t1 - t0) * 1e3)
                        span[side].append((t2 - t0) * 1e3)
        finally:
            _close(loaders[1])
    out = {"ops_per_step": ops, "torch_threads": threads, "op": op, "every": every, "warmup": warmup}
    for side, name in ((0, "original"), (1, "patched")):
        steps_ms, data_ms = np.asarray(span[side][warmup:]), np.asarray(data[side][warmup:])
        out[f"mean_step_ms_{name}"] = float(steps_ms.mean())
        out[f"median_step_ms_{name}"] = float(np.median(steps_ms))
        out[f"mean_data_ms_{name}"] = float(data_ms.mean())
        out[f"median_data_ms_{name}"] = float(np.median(data_ms))
    out["recovered_share"] = (out["mean_step_ms_original"] - out["mean_step_ms_patched"]) / out["mean_data_ms_original"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ops", type=int, default=15_000, help="torch ops a step (default 15000)")
    parser.add_argument("--compute-ms", type=float, help="calibrate the op count to this step time instead of --ops")
    parser.add_argument("--op", choices=OP_KINDS, default="mul-scalar")
    parser.add_argument("--op-numel", type=int, default=16)
    parser.add_argument("--torch-threads", type=int, default=0, help="0: torch's default (one per core)")
    parser.add_argument("--every", type=int, default=1, help="steps a side runs before the other's turn")
    parser.add_argument("--warmup", type=int, default=0, help="first steps of each side left out")
    parser.add_argument("--drop-before-hand-out", action="store_true", help="free the previous batch before t0 (bench's way)")
    parser.add_argument("--pageable-h2d", action="store_true")
    parser.add_argument("--data-dir")
    parser.add_argument("--shards", type=int, default=3)
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run_harness(
        args.script, args.steps, args.ops, args.op, args.op_numel, args.torch_threads, args.every, args.warmup,
        not args.drop_before_hand_out, args.pageable_h2d, args.compute_ms, args.data_dir, args.shards, args.shard_tokens,
    )
    if args.json:
        print(json.dumps(report))
    else:
        for name in ("original", "patched"):
            print(f"{name:9} step mean {report[f'mean_step_ms_{name}']:.3f} median {report[f'median_step_ms_{name}']:.3f} ms; "
                  f"hand-out mean {report[f'mean_data_ms_{name}']:.3f} median {report[f'median_data_ms_{name}']:.3f} ms")
        print(f"recovered {100 * report['recovered_share']:.1f} % ({report['ops_per_step']} {report['op']} ops a step, {report['torch_threads']} torch threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
