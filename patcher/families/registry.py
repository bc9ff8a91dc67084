"""The family units, found in `patcher/families/`, and the questions asked of them.

Every module of this package that declares `UNIT = Family(...)` is a family; adding one
means adding its module (with its fixture and test file), nothing else. The survey is
given this module (`registry.survey(module)` passes it) and asks its `loader_family` and
`generator_family`; `train_prefetch` looks a variable's family up in `BY_NAME`.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import patcher.families
from patcher.families.base import Family
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


def loader_family(loader) -> Family:
    """The family of a surveyed `LoaderClass`: the first "loader_class" unit that recognises it.

    Raises LookupError when none does (the units lack a catch-all)."""
    for unit in UNITS:
        if unit.driver == "loader_class" and unit.recognise(loader):
            return unit
    raise LookupError(f"no family recognises the loader class {loader.name}")


def generator_family(function) -> Family | None:
    """The family of a module-level generator function (`cst.FunctionDef`): the first
    "generator" unit that recognises it, or None (then it is not a data source we know)."""
    return next((u for u in UNITS if u.driver == "generator" and u.recognise(function)), None)


def survey(module, index=None):
    """`patcher.survey.survey.survey` of `module` with the families of this registry
    (`Survey`; index: a `ScriptIndex` already made, or None)."""
    return survey_facts(module, sys.modules[__name__], index)
