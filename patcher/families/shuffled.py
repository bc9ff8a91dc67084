"""Family `shuffled`: parameter-golf's `ShuffledSequenceLoader(h, device)` (April records).

Recognised: a loader class named `ShuffledSequenceLoader` that uses no threads
(`next_batch(global_tokens, grad_accum_steps)`, per-rank shards, its own
`np.random.Generator`, a module-level memmap cache). Refusals: those of every loader
rebuilt on the CPU (`loader_plan.py`); the GPTQ calibration loader `calib_loader` is
not the training loader (survey).

Producer: `_make_train_loader`, on the forked producer `prefetch_lean`, with or without
`--producer-toggles` (which adds only the depth toggle `TRAIN_PREFETCH_QUEUE`): the
child process runs the script's own `next_batch` at no GIL cost to the training loop,
and every byte counts against the artifact cap. The thread runtime `prefetch_loader`
only where the variable needs it, as in every family rebuilt on the CPU.
Verify: the "loader_class" driver.
"""

from __future__ import annotations

from patcher.families.base import MAKE_TRAIN_LOADER, DataVariable, Family, Plan
from patcher.families.loader_plan import plan_rebuilt_on_cpu


def recognise(loader) -> bool:
    """A `ShuffledSequenceLoader` that uses no threads."""
    return not loader.threaded and loader.name == "ShuffledSequenceLoader"


def plan(variable: DataVariable, verdicts) -> Plan:
    """That of every loader rebuilt on the CPU."""
    return plan_rebuilt_on_cpu(variable, verdicts)


UNIT = Family("shuffled", "loader_class", recognise, plan, producer=MAKE_TRAIN_LOADER, runtime="prefetch_lean", order=40, competition="parameter-golf")
