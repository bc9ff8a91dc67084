"""`patch-prefetch bench SCRIPT`: how long the training loop waits for data, original vs patched.

The script is patched in memory; the original and the patched training loaders are
built as the scripts build them (`patcher.proof.recipes`, one rank) on synthetic shards of
real size (3 x 100 M tokens by default, so shard loads happen), as rank 0 of an
8-GPU run (the records' configuration) with one torch CPU thread (torchrun sets
OMP_NUM_THREADS=1 when it starts several processes per node; with more, the worker's
torch ops start a second OpenMP team whose spinning threads take the cores the
training loop needs), and driven
**alternately, one step each, in one run**, so both see the same machine. After each
`next_batch` a simulated training step runs:

- `idle`: `time.sleep(compute_ms)`: a GPU-bound step; the GIL is free for the worker.
- `gil-busy` (default): part of the step is pure-Python work that holds the GIL (about
  5 ms, calibrated at start), the rest sleeps: closer to a loop that launches kernels
  from Python, where a producer holding the GIL competes with the training loop.
- `op-bound`: the whole step is a host-bound loop of small torch ops on the main thread,
  each releasing and re-taking the GIL as a kernel launch does; the op count is
  calibrated at start, alone, to `compute_ms`. A producer thread that takes the GIL
  between two ops delays the next one: what it costs shows as a longer step, not as a
  longer wait. The op models the host's share of a CUDA op: by default `torch.add(a, b)`
  on empty tensors (`--op add --op-numel 0`): Python, the dispatcher and a new output
  tensor's metadata each call, but no host data, since a CUDA op's output comes from
  the caching allocator and its compute runs on the GPU. An op with host data (16
  floats) also mallocs and frees 64 bytes per call, which makes both loaders' batch
  allocations costlier afterwards (0.2 -> 0.8 ms for the root script's batch after
  5,000 such ops; `x = x * 1.0001`: 1.5 ms), a cost of the CPU stand-in that no GPU run
  has; `--op add-out --op-numel 16` is the earlier step (`torch.add(..., out=)`, no
  allocation at all). `bench/op_ablation.py` measures each factor.

Per step and side, the step time is measured too: from dropping the previous batch to
the end of the simulated step, `next_batch` included; the original builds its batch
inline on the main thread, as it does in a run. Reported as means (the total over the
measured steps divided by their number, so shard-load stalls count), medians and p99
(`mean_step_ms_*`, `median_step_ms_*`, `p99_step_ms_*`, and the same for the time in
`next_batch`: `*_data_ms_*`). `recovered_share` is the share of the original's mean
data time the patched side recovers as a shorter step:
`(mean_step_ms_original - mean_step_ms_patched) / mean_data_ms_original` (1 = all of
it, 0 = none, negative = the patched step is longer). `step_goal_met`: the patched mean
step is at most the original's minus 80 % of its mean data time and the patched median
step no longer than the original's. Most meaningful in `op-bound` mode.

Measured per step, in ms: the main thread's wait inside `next_batch` (p50, p99, max,
total) for each loader, and the time of the Python work of the step (to see how much
the patched loader's worker slows the main thread). Producer throughput (batches/s)
is measured separately: the original loader's `next_batch` in a tight loop, and the
patched loader's worker filling a queue while the caller only waits (its build
rate). The first `warmup` steps (the cold start, whose first batch is built
synchronously) are left out of the statistics, and the report says how many. Each
rate is the best of three rounds that alternate the two sides;
`producer_batches_per_s_patched` is the default patch's producer, the one the wait
and the step are measured with.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from patcher.proof.compare import queued_batches
from patcher.proof.harness import HarnessError, load_module, scripts_unloaded, swapped
from patcher.proof.host_cuda import active_copies, cuda_on_host, host_only_pinning
from patcher.proof.recipes import LoaderRecipe, hparams_factory, patched_constructions
from patcher.patch import patch_source
from patcher.proof.shards import write_shards
from patcher.proof.timing import DEFAULT_OP, DEFAULT_OP_NUMEL, MAIN_THREAD_MODES, OP_KINDS, STEP_GOAL_SHARE, BenchError, step_function, step_report
from patcher.read.source import read_script
from patcher.templates.staging import _each_tensor

WORLD_SIZE = 8


# The scripts are unloaded once the run's frame is gone: a process that runs several benches
# (a test run) would otherwise keep every run's shared slots and shard memmaps open.
@scripts_unloaded()
def run_bench(
    script: str | Path,
    steps: int = 300,
    compute_ms: float = 20.0,
    main_thread: str = "gil-busy",
    shard_tokens: int = 100_000_000,
    shards: int = 3,
    queue_depth: int = 2,
    seed: int = 0,
    data_dir: str | None = None,
    warmup: int = 3,
    producer_batches: int = 30,
    torch_threads: int | None = 1,
    pageable_h2d: bool = False,
    op: str = DEFAULT_OP,
    op_numel: int = DEFAULT_OP_NUMEL,
    ops_per_step: int | None = None,
    alternate_every: int = 1,
) -> dict:
    """Benchmark one script. Returns the report dict (keys in the module docstring and README).

    pageable_h2d: charge the original's `next_batch` one host copy of its batch, the copy
    into the driver's staging buffer that its pageable `.to("cuda", non_blocking=True)`
    makes on a GPU (`_stage_pageable`); the patched side's hand-out already copies (the
    pinning copy it makes on a GPU), so both sides then pay what they pay in a CUDA run.
    torch_threads: torch's CPU threads during the run (None: as they are); op, op_numel,
    ops_per_step: the op-bound step's op (OP_KINDS), its size in float32 and a fixed op
    count (None: calibrated to `compute_ms`); alternate_every: steps a side runs before
    the other's turn (1: one each).

    Raises BenchError when the script has no training loader the patch prefetches, or
    for an unknown `main_thread` or `op`.
    """
    if main_thread not in MAIN_THREAD_MODES:
        raise BenchError(f"--main-thread must be one of {', '.join(MAIN_THREAD_MODES)}, not {main_thread!r}")
    if op not in OP_KINDS:
        raise BenchError(f"--op must be one of {', '.join(OP_KINDS)}, not {op!r}")
    with bench_loaders(script, shards, shard_tokens, seed, data_dir, queue_depth, torch_threads) as setup:
        build, args = setup.build, setup.args
        threads_used = torch.get_num_threads()
        step, ops = step_function(main_thread, compute_ms, op, op_numel, ops_per_step)
        waits, work, spans = _alternate([build[0], build[1]], args, steps + warmup, step, stage_original=_stage_pageable if pageable_h2d else None, every=alternate_every)
        # Best of a few alternating rounds: the rate a side can reach on this machine.
        rounds = [[_producer_rate(make, args, producer_batches, patched=make is build[1]) for make in build] for _ in range(3)]
        rates = [max(side) for side in zip(*rounds)]
        census = copy_census(setup)
    report = _report(script, steps, warmup, compute_ms, main_thread, queue_depth, waits, work, rates)
    report.update(census)
    report.update(step_report([s[warmup:] for s in spans], [w[warmup:] for w in waits]))
    report["ops_per_step"] = ops
    report["torch_threads"] = threads_used
    report["pageable_h2d"] = pageable_h2d
    report["op"] = op if main_thread == "op-bound" else None
    report["op_numel"] = op_numel if main_thread == "op-bound" else None
    report["alternate_every"] = max(1, int(alternate_every))
    return report


class BenchLoaders:
    """What `bench_loaders` yields.

    build: `[make_original, make_default_patch]`, each `() -> loader`; args: the
    `next_batch` arguments of rank 0; spaces: the two scripts' namespaces; on_cuda:
    the same two builders for a CUDA device (call them inside `cuda_on_host`).
    """

    def __init__(self, build, args, spaces, on_cuda=None):
        self.build, self.args, self.spaces, self.on_cuda = build, args, spaces, on_cuda


@contextlib.contextmanager
def bench_loaders(script, shards: int = 3, shard_tokens: int = 100_000_000, seed: int = 0, data_dir=None, queue_depth: int = 2, torch_threads: int | None = 1):
    """The original's and the patched scripts' training loaders of rank 0 of 8, ready to build.

    Patches `script` in memory (a default patch), writes `shards` synthetic shards of
    `shard_tokens` tokens into `data_dir` (reused when their count and size match;
    None: a temporary directory), loads both scripts and yields a `BenchLoaders`.
    Inside, torch runs `torch_threads` CPU threads (None: as many as before), CUDA
    pinning is a host-only stand-in, and the shards stay.
    Raises BenchError when the script has no training loader the patch prefetches.
    """
    original_source = read_script(script).source
    # The wait and the step are measured with what a default patch gives; the
    # producer-rate rounds wait for a full queue.
    result = patch_source(original_source, keep=frozenset({"wait_full"}))
    if "train_prefetch" not in result.applied:
        reasons = "; ".join(n.reason for n in result.skipped if n.feature == "train_prefetch") or "no training loader"
        raise BenchError(f"{script}: nothing to benchmark: {reasons}")
    try:
        recipe = LoaderRecipe.from_source(original_source)
    except HarnessError as error:
        raise BenchError(f"{script}: {error}") from None
    patched_site = patched_constructions(result.source, recipe)[0]
    threads = torch.get_num_threads() if torch_threads is None else torch_threads
    with _shard_dir(data_dir) as directory, host_only_pinning([]), swapped(torch.get_num_threads, torch.set_num_threads, threads):
        _ensure_shards(directory, shards, shard_tokens, seed)
        modules = load_module(original_source, str(script)), load_module(result.source, str(script))
        # Rank 0 of the record's own configuration, 8 GPUs: in the TokenStream family every
        # rank's stream advances by the global batch per step, so shard loads come as often
        # as in a real run.
        make_hp = hparams_factory(recipe, modules[0], WORLD_SIZE, directory)
        spaces = [recipe.namespace(mod, make_hp(0), 0, WORLD_SIZE, torch.device("cpu")) for mod in modules]
        args = recipe.arguments(spaces[0], 0, [getattr(make_hp(0), "train_seq_len", 1024)])
        binding = recipe.constructions[0].binding

        def builders(space_of):
            """[make_original, make_default_patch], each side built in `space_of(side)`."""
            return [
                lambda: recipe.build(recipe.constructions[0], space_of(0)),
                lambda: _with_depth(recipe.evaluate(patched_site, space_of(1), binding), queue_depth),
            ]

        # On CUDA a side's namespace is made when its loader is built (inside `cuda_on_host`).
        on_cuda = builders(lambda side: recipe.namespace(modules[side], make_hp(0), 0, WORLD_SIZE, torch.device("cuda", 0)))
        yield BenchLoaders(builders(spaces.__getitem__), args, spaces, on_cuda)


def copy_census(setup: BenchLoaders, batches: int = 6) -> dict:
    """H2D copies per `next_batch` of each side on the CUDA path driven with host memory
    (`host_cuda.AsyncCopies`): {"blocking_copies_per_batch_original", ..._patched,
    "async_copies_per_batch_original", ..._patched}. A blocking copy (from pageable
    memory, or not `non_blocking`) makes the host wait on a GPU: behind queued kernels a
    pageable 8 MB `.to("cuda")` took 21.3 ms (docs/measurements.md); an asynchronous one
    from pinned memory returns at once. The loaders are drawn `batches` times after one
    draw left out (a producer's first batch)."""
    census = {}
    with cuda_on_host(run_ahead=0):
        model = active_copies()
        for make, name in zip(setup.on_cuda, ("original", "patched")):
            loader = make()
            try:
                loader.next_batch(*setup.args)
                blocking, issued = model.blocking, model.issued
                for _ in range(batches):
                    loader.next_batch(*setup.args)
                    model.drain()
                census[f"blocking_copies_per_batch_{name}"] = round((model.blocking - blocking) / batches, 2)
                census[f"async_copies_per_batch_{name}"] = round((model.issued - issued - (model.blocking - blocking)) / batches, 2)
            finally:
                _close(loader)
    return census


def _with_depth(loader, depth: int):
    """`loader` (a default patch's, which has no `TRAIN_PREFETCH_QUEUE` toggle) set to
    prefetch `depth` batches ahead; both runtimes read their depth at the first call."""
    for attr in ("depth", "_depth"):
        if hasattr(loader, attr):
            setattr(loader, attr, depth)
    return loader


class _shard_dir:
    """The given directory (kept), or a temporary one (removed)."""

    def __init__(self, path):
        self.path, self.tmp = path, None

    def __enter__(self):
        if self.path is not None:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            return str(self.path)
        self.tmp = tempfile.TemporaryDirectory(prefix="patch-prefetch-bench-")
        return self.tmp.name

    def __exit__(self, *exc):
        if self.tmp is not None:
            self.tmp.cleanup()


def _ensure_shards(directory: str, shards: int, tokens: int, seed: int) -> None:
    expected = 256 * 4 + 2 * tokens
    files = sorted(Path(directory).glob("fineweb_train_*.bin"))
    if len(files) == shards and all(f.stat().st_size == expected for f in files):
        return  # reuse shards from an earlier run
    for f in files:  # another count or size: none of the old ones may stay behind
        f.unlink()
    write_shards(directory, train_shards=shards, val_shards=1, tokens_per_shard=tokens, vocab_size=1024, seed=seed)


def _stage_pageable(batch):
    """A host copy of every tensor of `batch`: what a pageable H2D copy costs the calling
    thread on a GPU, where `.to("cuda", non_blocking=True)` from pageable memory first
    copies the bytes into the driver's pinned staging buffer (CUDA runtime API,
    "API synchronization behavior"; a lower bound: the DMA is not modelled)."""
    return _each_tensor(batch, torch.Tensor.clone)


def _alternate(build, args, steps, step, stage_original=None, every: int = 1, drops=None):
    """Both loaders driven alternately, `every` steps each in turn (1: one step each), `steps` steps a side.

    Takes: build: `[make_original, make_patched]`, each `() -> loader`; args: the
    `next_batch` arguments; step: `() -> ms`, one simulated training step, run on this
    (the main) thread after each `next_batch`, returning the ms of its main-thread
    work; stage_original: None, or `batch -> batch` run on the original's batch inside
    its timed `next_batch` (`_stage_pageable`); every: steps a side runs before the
    other side's turn; drops: None, or `[[], []]` that receives per side the ms of
    dropping the previous batch. The original's `next_batch` runs here, inline, as in a
    run. Returns `(waits, work, spans)`, each `[original, patched]` lists of ms per step:
    the time in `next_batch`, the step's main-thread work, and the whole step (dropping
    the previous batch, `next_batch` and the simulated step).
    """
    loaders = [make() for make in build]
    waits: list[list[float]] = [[], []]
    work: list[list[float]] = [[], []]
    spans: list[list[float]] = [[], []]
    # Each side holds its batch through its step and drops it before the next call, as
    # a training loop does: freeing a batch (munmap of its host memory, tens of µs) is
    # the step's cost, not the wait's.
    held: list = [None, None]
    clock = time.perf_counter
    every = max(1, int(every))
    try:
        for block in range(0, steps, every):
            for side in (0, 1):
                for _ in range(min(every, steps - block)):
                    start = clock()
                    held[side] = None
                    t0 = clock()
                    if drops is not None:
                        drops[side].append((t0 - start) * 1e3)
                    held[side] = loaders[side].next_batch(*args)
                    if side == 0 and stage_original is not None:
                        held[side] = stage_original(held[side])
                    waits[side].append((clock() - t0) * 1e3)
                    work[side].append(step())
                    spans[side].append((clock() - start) * 1e3)
    finally:
        _close(loaders[1])
    return waits, work, spans


def _producer_rate(make, args, batches: int, patched: bool) -> float:
    """Batches per second the data source sustains, building `batches` batches that stay alive.

    Original: its `next_batch` in a tight loop, keeping the batches (a queue keeps them
    alive too; the allocator then has the same work on both sides). Patched: the
    worker's build rate, the batches built into a prefetch queue of depth `batches`
    after the first one, while the caller only waits for the queue to fill (a consumer
    pulling batches in a tight loop would measure the GIL hand-off between two threads).
    """
    loader = make()
    try:
        if not patched:
            loader.next_batch(*args)  # cold start (shard load) left out
            t0 = time.perf_counter()
            kept = [loader.next_batch(*args) for _ in range(batches)]
            return len(kept) / (time.perf_counter() - t0)
        _with_depth(loader, batches)  # `batches` slots or queue places, read at the first call
        lean = hasattr(loader, "lent")  # templates/prefetch_lean.py
        if lean:
            wait_full = lambda timeout: _wait_queued(loader, batches, timeout)
        loader.next_batch(*args)  # cold start: worker start and its first batch
        t0 = time.perf_counter()
        if not lean:
            loader._worker.queue.room()
            wait_full = loader._worker.queue.wait_full
        if not wait_full(timeout=60.0):
            raise BenchError("the prefetch worker did not fill its queue within 60 s")
        return batches / (time.perf_counter() - t0)
    finally:
        _close(loader)


def _wait_queued(loader, count: int, timeout: float) -> bool:
    """Poll (every ms) until the process producer of `loader` has `count` batches
    waiting (`queued_batches`); False after `timeout` s."""
    deadline = time.monotonic() + timeout
    while queued_batches(loader) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _close(loader) -> None:
    shutdown = getattr(type(loader), "shutdown", None)
    if shutdown is not None:
        shutdown(loader)


def _stats(values: list[float]) -> dict:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1], "total": sum(ordered)}


