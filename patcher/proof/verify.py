"""`patch-prefetch verify ORIGINAL PATCHED`: the patched loader hands out exactly the original's batches.

Both scripts are imported (not run), their training loaders are built the way each
script builds them, for every rank of a simulated world, on synthetic shards in the
real format sized so that the run crosses shard boundaries and wraps around. The
first construction is drawn from for the warm-up, then the loader is rebuilt by the
script's second construction (the warm-up reset) and drawn from again. Every tensor
of every batch is compared: dtype, shape and bytes, in order.
"""

from __future__ import annotations

import collections
import contextlib
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import numpy as np
import torch

from patcher.cst_walk import walk
from patcher.check.import_smoke import definitions_only
from patcher.proof.harness import (
    HarnessError,
    IteratorRecipe,
    LoaderRecipe,
    SimulatedDist,
    cuda_as_host,
    cuda_on_host,
    hparams_factory,
    host_only_pinning,
    swapped,
    load_definitions,
    load_module,
    patched_constructions,
    point_at_shards,
)
from patcher.proof.shards import DOC_LEN_RANGE, write_shards
from patcher.read.source import read_script
from patcher.proof.val_verify import function_namespace, loop_batches, val_loop_pairs, val_tokens_for
from patcher.transforms.features import TOGGLES
from patcher.transforms.py310_fstrings import requote

EXIT_IDENTICAL, EXIT_DIFFER, EXIT_CANNOT = 0, 1, 2

# Document lengths (tokens, BOS included) for scripts sized for web text.
WEB_DOC_LEN_RANGE = (128, 1024)


class CannotVerify(Exception):
    """Verification cannot run (one line, says why)."""


@dataclass
class Difference:
    """The first mismatch: rank, phase ("warmup", "train", "val:<function>"), batch index (from 0), field index, what differs."""

    rank: int
    phase: str
    batch: int
    field: int | None  # index of the batch's tensor that differs; None: not one field (an exception, a thread left running)
    what: str
    configuration: str | None = None  # how the patched loader ran (producer threads, device)


@dataclass
class VerifyResult:
    """identical: every batch matched. batches_compared: per rank, both phases. notes: how it ran."""

    identical: bool
    world_size: int
    batches_compared: int
    difference: Difference | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    val_batches_compared: int = 0

    def as_dict(self) -> dict:
        d = {
            "identical": self.identical,
            "world_size": self.world_size,
            "batches_compared": self.batches_compared,
            "difference": None if self.difference is None else vars(self.difference),
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "val_batches_compared": self.val_batches_compared,
        }
        return d


# Batches per rank after the rebuild (each rank runs the default producer, rank 0
# also several producer threads: an ordering race among them shows in most runs of
# this many batches; --batches 256 for more).
DEFAULT_BATCHES = 96
# Items per rank of a data generator (one producer thread; each item is a whole
# global batch, so the shards grow with this).
DEFAULT_GENERATOR_ITEMS = 64
# Producer threads of the several-thread run, where the script has the toggle.
SEVERAL_WORKERS = 3


@dataclass
class _Configuration:
    """One way of running the patched loader: its toggles, the device it hands batches to, the ranks."""

    label: str
    env: dict
    host_cuda: bool
    ranks: object  # a container of ranks, or None for all


def verify(original: str | Path, patched: str | Path, batches: int | None = None, world_size: int = 2, seed: int = 0, warmup: int = 4, sends: list[str] | None = None, shard_tokens: int | None = None, workers: int | None = None) -> VerifyResult:
    """Compare the training batches of `original` and `patched` for ranks 0..world_size-1.

    Both scripts are imported with `__file__` = the original's path (the patched one is
    meant to stand there). Each rank's original batches are drawn once; the patched
    loader is then run, for every rank, with the default producer and (where the
    script has `TRAIN_PREFETCH_WORKERS`) `workers` producer threads (default 3), both
    on the CUDA path driven with host memory (pinned staging, copy stream), and once
    more on a CPU device for rank 0. The script's own rebuild (its second
    construction) replaces the warm-up loader; the warm-up loader's threads and child processes must be
    gone after it. Every batch is compared when handed out and again when the next is
    taken (a staging buffer reused too early changes a batch already handed out).

    batches: batches per rank after the rebuild (>= 1; default `DEFAULT_BATCHES` for a
    loader class, `DEFAULT_GENERATOR_ITEMS` for a data generator); warmup: batches before it.
    sends: expressions (over the script's module-level names) of values to pass to a
    data generator's `.send()` besides those the script's own calls pass. shard_tokens:
    tokens per synthetic train shard of a loader class (default: sized from what the
    ranks read per call so that the run wraps around every shard and reshuffles).

    Returns a `VerifyResult` (identical, or the first `Difference`: rank, phase, batch,
    field). Raises `CannotVerify` (one line) when the loader cannot be driven outside
    the script, and `SourceError` for unreadable input.
    """
    # One intra-op torch thread, as torchrun gives each rank: comparing and converting
    # megabyte batches on several OpenMP threads is many times slower on a shared machine.
    with swapped(torch.get_num_threads, torch.set_num_threads, 1):
        return _verify(original, patched, batches, world_size, seed, warmup, sends, shard_tokens, workers)


