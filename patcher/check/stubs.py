"""Stubs for the packages a training script imports that are not installed.

Training scripts import GPU-only packages (`flash_attn_interface`, `triton`, fused
kernels). To import such a script on a CPU machine (the `check` import smoke in a
child process, `verify` and `bench` in this one), `StubFinder` hands out a stub module
for each missing package the script itself imports. A stub is a class: callable,
subclassable, usable as a decorator (it returns the function unchanged), a type hint
or a base class, and any attribute of it is another stub.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types

_IMPORTLIB = os.path.dirname(importlib.__file__)


def _stub(name):
    return _StubMeta(name, (), {"_is_stub": True, "__module__": name.partition(".")[0]})


class _StubMeta(type):
    """A stub is a class: callable, subclassable, usable as decorator, type hint or base."""

    def __getattr__(cls, attr):
        if attr == "__version__":
            return "0.0.0"
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _stub(cls.__name__ + "." + attr)

    def __call__(cls, *args, **kwargs):
        if not cls.__dict__.get("_is_stub"):  # a class of the script that subclasses a stub
            return super().__call__(*args, **kwargs)
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator: keep the function or class
        return _stub(cls.__name__ + "()")

    def __getitem__(cls, item):
        return cls

    def _op(cls, *other):
        return _stub(cls.__name__)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _op
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = __neg__ = _op


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr == "__version__":
            return "0.0.0"
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = _stub(self.__name__ + "." + attr)
        setattr(self, attr, value)
        return value


def _importer():
    """File of the code that asked for the import, past the import machinery."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen ") or name.startswith(_IMPORTLIB)):
            return name
        frame = frame.f_back
    return None


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: stubs a package the script imports that no finder can find.

    script: the file name the script's code was compiled with; only imports made by
    that code are stubbed (a library's own optional imports keep failing as they
    expect). stubbed: full names stubbed, in import order.
    """

    def __init__(self, script: str):
        self.script = script
        self.stubbed: list[str] = []
        self.tops: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in self.tops:
            if "." in fullname or _importer() != self.script or self._found_elsewhere(fullname):
                return None
            self.tops.add(top)
        if fullname not in self.stubbed:
            self.stubbed.append(fullname)
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def _found_elsewhere(self, fullname):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                if finder.find_spec(fullname, None) is not None:
                    return True
            except Exception:
                pass
        return False

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        pass


GROUPED_FROM = 3  # a package with this many stubbed modules or more is one entry


def summarise(stubbed: list[str]) -> list[str]:
    """The stubbed module names (`StubFinder.stubbed`) as a report lists them: a
    top-level package with `GROUPED_FROM` or more stubbed modules (itself included)
    becomes one entry `"triton.* (17 modules)"`, in the place of its first module;
    fewer are listed by name. Returns the entries in first-import order."""
    counts: dict[str, int] = {}
    for name in stubbed:
        top = name.partition(".")[0]
        counts[top] = counts.get(top, 0) + 1
    entries: list[str] = []
    for name in stubbed:
        top = name.partition(".")[0]
        if counts[top] < GROUPED_FROM:
            entries.append(name)
        elif f"{top}.* ({counts[top]} modules)" not in entries:
            entries.append(f"{top}.* ({counts[top]} modules)")
    return entries
