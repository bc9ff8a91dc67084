"""`patch-prefetch verify ORIGINAL PATCHED`: the patched loader hands out exactly the original's batches.

Both scripts are imported (not run), their training loaders are built the way each
script builds them, for every rank of a simulated world, on synthetic shards in the
real format sized so that the run crosses shard boundaries and wraps around. The
first construction is drawn from for the warm-up, then the loader is rebuilt by the
script's second construction (the warm-up reset) and drawn from again. Every tensor
of every batch is compared: dtype, shape and bytes, in order.

This module holds the orchestration and the verdict: which driver (`DRIVERS`, the one
place a driver is defined; a family's `Plan.driver` names one) drives the data source,
the configurations and the plan of the run, the launch environment. The parts:
`recipes` (how the script builds its data source), `harness` and `host_cuda` (running
it outside the script), `data` (synthetic data), `rank_compare` and `compare` (one
rank's comparison), `val_verify` (evaluation loops), `module_verify` (a data-loader module).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from patcher.check.import_smoke import definitions_only
from patcher.proof.compare import CannotVerify, Difference, VerifyResult, first_rank_difference
from patcher.proof.data import write_loader_shards
from patcher.proof.generator_plan import join_new_threads, plan_generator_run
from patcher.proof import module_verify
from patcher.proof.loop_calls import LoopCalls, loop_calls, script_seeding, seeding_calls
from patcher.proof.harness import HarnessError, SimulatedDist, environment, load_definitions, load_module, scripts_unloaded, swapped
from patcher.proof.host_cuda import RUN_AHEAD, cuda_as_host, cuda_on_host, host_only_pinning, run_ahead_of
from patcher.proof.rank_compare import Configuration, Plan, ShardsRanOut, compare_generator_rank, compare_loader_rank, reference_batches
from patcher.proof.recipes import IteratorRecipe, LoaderRecipe, hparams_factory, patched_constructions
from patcher.proof.script_eval import survey_of, verdicts_of
from patcher.proof.val_verify import compare_val_loops
from patcher.families import registry
from patcher.families.base import PRODUCERS, ModuleLoader
from patcher.read.source import read_script
from patcher.transforms.features import INJECTED_NAMES, TOGGLES
from patcher.transforms.py310_fstrings import requote


# Batches per rank after the rebuild (each rank runs the default producer on the CUDA
# path, rank 0 also on a CPU device; --batches 256 for more).
DEFAULT_BATCHES = 96
# Items per rank of a data generator (one producer thread; each item is a whole
# global batch, so the shards grow with this).
DEFAULT_GENERATOR_ITEMS = 64
# A batch takes milliseconds to build; one that has not come after this long never will
# (a generator that walks its files once and ran out, a script thread that died).
DRAW_TIMEOUT_S = 60.0


@dataclass
class _Run:
    """One `verify` call: its arguments (`batches` None: the driver's default), the
    scripts' paths and importable sources, where they are imported as, and the notes so far."""

    paths: tuple
    sources: tuple
    as_path: str
    batches: int | None
    world_size: int
    seed: int
    warmup: int
    sends: list[str]
    shard_tokens: int | None
    notes: list[str]
    started: float
    edited: bool = False  # the patched side is a hand-edited script (no runtime of this tool)
    tokenizer: str = "byte"  # a data-loader module's tokenizer (`module_verify.make_tokenizer`)
    leaks: list = field(default_factory=list)  # threads left running by a replaced loader (`compare.describe_leak`)
    loops: LoopCalls | None = None  # a hand-edited loop's calls read against the original's (`loop_calls`)
    seeded: bool = False  # both sides make their script's own global seeding (`_seeding`)
    unseeded: list = field(default_factory=list)  # why a seeding edit was not driven (the verdict is partial)


@dataclass(frozen=True)
class Driver:
    """One way of driving a script's training data source; an entry of `DRIVERS`.

    recipe: what the driver reads from the scripts (`LoaderRecipe`, `IteratorRecipe`, `ModuleLoader`);
    read(original source, patched source) -> that recipe, HarnessError when the
    original has no data source of this kind. compare: one rank's comparison of the
    original and patched sources (`patcher.proof.rank_compare`). run(recipe, run,
    compare) -> VerifyResult: every rank (loading, synthetic data, configurations),
    calling `compare` for each. default_batches: batches (items) per rank after the
    rebuild when `verify` is given none.
    """

    name: str
    recipe: type
    read: Callable
    compare: Callable
    run: Callable
    default_batches: int


# The scripts are unloaded once verify's frame is gone: a process that verifies many would
# otherwise keep every script's shards open (memmap caches) and its runtime's exit hooks.
@scripts_unloaded()
def verify(original: str | Path, patched: str | Path, batches: int | None = None, world_size: int = 2, seed: int = 0, warmup: int = 4, sends: list[str] | None = None, shard_tokens: int | None = None, run_ahead: int | None = None, tokenizer: str = "byte") -> VerifyResult:
    """Compare the training batches of `original` and `patched` for ranks 0..world_size-1.

    Both scripts are imported with `__file__` = the original's path (the patched one is
    meant to stand there). Each rank's original batches are drawn once; the patched
    loader is then run, for every rank, with the default producer on the CUDA path
    driven with host memory (pinned staging, copy stream), and once more on a CPU
    device for rank 0. The script's own rebuild (its second
    construction) replaces the warm-up loader; the warm-up loader's threads and child processes must be
    gone after it. Every batch is compared when handed out and again when the next is
    taken (a staging buffer reused too early changes a batch already handed out).

    batches: batches per rank after the rebuild (>= 1; default `DEFAULT_BATCHES` for a
    loader class, `DEFAULT_GENERATOR_ITEMS` for a data generator); warmup: batches before it.
    sends: expressions (over the script's module-level names) of values to pass to a
    data generator's `.send()` besides those the script's own calls pass. shard_tokens:
    tokens per synthetic train shard of a loader class (default: sized from what the
    ranks read per call so that the run wraps around every shard and reshuffles).
    run_ahead: micro-steps the host runs ahead of the GPU on the CUDA path driven with
    host memory (`host_cuda.AsyncCopies`: an asynchronous copy from pinned memory reads
    its source that late; the original's copies run at the call, its data as meant;
    None: `host_cuda.RUN_AHEAD`).

    Returns a `VerifyResult` (identical, or the first `Difference`: rank, phase, batch,
    field). Raises `CannotVerify` (one line) when the loader cannot be driven outside
    the script, and `SourceError` for unreadable input.
    """
    # One intra-op torch thread, as torchrun gives each rank: comparing and converting
    # megabyte batches on several OpenMP threads is many times slower on a shared machine.
    run_ahead = RUN_AHEAD if run_ahead is None else run_ahead
    with swapped(torch.get_num_threads, torch.set_num_threads, 1), run_ahead_of(run_ahead):
        started = time.perf_counter()
        notes: list[str] = []
        sources = (_importable(read_script(original).source, notes, "original"), _importable(read_script(patched).source, notes, "patched"))
        as_path = str(Path(original).resolve())
        notes.append(f"both scripts imported as if at {as_path} (__file__)")
        edited = _hand_edited(sources[1], original, patched)
        if edited:
            notes.append(f"{patched} holds no runtime of patch-prefetch: verified as a hand-edited version of {original}, its own loader driven by its own calls")
        prefetched = not edited and _patched_runtime(sources[1])
        module = DRIVERS["module"]
        try:
            loader = module.read(*sources)
        except HarnessError:  # a training script, not a data-loader module
            loader = None
        if loader is not None:  # a data-loader module (nanochat's dataloader.py)
            run = _Run((original, patched), sources, as_path, batches, world_size, seed, warmup, sends or [], shard_tokens, notes, started, edited, tokenizer)
            result = module.run(loader, run, module.compare)
            result.prefetched, result.edited, result.run_ahead = prefetched, edited, run_ahead
            return result
        notes.append("global random state (random, numpy, torch's CPU generator): each side starts from seed 0, then makes its script's own seeding before it builds its loader, and keeps its own, as in a process of its own")
        staged = STAGING_RUNTIME in survey_of(sources[1]).module_names
        if not prefetched and staged:
            notes.append("the training generator is not run ahead: its own H2D copies go through pinned staging (pinned_staging)")
        elif not prefetched and not edited:
            notes.append("nothing was prefetched: the patched script has no training prefetch (train_prefetch was skipped), so its training loader is the original's")
        run = _Run((original, patched), sources, as_path, batches, world_size, seed, warmup, sends or [], shard_tokens, notes, started, edited)
        driver, recipe = _select_driver(run)
        if run.batches is None:
            run.batches = driver.default_batches
        result = driver.run(recipe, run, driver.compare)
        result.prefetched, result.staged, result.edited, result.run_ahead = prefetched, staged, edited, run_ahead
        return result


class NothingToVerify(CannotVerify):
    """The patched script holds none of this tool's runtime: comparing it proves nothing."""


# The runtime functions a training prefetch injects (templates/prefetch_*.py):
# the producers a family's plan may call.
TRAIN_RUNTIME = tuple(PRODUCERS)


def _hand_edited(source: str, original, patched) -> bool:
    """Whether `source` (the patched side) is a hand-edited version of the original: it
    holds no runtime of this tool. Raises NothingToVerify when the two files are
    byte-identical (a file compared with itself proves nothing)."""
    names = survey_of(source).module_names
    if any(name in names for name in (*(n for injected in INJECTED_NAMES.values() for n in injected), *TRAIN_RUNTIME)):
        return False
    if Path(original).read_bytes() == Path(patched).read_bytes():
        raise NothingToVerify(f"{patched}: byte-identical to {original}, so comparing them proves nothing; pass the script patch-prefetch wrote, or your edited version")
    return True


def _patched_runtime(source: str) -> bool:
    """Whether `source` (this tool's output) prefetches its training batches."""
    return any(name in survey_of(source).module_names for name in TRAIN_RUNTIME)


def _select_driver(run: _Run) -> tuple[Driver, object]:
    """The driver the plans of the original's data sources name (`Plan.driver`), else the first
    driver of `DRIVERS` that reads the scripts, and its recipe. Raises CannotVerify when
    none does, with the last driver's reason where it names its own kind of source (a
    generator, a construction), else the first driver's."""
    named = _planned_drivers(run.sources[0])
    errors = []
    script_drivers = [driver for name, driver in DRIVERS.items() if name != "module"]
    for driver in sorted(script_drivers, key=lambda d: d.name not in named):
        try:
            return driver, driver.read(*run.sources)
        except HarnessError as error:
            errors.append(error)
    why = errors[-1] if "generator" in str(errors[-1]) or "`" in str(errors[-1]) else errors[0]
    raise CannotVerify(f"{run.paths[0]}: {why}") from None


def _planned_drivers(source: str) -> set[str]:
    """The drivers the plans of `source`'s data sources name (`Plan.driver`, from their
    families: `registry.verified_sources`); empty when the source cannot be surveyed or has none."""
    try:
        verdicts = verdicts_of(source)
    except Exception:  # the recipes say why a script cannot be read
        return set()
    return {variable.plan.driver for variable in registry.verified_sources(verdicts)}


def _verify_loader_class(recipe: LoaderRecipe, run: _Run, compare) -> VerifyResult:
    """`verify` for a loader class: each rank's original batches drawn once
    (`reference_batches`), then `compare` for every configuration of the patched loader
    that runs on that rank, then the evaluation loops."""
    original, patched = run.paths
    original_source, patched_source = run.sources
    as_path, world_size, notes = run.as_path, run.world_size, run.notes
    try:
        patched_sites = patched_constructions(patched_source, recipe, original_source, "edited" if run.edited else "patched")
    except HarnessError as error:
        raise CannotVerify(f"{patched}: {error}") from None
    calls = _edited_calls(recipe, patched_source, notes) if run.edited else None
    loops = loop_calls(recipe, calls) if calls is not None else LoopCalls({}, {}, [])
    run.loops = loops if calls is not None else None
    top_level = definitions_only(original_source) != original_source
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-verify-") as data_dir, _launch_env(as_path, world_size):

        def load_one(source: str, rank: int, env: dict | None = None):
            # A script that trains at top level: its definitions, as rank `rank` would run them.
            with environment(env or {}):
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
        if not run.edited:
            notes.append(_toggle_note(modules[1]))
        configurations = _configurations("the edited loader" if run.edited else "the default producer")
        difference, shard_tokens, train_shards, noted = None, run.shard_tokens, 4, len(notes)
        layouts, tried, first_error = None, [], None
        try:
            while True:
                plan = _plan(recipe, modules[0], world_size, run.batches, run.warmup, data_dir, run.seed, notes, shard_tokens, train_shards)
                if layouts is None:  # once
                    run.seeded = _seeding(recipe, calls or recipe, modules, plan, run)
                try:
                    difference = _compare_ranks(recipe, run, plan, modules, load, load_one, patched_sites, configurations, compare, calls)
                    break
                except ShardsRanOut as error:
                    if run.shard_tokens is not None:
                        raise CannotVerify(f"{original}: {error}: " + (
                            f"the loader reads past the end of its data, and --shard-tokens {shard_tokens} holds less than the run reads; a loader that does not wrap around needs --shard-tokens {plan.read_once_tokens} or more"
                            if shard_tokens < plan.read_once_tokens else
                            "the loader reads past the end of its data although the shards hold what the run reads: it expects data these shards lack (more shards, another layout)")) from None
                    # Shards sized to wrap around are read through by a loader that walks
                    # them once: the layouts verify knows, in turn (each reads no shard
                    # twice; larger shards, then more of them), before it gives up.
                    if layouts is None:
                        layouts = [(plan.read_once_tokens, 4), (4 * plan.read_once_tokens, 4), (plan.read_once_tokens, 16)]
                        first_error = error
                    tried.append(f"{train_shards} x {plan.shard_tokens} tokens")
                    if not layouts:
                        raise CannotVerify(f"{original}: {first_error}: the loader reads past the end of its data on every layout tried ({'; '.join(tried)} per train shard): it expects data these shards lack (another layout, longer documents); --shard-tokens N sets their size") from None
                    del notes[noted:]
                    run.leaks.clear()
                    shard_tokens, train_shards = layouts.pop(0)
                    notes.append(f"{error}: the loader walks its shards once and does not wrap around (a run over real shards never reads them all), so the shards are sized for the run to read each once ({train_shards} x {shard_tokens} tokens; tried before: {'; '.join(tried)}), and its wrap-around is not exercised")
        except HarnessError as error:
            raise CannotVerify(f"{original}: {error}") from None
        notes.extend(f"patched loader run with {c.label}" + ("" if c.ranks is None else f" (rank {', '.join(map(str, c.ranks))})") for c in configurations)
        val_compared = 0
        if difference is None:
            val_compared, difference = compare_val_loops(recipe, patched_source, lambda rank: modules if rank == 0 else load(rank), plan, run.seed, notes, run.edited)
    notes.extend(_assumption_notes(recipe))
    per_rank = plan.warmup + plan.batches
    result = VerifyResult(difference is None, world_size, per_rank * world_size, difference, notes, time.perf_counter() - run.started, val_compared)
    result.leaks = run.leaks
    result.skipped = loops.not_compared + run.unseeded
    for index, where in loops.where.items():
        notes.append(f"{'the warm-up' if index < len(recipe.constructions) - 1 else 'the training'} loop's batches drawn with {where}")
    return result


def _compare_ranks(recipe: LoaderRecipe, run: _Run, plan: Plan, modules, load, load_one, patched_sites, configurations, compare, calls) -> Difference | None:
    """Each rank's original batches (`reference_batches`), then `compare` for every
    configuration of the patched loader that runs on that rank; the first difference."""
    for rank in range(run.world_size):
        rank_modules = modules if rank == 0 else load(rank)
        reference, cpu_reference = reference_batches(recipe, rank_modules[0], plan, rank, run.notes, DRAW_TIMEOUT_S, run.seeded), None
        for configuration in configurations:
            if configuration.ranks is not None and rank not in configuration.ranks:
                continue
            if not configuration.host_cuda and cpu_reference is None:
                cpu_reference = _cpu_reference(recipe, rank_modules[0], plan, rank, run, reference)
            patched_module = rank_modules[1] if not configuration.env else load_one(run.sources[1], rank, configuration.env)
            difference = compare(recipe, patched_sites, patched_module, plan, rank, reference if configuration.host_cuda else cpu_reference, configuration, run.notes, DRAW_TIMEOUT_S, calls, leaks=run.leaks, phase_calls=run.loops.phases if run.loops else None, call_where=run.loops.where if run.loops else None, seeded=run.seeded)
            if difference is not None:
                difference.configuration = configuration.label
                return difference
    return None


def _cpu_reference(recipe: LoaderRecipe, module, plan: Plan, rank: int, run: _Run, reference):
    """The original's batches of `rank` drawn on a CPU device, for the patched loader's CPU
    run: there the tensors of a batch may share memory (`x, y = t[:-1], t[1:]`, a write
    to one showing in the other), and the patched batch must share it the same way. Where
    the original cannot be drawn on a CPU device, `reference` (the CUDA path's), with a
    note: values compared, sharing not."""
    try:
        return reference_batches(recipe, module, plan, rank, [], DRAW_TIMEOUT_S, run.seeded, on_cuda=False)
    except (CannotVerify, HarnessError) as error:
        run.notes.append(f"the original's batches not drawn on a CPU device ({error}): the CPU run's values compared, not which of its tensors share memory")
        return reference


def _verify_generator(recipe: IteratorRecipe, run: _Run, compare) -> VerifyResult:
    """`verify` for a data generator: both scripts imported definitions-only (a top-level
    script does not train), each rank's generator built by the script's own expression
    with `dist` answering the simulated rank, and `batches` items compared in order.
    Runs in a scratch working directory: scripts glob data paths relative to it."""
    explicit = [code for code in run.sends if code not in recipe.sent]
    recipe.sent += explicit
    batches, warmup, world_size, notes = run.batches, run.warmup, run.world_size, run.notes
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-verify-") as tmp, host_only_pinning(notes), cuda_as_host(notes), swapped(os.getcwd, os.chdir, tmp), _launch_env(run.as_path, world_size):
        modules = [_load_definitions(source, run.as_path) for source in run.sources]
        for module in modules:
            module.__dict__.setdefault("device", torch.device("cpu"))
        counts = [warmup] * (len(recipe.original) - 1) + [batches]
        started_with = set(threading.enumerate())
        try:
            plan = plan_generator_run(recipe, modules, tmp, counts, world_size, run.seed, explicit, run.shard_tokens, notes)
            difference = first_rank_difference(lambda rank: _compare_generator_configurations(compare, recipe, modules, rank, world_size, counts, plan, notes), world_size)
        except HarnessError as error:
            raise CannotVerify(f"{run.paths[0]}: {error}") from None
        finally:
            # The script's own threads (a shard loader's `load_async`) may still be reading
            # a shard of this directory: it goes only after they end.
            join_new_threads(started_with, DRAW_TIMEOUT_S)
    notes.append(f"generator `{recipe.target}`: {sum(counts)} items per rank" + (f" ({warmup} per warm-up build)" if len(counts) > 1 else ""))
    notes.extend(_assumption_notes(recipe))
    result = VerifyResult(difference is None, world_size, sum(counts) * world_size, difference, notes, time.perf_counter() - run.started)
    result.exercised, result.skipped = _generator_coverage(recipe, plan, world_size)
    return result


def _generator_coverage(recipe: IteratorRecipe, plan, world_size: int) -> tuple[list[str], list[str]]:
    """What a generator run crossed (stage changes sent, shard boundaries: the fewest any
    rank crossed, counted from the marked shards) and what it did not, with the reason."""
    exercised, skipped = [], list(plan.skipped)
    if plan.sends:
        count = len(plan.sends)
        exercised.append(f"{count} stage change{'s' if count != 1 else ''} ({plan.origin}{', None sent between' if plan.none_between else ''})")
    crossed = min(plan.marks.crossed_by(rank) for rank in range(world_size))
    if plan.marks.unreadable:
        skipped.append("shard boundaries (the generator's first tensor holds no token ids to tell its shard by)")
    elif crossed == 0:
        skipped.append(f"shard boundaries (no rank crossed one with shards of {plan.shard_tokens} tokens)")
    else:
        exercised.append(f"{crossed} shard boundar{'ies' if crossed != 1 else 'y'}" + (" (fewest of any rank)" if world_size > 1 else ""))
    return exercised, skipped


# The runtime function of a generator whose own H2D copies are staged (templates/pinned_staging.py).
STAGING_RUNTIME = "_pinned_h2d"


def _compare_generator_configurations(driver_compare, recipe, modules, rank, world_size, counts, plan, notes) -> Difference | None:
    """One rank's generators compared. Where the patched script stages its generator's
    H2D copies (`_pinned_h2d`), on the CUDA path driven with host memory (pinned ring
    buffers, copy stream, fences; pinned copies read late, `--run-ahead`) for every rank,
    then with CUDA unavailable (the original calls) for rank 0. `plan`: the sends and
    the marked shards (`patcher.proof.generator_plan.GeneratorPlan`)."""

    def compare(*arguments):
        return driver_compare(*arguments, plan.sends, DRAW_TIMEOUT_S, none_between=plan.none_between, marks=plan.marks)

    if STAGING_RUNTIME not in modules[1].__dict__:
        return compare(recipe, modules, rank, world_size, counts)
    configurations = [("the staged copies on the CUDA path (host memory)", True)] + ([("the staged copies with CUDA unavailable", False)] if rank == 0 else [])
    for label, on_host in configurations:
        with cuda_on_host(notes) if on_host else contextlib.nullcontext():
            difference = compare(recipe, modules, rank, world_size, counts)
        if difference is not None:
            difference.configuration = label
            return difference
        note = f"patched generator run with {label}" + ("" if on_host else " (rank 0)")
        if note not in notes:
            notes.append(note)
    return None


def _read_module(original: str, patched: str):
    """The "module" driver's recipe: the loader generator of the data-loader module
    `original` that module mode rewrites (`module_verify.module_loader`). Raises
    HarnessError when `original` has none (a training script)."""
    loader = module_verify.module_loader(original)
    if loader is None:
        raise HarnessError("no data-loader generator that module mode rewrites")
    return loader


def _verify_module(loader, run: _Run, compare) -> VerifyResult:
    """Every rank of a data-loader module (`module_verify.verify_module`), after this run's notes."""
    result = compare(run.sources[0], run.sources[1], run.paths[0], run.batches, run.world_size, run.seed, run.tokenizer)
    result.notes[:0] = run.notes
    return result


# How verify drives a training data source, by name: the name a family's plan gives
# (`Family.driver`, `Plan.driver`), defined here and nowhere else. A script's drivers are
# tried with those its plans name first, then in this order: the first whose recipe
# reads the original script drives it.
# A data-loader module (module mode, nanochat's dataloader.py) is no script (nothing
# builds or rebuilds its loader, there is no warm-up reset): `verify` tries the "module"
# driver first, on its own, before a script's driver is chosen: the "generator" driver
# would take its inner parquet reader for a script's generator, which cannot be built
# outside the loader (`split` is the loader's argument).
DRIVERS = {
    # a class with `next_batch`, built as `name = Cls(...)` (and rebuilt after the warm-up)
    "loader_class": Driver("loader_class", LoaderRecipe, lambda original, patched: LoaderRecipe.from_source(original), compare_loader_rank, _verify_loader_class, DEFAULT_BATCHES),
    # a data generator advanced with next() / .send(value), built by a call
    "generator": Driver("generator", IteratorRecipe, IteratorRecipe.from_source, compare_generator_rank, _verify_generator, DEFAULT_GENERATOR_ITEMS),
    # a data-loader module's loader generator, built as the training script that imports it would
    "module": Driver("module", ModuleLoader, _read_module, module_verify.verify_module, _verify_module, module_verify.DEFAULT_BATCHES),
}


def _edited_calls(recipe: LoaderRecipe, edited_source: str, notes: list[str]) -> LoaderRecipe:
    """How a hand-edited script's own training loop calls its loader: its recipe where
    its survey finds a `next_batch` call of a training loader, else the original's (said
    in `notes`, with the survey's reason)."""
    try:
        edited = LoaderRecipe.from_source(edited_source)
    except HarnessError as error:
        notes.append(f"the edited script's own next_batch call not found ({error}): its loader is called with the original's arguments")
        return recipe
    if edited.call_args != recipe.call_args:
        notes.append(f"the edited script's loader called with its own loop's arguments: next_batch({', '.join(edited.call_args)}), the original's next_batch({', '.join(recipe.call_args)})")
    return edited


def _configurations(what: str) -> list[Configuration]:
    """The runs of the patched loader (`what`: "the default producer", or "the edited
    loader" of a hand-edited script): on the CUDA path (host memory), and on the CPU
    device (what a laptop runs) for rank 0."""
    return [
        Configuration(f"{what} on the CUDA path (host memory)", {}, True, None),
        Configuration(f"{what} on a CPU device", {}, False, (0,)),
    ]


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


@contextlib.contextmanager
def _launch_env(script, world_size: int):
    """What torchrun gives a script: RANK, WORLD_SIZE, LOCAL_RANK in the environment (rank 0
    of `world_size`; `dist` answers per rank) and `sys.argv` without our own arguments."""
    values = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size)}
    saved_argv = sys.argv
    with environment(values):
        sys.argv = [str(script)]
        try:
            yield
        finally:
            sys.argv = saved_argv


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
        return _beside_the_harness(load_module(source, str(path)))
    except Exception as error:  # the script's own import-time failure
        raise CannotVerify(f"{path}: importing it failed: {type(error).__name__}: {error}") from None


