"""What a loader family declares (`Family`), what it is asked about (`DataVariable`) and what it answers (`Plan`).

A family is one kind of training-data source that real scripts use (the TokenStream
`DistributedTokenLoader`, the `ShuffledSequenceLoader`, a send-driven data generator,
...). Its module, `patcher/families/<name>.py`, declares `UNIT = Family(...)`: how the
survey recognises it, which producer and runtime `train_prefetch` gives it (and when
it refuses, with the reason), and which driver `verify` drives it with. Adding a
family means adding its module, its fixture `fixtures/<name>*.py` and its test file
`tests/test_family_<name>.py`, nothing else.

The survey (`patcher/survey/`) records facts only; the families layer judges them:
`registry.survey(module)` runs the survey, then `sources.classify` (each loader class,
generator site and module-level loader its family and verdict), and
`sources.data_sources` gives `train_prefetch` each training data variable with its
family's `Plan`. A family is asked with the survey alone (`plan(variable, survey)`),
never with a transform's context. Driver names (`DRIVERS`) and producer names
(`PRODUCERS`) are declared here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import libcst as cst

    from patcher.survey.index import ScriptIndex
    from patcher.survey.loaders import LoaderClass
    from patcher.survey.sites import IteratorSite
    from patcher.survey.survey import Survey

# The drivers `verify` has: how it builds and draws the original's and the patched
# training data side by side. "loader_class": build the class, call `next_batch`;
# "generator": build a script's data generator, `next()` / `.send()`; "module": build a
# data-loader module's loader generator as the training script that imports it would
# (`patcher/proof/module_verify.py`), found by `Family.module_sources`.
DRIVERS = ("loader_class", "generator", "module")
# The drivers whose families recognise module-level generator functions (`recognise`
# over a `cst.FunctionDef`, `refuse` for their sites); "loader_class" families recognise
# loader classes.
GENERATOR_DRIVERS = ("generator", "module")

# The runtime functions a patched script calls (`patcher/templates/`), each with the
# template that defines it: `_make_train_loader` rebuilds a loader on the CPU in a
# producer (the forked `prefetch_lean`; a plan that needs a thread gets `prefetch_loader`);
# `_prefetch_iterator` / `_prefetch_next_batch` run the script's own call ahead on a
# thread; `_spawn_generator` runs a data-loader module's generator in a spawned process.
MAKE_TRAIN_LOADER = "_make_train_loader"
PREFETCH_ITERATOR = "_prefetch_iterator"
PREFETCH_NEXT_BATCH = "_prefetch_next_batch"
SPAWN_GENERATOR = "_spawn_generator"
PRODUCERS = {
    MAKE_TRAIN_LOADER: "prefetch_lean",
    PREFETCH_ITERATOR: "prefetch_iterator",
    PREFETCH_NEXT_BATCH: "prefetch_iterator",
    SPAWN_GENERATOR: "spawn_generator",
}


@dataclass(frozen=True)
class Family:
    """A loader family as one unit: what its module declares (`UNIT = Family(...)`).

    name: the family's name, `LoaderClass.family` / `IteratorSite.family` of what it
    recognises, and the stem of its fixture and test file.
    driver: what `verify` drives it with, one of `DRIVERS`: "loader_class" (build the
    class, call `next_batch`), "generator" (build the generator, `next()` / `.send()`)
    or "module" (a data-loader module's loader generators, `module_sources`).
    recognise: for a "loader_class" family, `(LoaderClass) -> bool`: whether a surveyed
    loader class is of this family (its family-independent facts are filled, `family`
    not yet; `prefetches` says only whether it uses threads); for a "generator" or
    "module" family, `(cst.FunctionDef) -> bool` over a module-level generator function
    (a module family's are the generators its loaders read). The first unit in `order`
    that recognises a candidate gets it.
    order: recognition precedence, lower first (a catch-all family comes last).
    producer: the runtime function (one of `PRODUCERS`) the patched construction calls,
    unless its `Plan` names another: `_make_train_loader` (the loader is rebuilt on the
    CPU and run by a producer, a forked child process or a thread),
    `_prefetch_next_batch` or `_prefetch_iterator` (the script's own call runs ahead on
    a thread), `_spawn_generator` (a "module" family's loader generators); None for a
    family always left alone.
    runtime: the template that defines `producer` when nothing asks for more
    (`prefetch_lean`, the forked producer; `prefetch_iterator`, the thread runner).
    A `_make_train_loader` plan that needs a thread (`Plan.thread`) gets `prefetch_loader`.
    plan: `(DataVariable, Survey) -> Plan`: what `train_prefetch` does with one
    training-data variable of this family, or why it leaves it alone; it reads the
    survey and nothing of the transform that asks.
    prefetches: loaders of this family already build batches ahead by design, threads
    seen or not (`LoaderClass.prefetches`); they are never wrapped again.
    refuse: for a "generator" family, `(IteratorSite, cst.FunctionDef, ScriptIndex) ->
    str | None`: why a site built from one of its generator functions is not the
    training data source run ahead (None: it is). Read by the survey, so `verify` sees it too.
    stages: for a "generator" family, `(IteratorSite, cst.FunctionDef, ScriptIndex) ->
    bool`: whether a refused site's own H2D copies get pinned staging (`IteratorSite.staged`).
    module_sources: for a "module" family only (and there required), `(cst.Module,
    ScriptIndex | None) -> list[ModuleLoader]`: the module-level loader generators of
    this family in a data-loader module, each rewritten to run in `producer` or left
    alone with the reason (`registry.module_loaders` asks every "module" family).
    """

    name: str
    driver: str
    recognise: Callable[..., bool]
    plan: Callable[["DataVariable", "Survey"], "Plan"]
    producer: str | None
    runtime: str | None
    order: int = 50
    prefetches: bool = False
    refuse: Callable[["IteratorSite", "cst.FunctionDef", "ScriptIndex"], str | None] | None = None
    stages: Callable[["IteratorSite", "cst.FunctionDef", "ScriptIndex"], bool] | None = None
    module_sources: Callable[["cst.Module", "ScriptIndex | None"], list["ModuleLoader"]] | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for an unknown driver or producer, or hooks that do not fit the driver."""
        if self.driver not in DRIVERS:
            raise ValueError(f"family {self.name}: driver {self.driver!r} is not one of {', '.join(DRIVERS)}")
        if self.producer is not None and self.producer not in PRODUCERS:
            raise ValueError(f"family {self.name}: producer {self.producer!r} is not one of {', '.join(PRODUCERS)}")
        if (self.refuse is not None) != (self.driver in GENERATOR_DRIVERS):
            raise ValueError(f"family {self.name}: `refuse` is for generator families, and they need one")
        if (self.module_sources is not None) != (self.driver == "module"):
            raise ValueError(f"family {self.name}: `module_sources` is for \"module\" families, and they need one")

    @property
    def generators(self) -> bool:
        """Whether it recognises module-level generator functions (else loader classes)."""
        return self.driver in GENERATOR_DRIVERS


@dataclass
class DataVariable:
    """One variable that holds the training data, with every construction of it.

    target: the variable (`train_loader`). sites: its training constructions in source
    order (`Construction`s of a loader class, or `IteratorSite`s of a generator).
    family: its family unit. loader: the surveyed loader class, None for a generator.
    device_args: for a loader whose `__init__` takes a device, the index of the
    device argument in each site's call (None where a call passes none); else empty.
    plan: its family's `Plan`, filled by `sources.data_sources`.
    """

    target: str
    sites: list
    family: Family
    loader: LoaderClass | None = None
    device_args: list[int | None] = field(default_factory=list)
    plan: Plan | None = None

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

    producer, runtime, driver: the runtime function the patched construction calls (one
    of `PRODUCERS`), the template that defines it, and the driver `verify` drives the
    variable with (one of `DRIVERS`); None where the family's own (`Family.producer`,
    `.runtime`, `.driver`) hold, which `sources.data_sources` fills in.
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
    producer: str | None = None
    runtime: str | None = None
    driver: str | None = None


@dataclass
class ModuleLoader:
    """A module-level loader generator of a data-loader module (a "module" family's source).

    function: its definition; device: the name of its device parameter; refusal: why it
    is left alone (None: it is rewritten); split: (parameter, training value) where the
    loader asserts its split parameter is one of a few strings, the training value
    among them, else None. family: the family unit that found it (`registry.module_loaders`
    fills it), whose producer and runtime the rewrite calls.
    """

    function: cst.FunctionDef
    device: str | None
    refusal: str | None = None
    split: tuple[str, str] | None = None
    family: Family | None = None

    @property
    def name(self) -> str:
        return self.function.name.value


def refused(reason: str, line: int | None) -> Plan:
    """The plan that leaves a variable alone because of `reason` (at `line`)."""
    return Plan(refusal=reason, line=line)
