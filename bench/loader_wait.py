"""Main-thread data wait and step time, original vs patched, for several scripts and main-thread modes.

    python bench/loader_wait.py SCRIPT [SCRIPT ...] [--steps 300] [--data-dir DIR] [--modes idle,gil-busy,op-bound]

Runs `patch-prefetch bench` (patcher.proof.bench.run_bench) for each script and mode and
prints one row per idle or GIL-busy run, every figure a ratio against the original or
an absolute wait in ms:

- `wait`: total wait patched / original, and in a word whether the patched loader waited
  less or longer (below 1 it waited less; the orientation `patch-prefetch bench` prints);
- `max ms`: the patched loader's longest single wait, against the original's;
- `producer`: the patched worker's build rate / the original `next_batch` rate;
- `slowdown`: how much longer the main thread's own Python work took beside the patched
  loader's worker than beside the original (GIL-busy only).

Op-bound runs (a host-bound step of small torch ops, calibrated to `--compute-ms`;
by default `torch.add` on empty tensors, a new output a call and no host data, the host
side of a CUDA op: `--op`, `--op-numel`) print a second table, one row each, in ms per step: the mean step original -> patched,
the median and p99 steps, the original's mean time in `next_batch` (`data`), the
share of it recovered as a shorter step (`recovered`; the goal is 80 % with a median
step no longer than the original's), and the op loop's slowdown beside the worker.

The wait and the step are measured with what a default patch gives. Shards are
written once into --data-dir (`--shards` x 100 M tokens, about 200 MB each) and reused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patcher.proof.bench import ratio_word, run_bench  # noqa: E402
from patcher.proof.timing import DEFAULT_OP, DEFAULT_OP_NUMEL, MAIN_THREAD_MODES, OP_KINDS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="+")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--data-dir", default="out/bench-shards")
    parser.add_argument("--shards", type=int, default=3, help="synthetic train shards (default 3)")
    parser.add_argument("--modes", default=",".join(MAIN_THREAD_MODES), help=f"main-thread modes, comma-separated (default {','.join(MAIN_THREAD_MODES)})")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="simulated step in ms (default 20)")
    parser.add_argument("--pageable-h2d", action="store_true", help="charge the original's next_batch the host copy its pageable H2D makes on a GPU (see patch-prefetch bench --help)")
    parser.add_argument("--op", choices=OP_KINDS, default=DEFAULT_OP, help=f"op-bound: the op of the step's loop (default {DEFAULT_OP})")
    parser.add_argument("--op-numel", type=int, default=DEFAULT_OP_NUMEL, help=f"op-bound: float32 elements of the op's tensors (default {DEFAULT_OP_NUMEL})")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MAIN_THREAD_MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MAIN_THREAD_MODES)}")
    wait_modes = [m for m in modes if m != "op-bound"]
    if wait_modes:
        print(f"{'script':48} {'main thread':11} {'wait p/o':>15} {'max ms (orig)':>16} {'producer p/o':>14} {'orig b/s':>9} {'slowdown':>9}")
    for script in args.scripts:
        for mode in wait_modes:
            r = run_bench(script, steps=args.steps, compute_ms=args.compute_ms, main_thread=mode, data_dir=args.data_dir, shards=args.shards, pageable_h2d=args.pageable_h2d)
            slowdown = "" if r["main_thread_slowdown_pct"] is None else f"{r['main_thread_slowdown_pct']:+.2f} %"
            maxes = f"{r['wait_ms_patched_max']:.2f} ({r['wait_ms_original_max']:.1f})"
            print(
                f"{Path(script).parent.name[-48:] or script:48} {mode:11} {_wait(r):>15} {maxes:>16} {_built(r):>14} "
                f"{r['producer_batches_per_s_original']:>9.0f} {slowdown:>9}",
                flush=True,
            )
    if "op-bound" in modes:
        print(f"{'script':48} {'mean step ms':>17} {'median':>15} {'p99':>15} {'data ms':>8} {'recovered':>10} {'goal':>5} {'ops slowdown':>13} {'ops':>6}")
        for script in args.scripts:
            r = run_bench(script, steps=args.steps, compute_ms=args.compute_ms, main_thread="op-bound", data_dir=args.data_dir, shards=args.shards, pageable_h2d=args.pageable_h2d, op=args.op, op_numel=args.op_numel)
            share = "-" if r["recovered_share"] is None else f"{100 * r['recovered_share']:.1f} %"
            print(
                f"{Path(script).parent.name[-48:] or script:48} {_pair(r, 'mean'):>17} {_pair(r, 'median'):>15} {_pair(r, 'p99'):>15} "
                f"{r['mean_data_ms_original']:>8.3f} {share:>10} {'met' if r['step_goal_met'] else 'no':>5} {r['main_thread_slowdown_pct']:>+11.2f} % {r['ops_per_step']:>6}",
                flush=True,
            )
    return 0


def _wait(report: dict) -> str:
    """Total wait patched / original and its word: "0.022 less", "1.4 longer"; "-" when the
    original never waited."""
    original, patched = report["wait_ms_original_total"], report["wait_ms_patched_total"]
    if not original:
        return "-"
    return f"{patched / original:.2g} {ratio_word(patched / original, 'waited')}"


def _built(report: dict) -> str:
    """Producer rate patched / original and its word: "0.11 fewer", "1.3 more"; "-" when
    the original built nothing."""
    ratio = report["producer_ratio"]
    return "-" if ratio is None else f"{ratio:.2g} {ratio_word(ratio, 'built')}"


def _pair(report: dict, stat: str) -> str:
    """`original -> patched` step time in ms for `stat` (mean, median or p99)."""
    return f"{report[f'{stat}_step_ms_original']:.2f}->{report[f'{stat}_step_ms_patched']:.2f}"


if __name__ == "__main__":
    sys.exit(main())
