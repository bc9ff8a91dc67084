"""One rank of verify's drivers (`patcher.proof.verify.DRIVERS`): both data sources driven side by side.

A loader class: the original's batches drawn once per rank (`reference_batches`), then
the patched script's constructions run in one `Configuration` and every batch compared
when handed out and again when the next is taken; the warm-up loader's threads must be
gone after the script rebuilds it (`compare_loader_rank`). A data generator: both
generators advanced item by item with `next()`, or `.send(value)` at the items of
the plan (`patcher.proof.generator_plan`, `compare_generator_rank`).
"""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field

from patcher.proof import host_cuda
from patcher.proof.compare import CannotVerify, ChildProcess, Difference, DrawTimeout, GlobalRng, InFlight, close, compare_phases, copy_batch, describe_leak, draw_deadline, first_difference, harness_step, one_line, queued_batches, reset_producer, script_threads, still_alive, thread_kind, thread_starts
from patcher.proof.harness import SimulatedDist, environment
from patcher.proof.host_cuda import cuda_as_host, cuda_on_host, device_for, host_only_pinning
from patcher.proof.loop_calls import script_seeding, seed
from patcher.proof.loop_order import early_fetch_line
from patcher.proof.recipes import IteratorRecipe, LoaderRecipe


@dataclass
class Plan:
    """How a loader class is driven on every rank: `hparams_for(rank)` -> that rank's
    Hyperparameters instance (on the synthetic shards), the world size, the batches of
    the warm-up (0 where the script builds its loader once) and after the rebuild, and
    the sequence lengths a per-step `next_batch` argument cycles through. shard_tokens:
    tokens per synthetic train shard (`train_shards` of them, 4 unless a loader that
    reads past its data needs another layout); read_once_tokens: the size at which
    the longest phase reads no shard twice (what a loader that does not wrap around needs)."""

    hparams_for: object
    world_size: int
    warmup: int
    batches: int
    seq_lens: list[int]
    shard_tokens: int = 0
    read_once_tokens: int = 0
    train_shards: int = 4


class ShardsRanOut(CannotVerify):
    """The original's loader failed as reading past the end of its data does
    (IndexError, StopIteration, EOFError after at least one batch): a loader that walks
    its shards once, as a run over real shards does, and does not wrap around."""


@dataclass
class Configuration:
    """One way of running the patched loader: its toggles, the device it hands batches to, the ranks."""

    label: str
    env: dict
    host_cuda: bool
    ranks: object  # a container of ranks, or None for all


def loader_phases(recipe: LoaderRecipe, plan: Plan) -> list[tuple[str, int, int]]:
    """(phase, construction index, batches): the warm-up on the first construction, then the last one."""
    if plan.warmup:
        return [("warmup", 0, plan.warmup), ("train", len(recipe.constructions) - 1, plan.batches)]
    return [("train", 0, plan.batches)]


@dataclass
class Reference:
    """The original's batches of one rank: `batches[phase][n]`, a private copy of each
    as handed out, and per phase whether the original itself changed a batch it had
    handed out (a loader that reuses its buffers: then the later re-check is skipped);
    leaked: the kinds of thread (`thread_kind`) of the original's warm-up loader still
    running at the end of the phase after its rebuild, with their counts (a script
    loader's own idle thread pool, which the patched script keeps as well)."""

    batches: dict
    reuses: dict
    leaked: collections.Counter = field(default_factory=collections.Counter)
    on_cuda: bool = True  # drawn on the CUDA path (host memory), else on a CPU device: sharing compares only on the same path