def _report(script, steps, warmup, compute_ms, main_thread, queue_depth, waits, work, rates) -> dict:
    report = {"script": str(script), "steps": steps, "warmup_steps_excluded": warmup, "compute_ms": compute_ms, "main_thread": main_thread, "queue_depth": queue_depth}
    for side, name in ((0, "original"), (1, "patched")):
        for key, value in _stats(waits[side][warmup:]).items():
            report[f"wait_ms_{name}_{key}"] = round(value, 4)
    # Every ratio of the report reads patched / original, as the printed summary does.
    report["wait_ratio_patched_over_original"] = round(report["wait_ms_patched_total"] / report["wait_ms_original_total"], 3) if report["wait_ms_original_total"] else None
    report["producer_batches_per_s_original"] = round(rates[0], 2)
    report["producer_batches_per_s_patched"] = round(rates[1], 2)
    report["producer_ratio"] = round(rates[1] / rates[0], 3) if rates[0] else None
    if main_thread in ("gil-busy", "op-bound"):
        original, patched = statistics.mean(work[0][warmup:]), statistics.mean(work[1][warmup:])
        report["main_thread_slowdown_pct"] = round(100.0 * (patched / original - 1.0), 2)
    else:
        report["main_thread_slowdown_pct"] = None
    return report


