"""What a loader family declares (`Family`), what it is asked about (`DataVariable`) and what it answers (`Plan`).

A family is one kind of training-data source that real scripts use (the TokenStream
`DistributedTokenLoader`, the `ShuffledSequenceLoader`, a send-driven data generator,
...). Its module, `patcher/families/<name>.py`, declares `UNIT = Family(...)`: how the
survey recognises it, which producer and runtime `train_prefetch` gives it (and when
it refuses, with the reason), and which driver `verify` drives it with. Adding a
family means adding its module, its fixture `fixtures/<name>*.py` and its test file
`tests/test_family_<name>.py`, nothing else.

The survey (`patcher/survey/`) records facts only; the families layer judges them:
`registry.judge(module)` runs the survey, then `sources.judge` gives each loader class,
generator site and construction its family and verdict in a frozen `Verdicts` beside
the survey (`verdicts.py`), and `sources.data_sources` gives `train_prefetch` each
training data variable with its family's `Plan`. A family is asked with frozen data
alone (`plan(variable, verdicts)`: the variable and the verdicts, whose `survey` holds
the facts), never with a transform's context, and answers with frozen data: the
producer, runtime, options and driver its `Plan` names. Producer names (`PRODUCERS`)
are declared here and nowhere else; a driver is named by the family and defined once,
by `verify` (`patcher/proof/verify.py`'s `DRIVERS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    import libcst as cst

    from patcher.survey.index import ScriptIndex
    from patcher.survey.loaders import LoaderClass
    from patcher.survey.sites import IteratorSite
    from patcher.families.verdicts import Verdicts

# What a family recognises (`Family.kind`): "loader_class", a surveyed loader class (a
# class with `next_batch`); "generator", a module-level generator function.
KINDS = ("loader_class", "generator")

# The runtime functions a patched script calls (`templates/`), each with the
# template that defines it: `_make_train_loader` rebuilds a loader on the CPU in a
# producer (the forked `prefetch_lean`; a plan that needs a thread gets `prefetch_loader`);
# `_prefetch_iterator` / `_prefetch_next_batch` run the script's own call ahead on a
# thread; `_spawn_generator` runs a data-loader module's generator in a spawned process
# (the same process producer, `prefetch_lean`, started by spawn).
MAKE_TRAIN_LOADER = "_make_train_loader"
PREFETCH_ITERATOR = "_prefetch_iterator"
PREFETCH_NEXT_BATCH = "_prefetch_next_batch"
SPAWN_GENERATOR = "_spawn_generator"
# The template of `_make_train_loader` that runs the producer on a thread of the
# training process: what a plan asks for (`Plan.runtime`) where the forked one cannot
# serve the variable (per-step arguments, reads of the loader beyond `next_batch`).
THREAD_LOADER_RUNTIME = "prefetch_loader"
PRODUCERS = {
    MAKE_TRAIN_LOADER: "prefetch_lean",
    PREFETCH_ITERATOR: "prefetch_loader",
    PREFETCH_NEXT_BATCH: "prefetch_loader",
    SPAWN_GENERATOR: "prefetch_lean",
}


@dataclass(frozen=True)
class Family:
    """A loader family as one unit: what its module declares (`UNIT = Family(...)`).

    name: the family's name (`Verdicts.family_of`, `SiteVerdict.family`), and the stem
    of its fixture and test file.
    driver: the name of what `verify` drives it with, a key of `verify.DRIVERS`:
    "loader_class" (build the class, call `next_batch`), "generator" (build the
    generator, `next()` / `.send()`) or "module" (a data-loader module's loader
    generators, `module_sources`). A family with a driver of its own names it here, and
    its driver is defined once, in `verify.DRIVERS`; a test keeps every name defined.
    recognise: what it recognises, by `kind`: for "loader_class", `(LoaderClass) ->
    bool` over a surveyed loader class (facts only; `threaded` says whether it uses
    threads); for "generator", `(cst.FunctionDef) -> bool` over a module-level
    generator function (a module family's are the generators its loaders read). The
    first unit in `order` that recognises a candidate gets it.
    plan: `(DataVariable, Verdicts) -> Plan`: what `train_prefetch` does with one
    training-data variable of this family, or why it leaves it alone. Both arguments
    are frozen; it reads them and nothing of the transform that asks.
    producer: the runtime function (one of `PRODUCERS`) the patched construction calls,
    unless its `Plan` names another: `_make_train_loader` (the loader is rebuilt on the
    CPU and run by a producer, a forked child process or a thread),
    `_prefetch_next_batch` or `_prefetch_iterator` (the script's own call runs ahead on
    a thread), `_spawn_generator` (a data-loader module's loader generators); None for
    a family always left alone.
    runtime: the template that defines `producer` unless its `Plan` names another
    (`prefetch_lean`, the forked producer; `prefetch_loader`, the thread producer and its runners).
    order: recognition precedence, lower first (a catch-all family comes last).
    kind: "loader_class" or "generator" (`KINDS`): what `recognise` is asked about.
    prefetches: loaders of this family already build batches ahead by design, threads
    seen or not (`Verdicts.prefetches`); they are never wrapped again.
    refuse: for a "generator" kind (and there required), `(IteratorSite,
    cst.FunctionDef, ScriptIndex) -> str | None`: why a site built from one of its
    generator functions is not the training data source run ahead (None: it is).
    stages: for a "generator" kind, `(IteratorSite, cst.FunctionDef, ScriptIndex,
    reason) -> bool`: whether a site refused for `reason` still has its own H2D copies
    pinned and staged (`SiteVerdict.staged`).
    module_sources: `(cst.Module, ScriptIndex | None) -> list[ModuleLoader]`: the
    module-level loader generators of this family in a data-loader module, each
    rewritten to run in `producer` or left alone with the reason
    (`registry.module_loaders` asks every family that has one), else None.
    competition: the speedrun whose scripts carry this family's loader
    ("parameter-golf", "modded-nanogpt", "nanochat"), None for a generic one: a
    parameter-golf loader makes the report speak of that competition's artifact cap.
    """

    name: str
    driver: str
    recognise: Callable[..., bool]
    plan: Callable[["DataVariable", "Verdicts"], "Plan"]
    producer: str | None
    runtime: str | None
    order: int = 50
    kind: str = "loader_class"
    prefetches: bool = False
    refuse: Callable[["IteratorSite", "cst.FunctionDef", "ScriptIndex"], str | None] | None = None
    stages: Callable[["IteratorSite", "cst.FunctionDef", "ScriptIndex", str | None], bool] | None = None
    module_sources: Callable[["cst.Module", "ScriptIndex | None"], list["ModuleLoader"]] | None = None
    competition: str | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for an unknown kind or producer, or hooks that do not fit the kind."""
        if self.kind not in KINDS:
            raise ValueError(f"family {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.driver.isidentifier():
            raise ValueError(f"family {self.name}: driver {self.driver!r} is no name")
        if self.producer is not None and self.producer not in PRODUCERS:
            raise ValueError(f"family {self.name}: producer {self.producer!r} is not one of {', '.join(PRODUCERS)}")
        if (self.refuse is not None) != (self.kind == "generator"):
            raise ValueError(f"family {self.name}: `refuse` is for generator families, and they need one")
        if self.module_sources is not None and self.kind != "generator":
            raise ValueError(f"family {self.name}: `module_sources` finds loader generators: a generator family's")

    @property
    def generators(self) -> bool:
        """Whether it recognises module-level generator functions (else loader classes)."""
        return self.kind == "generator"


@dataclass(frozen=True)
class DataVariable:
    """One variable that holds the training data, with every construction of it.

    target: the variable (`train_loader`). sites: its training constructions in source
    order (`Construction`s of a loader class, or `SiteVerdict`s of a generator).
    family: its family unit. loader: the surveyed loader class, None for a generator.
    device_args: for a loader whose `__init__` takes a device, the index of the
    device argument in each site's call (None where a call passes none); else empty.
    plan: its family's `Plan` (`sources.data_sources`), None while it is being asked.
    """

    target: str
    sites: tuple
    family: Family
    loader: LoaderClass | None = None
    device_args: tuple[int | None, ...] = ()
    plan: Plan | None = None

    @property
    def line(self) -> int:
        """Line of the first construction."""
        return self.sites[0].line

    @property
    def lines(self) -> str:
        """Lines of every construction, as the report lists them: "12, 40"."""
        return ", ".join(str(s.line) for s in self.sites)


@dataclass(frozen=True)
class Plan:
    """A family's answer for one `DataVariable`, as data.

    producer, runtime, driver: the runtime function the patched construction calls (one
    of `PRODUCERS`), the template that defines it, and the driver `verify` drives the
    variable with (a key of `verify.DRIVERS`); None where the family's own
    (`Family.producer`, `.runtime`, `.driver`) hold, which `sources.data_sources` fills in.
    A `_make_train_loader` plan names `THREAD_LOADER_RUNTIME` where the variable needs
    the thread runtime (per-step arguments, attribute reads); a script has one
    `_make_train_loader`, so when any variable (or another feature's template) needs
    the thread runtime, every variable gets it.
    refusal: why it is left alone (then `line` says where), else None.
    note: the report line when it is wrapped; forked_note: the line instead when the
    patch ends up on the forked producer (`prefetch_lean`), None where that cannot be.
    options: the producer's keyword options this family chooses, in the order they are
    written (`reshape_arg=` the `next_batch` argument applied at hand-out; `rollback=True`
    for per-step arguments restored from a snapshot; `host_copy=False` where the loader
    writes into no array it keeps, so a batch need not be copied out; `attrs=True,
    replay=True` where the script reads the loader beyond `.next_batch`); the transform
    writes the run-time switches (`prefetch=`, `copy_stream=`, ...) before them and
    `name=` after, leaving out those the runtime it writes for does not take (the
    forked one takes none of them).
    """

    refusal: str | None = None
    line: int | None = None
    note: str = ""
    forked_note: str | None = None
    options: Mapping[str, object] = field(default_factory=dict)
    producer: str | None = None
    runtime: str | None = None
    driver: str | None = None

    def __post_init__(self) -> None:
        # A read-only view, so a plan stays as its family made it.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


@dataclass(frozen=True)
class ModuleLoader:
    """A module-level loader generator of a data-loader module (a module family's source).

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