def reference_batches(recipe: LoaderRecipe, module, plan: Plan, rank: int, notes: list[str], timeout_s: float, seeded: bool = False, on_cuda: bool = True) -> Reference:
    """Draw the original's batches of `rank` for every phase (on the CUDA path driven
    with host memory). Raises CannotVerify when the original cannot be built or drawn
    from here (a module it needs is missing, the configuration breaks its rules), and
    DrawTimeout when a batch takes longer than `timeout_s` seconds. seeded: the script's
    own global seeding before it builds its loader is made first (`loop_calls.script_seeding`).
    on_cuda False: drawn on a CPU device, as a CPU-only run draws them, where the tensors
    of a batch may share memory that the CUDA path's copies keep apart."""
    batches, reuses, leaked = {}, {}, collections.Counter()
    with contextlib.ExitStack() as context, host_cuda.reference_side(), GlobalRng():  # the same global random state as the patched side's; copies as meant
        _enter_device(context, on_cuda, notes)
        ns = recipe.namespace(module, plan.hparams_for(rank), rank, plan.world_size, device_for(on_cuda))
        if seeded:
            seed(script_seeding(recipe, ns))
        loader, started_with = None, script_threads()
        try:
            for p, (phase, index, count) in enumerate(loader_phases(recipe, plan)):
                # The warm-up loader is dropped as the script drops it when it builds the next (not shut down).
                earlier = script_threads() - started_with
                loader = harness_step(lambda: recipe.build(recipe.constructions[index], ns), f"building the original loader ({recipe.constructions[index].target} = ..., line {recipe.constructions[index].line}) for rank {rank}")
                drawn, copies, changed = [], [], False
                for n in range(count):
                    if drawn and not changed and first_difference(copies[-1], drawn[-1]) is not None:
                        changed = True
                    what = f"the original loader's batch {n} ({phase}) on rank {rank}"
                    with draw_deadline(timeout_s):
                        batch = harness_step(lambda: _draw_original(loader, recipe.arguments(ns, n, plan.seq_lens), n, plan, what), what)
                    drawn.append(batch)
                    copies.append(copy_batch(batch))
                batches[phase], reuses[phase] = copies, changed
                if p > 0:
                    leaked.update(thread_kind(t) for t in earlier if t.is_alive())
        finally:
            close(loader)
    return Reference(batches, reuses, leaked, on_cuda)


def _enter_device(context: contextlib.ExitStack, on_cuda: bool, notes: list[str]) -> None:
    """Enter, on `context`, the device a side's batches are drawn for: the CUDA path driven
    with host memory (`cuda_on_host`), or what a CPU-only run sees (pinning requests as
    plain host memory; a loader that calls .cuda() itself keeps its batches on the host)."""
    if on_cuda:
        context.enter_context(cuda_on_host(notes))
    else:
        context.enter_context(host_only_pinning(notes))
        context.enter_context(cuda_as_host(notes))


def _draw_original(loader, arguments: tuple, n: int, plan: Plan, what: str):
    """`loader.next_batch(*arguments)`; raises ShardsRanOut where batch `n` > 0 fails as
    reading past the end of the data does."""
    try:
        return loader.next_batch(*arguments)
    except (IndexError, StopIteration, EOFError) as error:
        if not n:
            raise
        raise ShardsRanOut(f"{what} fails here: {type(error).__name__}: {one_line(error)}, on {plan.train_shards} synthetic shards of {plan.shard_tokens} tokens") from None


# A replaced loader's worker threads have this long to end (its shutdown waits 1 s).
REBUILD_GRACE_S = 3.0