# What a figure of this bench can tell, said under its summary line.
CPU_FIGURE_NOTE = (
    "(a CPU figure: it tells whether the producer takes the batch work off the training loop and what it costs "
    "that loop; it counts the copies that make the host wait on a GPU but cannot time that wait: "
    "on a GPU, run `patch-prefetch ab ORIGINAL PATCHED`)"
)


# Below this share of the original's mean step, its data time is too small to show as a
# shorter step on a CPU: the step's own spread is about as large.
SMALL_DATA_SHARE = 0.05


def print_table(report: dict, stream) -> None:
    ops = f" ({report['ops_per_step']} torch ops a step, {report['op']} on {report['op_numel']} float32)" if report.get("ops_per_step") else ""
    print(f"{report['script']}: {report['steps']} steps ({report['warmup_steps_excluded']} warm-up steps left out), "
          f"{report['compute_ms']} ms step, main thread {report['main_thread']}{ops}, queue depth {report['queue_depth']}, {report['torch_threads']} torch thread(s)"
          + (", the original charged its pageable H2D's host copy" if report.get("pageable_h2d") else ""), file=stream)
    print(f"  {'wait per step (ms)':22} {'p50':>9} {'p99':>9} {'max':>9} {'total':>10}", file=stream)
    for name in ("original", "patched"):
        row = [report[f"wait_ms_{name}_{k}"] for k in ("p50", "p99", "max", "total")]
        print(f"  {name:22} {row[0]:9.3f} {row[1]:9.3f} {row[2]:9.3f} {row[3]:10.1f}", file=stream)
    print(f"  total wait, patched / original: {_ratio(report['wait_ms_patched_total'], report['wait_ms_original_total'], 'waited')}", file=stream)
    rates = report["producer_batches_per_s_original"], report["producer_batches_per_s_patched"]
    print(f"  producer: original {rates[0]} batches/s, patched {rates[1]} batches/s; patched / original: {_ratio(rates[1], rates[0], 'built')}", file=stream)
    slowdown = report["main_thread_slowdown_pct"]
    if slowdown is not None:
        work = "op loop" if report["main_thread"] == "op-bound" else "Python work"
        how = "unchanged" if slowdown == 0 else f"{abs(slowdown)} % {'slower' if slowdown > 0 else 'faster'}"
        print(f"  main thread's {work} beside the patched loader: {how}", file=stream)
    print(f"  {'step time (ms)':22} {'mean':>9} {'median':>9} {'p99':>9}   {'data mean':>9} {'median':>9} {'p99':>9}", file=stream)
    for name in ("original", "patched"):
        row = [report[f"{k}_{kind}_ms_{name}"] for kind in ("step", "data") for k in ("mean", "median", "p99")]
        print(f"  {name:22} {row[0]:9.3f} {row[1]:9.3f} {row[2]:9.3f}   {row[3]:9.3f} {row[4]:9.3f} {row[5]:9.3f}", file=stream)
    if "blocking_copies_per_batch_original" in report:
        print(f"  H2D copies per batch on the CUDA path: original {_copies(report, 'original')}; patched {_copies(report, 'patched')} "
              "(on a GPU a blocking copy waits for the work queued before it; docs/measurements.md)", file=stream)
    verdict, advice = _verdict(report)
    print(f"  verdict: {verdict}", file=stream)
    if advice:
        print(f"  advice: {advice}", file=stream)
    print(f"  {CPU_FIGURE_NOTE}", file=stream)


