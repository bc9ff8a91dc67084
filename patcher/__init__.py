"""patch-prefetch: rewrite a training script so data loading overlaps GPU compute.

The injected runtime is the package `patcher.templates`. An install (wheel or editable)
maps it from the repository's top-level `templates/` (pyproject's `package-dir`); a
source checkout used without one (`PYTHONPATH=.`, as the GPU proof runs on a bare
machine) finds it through `_SourceRuntime`, last of the import system's finders.
"""

import importlib.util as _util
import os as _os
import sys as _sys

_SOURCE_RUNTIME = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "templates")


class _SourceRuntime:
    """Finds `patcher.templates` in the checkout's templates/ (its modules follow its __path__)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        init = _os.path.join(_SOURCE_RUNTIME, "__init__.py")
        if name != "patcher.templates" or not _os.path.isfile(init):
            return None
        return _util.spec_from_file_location(name, init, submodule_search_locations=[_SOURCE_RUNTIME])


if not _os.path.isdir(_os.path.join(__path__[0], "templates")):  # an install has patcher/templates/
    _sys.meta_path.append(_SourceRuntime)