def compare_loader_rank(recipe: LoaderRecipe, patched_sites: list[str], module, plan: Plan, rank: int, reference: Reference, configuration: Configuration, notes: list[str], timeout_s: float, calls: LoaderRecipe | None = None, leaks: list[str] | None = None, phase_calls: dict | None = None, call_where: dict | None = None, seeded: bool = False) -> Difference | None:
    """Run the patched script's constructions of `rank` in `configuration` and compare
    every batch with the original's; the first difference, or None. Raises
    CannotVerify when the patched loader hangs (no batch within `timeout_s` seconds).

    The warm-up loader is not shut down here: the script's rebuild must do it (its
    worker threads, found by `threading.enumerate()`, must be gone after it, but for
    the producer the rebuild reset and the new loader holds: `reset_producer`). Each
    batch is compared when handed out and again just before the next is taken. An
    exception from the patched loader is a difference at that batch. calls: whose
    `next_batch` arguments the patched loader gets (a hand-edited script's own loop;
    None: the original's). leaks: where a thread or child process of the warm-up loader
    (beyond those the original leaves) is still alive after the rebuild, a line each
    (`describe_leak`) is appended here; that is no difference in the batches, which
    are still compared. phase_calls: construction index -> the recipe whose `next_batch`
    arguments drive that phase (a hand-edited call, `loop_calls.loop_calls`; None:
    `calls`' for every phase; the phases it does not name: the original's), and call_where: that call's line, for the
    difference. seeded: the patched script's own global seeding is made first (`calls`' or the original's).
    Whether tensors of a batch share memory is compared only against a reference drawn
    on the same path (`Reference.on_cuda`): the CUDA path's copies keep them apart.
    """
    sharing = reference.on_cuda == configuration.host_cuda
    loader = None
    started_with, leaked = script_threads(), []
    # A hand-edited loop that fetches the next batch before it uses this one: each batch
    # must hold across the next call, and is compared where the loop uses it.
    early_at = _early_fetches(calls) if calls is not None else {}
    with contextlib.ExitStack() as context:
        context.enter_context(GlobalRng())  # the same global random state as the original's side
        started = context.enter_context(thread_starts())
        _enter_device(context, configuration.host_cuda, notes)
        ns = recipe.namespace(module, plan.hparams_for(rank), rank, plan.world_size, device_for(configuration.host_cuda))
        if seeded:
            seed(script_seeding(calls or recipe, ns))
        try:
            for p, (phase, index, count) in enumerate(loader_phases(recipe, plan)):
                if loader is not None:  # the warm-up loader's producer as far ahead as it goes: a rebuild must drop those batches
                    _producer_caught_up(loader)
                before_build = script_threads()
                earlier = before_build - started_with
                loader = harness_step(lambda: recipe.evaluate(patched_sites[index], ns, recipe.constructions[index].binding), f"building the patched loader (line {recipe.constructions[index].line}'s construction) for rank {rank}")
                kept = reset_producer(loader) & earlier  # the producer the rebuild reset: it serves the new loader
                if p > 0:
                    leaked = still_alive(earlier - kept, REBUILD_GRACE_S, reference.leaked)
                    if leaked and leaks is not None:
                        leaks.extend(f"rank {rank}, {configuration.label}: still alive after the script rebuilt its loader: {describe_leak(t, started)}" for t in sorted(leaked, key=lambda t: t.name))
                held = None  # (n, batch): the last batch compared, held while the next is drawn and compared again then
                early = early_at.get(index)
                early_words = f" (the edited loop fetches the next batch before it uses this one, line {early})" if early else ""
                drives = (phase_calls.get(index) or recipe) if phase_calls is not None else calls or recipe
                if (call_where or {}).get(index):
                    early_words += f" ({call_where[index]})"
                in_flight = InFlight(use_delay=1 if early else 0)
                # The tool's own runtime hands out batches that hold as long as they are held,
                # as the original's fresh tensors do (a loop holds one while it takes the next,
                # `x, y = train_loader.next_batch(...)`); a hand-edited loop's batch need only
                # hold until the next call, unless that loop fetches the next batch first.
                after_the_draw = calls is None or early
                for n in range(count):
                    if held is not None and not after_the_draw and not reference.reuses[phase]:
                        diff = _changed_since_handed_out(loader, reference.batches[phase][held[0]], held[1], sharing)
                        if diff is not None:
                            return Difference(rank, phase, held[0], diff[0], f"changed after it was handed out, before batch {n} was taken: {diff[1]}")
                    try:
                        with draw_deadline(timeout_s):
                            candidate = loader.next_batch(*drives.arguments(ns, n, plan.seq_lens))
                    except DrawTimeout as error:
                        raise CannotVerify(f"the patched loader hangs here (rank {rank}, {phase} batch {n}, {configuration.label}): {error}") from None
                    except Exception as error:
                        return Difference(rank, phase, n, None, f"the patched loader raised {type(error).__name__}: {one_line(error)}")
                    if held is not None and after_the_draw and (early or not reference.reuses[phase]):
                        diff = _changed_since_handed_out(loader, reference.batches[phase][held[0]], held[1], sharing)
                        if diff is not None:
                            return Difference(rank, phase, held[0], diff[0], f"changed after it was handed out, by the time batch {n} was taken{early_words}: {diff[1]}")
                    for m, batch in in_flight.drawn(n, candidate):
                        diff = first_difference(reference.batches[phase][m], batch, sharing)
                        if diff is not None:
                            return Difference(rank, phase, m, diff[0], diff[1] + early_words)
                        held = m, batch
                for m, batch in in_flight.landed():
                    diff = first_difference(reference.batches[phase][m], batch, sharing)
                    if diff is not None:
                        return Difference(rank, phase, m, diff[0], diff[1] + early_words)
                    held = m, batch
                if held is not None and (early or not reference.reuses[phase]):
                    diff = first_difference(reference.batches[phase][held[0]], held[1], sharing)
                    if diff is not None:
                        return Difference(rank, phase, held[0], diff[0], f"changed after it was handed out: {diff[1]}")
                if p > 0 and rank == 0:
                    alive = script_threads() - before_build
                    reset = f"; its producer reset for the new loader, not started again ({', '.join(sorted(t.name for t in kept))})" if kept else ""
                    notes.append(f"after the script's rebuild ({configuration.label}): the warm-up loader's threads and child processes ended{reset}; {len(alive)} more of the new loader alive ({', '.join(sorted({t.name for t in alive})) or 'none'})")
        finally:
            close(loader)
            loader = None  # the last loader's threads may end with it (a pool of its own ends when the loader is collected)
            still_alive(script_threads() - started_with - set(leaked), REBUILD_GRACE_S, reference.leaked)  # those found left running were waited for
    return None