def _verify(original, patched, batches, world_size, seed, warmup, sends, shard_tokens, workers) -> VerifyResult:
    """`verify` with its arguments as given (see there)."""
    started = time.perf_counter()
    notes: list[str] = []
    original_source = _importable(read_script(original).source, notes, "original")
    patched_source = _importable(read_script(patched).source, notes, "patched")
    as_path = str(Path(original).resolve())
    notes.append(f"both scripts imported as if at {as_path} (__file__)")
    try:
        recipe = LoaderRecipe.from_source(original_source)
    except HarnessError as error:
        try:
            iterator = IteratorRecipe.from_source(original_source, patched_source)
        except HarnessError as iterator_error:
            why = iterator_error if "generator" in str(iterator_error) or "`" in str(iterator_error) else error
            raise CannotVerify(f"{original}: {why}") from None
        iterator.sent += [code for code in sends or [] if code not in iterator.sent]
        batches = DEFAULT_GENERATOR_ITEMS if batches is None else batches
        if True:  # the environment's toggles apply, as in a run
            return _verify_iterator(iterator, (original, patched), (original_source, patched_source), batches, world_size, seed, warmup, notes, started, as_path)
    try:
        patched_sites = patched_constructions(patched_source, recipe, original_source)
    except HarnessError as error:
        raise CannotVerify(f"{patched}: {error}") from None
    batches = DEFAULT_BATCHES if batches is None else batches
    top_level = definitions_only(original_source) != original_source
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-verify-") as data_dir, _launch_env(as_path, world_size):

        def load_one(source: str, rank: int, env: dict | None = None):
            # A script that trains at top level: its definitions, as rank `rank` would run them.
            with _env(env or {}):
                if not top_level:
                    return _load(source, as_path)
                os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
                module = _load_definitions(source, as_path)
            if "dist" in module.__dict__:
                module.__dict__["dist"] = SimulatedDist(rank, world_size)
            return module

        def load(rank: int):
            return (load_one(original_source, rank), load_one(patched_source, rank))

        modules = load(0)
        notes.append(_toggle_note(modules[1]))
        configurations = _configurations(modules[1], workers)
        difference = None
        try:
            plan = _plan(recipe, modules[0], world_size, batches, warmup, data_dir, seed, notes, shard_tokens)
            for rank in range(world_size):
                rank_modules = modules if rank == 0 else load(rank)
                reference = _reference_batches(recipe, rank_modules[0], plan, rank, notes)
                for configuration in configurations:
                    if configuration.ranks is not None and rank not in configuration.ranks:
                        continue
                    patched_module = rank_modules[1] if not configuration.env else load_one(patched_source, rank, configuration.env)
                    difference = _compare_patched_rank(recipe, patched_sites, patched_module, plan, rank, reference, configuration, notes)
                    if difference is not None:
                        difference.configuration = configuration.label
                        break
                if difference is not None:
                    break
        except HarnessError as error:
            raise CannotVerify(f"{original}: {error}") from None
        notes.extend(f"patched loader run with {c.label}" + ("" if c.ranks is None else f" (rank {', '.join(map(str, c.ranks))})") for c in configurations)
        val_compared = 0
        if difference is None:
            val_compared, difference = _compare_val(recipe, patched_source, lambda rank: modules if rank == 0 else load(rank), plan, seed, notes)
    notes.extend(_assumption_notes(recipe))
    per_rank = plan.warmup + plan.batches
    return VerifyResult(difference is None, world_size, per_rank * world_size, difference, notes, time.perf_counter() - started, val_compared)


def _configurations(patched_module, workers: int | None) -> list[_Configuration]:
    """The runs of the patched loader: the default producer on the CUDA path (host
    memory), several producer threads where the script reads `TRAIN_PREFETCH_WORKERS`,
    and the CPU device (what a laptop runs) for rank 0."""
    several = SEVERAL_WORKERS if workers is None else max(2, int(workers))
    runs = [_Configuration("the default producer on the CUDA path (host memory)", {}, True, None)]
    if _has_toggle(patched_module, "TRAIN_PREFETCH_WORKERS"):
        runs.append(_Configuration(f"{several} producer threads (TRAIN_PREFETCH_WORKERS={several}) on the CUDA path (host memory)", {"TRAIN_PREFETCH_WORKERS": str(several)}, True, (0,)))
    runs.append(_Configuration("the default producer on a CPU device", {}, False, (0,)))
    return runs


