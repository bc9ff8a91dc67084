"""Family `tokenstream`: parameter-golf's `DistributedTokenLoader(pattern, rank, world_size, device)` on a `TokenStream`.

Most records of March 2026 and the root `train_gpt.py`: `next_batch(global_tokens,
seq_len, grad_accum_steps)` takes consecutive spans of a `TokenStream(pattern)` (files,
position, `take(n)`) and returns `(x, y)` on the device; `main()` builds it again after
the warm-up steps.

Recognised: a loader class that builds a script class named `TokenStream` and uses no
threads. Refusals: those of every loader rebuilt on the CPU (`loader_plan.py`).
Producer: `_make_train_loader`, on the forked producer `prefetch_lean` when every
`next_batch` call passes run constants (`args.train_batch_tokens, args.train_seq_len,
grad_accum_steps`, about 90 % of the records); on the thread runtime `prefetch_loader`
for a `seq_len` curriculum (the loader only reshapes with it: applied at hand-out), a
batch-size schedule (a snapshot rollback, cheap: the TokenStream rebinds its
attributes, it changes no array in place) or reads of the loader's attributes.
Verify: the "loader_class" driver.
"""

from __future__ import annotations

from patcher.families.base import MAKE_TRAIN_LOADER, DataVariable, Family, Plan
from patcher.families.loader_plan import plan_rebuilt_on_cpu


def recognise(loader) -> bool:
    """A loader that builds a `TokenStream` and uses no threads."""
    return not loader.threaded and any(c.name.value == "TokenStream" for c in loader.related[1:])


def plan(variable: DataVariable, verdicts) -> Plan:
    """That of every loader rebuilt on the CPU."""
    return plan_rebuilt_on_cpu(variable, verdicts)


UNIT = Family("tokenstream", "loader_class", recognise, plan, producer=MAKE_TRAIN_LOADER, runtime="prefetch_lean", order=30, competition="parameter-golf")
