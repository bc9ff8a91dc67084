"""The families' verdicts on one script's survey, kept beside its facts, never in them.

The survey (`patcher/survey/`) records facts: loader classes, constructions and their
`next_batch` calls, the sites built from module-level generator functions.
`sources.judge` asks the family units about them and returns one frozen `Verdicts`:
each loader class's family and whether it prefetches, each generator site of a
recognised generator function with its family and verdict (`SiteVerdict`), each
construction's final verdict (`ConstructionVerdict`: the survey's candidates, less the
loaders built inside a generator that runs ahead or is staged). The transforms
(`Context.verdicts`) and `verify` read the verdicts here; nothing writes them later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from patcher.survey.sites import Construction, IteratorSite
    from patcher.survey.survey import Survey


@dataclass(frozen=True)
class SiteVerdict:
    """A family's verdict on one generator site (`name = generator_function(...)`).

    site: the survey's `IteratorSite`, whose facts (target, function, node, call, line,
    binding, sends) read through the verdict too. family: the name of the generator
    function's family unit. training: the training data source run ahead (advanced with
    `next()` / `.send()`, named for training, not refused). reason: why it is not run
    ahead, or None. staged: not run ahead, but the training data source whose own H2D
    copies get pinned staging (`Family.stages`).
    """

    site: IteratorSite
    family: str
    training: bool = False
    reason: str | None = None
    staged: bool = False

    def __getattr__(self, name: str):
        """The site's facts, read through the verdict: `target`, `function`, `line`,
        `call`, `node`, `binding`, `sends`. Raises AttributeError for anything else."""
        if name.startswith("__") or name == "site":  # copy and pickle probe before `site` is set
            raise AttributeError(name)
        return getattr(self.site, name)


@dataclass(frozen=True)
class ConstructionVerdict:
    """The verdict on one loader construction (`name = LoaderClass(...)`).

    construction: the survey's `Construction`. training: it builds the training loader
    (a survey candidate not built inside a generator that runs ahead or is staged).
    reason: why it does not, or None.
    """

    construction: Construction
    training: bool
    reason: str | None


@dataclass(frozen=True)
class Verdicts:
    """The families' verdicts on `survey` (`sources.judge`); read-only.

    survey: the facts judged. families: loader class name -> its family unit's name.
    prefetching: the loader classes that build batches ahead already: threads of their
    own or reached (`LoaderClass.threaded`), or a family that prefetches by design
    (`Family.prefetches`). iterators: the sites of recognised generator functions, in
    source order (a site of a function no family recognises is no data source we
    know, and is left out). constructions: every construction's verdict, in the
    survey's order.
    """

    survey: Survey
    families: Mapping[str, str]
    prefetching: frozenset[str]
    iterators: tuple[SiteVerdict, ...]
    constructions: tuple[ConstructionVerdict, ...]

    def family_of(self, class_name: str) -> str:
        """The family name of the loader class `class_name`. Raises KeyError for a class the survey has not."""
        return self.families[class_name]

    def prefetches(self, class_name: str) -> bool:
        """Whether the loader class `class_name` builds batches ahead already."""
        return class_name in self.prefetching

    def training_constructions(self) -> list[Construction]:
        """The constructions that build the training loader, in source order."""
        return [v.construction for v in self.constructions if v.training]

    def construction_reasons(self) -> list[str]:
        """Why the constructions that do not build the training loader do not, sorted, each once."""
        return sorted({v.reason for v in self.constructions if v.reason})

    def iterator_reasons(self) -> list[str]:
        """Why the generator sites are not run ahead, sorted, each once."""
        return sorted({i.reason for i in self.iterators if i.reason})