def _has_toggle(module, env_name: str) -> bool:
    """True when the patched script reads the toggle `env_name` (a module constant or a Hyperparameters attribute)."""
    if env_name in module.__dict__:
        return True
    attr = TOGGLES[env_name][0]
    return any(isinstance(value, type) and attr in vars(value) for value in list(module.__dict__.values()))


@contextlib.contextmanager
def _env(values: dict):
    """Environment variables set to `values` inside, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _toggles_cleared():
    """The patch's toggles unset inside (their defaults: what a run of the patched script does), restored after."""
    saved = {k: os.environ.pop(k) for k in list(TOGGLES) if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _compare_val(recipe, patched_source: str, load, plan: "_Plan", seed: int, notes: list[str]) -> tuple[int, Difference | None]:
    """The (x, y) batches of every evaluation loop val_prefetch rewrote, for every rank.

    Returns (batches compared, first difference or None). A loop that cannot be driven
    outside its function is noted, not failed.
    """
    try:
        pairs = val_loop_pairs(recipe.survey, patched_source)
    except HarnessError as error:
        notes.append(f"validation batches not compared: {error}")
        return 0, None
    compared = 0
    for site, patched_survey, patched_function, patched_loop in pairs:
        for rank in range(plan.world_size):
            modules = load(rank)
            hparams = plan.hparams_for(rank)
            tokens = val_tokens_for(hparams, plan.world_size, seed)
            sides = ((recipe.survey, site.function_node, site.loop), (patched_survey, patched_function, patched_loop))

            def batches_of(side: int, host_cuda: bool):
                s, f, loop = sides[side]
                with cuda_on_host(notes) if host_cuda else contextlib.nullcontext():
                    return loop_batches(s, f, loop, function_namespace(modules[side], f, s.module.code_for_node, hparams, rank, plan.world_size, tokens, _device_for(host_cuda)))

            phase = f"val:{site.function}"
            try:
                reference, reference_changed = batches_of(0, True)
                # The patched loop on the CUDA path driven with host memory (pinned staging,
                # copy stream), and for rank 0 also on a CPU device.
                runs = [(host_cuda, batches_of(1, host_cuda)) for host_cuda in ((True, False) if rank == 0 else (True,))]
            except Exception as error:  # the script's own code outside its function
                notes.append(f"validation batches of {site.function} (line {site.line}) not compared: {type(error).__name__}: {error}")
                break
            for host_cuda, (batches, changed) in runs:
                where = "the CUDA path (host memory)" if host_cuda else "a CPU device"
                if len(reference) != len(batches):
                    return compared, Difference(rank, phase, min(len(reference), len(batches)), 0, f"{len(reference)} batches vs {len(batches)}", where)
                for n, (expected, candidate) in enumerate(zip(reference, batches)):
                    diff = _first_difference(expected, candidate)
                    if diff is not None:
                        return compared, Difference(rank, phase, n, diff[0], diff[1], where)
                if changed is not None and reference_changed is None:
                    return compared, Difference(rank, phase, changed, None, "changed after it was handed out, before the next batch was taken", where)
            compared += len(reference)
        else:
            notes.append(f"validation loop of {site.function} (line {site.line}): x, y of every batch compared on {plan.world_size} ranks, on the CUDA path driven with host memory (rank 0 also on a CPU device)")
    return compared, None


def _first_rank_difference(compare, world_size: int) -> Difference | None:
    """`compare(rank)` for ranks 0, 1, ... until one differs; None when none does."""
    for rank in range(world_size):
        difference = compare(rank)
        if difference is not None:
            return difference
    return None


def _assumption_notes(recipe) -> list[str]:
    """One note per name the recipe evaluated from its one unconditional assignment (in order, once)."""
    return [f"evaluated as in a fresh run: {text}" for text in dict.fromkeys(recipe.assumed)]


def _importable(source: str, notes: list[str], which: str) -> str:
    """The source, with PEP 701 f-strings requoted when the running Python needs it (same AST)."""
    try:
        compile(source, which, "exec")
        return source
    except SyntaxError:
        fixed = requote(source)
        if fixed is None:
            return source  # loading it names the syntax error
        notes.append(f"{which}: Python 3.12-only f-strings requoted to import it here (same AST)")
        return fixed


def _load(source: str, path):
    try:
        return load_module(source, str(path))
    except Exception as error:  # the script's own import-time failure
        raise CannotVerify(f"{path}: importing it failed: {type(error).__name__}: {error}") from None


@dataclass
class _Plan:
    hparams_for: object
    world_size: int
    warmup: int
    batches: int
    seq_lens: list[int]


def _toggle_note(module) -> str:
    """The patched script's toggle values as it read them (module constants or Hyperparameters attributes)."""
    values = []
    for env_name, (attr, _default) in TOGGLES.items():
        if env_name in module.__dict__:
            values.append(f"{env_name}={module.__dict__[env_name]}")
            continue
        for value in list(module.__dict__.values()):
            if isinstance(value, type) and attr in vars(value):
                values.append(f"{env_name}={vars(value)[attr]}")
                break
    return "patched toggles: " + (" ".join(values) if values else "none found (defaults inline)")


def _plan(recipe: LoaderRecipe, module, world_size, batches, warmup, data_dir, seed, notes, shard_tokens=None) -> _Plan:
    """Write shards sized for the run and decide the per-rank hyperparameters.

    The shards together hold about 3/5 of what all ranks read in the longest phase
    (each call reads its global tokens over the gradient accumulation steps, shared
    by the ranks), so every loader crosses shard boundaries, wraps around and (per-rank
    shard lists) reshuffles within the run; each shard still holds two per-rank
    batches of the largest call."""
    make_hparams = hparams_factory(recipe, module, world_size, data_dir)
    ns = recipe.namespace(module, make_hparams(0), 0, world_size, torch.device("cpu"))
    seq_len = int(getattr(make_hparams(0), "train_seq_len", 1024))
    seq_lens = [seq_len, max(1, seq_len // 2)] if recipe.varying else None
    calls = [recipe.arguments(ns, step, seq_lens) for step in range(max(10, 1))]
    tokens_per_call = max((int(a[0]) for a in calls if a and isinstance(a[0], int) and not isinstance(a[0], bool)), default=seq_len * 64)
    accum = _grad_accum(recipe, calls[0])
    read_per_call = max(1, tokens_per_call // max(1, accum))
    per_rank_call = max(1, read_per_call // world_size)
    longest = max(batches, warmup)
    floor = 2 * (per_rank_call + seq_len + 1)
    if shard_tokens is None:
        tokens_per_shard = max(math.ceil(read_per_call * longest * 0.6 / 4), floor, 8 * (seq_len + 1))
    else:
        tokens_per_shard = max(int(shard_tokens), 2 * (seq_len + 1))
    write_shards(data_dir, train_shards=4, val_shards=1, tokens_per_shard=tokens_per_shard, vocab_size=256, seed=seed, bos_id=1)
    wraps = read_per_call * longest / (4 * tokens_per_shard)
    notes.append(f"4 shards x {tokens_per_shard} tokens; next_batch{calls[0]} (global tokens {tokens_per_call}, gradient accumulation {accum}: {read_per_call} tokens read per call by {world_size} ranks, the shards read {wraps:.1f} times in {longest} calls); {warmup} warm-up + {batches} batches per rank")
    if recipe.varying:
        used = [sorted({a[i] for a in calls}) for i in recipe.varying]
        notes.append(f"per-step argument(s) {[recipe.call_args[i] for i in recipe.varying]} driven with {used}, changing every 5 calls")
    return _Plan(make_hparams, world_size, warmup if len(recipe.constructions) > 1 else 0, batches, seq_lens or [])


def _grad_accum(recipe: LoaderRecipe, args: tuple) -> int:
    """The gradient accumulation steps of a call: the argument whose code names them, else 1."""
    for code, value in zip(recipe.call_args, args):
        if "accum" in code and isinstance(value, int) and value > 0:
            return value
    return 1


def _phases(recipe: LoaderRecipe, plan: _Plan) -> list[tuple[str, int, int]]:
    """(phase, construction index, batches): the warm-up on the first construction, then the last one."""
    if plan.warmup:
        return [("warmup", 0, plan.warmup), ("train", len(recipe.constructions) - 1, plan.batches)]
    return [("train", 0, plan.batches)]


@dataclass
class _Reference:
    """The original's batches of one rank: `batches[phase][n]`, a private copy of each
    as handed out, and per phase whether the original itself changed a batch it had
    handed out (a loader that reuses its buffers: then the later re-check is skipped);
    leaked: the kinds of thread (`_thread_kind`) of the original's warm-up loader still
    running at the end of the phase after its rebuild, with their counts (a script
    loader's own idle thread pool, which the patched script keeps as well)."""

    batches: dict
    reuses: dict
    leaked: collections.Counter = field(default_factory=collections.Counter)


def _thread_kind(thread: threading.Thread) -> str:
    """A thread's name without its numbers (`ThreadPoolExecutor-2_0` -> `ThreadPoolExecutor-_`)."""
    return "".join(c for c in thread.name if not c.isdigit())


def _device_for(host_cuda: bool):
    return torch.device("cuda", 0) if host_cuda else torch.device("cpu")


def _reference_batches(recipe, module, plan: _Plan, rank: int, notes: list[str]) -> _Reference:
    """Draw the original's batches of `rank` for every phase (on the CUDA path driven
    with host memory). Raises CannotVerify when the original cannot be built or drawn
    from here (a module it needs is missing, the configuration breaks its rules)."""
    batches, reuses, leaked = {}, {}, collections.Counter()
    with cuda_on_host(notes):
        ns = recipe.namespace(module, plan.hparams_for(rank), rank, plan.world_size, _device_for(True))
        loader, started_with = None, _script_threads()
        try:
            for p, (phase, index, count) in enumerate(_phases(recipe, plan)):
                # The warm-up loader is dropped as the script drops it when it builds the next (not shut down).
                earlier = _script_threads() - started_with
                loader = _harness_step(lambda: recipe.build(recipe.constructions[index], ns), f"building the original loader ({recipe.constructions[index].target} = ..., line {recipe.constructions[index].line}) for rank {rank}")
                drawn, copies, changed = [], [], False
                for n in range(count):
                    if drawn and not changed and _first_difference(copies[-1], drawn[-1]) is not None:
                        changed = True
                    with _draw_deadline(DRAW_TIMEOUT_S):
                        batch = _harness_step(lambda: loader.next_batch(*recipe.arguments(ns, n, plan.seq_lens)), f"the original loader's batch {n} ({phase}) on rank {rank}")
                    drawn.append(batch)
                    copies.append(_copy_batch(batch))
                batches[phase], reuses[phase] = copies, changed
                if p > 0:
                    leaked.update(_thread_kind(t) for t in earlier if t.is_alive())
        finally:
            _close(loader)
    return _Reference(batches, reuses, leaked)


def _harness_step(step, what: str):
    """Run `step()`; an exception is the harness's problem, not a difference: CannotVerify
    "needs MODULE" for a missing module, else one line naming `what`."""
    try:
        return step()
    except (CannotVerify, DrawTimeout):
        raise
    except HarnessError as error:
        raise CannotVerify(str(error)) from None
    except ModuleNotFoundError as error:
        raise CannotVerify(f"needs {error.name or error}: {what} imports it and it is not installed here") from None
    except Exception as error:
        raise CannotVerify(f"{what} fails here: {type(error).__name__}: {_one_line(error)}") from None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _copy_batch(batch):
    """A private copy of a batch (tensors cloned, containers rebuilt)."""
    if isinstance(batch, torch.Tensor):
        return batch.detach().clone()
    if isinstance(batch, np.ndarray):
        return batch.copy()
    if isinstance(batch, (tuple, list)):
        return type(batch)(_copy_batch(b) for b in batch)
    return batch


def _script_threads() -> set:
    """The threads (but the main one) and the child processes running here: a loader's
    worker threads and (templates/prefetch_lean.py) its forked producer. Both kinds
    have `name`, `join(timeout)` and `is_alive()`."""
    return {t for t in threading.enumerate() if t is not threading.main_thread()} | set(multiprocessing.active_children())


def _still_alive(threads: set, grace_s: float) -> list:
    """The threads and processes of `threads` still alive after waiting up to `grace_s` seconds in all."""
    deadline = time.monotonic() + grace_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def _unexcused(threads: list, excused: collections.Counter) -> list:
    """The threads of `threads` beyond those of a kind (`_thread_kind`) the original also left running, up to its count."""
    left = collections.Counter(excused)
    unexcused = []
    for thread in threads:
        kind = _thread_kind(thread)
        if left[kind] > 0:
            left[kind] -= 1
        else:
            unexcused.append(thread)
    return unexcused


# A replaced loader's worker threads have this long to end (its shutdown waits 1 s).
REBUILD_GRACE_S = 3.0


def _compare_patched_rank(recipe, patched_sites, module, plan: _Plan, rank: int, reference: _Reference, configuration: _Configuration, notes: list[str]) -> Difference | None:
    """Run the patched script's constructions of `rank` in `configuration` and compare
    every batch with the original's; the first difference, or None.

    The warm-up loader is not shut down here: the script's rebuild must do it (its
    worker threads, found by `threading.enumerate()`, must be gone after it). Each
    batch is compared when handed out and again just before the next is taken. An
    exception from the patched loader is a difference at that batch.
    """
    loader = None
    started_with = _script_threads()
    with contextlib.ExitStack() as context:
        if configuration.host_cuda:
            context.enter_context(cuda_on_host(notes))
        else:  # what a CPU-only run sees; a loader that calls .cuda() itself keeps its batches on the host
            context.enter_context(host_only_pinning(notes))
            context.enter_context(cuda_as_host(notes))
        ns = recipe.namespace(module, plan.hparams_for(rank), rank, plan.world_size, _device_for(configuration.host_cuda))
        try:
            for p, (phase, index, count) in enumerate(_phases(recipe, plan)):
                before_build = _script_threads()
                earlier = before_build - started_with
                loader = _harness_step(lambda: recipe.evaluate(patched_sites[index], ns, recipe.constructions[index].binding), f"building the patched loader (line {recipe.constructions[index].line}'s construction) for rank {rank}")
                if p > 0:
                    leaked = _unexcused(_still_alive(earlier, REBUILD_GRACE_S), reference.leaked)
                    if leaked:
                        names = ", ".join(sorted({t.name for t in leaked}))
                        return Difference(rank, phase, 0, None, f"{len(leaked)} thread(s) or child process(es) of the loader built before ({names}) still alive after the script rebuilt it")
                held = None
                for n in range(count):
                    if held is not None and not reference.reuses[phase]:
                        _producer_caught_up(loader)
                        diff = _first_difference(reference.batches[phase][n - 1], held)
                        if diff is not None:
                            return Difference(rank, phase, n - 1, diff[0], f"changed after it was handed out, before batch {n} was taken: {diff[1]}")
                    try:
                        with _draw_deadline(DRAW_TIMEOUT_S):
                            candidate = loader.next_batch(*recipe.arguments(ns, n, plan.seq_lens))
                    except DrawTimeout as error:
                        raise CannotVerify(f"the patched loader hangs here (rank {rank}, {phase} batch {n}, {configuration.label}): {error}") from None
                    except Exception as error:
                        return Difference(rank, phase, n, None, f"the patched loader raised {type(error).__name__}: {_one_line(error)}")
                    diff = _first_difference(reference.batches[phase][n], candidate)
                    if diff is not None:
                        return Difference(rank, phase, n, diff[0], diff[1])
                    held = candidate
                if held is not None and not reference.reuses[phase]:
                    diff = _first_difference(reference.batches[phase][count - 1], held)
                    if diff is not None:
                        return Difference(rank, phase, count - 1, diff[0], f"changed after it was handed out: {diff[1]}")
                if p > 0 and rank == 0:
                    alive = _script_threads() - before_build
                    notes.append(f"after the script's rebuild ({configuration.label}): the warm-up loader's threads and child processes ended; {len(alive)} of the new loader alive ({', '.join(sorted({t.name for t in alive})) or 'none'})")
        finally:
            _close(loader)
            _still_alive(_script_threads() - started_with, REBUILD_GRACE_S)
    return None


def _producer_caught_up(loader, timeout_s: float = 2.0) -> None:
    """Wait until a lean runtime's child (templates/prefetch_lean.py) has filled every
    free slot, at most `timeout_s` seconds: the slot of the batch handed out last is
    then rewritten, so a batch that still views its slot shows it when compared again
    (deterministically, not by the child's timing). Other runtimes: returns at once."""
    filled, process = getattr(loader, "filled", None), getattr(loader, "process", None)
    if filled is None or not process:
        return
    deadline = time.monotonic() + timeout_s
    while filled.get_value() < loader.depth and process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.0005)


def _compare_phases(rank: int, phases, build, draw, what: str) -> Difference | None:
    """Build both sides for each (phase, construction index, count) and compare `count`
    draws in order; the first difference, or None. build(side, index) -> source;
    draw(source, n) -> the n-th batch of the phase. Both sides are closed at the end."""
    sources = [None, None]
    try:
        for phase, index, count in phases:
            for side in (0, 1):
                _close(sources[side])
                sources[side] = _harness_step(lambda: build(side, index), f"building the {'original' if side == 0 else 'patched'} {what} ({phase}) for rank {rank}")
            for n in range(count):
                with _draw_deadline(DRAW_TIMEOUT_S):
                    reference = _harness_step(lambda: draw(sources[0], n), f"the original {what}'s item {n} ({phase}) on rank {rank}")
                try:
                    with _draw_deadline(DRAW_TIMEOUT_S):
                        candidate = draw(sources[1], n)
                except DrawTimeout as error:
                    raise CannotVerify(f"the patched {what} hangs here (rank {rank}, {phase} item {n}): {error}") from None
                except Exception as error:
                    return Difference(rank, phase, n, None, f"the patched {what} raised {type(error).__name__}: {_one_line(error)}")
                diff = _first_difference(reference, candidate)
                if diff is not None:
                    return Difference(rank, phase, n, diff[0], diff[1])
    finally:
        for source in sources:
            _close(source)
    return None


def _verify_iterator(recipe: IteratorRecipe, paths, sources, batches, world_size, seed, warmup, notes, started, as_path: str) -> VerifyResult:
    """`verify` for a data generator: both scripts imported definitions-only (a top-level
    script does not train), each rank's generator built by the script's own expression
    with `dist` answering the simulated rank, and `batches` items compared in order.
    Runs in a scratch working directory: scripts glob data paths relative to it."""
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-verify-") as tmp, host_only_pinning(notes), cuda_as_host(notes), swapped(os.getcwd, os.chdir, tmp), _launch_env(as_path, world_size):
        modules = [_load_definitions(source, as_path) for source in sources]
        for module in modules:
            module.__dict__.setdefault("device", torch.device("cpu"))
        counts = [warmup] * (len(recipe.original) - 1) + [batches]
        try:
            sends = _send_schedule(recipe, modules, batches, notes)
            # a sent value can ask for bigger items than the construction (a batch-size schedule)
            sent_ints = [v for pair in sends.values() for v in _ints_in(pair[0])]
            tokens_per_item = max([_largest_int_argument(recipe, recipe.original[-1], modules[0]), *sent_ints])
            _write_iterator_shards(recipe, modules, tmp, tokens_per_item, sum(counts), seed, notes)
            difference = _first_rank_difference(lambda rank: _compare_iterator_rank(recipe, modules, rank, world_size, counts, sends), world_size)
        except HarnessError as error:
            raise CannotVerify(f"{paths[0]}: {error}") from None
    notes.append(f"generator `{recipe.target}`: {sum(counts)} items per rank" + (f" ({warmup} per warm-up build)" if len(counts) > 1 else ""))
    notes.extend(_assumption_notes(recipe))
    return VerifyResult(difference is None, world_size, sum(counts) * world_size, difference, notes, time.perf_counter() - started)


def _load_definitions(source: str, path):
    try:
        return load_definitions(definitions_only(source), str(path))
    except Exception as error:  # the script's own definitions fail to import
        raise CannotVerify(f"{path}: importing its definitions failed: {type(error).__name__}: {error}") from None


@contextlib.contextmanager
def _launch_env(script, world_size: int):
    """What torchrun gives a script: RANK, WORLD_SIZE, LOCAL_RANK in the environment (rank 0
    of `world_size`; `dist` answers per rank) and `sys.argv` without our own arguments."""
    values = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
    saved_argv = sys.argv
    with _env(values):
        sys.argv = [str(script)]
        try:
            yield
        finally:
            sys.argv = saved_argv


def _largest_int_argument(recipe: IteratorRecipe, code: str, module) -> int:
    """The largest int among the construction's arguments (the tokens per item), or 65536."""
    call = cst.parse_expression(code)
    values = []
    for arg in getattr(call, "args", []):
        try:
            value = recipe.evaluate(cst.Module([]).code_for_node(arg.value), module)
        except HarnessError:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            values.append(value)
    return max(values, default=65536)


def _ints_in(value) -> list[int]:
    """The ints in a sent value: the value itself, or the items of a tuple or list."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


def _write_iterator_shards(recipe, modules, root, tokens_per_item, items, seed, notes) -> None:
    """Shards where the scripts look: `Hyperparameters.train_files`, or the glob literal
    of the construction (relative to the working directory, `root`)."""
    # Relative to the working directory (`root`): some scripts glob with Path.cwd().glob().
    data_dir = "data"
    call = cst.parse_expression(recipe.original[-1])
    literals = [n.evaluated_value for n in m.findall(call, m.SimpleString()) if "*" in str(n.evaluated_value)]
    if literals:
        data_dir = os.path.dirname(literals[0]) or "."
    hp_info = recipe.survey.hyperparameters
    for module in modules:
        cls = module.__dict__.get(hp_info.name) if hp_info is not None else None
        for name in ("args", "h", "hparams", "hyperparameters"):
            if name not in module.__dict__ and recipe.survey.collector.module_scope.bindings.get(name):
                try:
                    recipe.evaluate(name, module)
                except HarnessError:
                    continue
            value = module.__dict__.get(name)
            if cls is not None and isinstance(value, cls):
                point_at_shards(value, data_dir, os.path.join(data_dir, "fineweb_train_*.bin"))
    # Four shards holding 1.5 times what the run reads (a generator may walk the files
    # once, without wrapping around); every shard crossed, each holds several items.
    # An argument may be per rank (older generators: `batch_size` tokens for each of
    # `world_size` ranks per item): sized as if every rank read it.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_shard = max(math.ceil(tokens_per_item * world_size * items * 1.5 / 4), 4 * tokens_per_item * world_size + 2)
    bos_id = _script_bos_id(modules[0])
    if bos_id is None:
        bos_id = _literal_bos_id(recipe)
    # A script that names its BOS id sizes buffers for web-text documents (modded-nanogpt:
    # "median doc length is ~400"); short synthetic documents would overflow them.
    doc_lens = DOC_LEN_RANGE if bos_id is None else WEB_DOC_LEN_RANGE
    bos_id = 1 if bos_id is None else bos_id
    write_shards(os.path.join(root, data_dir), train_shards=4, val_shards=1, tokens_per_shard=tokens_per_shard, vocab_size=max(256, bos_id + 1), seed=seed, bos_id=bos_id, doc_len_range=doc_lens)
    notes.append(f"4 shards x {tokens_per_shard} tokens in {data_dir}/, documents starting with BOS {bos_id}; {tokens_per_item} tokens per item")


def _script_bos_id(module) -> int | None:
    """The BOS token id the script aligns documents to: a module-level int whose name
    says BOS (`BOS_ID = 50256` in modded-nanogpt), else None. Shards without that id
    would leave a BOS-aligned generator with no document to start from."""
    for name, value in vars(module).items():
        if "BOS" in name.upper() and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFF:
            return value
    return None


# GPT-2's end-of-text token: the document separator of modded-nanogpt's shards.
GPT2_EOT = 50256


def _literal_bos_id(recipe: IteratorRecipe) -> int | None:
    """The BOS id a generator compares tokens with when no module-level name holds it:
    a parameter default of the generator named like BOS (`bos_id=50256`), or GPT-2's
    end-of-text id written as a literal in the script; else None."""
    for function in recipe.survey.collector.functions:
        for param in function.params.params:
            if "bos" in param.name.value.lower() and m.matches(param.default, m.Integer()):
                return int(param.default.value)
    eot = str(GPT2_EOT)
    if any(isinstance(node, cst.Integer) and node.value == eot for node in walk(recipe.survey.module)):
        return GPT2_EOT
    return None


def _send_schedule(recipe: IteratorRecipe, modules, batches: int, notes: list[str]) -> dict:
    """Where the comparison sends values, as the script does: {item: (original's value,
    patched's value)}, each distinct value the script's `.send(...)` passes (evaluated
    in each script's own module) at evenly spaced items of every phase."""
    if not recipe.sent:
        return {}
    values = [recipe.sent_values(module) for module in modules]
    if not values[0] or len(values[0]) != len(values[1]) or batches < 2:
        notes.append(f"`{recipe.target}.send(...)`: no value it passes could be evaluated outside training ({', '.join(recipe.sent)}); items drawn with next() only (--send EXPR gives one)")
        return {}
    at = [(i + 1) * batches // (len(values[0]) + 1) for i in range(len(values[0]))]
    notes.append(f"`{recipe.target}.send(...)` of {', '.join(map(repr, values[0]))} at item {', '.join(map(str, at))}")
    return {n: pair for n, pair in zip(at, zip(*values))}


def _compare_iterator_rank(recipe: IteratorRecipe, modules, rank: int, world_size: int, counts, sends: dict) -> Difference | None:
    """Both generators of one rank, item by item; at the items in `sends` each side is
    sent its own script's value instead of advanced with next()."""
    for module in modules:
        if "dist" in module.__dict__:
            module.__dict__["dist"] = SimulatedDist(rank, world_size)
    phases = [("train" if index == len(counts) - 1 else "warmup", index, count) for index, count in enumerate(counts)]
    codes = (recipe.original, recipe.patched)
    sides = {}

    def build(side, index):
        iterator = recipe.evaluate(codes[side][index], modules[side])
        sides[id(iterator)] = side
        return iterator

    def draw(iterator, n):
        if n in sends:
            return iterator.send(sends[n][sides[id(iterator)]])
        return next(iterator)

    return _compare_phases(rank, phases, build, draw, "generator")


# A batch takes milliseconds to build; one that has not come after this long never will
# (a generator that walks its files once and ran out, a script thread that died).
DRAW_TIMEOUT_S = 60.0


class DrawTimeout(Exception):
    """A draw from a loader or generator did not return within its deadline."""


@contextlib.contextmanager
def _draw_deadline(seconds: float):
    """Raise `DrawTimeout` in the main thread if the body runs longer than `seconds`
    (SIGALRM interrupts a wait on a lock or event there). A no-op off the main thread
    or where SIGALRM does not exist."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise DrawTimeout(f"no batch after {seconds:.0f} s (the data source waits on data that never comes)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _close(loader) -> None:
    shutdown = getattr(type(loader), "shutdown", None)
    if shutdown is not None:
        shutdown(loader)


def _first_difference(a, b) -> tuple[int, str] | None:
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    if len(a) != len(b):
        return 0, f"{len(a)} fields vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype:
                return i, f"dtype {x.dtype} vs {y.dtype}"
            if x.shape != y.shape:
                return i, f"shape {tuple(x.shape)} vs {tuple(y.shape)}"
            if not (x.dtype.is_floating_point or x.dtype.is_complex) and x.device == y.device and torch.equal(x, y):
                continue  # integers: equal values are equal bytes
            xb, yb = _bytes(x), _bytes(y)
            if not torch.equal(xb, yb):
                flat_x, flat_y = x.detach().cpu().reshape(-1), y.detach().cpu().reshape(-1)
                unequal = (xb.view(-1, x.element_size()) != yb.view(-1, y.element_size())).any(dim=1)
                at = int(unequal.nonzero()[0, 0]) if bool(unequal.any()) else 0
                index = tuple(int(v) for v in np.unravel_index(at, tuple(x.shape))) if x.dim() else ()
                return i, f"bytes differ: first at {list(index)}: {flat_x[at].item()!r} vs {flat_y[at].item()!r}"
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)) or x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return i, "numpy arrays differ"
        elif x != y:
            return i, f"{x!r} vs {y!r}"
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 (so -0.0 and 0.0, or two NaNs, compare as stored)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
