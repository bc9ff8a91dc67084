"""Bench: DeepXube's round loop, original vs pull request #11 vs `--with round_overlap`, on CPU.

Takes DeepXube from its git mirror (base 4262fe3 and the pull request's head 5e9cf36,
`git archive` into a temporary folder; never installed into this project), patches the
base trainer with `round_overlap`, and trains grid.7 (heuristic `resnet_fc.100H_1B_bn`,
V, updater `graph_v`, `UpArgs(procs=1, up_itrs, step_max=100, search_itrs=20)` as
DeepXube's own test, batch 50) with one data worker and one torch thread in the
training process (DeepXube's `get_device()` sets 8 on CPU; the driver sets 1 after it),
`--up-itrs` training iterations a round, `--rounds` rounds, alternating the three
variants `--sets` times in one run. Each run is a fresh process and a fresh network
directory; a run fails unless it made exactly `--rounds` update steps, all trained with
one torch thread. DeepXube's own dependencies (clingo, tensorboard, ...) come from
`--deps` (a `pip install --target` folder), prepended to PYTHONPATH.

Prints each run's round times, total wall, end wait (last update step to the end of
`train`: stopping the workers, and pull request #11's wait for its unused round), final
training loss and solve rate; then per variant the medians: warm round (rounds 2..N of
every set), first round, total wall, end wait, the warm and total ratios against the
original measured in the same run, the final training loss and the solve rate of a
batch search (`graph_v`, 100 instances, 20 search iterations, as DeepXube's own test)
with the trained network. DeepXube's runs are not reproducible seed for seed (its
spawned workers draw their own random numbers), so loss and solve rate vary from run to
run; compare them across sets, not one run.

The issue's settings (10 rounds of 1,000 iterations, two sets): about 10 minutes on 2
quiet cores (original rounds of about 9 s, six runs of 10 rounds plus start-up and the
solve test); the overlap needs a core of its own, so on a machine loaded by other work
the run is several times longer and its ratios say little:

    python bench/round_overlap.py --mirror /work/.mirror/forestagostinelli+deepxube/repo --deps DEPS --rounds 10 --up-itrs 1000 --sets 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRIVER = r'''
import json, os, sys, time
import torch
from deepxube.base import trainer as trainer_mod
from deepxube.utils.command_line_utils import get_domain_from_arg, get_heur_nnet_par_from_arg, get_pathfind_from_arg
from deepxube.factories.updater_factory import get_updater
from deepxube.base.updater import UpArgs
from deepxube.base.trainer import TrainArgs
from deepxube.base.pathfinding import FNsHeurV
from deepxube.trainers.utils.train_loop import train
from deepxube.pathfinding.utils.performance import PathFindPerf
from deepxube.nnet import nnet_utils

rounds, up_itrs, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

# One torch thread in the training process: DeepXube's get_device() sets 8 on CPU,
# which on a small machine oversubscribes the cores the data workers need.
get_device = nnet_utils.get_device
def get_device_one_thread():
    found = get_device()
    torch.set_num_threads(1)
    return found
nnet_utils.get_device = get_device_one_thread

ends, losses, threads = [], [], []
original_step = trainer_mod.Train.update_step
def timed_step(self):
    original_step(self)
    ends.append(time.perf_counter())
trainer_mod.Train.update_step = timed_step
def keep_loss(method):
    def wrapped(self, times):
        threads.append(torch.get_num_threads())
        loss = method(self, times)
        losses.append(loss)
        return loss
    return wrapped
trainer_mod.Train._train = keep_loss(trainer_mod.Train._train)

if __name__ == "__main__":
    torch.manual_seed(0)
    domain, domain_name = get_domain_from_arg("grid.7")
    heur_nnet_par = get_heur_nnet_par_from_arg(domain, domain_name, "resnet_fc.100H_1B_bn", "V")[0]
    # UpArgs(procs, up_itrs, step_max, search_itrs): DeepXube's own test uses step_max 100
    up_args = UpArgs(1, up_itrs, 100, 20, sync_main=False)
    updater = get_updater(domain, "graph_v", up_args, False, "heur")
    train_args = TrainArgs(50, 0.001, 0.9999993, rounds * up_itrs, False, display=0)
    start = time.perf_counter()
    train(domain, heur_nnet_par, updater, None, None, out_dir, train_args, debug=True)
    total = time.perf_counter() - start
    assert len(ends) == rounds, f"{len(ends)} update steps for {rounds} rounds"
    assert set(threads) == {1}, f"training ran with {sorted(set(threads))} torch threads"

    nnet = nnet_utils.load_nnet(f"{out_dir}/heur.pt", heur_nnet_par.get_nnet())
    nnet.eval()
    heur_fn = heur_nnet_par.get_nnet_fn(nnet, None, torch.device("cpu"), None)
    pathfind = get_pathfind_from_arg(domain, FNsHeurV(heur_fn), "graph_v")[0]
    states, goals = domain.sample_problem_instances(list(range(0, 100)))
    pathfind.add_instances(pathfind.make_instances(states, goals, None, True))
    for _ in range(20):
        pathfind.step()
    perf = PathFindPerf()
    for instance in pathfind.instances:
        perf.update_perf(instance)
    rounds_s = [b - a for a, b in zip([start] + ends[:-1], ends)]
    print("BENCH " + json.dumps({"rounds_s": rounds_s, "total_s": total, "end_wait_s": start + total - ends[-1],
                                 "final_loss": float(losses[-1]), "solved": perf.per_solved()}))
'''


def prepare(mirror: str, work: Path) -> dict[str, Path]:
    """Trees of the three variants under `work`: original (4262fe3), pr11 (5e9cf36), ours (4262fe3 patched)."""
    sys.path.insert(0, str(ROOT))
    from patcher.patch import features_from, patch_source

    trees = {}
    for name, ref in (("original", "4262fe3"), ("pr11", "5e9cf36"), ("ours", "4262fe3")):
        tree = work / name
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", mirror, "archive", ref, "deepxube"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        trees[name] = tree
    trainer = trees["ours"] / "deepxube/base/trainer.py"
    result = patch_source(trainer.read_text(), features_from(None, None, ["round_overlap"]))
    assert "round_overlap" in result.applied, [n.reason for n in result.notes]
    trainer.write_text(result.source)
    return trees


def run_one(tree: Path, deps: str, rounds: int, up_itrs: int, work: Path, tag: str) -> dict:
    out_dir = work / f"run_{tag}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), deps]), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(rounds), str(up_itrs), str(out_dir)], env=env, capture_output=True, text=True, cwd=str(work))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{tag} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("BENCH "):])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", required=True, help="git directory of forestagostinelli/deepxube (with 4262fe3 and 5e9cf36)")
    parser.add_argument("--deps", required=True, help="folder with DeepXube's dependencies (pip install --target)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds a run (the first is cold; at least 2)")
    parser.add_argument("--up-itrs", type=int, default=1000, help="training iterations a round")
    parser.add_argument("--sets", type=int, default=2, help="alternations of original, pr11, ours")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (round 1 is cold)")
    work = Path(tempfile.mkdtemp(prefix="round_overlap_bench_"))
    trees = prepare(args.mirror, work)
    results: dict[str, list[dict]] = {name: [] for name in trees}
    for s in range(args.sets):
        for name in ("original", "pr11", "ours"):
            r = run_one(trees[name], args.deps, args.rounds, args.up_itrs, work, f"{name}_{s}")
            results[name].append(r)
            print(f"set {s} {name}: rounds {[round(x, 2) for x in r['rounds_s']]} total {r['total_s']:.1f}s end wait {r['end_wait_s']:.2f}s "
                  f"loss {r['final_loss']:.3e} solved {r['solved']:.0f}%", flush=True)
    print(f"\n{args.rounds} rounds x {args.up_itrs} iterations, {args.sets} set(s); medians over sets (warm: rounds 2..{args.rounds} of every set)")
    print(summary(results))


def summary(results: dict[str, list[dict]]) -> str:
    """The table of medians: warm round, first round, total, end wait (s), ratios to the original, final loss, solve rate (%)."""
    warm = {n: statistics.median([x for r in rs for x in r["rounds_s"][1:]]) for n, rs in results.items()}
    first = {n: statistics.median([r["rounds_s"][0] for r in rs]) for n, rs in results.items()}
    total = {n: statistics.median([r["total_s"] for r in rs]) for n, rs in results.items()}
    lines = [f"{'variant':9} {'warm s':>7} {'warm/orig':>9} {'first s':>8} {'total s':>8} {'total/orig':>10} {'end wait s':>10} {'final loss':>11} {'solved %':>9}"]
    for n, rs in results.items():
        lines.append(f"{n:9} {warm[n]:7.2f} {warm[n] / warm['original']:9.3f} {first[n]:8.2f} {total[n]:8.1f} {total[n] / total['original']:10.3f} "
                     f"{statistics.median([r['end_wait_s'] for r in rs]):10.2f} {statistics.median([r['final_loss'] for r in rs]):11.3e} "
                     f"{statistics.median([r['solved'] for r in rs]):9.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
