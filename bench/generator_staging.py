"""Op-bound step time of a staged data generator against the original and a thread producer, on CPU.

    python bench/generator_staging.py [SCRIPT] [--steps N] [--compute-ms T] [--shard-tokens N]

SCRIPT (default fixtures/generator_shards.py) is a script whose training generator
`pinned_staging` stages (modded-nanogpt's 2026 shape). Each step, like `bench
--main-thread op-bound`, is a host-bound loop of small torch ops calibrated to T ms on
the main thread plus one item of the generator; three sides run alternately, step by
step, on the same shards:

- original: the script's generator, its `.to(device)` charged the host copy a pageable
  H2D makes on a GPU (`_stage_pageable`);
- staged: the patched script's generator on the CUDA path driven with host memory
  (`cuda_on_host`): each copy goes into pinned memory, as on a GPU;
- thread: the original generator run ahead by the thread producer
  (`templates/prefetch_loader.py`), what a default patch gives generators without
  shard threads.

Prints the mean and median step (ms) of each side and its ratio to the original's.
What a CPU cannot show: the wait a pageable H2D copy makes the host do on a GPU (behind
every kernel already queued), which pinned staging on the copy stream removes; here
both the original's and the staged copy are one host memcpy, so staged/original near
1.0 means staging costs the loop nothing it did not pay already, and the thread's
ratio is what running the generator ahead costs a host-bound loop in GIL time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from patcher.check.import_smoke import definitions_only  # noqa: E402
from patcher.patch import patch_source  # noqa: E402
from patcher.proof.bench import _stage_pageable  # noqa: E402
from patcher.proof.timing import step_function as _step_function  # noqa: E402
from patcher.proof.harness import load_definitions  # noqa: E402
from patcher.proof.host_cuda import cuda_on_host, host_only_pinning  # noqa: E402
from patcher.proof.shards import write_shards  # noqa: E402
from patcher.templates.prefetch_loader import _prefetch_iterator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(script: Path, steps: int, compute_ms: float, shard_tokens: int) -> dict:
    """The three sides' step times (ms lists) and ratios; see the module docstring."""
    source = script.read_text()
    patched = patch_source(source).source
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="generator-staging-") as data, host_only_pinning([]), cuda_on_host():
        write_shards(data, train_shards=4, val_shards=1, tokens_per_shard=shard_tokens, vocab_size=50257, bos_id=1, doc_len_range=(128, 1024))
        os.environ["DATA_PATH"] = data
        original = load_definitions(definitions_only(source), str(script))
        staged = load_definitions(definitions_only(patched), str(script))

        for module in (original, staged):
            module.__dict__.setdefault("args", module.Hyperparameters())  # left out of a definitions-only import

        def build(module):
            return module.distributed_data_generator(os.path.join(data, "fineweb_train_*.bin"), 4096, 256, grad_accum_steps=1)

        sides = {
            "original": (build(original), _stage_pageable),
            "staged": (build(staged), None),
            "thread": (_prefetch_iterator(lambda: build(original)), None),
        }
        step, ops = _step_function("op-bound", compute_ms)
        times = {name: [] for name in sides}
        for n in range(steps + 3):
            for name, (source_, charge) in sides.items():
                t0 = time.perf_counter()
                item = next(source_)
                if charge is not None:
                    charge(item[:4])
                step()
                if n >= 3:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        sides["thread"][0].shutdown()
    base = statistics.fmean(times["original"])
    return {
        "ops_per_step": ops,
        **{f"mean_step_ms_{k}": round(statistics.fmean(v), 3) for k, v in times.items()},
        **{f"median_step_ms_{k}": round(statistics.median(v), 3) for k, v in times.items()},
        **{f"ratio_{k}": round(statistics.fmean(v) / base, 3) for k, v in times.items() if k != "original"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("script", nargs="?", default=str(ROOT / "fixtures" / "generator_shards.py"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--shard-tokens", type=int, default=2_000_000)
    args = parser.parse_args()
    report = run(Path(args.script), args.steps, args.compute_ms, args.shard_tokens)
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