def _load_definitions(source: str, path):
    try:
        return _beside_the_harness(load_definitions(definitions_only(source), str(path)))
    except Exception as error:  # the script's own definitions fail to import
        raise CannotVerify(f"{path}: importing its definitions failed: {type(error).__name__}: {error}") from None


def _beside_the_harness(module):
    """`module` with the lean runtime's fork check (`_threads_a_fork_lacks`, see
    templates/prefetch_lean.py) blind to the threads that were running before it was
    loaded: the harness's own (a test runner's, the progress clock's), which a script's
    loader never hands work to. Without this the forked producer would decline to fork
    here and verify would prove the unprefetched path. The script's own threads, started
    after the load, still count."""
    check = module.__dict__.get("_threads_a_fork_lacks")
    if callable(check):
        harness = {t.name for t in threading.enumerate()}
        module.__dict__["_threads_a_fork_lacks"] = lambda: [name for name in check() if name not in harness]
    return module


def _plan(recipe: LoaderRecipe, module, world_size, batches, warmup, data_dir, seed, notes, shard_tokens=None, train_shards=4) -> Plan:
    """Write shards sized for the run (`write_loader_shards`: every loader crosses
    shard boundaries and wraps around in the longest phase) and decide the per-rank
    hyperparameters."""
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
    tokens_per_shard = write_loader_shards(data_dir, read_per_call, per_rank_call, seq_len, longest, seed, shard_tokens, train_shards)
    wraps = read_per_call * longest / (train_shards * tokens_per_shard)
    notes.append(f"{train_shards} shards x {tokens_per_shard} tokens; next_batch{calls[0]} (global tokens {tokens_per_call}, gradient accumulation {accum}: {read_per_call} tokens read per call by {world_size} ranks, the shards read {wraps:.1f} times in {longest} calls); {warmup} warm-up + {batches} batches per rank")
    if recipe.varying:
        used = [sorted({a[i] for a in calls}) for i in recipe.varying]
        notes.append(f"per-step argument(s) {[recipe.call_args[i] for i in recipe.varying]} driven with {used}, changing every 5 calls")
    read_once_tokens = math.ceil(read_per_call * longest * 1.25 / 4)  # a quarter of the run each, and a margin
    return Plan(make_hparams, world_size, warmup if len(recipe.constructions) > 1 else 0, batches, seq_lens or [], tokens_per_shard, read_once_tokens, train_shards)


