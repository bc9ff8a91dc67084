"""One factor at a time between `patch-prefetch bench --main-thread op-bound` and a user-style op harness.

    python bench/op_ablation.py SCRIPT [--repeats 2] [--steps 300] [--configs bench,threads,...] [--data-dir DIR]

Runs `bench/op_harness.py` (each run a fresh process, so torch's default thread count
is its own) for each configuration below, `--repeats` times, the configurations in a
rotated order each repeat, and prints per configuration the share of the original's
mean hand-out recovered as a shorter mean step (median and range over the repeats),
the median hand-out original -> patched and the mean step patched / original.

`bench` is what `patch-prefetch bench --main-thread op-bound` did (one torch thread,
`torch.add(a, b, out=out)` on 16 float32, calibrated to a 20 ms step, one step a side
in turn, 3 warm-up steps left out, the previous batch freed before the hand-out);
each other configuration changes one factor of it; `user` changes all of them to a
user's harness (torch's default threads, `x = x * 1.0001`, 15,000 ops a step, every
step counted, the previous batch freed by the assignment inside the hand-out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).resolve().parent / "op_harness.py"
BENCH = ["--torch-threads", "1", "--op", "add-out", "--compute-ms", "20", "--warmup", "3", "--drop-before-hand-out"]
# Name -> the harness options; each but `user` is `bench` with one factor changed.
CONFIGS = {
    "bench": BENCH,
    "threads": ["--torch-threads", "0", "--op", "add-out", "--compute-ms", "20", "--warmup", "3", "--drop-before-hand-out"],
    "alloc-add": ["--torch-threads", "1", "--op", "add", "--compute-ms", "20", "--warmup", "3", "--drop-before-hand-out"],
    "alloc-add-0": ["--torch-threads", "1", "--op", "add", "--op-numel", "0", "--compute-ms", "20", "--warmup", "3", "--drop-before-hand-out"],
    "mul-scalar": ["--torch-threads", "1", "--op", "mul-scalar", "--compute-ms", "20", "--warmup", "3", "--drop-before-hand-out"],
    "ops-15000": ["--torch-threads", "1", "--op", "add-out", "--ops", "15000", "--warmup", "3", "--drop-before-hand-out"],
    "big-op": ["--torch-threads", "1", "--op", "add-out", "--op-numel", "4096", "--compute-ms", "20", "--warmup", "3", "--drop-before-hand-out"],
    "step-60ms": ["--torch-threads", "1", "--op", "add-out", "--compute-ms", "60", "--warmup", "3", "--drop-before-hand-out"],
    "warmup-0": ["--torch-threads", "1", "--op", "add-out", "--compute-ms", "20", "--warmup", "0", "--drop-before-hand-out"],
    "drop-inside": ["--torch-threads", "1", "--op", "add-out", "--compute-ms", "20", "--warmup", "3"],
    "every-50": BENCH + ["--every", "50"],
    "pageable-h2d": BENCH + ["--pageable-h2d"],
    "user": [],
    "user-threads-1": ["--torch-threads", "1"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--data-dir", default="out/bench-shards")
    parser.add_argument("--shards", type=int, default=3)
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        for name in order:
            command = [sys.executable, str(HARNESS), args.script, "--steps", str(args.steps), "--data-dir", args.data_dir, "--shards", str(args.shards), "--json", *CONFIGS[name]]
            report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            runs[name].append(report)
            print(f"# {name} run {repeat + 1}: {100 * report['recovered_share']:.1f} %", file=sys.stderr, flush=True)
    print(f"{'config':15} {'recovered (median, range)':>28} {'hand-out ms orig->patched':>27} {'step patched/orig':>18} {'ops':>6} {'threads':>7}")
    for name in names:
        reports = runs[name]
        shares = [100 * r["recovered_share"] for r in reports]
        hand = [(r["median_data_ms_original"], r["median_data_ms_patched"]) for r in reports]
        ratio = [r["mean_step_ms_patched"] / r["mean_step_ms_original"] for r in reports]
        print(
            f"{name:15} {statistics.median(shares):>9.1f} % ({min(shares):.1f} .. {max(shares):.1f}) "
            f"{statistics.median(h[0] for h in hand):>12.2f} -> {statistics.median(h[1] for h in hand):.2f}"
            f"{' ':9}{statistics.median(ratio):>9.4f} ({min(ratio):.4f}..{max(ratio):.4f}) {reports[0]['ops_per_step']:>6} {reports[0]['torch_threads']:>7}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
