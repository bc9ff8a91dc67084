"""Which batch a data-loader module hands out changes when the host runs ahead of the GPU.

    python bench/run_ahead.py DATALOADER [--patched PATCHED] [--batches 12] [--max-run-ahead 4]

Drives a data-loader module's generator (nanochat's `dataloader.py`, found as the
"module" family finds it) the way `verify` does: a synthetic parquet corpus, a byte-level
tokenizer stand-in, rank 0. The reference is the loader on the CPU. Each case runs on
the CUDA path driven with host memory under the model of asynchronous copies
(`patcher.proof.host_cuda.AsyncCopies`), the host K micro-steps ahead of the GPU, for
K = 0 .. --max-run-ahead, called two ways:

- `device=torch.device("cuda", 0)`, as `scripts/base_train.py` passes `compute_init`'s device;
- `device="cuda"`, the string.

Printed per case: the first batch that differs from the reference (or "identical"), the
blocking H2D copies per `next()` (on a GPU each waits for every kernel queued before it:
the host's run-ahead drained) and the asynchronous ones. With --patched, the patched
module is run the same way (its spawned producer, a fresh pinned block per copy).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from patcher.proof import host_cuda  # noqa: E402
from patcher.proof.compare import InFlight, first_difference  # noqa: E402
from patcher.proof.module_verify import CALL, ByteTokenizer, _draw, module_loader, package_importable, write_corpus, write_package  # noqa: E402

CALLS = (("torch.device('cuda', 0)", torch.device("cuda", 0)), ("'cuda'", "cuda"))


def first_changed(loader_fn, device_param: str, device, reference: list, run_ahead: int) -> tuple[str, float, float]:
    """(verdict, blocking copies per next(), asynchronous copies per next()) of one case."""
    with host_cuda.cuda_on_host(run_ahead=run_ahead):
        model = host_cuda.active_copies()
        generator = loader_fn(ByteTokenizer(), **CALL, **{device_param: device})
        window, verdict = InFlight(), None
        try:
            for n in range(len(reference)):
                for m, batch in window.drawn(n, next(generator)):
                    verdict = verdict or _differs(reference[m], batch, m)
            for m, batch in window.landed():
                verdict = verdict or _differs(reference[m], batch, m)
        finally:
            generator.close()
        per = len(reference)
        return verdict or f"identical over {per} batches", model.blocking / per, (model.issued - model.blocking) / per


def _differs(expected, got, n: int) -> str | None:
    found = first_difference(expected[:2], tuple(got[:2]))
    return None if found is None else f"batch {n} differs ({'inputs' if found[0] == 0 else 'targets'}: {found[1]})"


def cases(dataloader: Path, patched: Path | None, batches: int, run_aheads, calls=CALLS):
    """Yield (module, device shown, K, verdict, blocking per next(), asynchronous per next())
    for the original (and `patched`) module, each call of `calls`, each K of `run_aheads`.
    Raises LookupError when the module has no loader module mode rewrites."""
    original = dataloader.read_text()
    loader = module_loader(original)
    if loader is None:
        raise LookupError(f"{dataloader}: no data-loader generator that module mode rewrites")
    with tempfile.TemporaryDirectory(prefix="run-ahead-") as tmp:
        tmp = Path(tmp)
        package, _ = write_package(tmp, original, patched.read_text() if patched else original, dataloader.stem, [])
        (tmp / "data").mkdir()
        write_corpus(tmp / "data")
        with package_importable(tmp, package):
            os.environ.update(PATCH_PREFETCH_PARQUET_DIR=str(tmp / "data"), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            modules = {"original": importlib.import_module(f"{package}._verify_original")}
            if patched:
                modules["patched"] = importlib.import_module(f"{package}.{dataloader.stem}")
            reference = _draw(getattr(modules["original"], loader.name)(ByteTokenizer(), **CALL, **{loader.device: "cpu"}), batches)
            for label, module in modules.items():
                for shown, device in calls:
                    for k in run_aheads:
                        yield (label, shown, k, *first_changed(getattr(module, loader.name), loader.device, device, reference, k))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataloader")
    parser.add_argument("--patched", default=None)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--max-run-ahead", type=int, default=4)
    args = parser.parse_args()
    print(f"{'module':9} {'device':24} {'K':>2}  {'blocking/next':>13} {'async/next':>10}  verdict")
    try:
        for label, shown, k, verdict, blocking, asynchronous in cases(Path(args.dataloader), Path(args.patched) if args.patched else None, args.batches, range(args.max_run_ahead + 1)):
            print(f"{label:9} {shown:24} {k:>2}  {blocking:>13.2f} {asynchronous:>10.2f}  {verdict}", flush=True)
    except LookupError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
