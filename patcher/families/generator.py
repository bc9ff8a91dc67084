"""Family `generator`: a data generator function, `train_loader = gen(...)` advanced with `next()` or `.send()`.

modded-nanogpt's `distributed_data_generator(filename_pattern, num_tokens, seq_len)`
(rank and world size from torch.distributed, shards in order, batches already on the
device), which takes new batch sizes through `.send()`.

Recognised: a generator function (one that yields) defined at module level. A site
built from one is refused (`refuse`, asked by `sources.judge`) where the script uses the
generator object for more than `next()` / `.send()`, never advances it, or where the
generator already loads in the background (`Thread`, `load_async`), draws from a
global RNG, or calls a torch.distributed collective (local queries such as
`get_rank` are fine). Producer: `_prefetch_iterator`, thread runtime
`prefetch_loader`: the generator runs ahead on a thread, its own H2D copies on the
copy stream; a `.send(value)` rebuilds and replays it, exactly. Verify: the
"generator" driver.

Background loading comes in two kinds (`background_kind`). A generator that yields
what its threads built (`yield queue.get()`, `yield future.result()`) prefetches
batches: it is left alone. One whose threads only load shards or files (modded-nanogpt's
`Shard.load_async`, 2026) and builds every batch on the caller's thread prefetches
shards, not batches: it is not run ahead either (a forked child would not have its
threads and must not touch the memory it pins; a thread producer takes GIL time from
a host-bound training loop, and every changed `.send(value)` would rebuild and replay
the shard threads), but its site is `staged`: its `.to(device, non_blocking=True)`
copies go through pinned memory on the copy stream (feature `pinned_staging`),
exact because the generator still runs where and when the original does.
"""

from __future__ import annotations

import libcst as cst

import libcst.matchers as m

from patcher.cst_walk import dotted, walk
from patcher.families.base import PREFETCH_ITERATOR, DataVariable, Family, Plan
from patcher.families.copies import device_copies
from patcher.survey.loaders import THREAD_NAMES, global_rng

DIST_LOCAL_QUERIES = {"get_rank", "get_world_size", "is_initialized", "is_available", "get_backend"}


def recognise(function: cst.FunctionDef) -> bool:
    """Every module-level generator function."""
    return True


def refuse(site, function: cst.FunctionDef, index) -> str | None:
    """Why the generator `site.target` (built from `function`) is not run ahead, else None."""
    target, binding = site.target, site.binding
    advanced = [c for c, sc in index.next_calls if c.args[0].value.value == target and sc.resolve(target) is binding]
    # `.send(value)` is exact in the runtime (rebuild and replay); other methods are not ours to run ahead
    uses = sorted({a.attr for a in index.attribute_uses if a.base == target and a.scope.resolve(a.base) is binding} - ({"send"} if site.sends else set()))
    advanced += site.sends
    if uses:
        return f"`{target}` is used as {', '.join(f'`{target}.{u}`' for u in uses)}, not only with next()"
    if not advanced:
        return f"`{target}` is never advanced with next()"
    return unsafe_reason(function)


def stages(site, function: cst.FunctionDef, index, reason: str | None) -> bool:
    """Whether the site `site` (built from `function`), refused for `reason`, gets pinned staging: its
    only obstacle is background loading of shards or files (`background_kind`), and it
    has a `.to(device, non_blocking=True)` copy whose target is a device (`copies.DEVICE_TARGET`) to stage; a generator whose copies are all casts gets none."""
    if not reason or not reason.startswith(f"{function.name.value} loads shards"):
        return False
    return bool(device_copies(function))


def background_kind(function: cst.FunctionDef) -> str | None:
    """What the background work a generator starts hands it: "batches" where what it
    yields is taken straight from that work (`yield q.get()`, `yield f.result()`, a
    name bound to one, `yield from`), "shards" where every yielded value is built in
    the generator's own body (its threads load only shards or files), None where it
    starts no thread and calls no `load_async`."""
    called = [dotted(node.func) or "" for node in walk(function) if isinstance(node, cst.Call)]
    if not any(c.split(".")[-1] in THREAD_NAMES or c.split(".")[-1] == "load_async" for c in called):
        return None
    fetched = {"get", "get_nowait", "result"}
    handed = set()  # names bound straight to what background work hands over
    for node in walk(function):
        if m.matches(node, m.Assign(value=m.Call(func=m.Attribute()))) and node.value.func.attr.value in fetched:
            handed.update(t.target.value for t in node.targets if isinstance(t.target, cst.Name))
    for node in walk(function):
        if not isinstance(node, cst.Yield) or node.value is None:
            continue
        if isinstance(node.value, cst.From):
            return "batches"
        parts = node.value.elements if isinstance(node.value, (cst.Tuple, cst.List)) else [node.value]
        for part in parts:
            value = part.value if isinstance(part, cst.BaseElement) else part
            if isinstance(value, cst.Name) and value.value in handed:
                return "batches"
            if m.matches(value, m.Call(func=m.Attribute())) and value.func.attr.value in fetched:
                return "batches"
    return "shards"


def unsafe_reason(function: cst.FunctionDef) -> str | None:
    """Why running `function` on another thread could change what it yields, else None."""
    name = function.name.value
    for node in walk(function):
        if not isinstance(node, cst.Call):
            continue
        called = dotted(node.func)
        parts = called.split(".")
        if parts[-1] in THREAD_NAMES or parts[-1] == "load_async":
            if background_kind(function) == "shards":
                return (f"{name} loads shards in the background ({called}) and builds each batch on the caller's thread: "
                        "not run ahead (a fork would not copy its threads, a producer thread would take GIL time from the training loop); "
                        + ("its H2D copies get pinned staging" if device_copies(function)
                           else "it has no `.to(device, non_blocking=True)` to a device to stage (its casts stay as written)"))
            return f"{name} already loads data in the background ({called}); not wrapped again"
        rng = global_rng(called)
        if rng is not None:
            return f"{name} draws from {rng}; a background thread would change the draw order"
        if (parts[0] == "dist" or called.startswith("torch.distributed")) and parts[-1] not in DIST_LOCAL_QUERIES:
            return f"{name} calls {called} (a collective); it must stay on the training thread"
    return None


def plan(variable: DataVariable, verdicts) -> Plan:
    """Run it ahead: `refuse` has already turned away the sites that cannot be."""
    return Plan(note=f"`{variable.target}` (generator {variable.sites[0].function}) built at line {variable.lines} runs ahead on a background thread")


UNIT = Family("generator", "generator", recognise, plan, producer=PREFETCH_ITERATOR, runtime="prefetch_loader", order=10, kind="generator", refuse=refuse, stages=stages)