def _copies(report: dict, side: str) -> str:
    return f"{report[f'blocking_copies_per_batch_{side}']:g} blocking, {report[f'async_copies_per_batch_{side}']:g} asynchronous from pinned memory"


def _ratio(patched: float, original: float, verb: str) -> str:
    """`patched / original` as a number and in words: "1.33 (the patched side waited
    longer)"; "-" when `original` is 0."""
    if not original:
        return "-"
    return f"{patched / original:.3g} (the patched side {verb} {ratio_word(patched / original, verb)})"


def ratio_word(ratio: float, verb: str) -> str:
    """The word for a ratio patched / original: for `verb` "waited", "less", "longer" or
    "as long"; for "built", "fewer", "more" or "as many". A ratio that rounds to 1.00 is
    "as long" / "as many", so no word contradicts a printed 1.0."""
    if round(ratio, 2) == 1.0:
        return "as long" if verb == "waited" else "as many"
    return ("longer" if ratio > 1 else "less") if verb == "waited" else ("more" if ratio > 1 else "fewer")


def _verdict(report: dict) -> tuple[str, str | None]:
    """The step goal's verdict in words, and one line of advice (None when the goal was
    met on a data time large enough to tell). The goal: `step_report`'s `step_goal_met`."""
    data = report["mean_data_ms_original"]
    step = report["mean_step_ms_original"]
    saved = step - report["mean_step_ms_patched"]
    share = report["recovered_share"]
    goal = f"(goal {100 * STEP_GOAL_SHARE:.0f} %, and a median step no longer)"
    longer = f"the patched step is {abs(saved):.3f} ms {'shorter' if saved >= 0 else 'longer'} on average"
    small = data < SMALL_DATA_SHARE * step
    if share is None:
        verdict = f"not measured: the original's next_batch took no measurable time, so no data time could be recovered as a shorter step {goal}; {longer}"
    else:
        met = "goal met" if report["step_goal_met"] else "goal not met"
        verdict = f"{met}: data time recovered as a shorter step: {100 * share:.1f} % of the original's {data:.3f} ms {goal}; {longer}"
        if report["step_goal_met"] and not small:
            return verdict, None
    if small:
        return verdict, (
            f"the original's next_batch takes {data:.3f} ms of its {step:.3f} ms step here, less than {100 * SMALL_DATA_SHARE:.0f} %: "
            "the loader's work is too small to hide on this machine (the step's own spread is as large); on your GPU, "
            "`patch-prefetch ab ORIGINAL PATCHED` measures what a run gains"
        )
    steps_per_s = 1e3 / report["mean_step_ms_patched"] if report["mean_step_ms_patched"] else 0.0
    if report["producer_batches_per_s_patched"] < steps_per_s:
        return verdict, (
            f"the producer builds {report['producer_batches_per_s_patched']} batches/s, fewer than the {steps_per_s:.1f} steps/s "
            "of the loop: it cannot stay ahead on this machine (a deeper --queue-depth only absorbs bursts)"
        )
    slowdown = report["main_thread_slowdown_pct"]
    if slowdown is not None and slowdown > 2.0:
        return verdict, (
            f"the producer slows the main thread's work by {slowdown} %: it competes with the training loop for this machine's "
            "cores and the GIL; measure where the run happens: `patch-prefetch ab ORIGINAL PATCHED` on your GPU"
        )
    return verdict, "the step did not shorten by the data time on this machine; `patch-prefetch ab ORIGINAL PATCHED` on your GPU measures what a run gains"
