"""Family `distributed_data_loader`: the older modded-nanogpt `DistributedDataLoader`.

`DistributedDataLoader(pattern, B, T, process_rank, num_processes)` takes no device:
its `next_batch()` moves the batch to the GPU itself (`x.cuda()`, `x.to("cuda")`), so
it cannot be rebuilt on the CPU. Instead the script's own `next_batch()` runs ahead on
a thread, with its `.cuda()` copies on the copy stream.

Recognised: a loader class whose `__init__` takes no `device`, whose `next_batch` moves
to CUDA itself, and which uses no threads. Refusals: a loader that draws from a global
RNG, calls torch.distributed or torch.cuda (`LoaderClass.unsafe`); a `next_batch` call
with an argument that changes during the run (the thread runs calls ahead with the
arguments it was given). Producer: `_prefetch_next_batch`, thread runtime
`prefetch_loader`. Verify: the "loader_class" driver (its `.cuda()` kept on the host).
"""

from __future__ import annotations

from patcher.families.base import PREFETCH_NEXT_BATCH, DataVariable, Family, Plan, refused


def recognise(loader) -> bool:
    """No `device` parameter, `.cuda()` in `next_batch`, no threads."""
    return not loader.threaded and loader.device_index is None and loader.cuda_in_next_batch


def plan(variable: DataVariable, verdicts) -> Plan:
    """Run `next_batch()` ahead where every call passes run constants and the loader is safe on a thread."""
    loader = variable.loader
    if loader.unsafe:
        return refused(loader.unsafe, loader.line)
    for call in (c for site in variable.sites for c in verdicts.survey.calls_on(site)):
        changing = [call.args[i] for i, const in enumerate(call.constant) if not const]
        if changing:
            names = ", ".join(f"`{a}`" for a in changing)
            return refused(f"next_batch gets per-step argument {names} and moves batches to the GPU itself; only constant arguments run ahead", call.line)
    return Plan(note=f"`{variable.target}` built at line {variable.lines}: next_batch() runs ahead on a background thread, its own .cuda() copies on the copy stream")


UNIT = Family("distributed_data_loader", "loader_class", recognise, plan, producer=PREFETCH_NEXT_BATCH, runtime="prefetch_loader", order=20, competition="modded-nanogpt")
