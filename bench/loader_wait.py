"""Main-thread data wait, original vs patched, for several scripts and both main-thread modes.

    python bench/loader_wait.py SCRIPT [SCRIPT ...] [--steps 300] [--data-dir DIR]

Runs `patch-prefetch bench` (patcher.bench.run_bench) for each script with an idle and
a GIL-busy main thread and prints one row per run, every figure a ratio against the
original or an absolute wait in ms:

- `wait ratio`: total wait original / patched (higher is better);
- `max ms`: the patched loader's longest single wait, against the original's;
- `producer`: the patched worker's build rate / the original `next_batch` rate;
- `slowdown`: how much longer the main thread's own Python work took beside the patched
  loader's worker than beside the original (GIL-busy only).

Shards are written once into --data-dir (3 x 100 M tokens, about 600 MB) and reused.
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
    args = parser.parse_args()
    print(f"{'script':48} {'main thread':11} {'wait ratio':>10} {'max ms (orig)':>16} {'producer':>9} {'slowdown':>9}")
    for script in args.scripts:
        for mode in ("idle", "gil-busy"):
            r = run_bench(script, steps=args.steps, main_thread=mode, data_dir=args.data_dir)
            slowdown = "" if r["main_thread_slowdown_pct"] is None else f"{r['main_thread_slowdown_pct']:+.2f} %"
            maxes = f"{r['wait_ms_patched_max']:.2f} ({r['wait_ms_original_max']:.1f})"
            print(f"{Path(script).parent.name[-48:] or script:48} {mode:11} {r['ratio']:>9.1f}x {maxes:>16} {r['producer_ratio']:>8.2f}x {slowdown:>9}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
