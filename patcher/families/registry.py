"""The family units, found in `patcher/families/`, and the questions asked of them.

Every module of this package that declares `UNIT = Family(...)` is a family; adding one
means adding its module (with its fixture and test file), nothing else. `judge(module)`
is the one entry point to a script's reading: the facts (`patcher.survey.survey`), then
the families' verdicts beside them (`sources.judge`). `data_sources`,
`verified_sources` and `module_loaders` ask the units for what `train_prefetch`,
`verify` and `bench` act on; none of them names a family.
"""

from __future__ import annotations

import importlib
import pkgutil

import patcher.families
from patcher.families import sources
from patcher.families.base import DataVariable, Family, ModuleLoader
from patcher.families.verdicts import Verdicts
from patcher.survey.survey import survey as survey_facts


def discover() -> list[Family]:
    """The `UNIT` of every module in `patcher.families`, in recognition order (`Family.order`, then name).

    Raises ValueError when two units share a name.
    """
    units = []
    for info in pkgutil.iter_modules(patcher.families.__path__):
        unit = getattr(importlib.import_module(f"patcher.families.{info.name}"), "UNIT", None)
        if isinstance(unit, Family):
            units.append(unit)
    units.sort(key=lambda u: (u.order, u.name))
    names = [u.name for u in units]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"family declared twice: {', '.join(repeated)}")
    return units


UNITS: list[Family] = discover()
BY_NAME: dict[str, Family] = {u.name: u for u in UNITS}


def judge(module, index=None) -> Verdicts:
    """The families' `Verdicts` on the survey of `module` (`cst.Module`; index: a
    `ScriptIndex` already made, or None); the facts are its `.survey`. Raises
    LookupError when no family recognises a loader class."""
    return sources.judge(survey_facts(module, index), UNITS)


def data_sources(verdicts: Verdicts) -> list[DataVariable]:
    """The training data variables of `verdicts`, each with its family and `Plan` (`sources.data_sources`)."""
    return sources.data_sources(verdicts, UNITS)


def verified_sources(verdicts: Verdicts) -> list[DataVariable]:
    """What `verify` drives: the training data variables and the staged generators (`sources.verified_sources`)."""
    return sources.verified_sources(verdicts, UNITS)


def module_loaders(module, index=None) -> list[ModuleLoader]:
    """The loader generators of a data-loader module (`cst.Module`) that the module
    families find, each with its family; empty for a training script (`sources.module_loaders`)."""
    return sources.module_loaders(module, UNITS, index)
