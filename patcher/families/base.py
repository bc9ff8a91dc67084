"""What a loader family declares (`Family`), what it is asked about (`DataVariable`) and what it answers (`Plan`).

A family is one kind of training-data source that real scripts use (the TokenStream
`DistributedTokenLoader`, the `ShuffledSequenceLoader`, a send-driven data generator,
...). Its module, `patcher/families/<name>.py`, declares `UNIT = Family(...)`: how the
survey recognises it, which producer and runtime `train_prefetch` gives it (and when
it refuses, with the reason), and which driver `verify` drives it with. Adding a
family means adding its module, its fixture `fixtures/<name>*.py` and its test file
`tests/test_family_<name>.py`, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import libcst as cst

    from patcher.survey.index import ScriptIndex
    from patcher.survey.loaders import LoaderClass
    from patcher.survey.sites import IteratorSite
    from patcher.survey.survey import Survey

# The drivers `verify` has: how it builds and draws the original's and the patched
# script's training data side by side.
DRIVERS = ("loader_class", "generator")
# The runtime functions a patched construction calls (`patcher/templates/`).
MAKE_TRAIN_LOADER = "_make_train_loader"


class Context(Protocol):
    """What a family's `plan` reads of the transform that asks it
    (`patcher.transforms.base.Context` is one): declared here so that the families
    need nothing from the transforms, which come after them."""

    survey: Survey


@dataclass(frozen=True)
class Family:
    """A loader family as one unit: what its module declares (`UNIT = Family(...)`).

    name: the family's name, `LoaderClass.family` / `IteratorSite.family` of what it
    recognises, and the stem of its fixture and test file.
    driver: what `verify` drives it with: "loader_class" (build the class, call
    `next_batch`) or "generator" (build the generator, `next()` / `.send()`).
    recognise: for a "loader_class" family, `(LoaderClass) -> bool`: whether a surveyed
    loader class is of this family (its family-independent facts are filled, `family`
    not yet; `prefetches` says only whether it uses threads); for a "generator" family,
    `(cst.FunctionDef) -> bool` over a module-level generator function. The first unit
    in `order` that recognises a candidate gets it.
    order: recognition precedence, lower first (a catch-all family comes last).
    producer: the runtime function the patched construction calls:
    `_make_train_loader` (the loader is rebuilt on the CPU and run by a producer, a
    forked child process or a thread), `_prefetch_next_batch` or `_prefetch_iterator`
    (the script's own call runs ahead on a thread); None for a family always left alone.
    runtime: the template that defines `producer` when nothing asks for more
    (`prefetch_lean`, the forked producer; `prefetch_iterator`, the thread runner).
    A `_make_train_loader` plan that needs a thread (`Plan.thread`) gets `prefetch_loader`.
    plan: `(DataVariable, Context) -> Plan`: what `train_prefetch` does with one
    training-data variable of this family, or why it leaves it alone.
    prefetches: loaders of this family already build batches ahead by design, threads
    seen or not (`LoaderClass.prefetches`); they are never wrapped again.
    refuse: for a "generator" family, `(IteratorSite, cst.FunctionDef, ScriptIndex) ->
    str | None`: why a site built from one of its generator functions is not the
    training data source run ahead (None: it is). Read by the survey, so `verify` sees it too.
    stages: for a "generator" family, `(IteratorSite, cst.FunctionDef, ScriptIndex) ->
    bool`: whether a refused site's own H2D copies get pinned staging (`IteratorSite.staged`).
    """

    name: str
    driver: str
    recognise: Callable[..., bool]
    plan: Callable[["DataVariable", "Context"], "Plan"]
    producer: str | None
    runtime: str | None
    order: int = 50
    prefetches: bool = False
    refuse: Callable[["IteratorSite", "cst.FunctionDef", "ScriptIndex"], str | None] | None = None
    stages: Callable[["IteratorSite", "cst.FunctionDef", "ScriptIndex"], bool] | None = None

    def __post_init__(self) -> None:
        if self.driver not in DRIVERS:
            raise ValueError(f"family {self.name}: driver {self.driver!r} is not one of {', '.join(DRIVERS)}")
        if (self.refuse is not None) != (self.driver == "generator"):
            raise ValueError(f"family {self.name}: `refuse` is for generator families, and they need one")


@dataclass
class DataVariable:
    """One variable that holds the training data, with every construction of it.

    target: the variable (`train_loader`). sites: its training constructions in source
    order (`Construction`s of a loader class, or `IteratorSite`s of a generator).
    family: its family unit. loader: the surveyed loader class, None for a generator.
    device_args: for a loader whose `__init__` takes a device, the index of the
    device argument in each site's call (None where a call passes none); else empty.
    """

    target: str
    sites: list
    family: Family
    loader: LoaderClass | None = None
    device_args: list[int | None] = field(default_factory=list)

    @property
    def line(self) -> int:
        """Line of the first construction."""
        return self.sites[0].line

    @property
    def lines(self) -> str:
        """Lines of every construction, as the report lists them: "12, 40"."""
        return ", ".join(str(s.line) for s in self.sites)


@dataclass
class Plan:
    """A family's answer for one `DataVariable`.

    refusal: why it is left alone (then `line` says where), else None.
    note: the report line when it is wrapped; forked_note: the line instead when the
    patch ends up on the forked producer (`prefetch_lean`), None where that cannot be.
    For `_make_train_loader` only: reshape_arg: index of the `next_batch` argument
    applied at hand-out (a reshape); rollback: the per-step arguments that need the
    snapshot rollback, or None; attrs: the script reads the loader beyond
    `.next_batch` (settle it on reads); thread: the variable needs the thread runtime
    `prefetch_loader` (per-step arguments, attribute reads), not the forked one.
    """

    refusal: str | None = None
    line: int | None = None
    note: str = ""
    forked_note: str | None = None
    reshape_arg: int | None = None
    rollback: str | None = None
    attrs: bool = False
    thread: bool = False


def refused(reason: str, line: int | None) -> Plan:
    """The plan that leaves a variable alone because of `reason` (at `line`)."""
    return Plan(refusal=reason, line=line)
