"""Family `document_packing`: parameter-golf's `DocumentPackingLoader` (mid April on).

Variable-length packing that returns cumulative sequence lengths too. The records
already prefetch inside it (a `ThreadPoolExecutor(1)` prepares two batches ahead into
pinned buffers, shard loads run on another pool), so it is never wrapped again, threads
seen or not (`prefetches`). Its H2D copies still run on the default stream: the
`copy_stream` feature routes them.

Recognised: a loader class named `DocumentPackingLoader`. Refusal: "already prefetches
(threads in the loader)". Producer: none. Verify: the "loader_class" driver.
"""

from __future__ import annotations

from patcher.families.base import DataVariable, Family, Plan
from patcher.families.loader_plan import already_prefetches


def recognise(loader) -> bool:
    """A class named `DocumentPackingLoader`."""
    return loader.name == "DocumentPackingLoader"


def plan(variable: DataVariable, verdicts) -> Plan:
    """Always left alone: it prefetches itself."""
    return already_prefetches(variable.loader)


UNIT = Family("document_packing", "loader_class", recognise, plan, producer=None, runtime=None, order=10, prefetches=True, competition="parameter-golf")