def _early_fetches(calls: LoaderRecipe) -> dict[int, int]:
    """For each construction of a hand-edited script (by index), the line where the loop
    that draws from it uses a batch after fetching the next (`loop_order`); the calls
    between one construction and the next are that construction's."""
    sites = sorted(calls.constructions, key=lambda c: c.line)
    found = {}
    for index, site in enumerate(sites):
        end = sites[index + 1].line if index + 1 < len(sites) else float("inf")
        mine = [c for c in calls.survey.calls_on(site) if site.line < c.line < end]
        line = early_fetch_line(calls.survey, mine)
        if line is not None:
            found[index] = line
    return found


def _changed_since_handed_out(loader, want, batch, sharing=True):
    """`first_difference(want, batch, sharing)` for a batch handed out earlier and still held,
    once the producer of `loader` has filled the slots it was given (`_producer_caught_up`)."""
    _producer_caught_up(loader)
    return first_difference(want, batch, sharing)


def _producer_caught_up(loader, timeout_s: float = 2.0) -> None:
    """Wait until a lean runtime's child (templates/prefetch_lean.py) has filled every
    slot it was given, at most `timeout_s` seconds: every slot but those the loader
    still lends (`lent`, the batches handed out since the last slots went back). A slot
    given back too early (its batch still held) is then rewritten, so the batch shows
    it when compared again (deterministically, not by the child's timing). Other
    runtimes: returns at once."""
    own = vars(loader) if hasattr(loader, "__dict__") else {}  # not getattr: a `_SettlingLoader` settles on attribute reads
    pid = own.get("pid")
    if queued_batches(loader) is None or not pid:
        return
    child = ChildProcess(pid)
    deadline = time.monotonic() + timeout_s
    while queued_batches(loader) < len(own["slots"]) - len(own["lent"]) and child.is_alive() and time.monotonic() < deadline:
        time.sleep(0.0005)


def compare_generator_rank(recipe: IteratorRecipe, modules, rank: int, world_size: int, counts, sends: dict, timeout_s: float, none_between: bool = False, marks=None) -> Difference | None:
    """Both generators of one rank, item by item; at the items in `sends` each side is
    sent its own script's value instead of advanced with next(), and with
    `none_between` every other item is drawn with `.send(None)` (a script that sends
    None when nothing changed). `counts`: items per construction (the warm-up builds,
    then the last); `modules`: (original, patched). `marks` (`patcher.proof.data.ShardMarks`),
    where given, counts the shard boundaries in the original's items of each phase.
    The first difference, or None; CannotVerify when an item takes longer than
    `timeout_s` seconds."""
    for module in modules:
        if "dist" in module.__dict__:
            module.__dict__["dist"] = SimulatedDist(rank, world_size)
    phases = [("train" if index == len(counts) - 1 else "warmup", index, count) for index, count in enumerate(counts)]
    codes = (recipe.original, recipe.patched)
    sides = {}
    building = [0]

    def build(side, index):
        iterator = recipe.evaluate(codes[side][index], modules[side], side)
        sides[id(iterator)] = side
        building[0] = index
        if side == 0 and marks is not None:
            marks.reset((rank, index))
        return iterator

    def draw(iterator, n):
        side = sides[id(iterator)]
        if n in sends:
            item = iterator.send(sends[n][side])
        else:
            item = iterator.send(None) if none_between else next(iterator)
        if side == 0 and marks is not None:
            marks.observe((rank, building[0]), item)
        return item

    # A generator built from the rank the environment gives (`rank = int(os.environ["RANK"])`
    # in the function that builds it) is built as this rank's.
    with environment({"RANK": str(rank), "LOCAL_RANK": str(rank)}):
        return compare_phases(rank, phases, build, draw, "generator", timeout_s)
