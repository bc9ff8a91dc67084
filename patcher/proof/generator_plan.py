"""How verify drives a data generator: the stage changes it sends and the shards it reads.

A script that drives its generator with `.send(value)` changes what the generator
builds (tokens per item, sequence length) a few times a run; the comparison must cross
such changes. The values are the script's own where they evaluate outside training,
`--send` expressions where given, else synthesized from the generator's construction
and its send protocol (`patcher.proof.send_synthesis`), keeping only a candidate the
original generator accepts. Then a short draw of the original (rank 0) measures the
tokens of an item in each stage, and the shards are sized from that so that the run
crosses shard boundaries; the shards are marked (`ShardMarks`) so that the boundaries
each rank crossed are counted from the tokens, and the verdict says what was crossed
(`GeneratorPlan.exercised`) and what was not (`GeneratorPlan.skipped`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from patcher.proof.compare import CannotVerify, DrawTimeout, close, draw_deadline, harness_step, one_line
from patcher.proof.data import ShardMarks, generator_tokens_per_item, item_read, shard_documents, shard_tokens_for_run, write_iterator_shards
from patcher.proof.harness import HarnessError, SimulatedDist
from patcher.proof.recipes import IteratorRecipe
from patcher.proof.send_synthesis import may_send_none, send_protocol, synthesized_schedules


@dataclass
class GeneratorPlan:
    """sends: {item of a phase: (original's value, patched's value)}; none_between:
    the other items drawn with `.send(None)`; origin: where the sent values come from
    ("the script's", "given", "synthesized"); marks: the marked shards (counting the
    boundaries crossed); shard_tokens: tokens per train shard; skipped: what the run
    could not exercise, each with its reason."""

    sends: dict
    none_between: bool
    origin: str
    marks: ShardMarks
    shard_tokens: int
    skipped: list[str] = field(default_factory=list)


# Time one item of the short draw may take (as verify's DRAW_TIMEOUT_S).
PROBE_TIMEOUT_S = 60.0
# The largest synthetic shard a short draw is tried on (tokens; 32 MB of uint16 each).
PROBE_MAX_SHARD_TOKENS = 1 << 24


class _NoFirstItem(Exception):
    """The generator ended (StopIteration) before its first item."""


def plan_generator_run(recipe: IteratorRecipe, modules, root: str, counts: list[int], world_size: int, seed: int, explicit: list[str], shard_tokens: int | None, notes: list[str]) -> GeneratorPlan:
    """Decide the sends and write the shards (into `root`, where the scripts look) for
    a generator run of `counts` items per construction on `world_size` ranks.
    `explicit`: the `--send` expressions (they win over synthesized values);
    `shard_tokens`: `--shard-tokens` (else sized from a short draw). Raises HarnessError
    when the original generator cannot be drawn from even without sends."""
    batches = counts[-1]
    none_between = bool(recipe.sent) and may_send_none(recipe)
    candidates, skipped = _candidates(recipe, modules, explicit, batches, notes)
    chosen, tokens = None, None
    for origin, label, values in candidates:
        try:
            tokens = _probe(recipe, modules, root, world_size, seed, [v[0] for v in values], none_between, notes)
        except HarnessError as error:
            notes.append(f"`{recipe.target}.send(...)` of {', '.join(repr(v[0]) for v in values)} ({label}) not used: the original generator rejects it ({error})")
            continue
        chosen = (origin, label, values)
        break
    if chosen is None:
        if candidates:
            skipped.append("stage changes (the original generator rejected every candidate value)")
        tokens = _probe(recipe, modules, root, world_size, seed, [], none_between, notes)
        origin, values = "", []
    else:
        origin, label, values = chosen
        notes.append(f"`{recipe.target}.send(...)` of {', '.join(repr(v[0]) for v in values)} ({label}){', None sent at the other items (as the script sends when nothing changed)' if none_between else ''}")
    at = [(i + 1) * batches // (len(values) + 1) for i in range(len(values))]
    sends = {n: pair for n, pair in zip(at, values)}
    if values:
        notes.append(f"stage changes at item {', '.join(map(str, at))} of {batches} (train phase); the original's items hold {', '.join(str(n) for n, _r in tokens)} tokens in each stage (rank 0)")
    stage = [sum(n >= a for a in at) for n in range(batches)]
    read = [tokens[s][1] for s in stage]
    sized = shard_tokens if shard_tokens is not None else shard_tokens_for_run(read, world_size, max(r for _n, r in tokens))
    tokens_per_item = generator_tokens_per_item(recipe, modules[0], [v[0] for v in values])
    marks = write_iterator_shards(recipe, modules, root, tokens_per_item, sum(counts), seed, notes, sized)
    how = "--shard-tokens" if shard_tokens is not None else f"sized so that the train phase, about {sum(read) * world_size} tokens read by {world_size} ranks, crosses two boundaries"
    notes.append(f"train shards of {sized} tokens ({how}), each marked by its own band of token ids so the boundaries crossed are counted")
    return GeneratorPlan(sends, none_between, origin, marks, sized, skipped)


def _item(iterator, value, none_between: bool):
    """The next item (`value` sent, or None sent where the script sends None between);
    raises _NoFirstItem where the first one (`value` None) ends the generator."""
    try:
        return iterator.send(value) if value is not None or none_between else next(iterator)
    except StopIteration:
        if value is None:
            raise _NoFirstItem from None
        raise
    except RuntimeError as error:
        # PEP 479: an iterator the generator advances inside (its shard files, a
        # document stream) ran out, and the generator's own StopIteration became this.
        if value is None and isinstance(error.__cause__, StopIteration):
            raise _NoFirstItem("an iterator it advances inside ran out (generator raised StopIteration)") from None
        raise


def _candidates(recipe: IteratorRecipe, modules, explicit: list[str], batches: int, notes: list[str]) -> tuple[list, list[str]]:
    """[(origin, label, [(original's value, patched's value), ...]), ...] best first, and what is skipped."""
    if not recipe.sent:
        return [], []
    if batches < 3:
        return [], [f"stage changes (`{recipe.target}.send(...)`: {batches} items are too few to change twice)"]
    values = [recipe.sent_values(module) for module in modules]
    if values[0] and len(values[0]) == len(values[1]):
        origin = "given" if explicit else "the script's"
        return [(origin, "--send" if explicit else "the script's values", list(zip(*values)))], []
    why = f"no value it passes could be evaluated outside training ({', '.join(recipe.sent)})"
    try:
        protocol = send_protocol(recipe, modules[0])
    except HarnessError as error:
        notes.append(f"`{recipe.target}.send(...)`: {why}; none synthesized: {error} (--send EXPR gives one)")
        return [], [f"stage changes ({why}; none could be synthesized: {one_line(error)}; --send EXPR gives one)"]
    synthesized = synthesized_schedules(protocol)
    notes.append(f"`{recipe.target}.send(...)`: {why}; stage changes synthesized from the construction's {', '.join(f'{f}={protocol.base[f]!r}' for f in protocol.fields)} (the fields `{protocol.function}` takes from `{protocol.received} = yield ...`)")
    if not synthesized:
        return [], [f"stage changes ({why}; no int field to change)"]
    return [("synthesized", label, [(v, v) for v in changes]) for label, changes in synthesized], []


def join_new_threads(started_with: set, timeout_s: float) -> None:
    """Wait, at most `timeout_s` seconds in all, for the non-daemon threads not in
    `started_with` (a generator's shard loaders, and the threads those start) to end:
    the files they read may be rewritten or removed next. A thread still being started
    by another is joined once that one has started it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        running = [t for t in threading.enumerate() if t not in started_with and not t.daemon and t is not threading.current_thread()]
        if not running:
            return
        for thread in running:
            try:
                thread.join(max(0.0, deadline - time.monotonic()))
            except RuntimeError:  # not started yet: its starter, also in `running`, is joined too
                continue


def _rejected_as_harness_error(step, what: str):
    """`step()`; an exception the generator raises (an assertion on the sent values) as a HarnessError naming `what`."""
    try:
        return step()
    except (CannotVerify, DrawTimeout, ModuleNotFoundError, _NoFirstItem):
        raise
    except Exception as error:
        raise HarnessError(f"{what}: {type(error).__name__}: {one_line(error)}") from None


def _probe(recipe: IteratorRecipe, modules, root: str, world_size: int, seed: int, changes: list, none_between: bool, notes: list[str]) -> list[tuple[int, int]]:
    """Draw the original's last construction on rank 0 over small shards: one item,
    then one after each value of `changes` is sent (`_probe_on`). A generator that ends
    before its first item (its item holds more tokens than its arguments say: `batch_size
    * seq_len` from a shard at a time) is drawn again on shards 16 times larger, up to
    `PROBE_MAX_SHARD_TOKENS`, with a note. Raises HarnessError when it still ends."""
    largest = generator_tokens_per_item(recipe, modules[0], changes)
    # Roomy in documents: a generator that cuts documents at a short sequence length uses
    # up many documents per item, and one that runs out of shard loads the next forever.
    longest_document = shard_documents(recipe, modules[0])[1][1]
    first = shard_tokens = max(4 * largest * world_size + 2, 256 * longest_document)
    while True:
        try:
            tokens = _probe_on(recipe, modules, root, world_size, seed, changes, none_between, largest, shard_tokens)
        except _NoFirstItem as error:
            if shard_tokens * 16 > PROBE_MAX_SHARD_TOKENS:
                inner = f": {error}" if str(error) else ""
                tried = ", ".join(str(first * 16**k) for k in range(20) if first * 16**k <= shard_tokens)
                raise HarnessError(f"the original generator ends (StopIteration) before its first item{inner}, on 4 synthetic shards of {tried} tokens in turn: it needs data these shards lack (more shard files, longer documents, another layout), or items larger still; --shard-tokens N sets their size") from None
            shard_tokens *= 16
            continue
        if shard_tokens != first:
            notes.append(f"the original generator ends (StopIteration) before its first item on shards of {first} tokens (its items hold more than its arguments say): drawn on shards of {shard_tokens}")
        return tokens


def _probe_on(recipe: IteratorRecipe, modules, root: str, world_size: int, seed: int, changes: list, none_between: bool, largest: int, shard_tokens: int) -> list[tuple[int, int]]:
    """`_probe` on shards of `shard_tokens` tokens. Returns (tokens of the first tensor,
    tokens of the shard used up: `item_read`) of each item; raises _NoFirstItem, or
    HarnessError when the original raises or yields no tensor. Waits for the threads
    the draw started before returning (the shards are rewritten next)."""
    module = modules[0]
    marks = write_iterator_shards(recipe, modules, root, largest, 1 + len(changes), seed, None, shard_tokens)
    if "dist" in module.__dict__:
        module.__dict__["dist"] = SimulatedDist(0, world_size)
    started_with = set(threading.enumerate())
    iterator, tokens = None, []
    try:
        iterator = harness_step(lambda: recipe.evaluate(recipe.original[-1], module), "building the original generator for a short draw (rank 0)")
        for value in [None, *changes]:
            with draw_deadline(PROBE_TIMEOUT_S):
                item = _rejected_as_harness_error(lambda: _item(iterator, value, none_between), "its first item" if value is None else f"sent {value!r}")
            try:
                tokens.append(item_read(item, marks.bos_id, marks.doc_len_range))
            except ValueError:
                raise HarnessError("the original generator yields no tensor") from None
    finally:
        close(iterator)
        join_new_threads(started_with, PROBE_TIMEOUT_S)
    return tokens
