"""The feature units and the tables derived from them.

Every module of `patcher/transforms/` that declares `UNIT = Feature(...)` is a feature;
adding one means adding its module (and its test file), nothing else. The pipeline
order, the toggle table, the template dependencies and the names that mark an already
patched script all come from the units.
"""

from __future__ import annotations

import importlib
import pkgutil

import patcher.transforms
from patcher.transforms.base import Feature, Toggle


def discover() -> list[Feature]:
    """The `UNIT` of every module in `patcher.transforms`, in pipeline order (`Feature.order`).

    Raises ValueError when two units share a name, a toggle name or a toggle position.
    """
    units = []
    for info in pkgutil.iter_modules(patcher.transforms.__path__):
        if f"patcher.transforms.{info.name}" == __name__:
            continue  # this module: the tables, not a unit
        unit = getattr(importlib.import_module(f"patcher.transforms.{info.name}"), "UNIT", None)
        if isinstance(unit, Feature):
            units.append(unit)
    units.sort(key=lambda u: (u.order, u.name))
    toggles = [t for u in units for t in u.toggles]
    for what, values in (("feature", [u.name for u in units]), ("toggle", [t.name for t in toggles]), ("toggle position", [t.position for t in toggles])):
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"{what} declared twice: {', '.join(repeated)}")
    return units


UNITS: list[Feature] = discover()
FEATURES: list[str] = [u.name for u in UNITS]
# Diagnostics only add code until a toggle is set, so a default patch leaves them out
# (every added byte counts against the artifact cap): `--with FEATURE` or `--diagnostics`.
DIAGNOSTICS: list[str] = [u.name for u in UNITS if u.diagnostic]
DEFAULT_FEATURES: list[str] = [u.name for u in UNITS if not u.diagnostic and not u.opt_in]
# Features that change what the script computes: only by name, `--with FEATURE`.
OPT_IN: list[str] = [u.name for u in UNITS if u.opt_in]
# Features whose code reads a toggle: `--only` one of them brings env_toggles along.
SWITCHED: set[str] = {u.name for u in UNITS if u.toggles}
TOGGLE_UNITS: dict[str, Toggle] = {t.name: t for t in sorted((t for u in UNITS for t in u.toggles), key=lambda t: t.position)}
# Toggle name -> (attribute in the Hyperparameters idiom, default), in position order.
TOGGLES: dict[str, tuple[str, int | str]] = {name: (t.attr, t.default) for name, t in TOGGLE_UNITS.items()}
# Template name -> the templates it uses, injected before it.
TEMPLATE_DEPENDENCIES: dict[str, list[str]] = {template: list(uses) for u in UNITS for template, uses in u.runtime.items()}
# Template name -> the options of its entry function that the cut may fold.
TEMPLATE_OPTIONS: dict[str, tuple[str, ...]] = {template: names for u in UNITS for template, names in u.options.items()}
# Feature -> the module-level name its runtime defines: present means already patched.
INJECTED_NAMES: dict[str, tuple[str, ...]] = {u.name: (u.injected,) if isinstance(u.injected, str) else tuple(u.injected) for u in UNITS if u.injected}
