"""`patch-prefetch verify ORIGINAL PATCHED`: the patched loader hands out exactly the original's batches.

Both scripts are imported (not run), their training loaders are built the way each
script builds them, for every rank of a simulated world, on synthetic shards in the
real format sized so that the run crosses shard boundaries and wraps around. The
first construction is drawn from for the warm-up, then the loader is rebuilt by the
script's second construction (the warm-up reset) and drawn from again. Every tensor
of every batch is compared: dtype, shape and bytes, in order.
"""

from __future__ import annotations

import contextlib
import math
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

from patcher.import_smoke import definitions_only
from patcher.harness import (
    HarnessError,
    IteratorRecipe,
    LoaderRecipe,
    SimulatedDist,
    cuda_as_host,
    hparams_factory,
    host_only_pinning,
    swapped,
    load_definitions,
    load_module,
    patched_constructions,
    point_at_shards,
)
from patcher.patch import features_from, patch_source
from patcher.shards import DOC_LEN_RANGE, write_shards
from patcher.source import read_script
from patcher.val_verify import function_namespace, loop_batches, val_loop_pairs, val_tokens_for
from patcher.features import TOGGLES

EXIT_IDENTICAL, EXIT_DIFFER, EXIT_CANNOT = 0, 1, 2

# Document lengths (tokens, BOS included) for scripts sized for web text.
WEB_DOC_LEN_RANGE = (128, 1024)


class CannotVerify(Exception):
    """Verification cannot run (one line, says why)."""


@dataclass
class Difference:
    """The first mismatch: rank, phase ("warmup" or "train"), batch index, field index, what differs."""

    rank: int
    phase: str
    batch: int
    field: int
    what: str


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


