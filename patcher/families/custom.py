"""Family `custom`: any other class with a `next_batch` method (the catch-all, recognised last).

Refusals: those of every loader rebuilt on the CPU (`loader_plan.py`), first among them
a loader that already builds batches on threads (`Thread`, `ThreadPoolExecutor`: 12 of
the 66 parameter-golf loader scripts) or whose code reaches threads outside its class (a
module-level helper or executor, a `threading.Thread` subclass: `survey/threads.py`,
the reason names where), and one whose `__init__` takes no `device` to
build it on the CPU. Producer: `_make_train_loader`, on the forked producer
`prefetch_lean` for run-constant arguments, else the thread runtime `prefetch_loader`.
Verify: the "loader_class" driver.
"""

from __future__ import annotations

from patcher.families.base import MAKE_TRAIN_LOADER, DataVariable, Family, Plan
from patcher.families.loader_plan import plan_rebuilt_on_cpu


def recognise(loader) -> bool:
    """Every loader class: the families before it in order had their pick."""
    return True


def plan(variable: DataVariable, verdicts) -> Plan:
    """That of every loader rebuilt on the CPU."""
    return plan_rebuilt_on_cpu(variable, verdicts)


UNIT = Family("custom", "loader_class", recognise, plan, producer=MAKE_TRAIN_LOADER, runtime="prefetch_lean", order=1000)
