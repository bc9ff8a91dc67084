"""Family `coprime`: the coprime-stride `DistributedTokenLoader` (parameter-golf, late March to early April).

The same name and `next_batch` as the TokenStream family, no TokenStream: numpy
memmaps of the shards and an `np.random.Generator` seeded from the file names (its own
RNG, so running it ahead draws in the same order).

Recognised: a `DistributedTokenLoader` with a `_pick_coprime_stride` method or an
`np.random.Generator`, using no threads. Refusals: those of every loader rebuilt on the
CPU (`loader_plan.py`); a per-step argument is refused where the loader changes its
arrays in place. Producer: `_make_train_loader`, on the forked producer `prefetch_lean`
for run-constant arguments, else the thread runtime `prefetch_loader`.
Verify: the "loader_class" driver.
"""

from __future__ import annotations

from patcher.families.base import MAKE_TRAIN_LOADER, DataVariable, Family, Plan
from patcher.families.loader_plan import plan_rebuilt_on_cpu
from patcher.survey.loaders import method


def recognise(loader) -> bool:
    """A `DistributedTokenLoader` that picks a coprime stride or keeps a numpy Generator, using no threads."""
    if loader.threaded or loader.name != "DistributedTokenLoader":
        return False
    return method(loader.node, "_pick_coprime_stride") is not None or "Generator" in loader.called


def plan(variable: DataVariable, verdicts) -> Plan:
    """That of every loader rebuilt on the CPU."""
    return plan_rebuilt_on_cpu(variable, verdicts)


UNIT = Family("coprime", "loader_class", recognise, plan, producer=MAKE_TRAIN_LOADER, runtime="prefetch_lean", order=50, competition="parameter-golf")