def verify(original: str | Path, patched: str | Path, batches: int = 64, world_size: int = 2, seed: int = 0, warmup: int = 4, sends: list[str] | None = None, shard_tokens: int | None = None) -> VerifyResult:
    """Compare the training batches of `original` and `patched` for ranks 0..world_size-1.

    sends: expressions (over the script's module-level names) of values to pass to a
    data generator's `.send()` besides those the script's own calls pass. shard_tokens:
    tokens per synthetic train shard of a loader class (default: about 2/3 of what the
    run reads over 4 shards); smaller shards make a loader that reshuffles when its
    shards are used up (ShuffledSequenceLoader) do so within the run.

    Returns a `VerifyResult`. Raises `CannotVerify` when the loader cannot be driven
    outside the script, and `SourceError` for unreadable input.
    """
    started = time.perf_counter()
    notes: list[str] = []
    original_source = _importable(read_script(original).source, notes, "original")
    patched_source = _importable(read_script(patched).source, notes, "patched")
    try:
        recipe = LoaderRecipe.from_source(original_source)
    except HarnessError as error:
        try:
            iterator = IteratorRecipe.from_source(original_source, patched_source)
        except HarnessError as iterator_error:
            why = iterator_error if "generator" in str(iterator_error) or "`" in str(iterator_error) else error
            raise CannotVerify(f"{original}: {why}") from None
        iterator.sent += [code for code in sends or [] if code not in iterator.sent]
        return _verify_iterator(iterator, (original, patched), (original_source, patched_source), batches, world_size, seed, warmup, notes, started)
    patched_sites = patched_constructions(patched_source, recipe)
    if len(patched_sites) != len(recipe.constructions):
        raise CannotVerify(f"{patched}: {len(patched_sites)} constructions of `{recipe.constructions[0].target}`, the original has {len(recipe.constructions)}")
    top_level = definitions_only(original_source) != original_source
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-verify-") as data_dir, host_only_pinning(notes), cuda_as_host(notes), _launch_env(original, world_size):

        def load(rank: int):
            # A script that trains at top level: its definitions, as rank `rank` would run them.
            if not top_level:
                return (_load(original_source, original), _load(patched_source, patched))
            os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
            loaded = (_load_definitions(original_source, original), _load_definitions(patched_source, patched))
            for module in loaded:
                if "dist" in module.__dict__:
                    module.__dict__["dist"] = SimulatedDist(rank, world_size)
            return loaded

        modules = load(0)
        notes.append(_toggle_note(modules[1]))
        difference = None
        try:
            plan = _plan(recipe, modules[0], world_size, batches, warmup, data_dir, seed, notes, shard_tokens)
            difference = _first_rank_difference(lambda rank: _compare_rank(recipe, patched_sites, modules if rank == 0 else load(rank), plan, rank), world_size)
        except HarnessError as error:
            raise CannotVerify(f"{original}: {error}") from None
        val_compared = 0
        if difference is None:
            val_compared, difference = _compare_val(recipe, patched_source, lambda rank: modules if rank == 0 else load(rank), plan, seed, notes)
    notes.extend(_assumption_notes(recipe))
    per_rank = plan.warmup + plan.batches
    return VerifyResult(difference is None, world_size, per_rank * world_size, difference, notes, time.perf_counter() - started, val_compared)


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
            try:
                batches = [
                    loop_batches(s, f, loop, function_namespace(module, f, s.module.code_for_node, hparams, rank, plan.world_size, tokens))
                    for module, (s, f, loop) in zip(modules, sides)
                ]
            except Exception as error:  # the script's own code outside its function
                notes.append(f"validation batches of {site.function} (line {site.line}) not compared: {type(error).__name__}: {error}")
                break
            if len(batches[0]) != len(batches[1]):
                return compared, Difference(rank, f"val:{site.function}", min(map(len, batches)), 0, f"{len(batches[0])} batches vs {len(batches[1])}")
            for n, (reference, candidate) in enumerate(zip(*batches)):
                diff = _first_difference(reference, candidate)
                if diff is not None:
                    return compared, Difference(rank, f"val:{site.function}", n, diff[0], diff[1])
            compared += len(batches[0])
        else:
            notes.append(f"validation loop of {site.function} (line {site.line}): x, y of every batch compared on {plan.world_size} ranks")
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
        fixed = patch_source(source, features_from(["py310_fstrings"], None)).source
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
    """Write shards sized for the run and decide the per-rank hyperparameters."""
    make_hparams = hparams_factory(recipe, module, world_size, data_dir)
    ns = recipe.namespace(module, make_hparams(0), 0, world_size, torch.device("cpu"))
    seq_len = int(getattr(make_hparams(0), "train_seq_len", 1024))
    seq_lens = [seq_len, max(1, seq_len // 2)] if recipe.varying else None
    args = recipe.arguments(ns, 0, seq_lens)
    tokens_per_call = int(args[0]) if args and isinstance(args[0], int) else seq_len * 64
    total = tokens_per_call * (batches + warmup)
    # Four shards holding about 2/3 of what the run reads: boundaries are crossed and the
    # stream wraps around; every shard still fits several sequences.
    tokens_per_shard = max(math.ceil(total / 6), 8 * (seq_len + 1)) if shard_tokens is None else max(int(shard_tokens), 2 * (seq_len + 1))
    write_shards(data_dir, train_shards=4, val_shards=1, tokens_per_shard=tokens_per_shard, vocab_size=256, seed=seed, bos_id=1)
    notes.append(f"4 shards x {tokens_per_shard} tokens; {tokens_per_call} tokens per next_batch; {warmup} warm-up + {batches} batches per rank")
    if recipe.varying:
        notes.append(f"per-step argument(s) {[recipe.call_args[i] for i in recipe.varying]} driven with {seq_lens}, changing every 5 calls")
    return _Plan(make_hparams, world_size, warmup if len(recipe.constructions) > 1 else 0, batches, seq_lens or [])


def _compare_rank(recipe, patched_sites, modules, plan: _Plan, rank: int) -> Difference | None:
    cpu = torch.device("cpu")
    spaces = [recipe.namespace(m, plan.hparams_for(rank), rank, plan.world_size, cpu) for m in modules]
    builders = [lambda i: recipe.build(recipe.constructions[i], spaces[0]), lambda i: recipe.evaluate(patched_sites[i], spaces[1], recipe.constructions[i].binding)]
    phases = [("warmup", 0, plan.warmup), ("train", len(recipe.constructions) - 1, plan.batches)] if plan.warmup else [("train", 0, plan.batches)]
    return _compare_phases(rank, phases, lambda side, index: builders[side](index), lambda loader, batch: loader.next_batch(*recipe.arguments(spaces[0], batch, plan.seq_lens)), "loader")


def _compare_phases(rank: int, phases, build, draw, what: str) -> Difference | None:
    """Build both sides for each (phase, construction index, count) and compare `count`
    draws in order; the first difference, or None. build(side, index) -> source;
    draw(source, n) -> the n-th batch of the phase. Both sides are closed at the end."""
    sources = [None, None]
    try:
        for phase, index, count in phases:
            for side in (0, 1):
                _close(sources[side])
                sources[side] = build(side, index)
            for n in range(count):
                try:
                    with _draw_deadline(DRAW_TIMEOUT_S):
                        reference = draw(sources[0], n)
                except Exception as error:
                    raise CannotVerify(f"the original {what} fails here (rank {rank}, batch {n}): {type(error).__name__}: {error}") from None
                try:
                    with _draw_deadline(DRAW_TIMEOUT_S):
                        candidate = draw(sources[1], n)
                except DrawTimeout as error:
                    raise CannotVerify(f"the patched {what} hangs here (rank {rank}, batch {n}): {error}") from None
                diff = _first_difference(reference, candidate)
                if diff is not None:
                    return Difference(rank, phase, n, diff[0], diff[1])
    finally:
        for source in sources:
            _close(source)
    return None


def _verify_iterator(recipe: IteratorRecipe, paths, sources, batches, world_size, seed, warmup, notes, started) -> VerifyResult:
    """`verify` for a data generator: both scripts imported definitions-only (a top-level
    script does not train), each rank's generator built by the script's own expression
    with `dist` answering the simulated rank, and `batches` items compared in order.
    Runs in a scratch working directory: scripts glob data paths relative to it."""
    with tempfile.TemporaryDirectory(prefix="patch-prefetch-verify-") as tmp, host_only_pinning(notes), cuda_as_host(notes), swapped(os.getcwd, os.chdir, tmp), _launch_env(paths[0], world_size):
        modules = [_load_definitions(source, path) for source, path in zip(sources, paths)]
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
    saved_env, saved_argv = {k: os.environ.get(k) for k in values}, sys.argv
    os.environ.update(values)
    sys.argv = [str(script)]
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
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
    tokens_per_shard = max(math.ceil(tokens_per_item * items * 1.5 / 4), 4 * tokens_per_item + 2)
    bos_id = _script_bos_id(modules[0])
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
            if not torch.equal(_bytes(x), _bytes(y)):
                return i, "bytes differ"
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)) or x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return i, "numpy arrays differ"
        elif x != y:
            return i, f"{x!r} vs {y!r}"
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as uint8 (so -0.0 and 0.0, or two NaNs, compare as stored)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
