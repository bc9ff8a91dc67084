"""Main-thread data wait, original vs patched, for several scripts and both main-thread modes.

    python bench/loader_wait.py SCRIPT [SCRIPT ...] [--steps 300] [--data-dir DIR]

Runs `patch-prefetch bench` (patcher.bench.run_bench) for each script with an idle and
a GIL-busy main thread and prints one row per run, every figure a ratio against the
original or an absolute wait in ms:

- `wait ratio`: total wait original / patched (higher is better);
- `max ms`: the patched loader's longest single wait, against the original's;
- `producer`: the patched worker's build rate / the original `next_batch` rate;
- `python`, `numpy`, `N workers`: producer batches/s of one worker calling the script's
  own `next_batch`, of one worker with the numpy assembly, and of `--workers N` threads
  (ShuffledSequenceLoader family; `-` where a variant does not apply), each with its
  ratio to the original's;
- `N/1`: N workers' rate against one worker's (same assembly);
- `slowdown`: how much longer the main thread's own Python work took beside the patched
  loader's worker than beside the original (GIL-busy only).

The wait is measured with the patched loader at `TRAIN_PREFETCH_WORKERS=N`. Shards are
written once into --data-dir (`--shards` x 100 M tokens, about 200 MB each) and reused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patcher.bench import run_bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="+")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--data-dir", default="out/bench-shards")
    parser.add_argument("--workers", type=int, default=2, help="TRAIN_PREFETCH_WORKERS of the patched loader and of the N-worker producer variant (default 2)")
    parser.add_argument("--shards", type=int, default=3, help="synthetic train shards (default 3)")
    args = parser.parse_args()
    n = f"{args.workers} workers"
    print(f"{'script':48} {'main thread':11} {'wait ratio':>10} {'max ms (orig)':>16} {'producer':>9} {'orig b/s':>9} {'python':>16} {'numpy':>16} {n:>16} {'N/1':>7} {'slowdown':>9}")
    for script in args.scripts:
        for mode in ("idle", "gil-busy"):
            r = run_bench(script, steps=args.steps, main_thread=mode, data_dir=args.data_dir, workers=args.workers, shards=args.shards)
            slowdown = "" if r["main_thread_slowdown_pct"] is None else f"{r['main_thread_slowdown_pct']:+.2f} %"
            maxes = f"{r['wait_ms_patched_max']:.2f} ({r['wait_ms_original_max']:.1f})"
            rates = [_rate(r, name) for name in ("python", "numpy", "workers")]
            per_worker = "-" if r["producer_ratio_workers_vs_1"] is None else f"{r['producer_ratio_workers_vs_1']:.2f}x"
            print(
                f"{Path(script).parent.name[-48:] or script:48} {mode:11} {r['ratio']:>9.1f}x {maxes:>16} {r['producer_ratio']:>8.2f}x "
                f"{r['producer_batches_per_s_original']:>9.0f} {rates[0]:>16} {rates[1]:>16} {rates[2]:>16} {per_worker:>7} {slowdown:>9}",
                flush=True,
            )
    return 0


def _rate(report: dict, name: str) -> str:
    """`batches/s (ratio to the original)`, or `-` where the variant does not apply."""
    rate = report[f"producer_batches_per_s_{name}"]
    return "-" if rate is None else f"{rate:.0f} ({report[f'producer_ratio_{name}']:.2f}x)"


if __name__ == "__main__":
    sys.exit(main())
