"""`bench` for a data-loader module (module mode, the "module" driver's sources): nanochat's `dataloader.py`.

The module and its patched version (patched here, the default features) are driven side
by side, rank 0 of 1, on a synthetic parquet corpus of nanochat-like documents with the
byte-level test tokenizer of `module_verify`, at nanochat's packing sizes
(`buffer_size=1000`, `tokenizer_batch_size=128`, rows of `T + 1` tokens). Each measured
step is `next(loader)` then the simulated step of `bench` (`--main-thread op-bound`: a
host-bound loop of small torch ops calibrated to `--compute-ms`; `idle`: a sleep).
The two sides alternate within one run, `BLOCK_STEPS` steps each in turn (both
generators open from the start, so the patched side's producer also runs during the
original's turns, as it would beside a training loop): run one after the other, the
step figures followed the host's load more than the patch.
Reported as `timing.step_report` does: mean / median / p99 step and data ms per side and
`recovered_share`, the share of the original's data time the patched step gives back.
The spawned producer's start (importing torch and pyarrow) is outside the measured
steps: `warmup` batches are drawn first on each side.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path

from patcher.patch import patch_source
from patcher.proof import timing
from patcher.proof.module_verify import ByteTokenizer, module_loader, package_importable, write_package
from patcher.read.source import read_script

# Steps a side runs before the other side's turn (both loaders stay open throughout).
BLOCK_STEPS = 5
# nanochat's defaults, at a sequence length this CPU packs in milliseconds
CALL = {"B": 8, "T": 512, "split": "train", "tokenizer_threads": 1, "tokenizer_batch_size": 128, "buffer_size": 1000}


def write_corpus(directory: Path, docs: int, seed: int = 0) -> None:
    """Two train files and a val file of documents of 100-4000 characters, 256 a row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    for f in range(3):
        texts = [" ".join(rng.choice(words) for _ in range(int(rng.lognormvariate(5.0, 0.8)) + 20)) for _ in range(docs // 2)]
        pq.write_table(pa.table({"text": texts}), directory / f"shard_{f:05d}.parquet", row_group_size=256)


def run_module_bench(path, steps: int = 100, compute_ms: float = 20.0, main_thread: str = "op-bound", warmup: int = 3, block: int = BLOCK_STEPS) -> dict:
    """Bench the module at `path` against its patched version, `steps` measured steps a
    side, the sides alternating every `block` steps in one run. Returns the report dict
    (ms; `recovered_share`: a fraction, see `timing.step_report`)."""
    source = read_script(path).source
    loader = module_loader(source)
    if loader is None:
        raise timing.BenchError(f"{path}: no data-loader generator that module mode rewrites")
    patched = patch_source(source).source
    import torch

    torch.set_num_threads(1)  # as torchrun gives each rank
    step, ops = timing.step_function(main_thread, compute_ms)
    call = {k: v for k, v in CALL.items() if k in {p.name.value for p in loader.function.params.params + loader.function.params.kwonly_params}}
    tokens = (steps + warmup) * call.get("B", 8) * (call.get("T", 512) + 1)
    with tempfile.TemporaryDirectory(prefix="bench-module-") as tmp:
        tmp = Path(tmp)
        package, _ = write_package(tmp, source, patched, Path(path).stem, [])
        data = tmp / "data"
        data.mkdir()
        write_corpus(data, docs=max(4000, tokens // 300))
        with package_importable(tmp, package):
            os.environ.update(PATCH_PREFETCH_PARQUET_DIR=str(data), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            import importlib

            functions = [getattr(importlib.import_module(f"{package}.{m}"), loader.name) for m in ("_verify_original", Path(path).stem)]
            spans, waits = [[], []], [[], []]
            generators = [function(ByteTokenizer(), **call, **{loader.device: "cpu"}) for function in functions]
            batches = [None, None]
            try:
                for generator in generators:
                    for _ in range(warmup):
                        next(generator)
                # Both sides in turn, `block` steps each, until each has run `steps`: a
                # change of the host's load falls on both alike.
                while len(spans[1]) < steps:
                    for side, generator in enumerate(generators):
                        for _ in range(min(block, steps - len(spans[side]))):
                            t0 = time.perf_counter()
                            batches[side] = None  # the previous batch is dropped, as a training step does
                            batches[side] = next(generator)
                            t1 = time.perf_counter()
                            step()
                            waits[side].append((t1 - t0) * 1e3)
                            spans[side].append((time.perf_counter() - t0) * 1e3)
            finally:
                for generator in generators:
                    generator.close()
    report = {"script": str(path), "family": loader.family.name, "steps": steps, "block_steps": block, "compute_ms": compute_ms, "main_thread": main_thread, "ops_per_step": ops, "call": call}
    report.update(timing.step_report(spans, waits))
    return report


def print_module_report(report: dict, stream) -> None:
    """The report's values one a line, then the step time recovered (%) as `bench` prints it."""
    for key, value in report.items():
        print(f"{key}: {value}", file=stream)
    share = report["recovered_share"]
    print(f"data time recovered as a shorter step: {'-' if share is None else f'{100 * share:.1f} %'} of the original's "
          f"(mean step {report['mean_step_ms_original']:.3f} -> {report['mean_step_ms_patched']:.3f} ms, mean data {report['mean_data_ms_original']:.3f} -> {report['mean_data_ms_patched']:.3f} ms; "
          f"sides alternated every {report['block_steps']} steps)", file=stream)
