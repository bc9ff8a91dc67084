"""Family `generator`: a data generator function, `train_loader = gen(...)` advanced with `next()` or `.send()`.

modded-nanogpt's `distributed_data_generator(filename_pattern, num_tokens, seq_len)`
(rank and world size from torch.distributed, shards in order, batches already on the
device), which takes new batch sizes through `.send()`.

Recognised: a generator function (one that yields) defined at module level. A site
built from one is refused (`refuse`, read by the survey) where the script uses the
generator object for more than `next()` / `.send()`, never advances it, or where the
generator already loads in the background (`Thread`, `load_async`), draws from a
global RNG, or calls a torch.distributed collective (local queries such as
`get_rank` are fine). Producer: `_prefetch_iterator`, thread runtime
`prefetch_iterator`: the generator runs ahead on a thread, its own H2D copies on the
copy stream; a `.send(value)` rebuilds and replays it, exactly. Verify: the
"generator" driver.
"""

from __future__ import annotations

import libcst as cst

from patcher.cst_walk import dotted, walk
from patcher.families.base import DataVariable, Family, Plan
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
    return _generator_unsafe(function)


def _generator_unsafe(function: cst.FunctionDef) -> str | None:
    """Why running `function` on another thread could change what it yields, else None."""
    name = function.name.value
    for node in walk(function):
        if not isinstance(node, cst.Call):
            continue
        called = dotted(node.func)
        parts = called.split(".")
        if parts[-1] in THREAD_NAMES or parts[-1] == "load_async":
            return f"{name} already loads data in the background ({called}); not wrapped again"
        rng = global_rng(called)
        if rng is not None:
            return f"{name} draws from {rng}; a background thread would change the draw order"
        if (parts[0] == "dist" or called.startswith("torch.distributed")) and parts[-1] not in DIST_LOCAL_QUERIES:
            return f"{name} calls {called} (a collective); it must stay on the training thread"
    return None


def plan(variable: DataVariable, ctx) -> Plan:
    """Run it ahead: the survey has refused the sites that cannot be."""
    return Plan(note=f"`{variable.target}` (generator {variable.sites[0].function}) built at line {variable.lines} runs ahead on a background thread")


UNIT = Family("generator", "generator", recognise, plan, producer="_prefetch_iterator", runtime="prefetch_iterator", order=10, refuse=refuse)