def _seeding(recipe: LoaderRecipe, patched: LoaderRecipe, modules, plan: Plan, run: _Run) -> bool:
    """Whether both sides can make their script's own global seeding before building
    their loader (`loop_calls.script_seeding`, tried for rank 0): each side then starts
    from the state its script seeds, not from seed 0. Where a side cannot, neither
    does (a note), and a seeding that differs between the two goes to `run.unseeded`."""
    calls = [seeding_calls(recipe), seeding_calls(patched)]
    if not calls[0] and not calls[1]:
        return False
    try:
        for side, (side_recipe, module) in enumerate(((recipe, modules[0]), (patched, modules[1]))):
            script_seeding(side_recipe, side_recipe.namespace(module, plan.hparams_for(0), 0, plan.world_size, torch.device("cpu")))
    except Exception as error:  # the seed needs what only the run has
        run.notes.append(f"the script's global seeding (line {(calls[side] or calls[0])[0][0]}) not made here ({type(error).__name__}: {error}): each side starts from seed 0")
        if [c[1:] for c in calls[0]] != [c[1:] for c in calls[1]]:
            run.unseeded.append("the edited script's global seeding (it differs from the original's and cannot be evaluated here)")
        return False
    shown = ", ".join(f"{name}({code}) line {line}" for line, name, code in calls[0])
    run.notes.append(f"global random state: each side makes its script's own seeding first ({shown or 'none'} in the original)")
    return True


def _grad_accum(recipe: LoaderRecipe, args: tuple) -> int:
    """The gradient accumulation steps of a call: the argument whose code names them, or
    that is passed to a `next_batch` parameter named for them (`grad_accum_steps`), else 1."""
    for index, (code, value) in enumerate(zip(recipe.call_args, args)):
        if ("accum" in code or "accum" in recipe.parameter_of(index)) and isinstance(value, int) and value > 0:
            return value
    return 1
