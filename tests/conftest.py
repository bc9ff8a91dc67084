"""Shared test fixtures: the real interpreters some tests compile with; Ctrl-C restored.

`find_python` (patcher.check.interpreters) is the one finder: `pythonX.Y` on PATH, then pyenv's
versions folder. It runs when a test first asks for the fixture, never at import,
and a test whose interpreter is missing is skipped with the reason.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest

from patcher.check.interpreters import find_python


def _interpreter(version: str) -> str:
    path, _ = find_python(version)
    if path is None:
        pytest.skip(f"no real Python {version} installed (PATH or pyenv)")
    return path


@pytest.fixture(scope="session")
def python310() -> str:
    """Path of a real CPython 3.10; skips the test when none is installed."""
    return _interpreter("3.10")


@pytest.fixture(scope="session")
def python312() -> str:
    """Path of a real CPython 3.12; skips the test when none is installed."""
    return _interpreter("3.12")


# The files that take longest (seconds of a full run, measured on 2 cores), longest
# first; `make test` (pytest-xdist, --dist loadfile) hands them out before the others, so
# that the many short files fill in at the end instead of one long file running alone
# while the other worker has nothing left. The first two share their original fixture
# runs (fixture_training.py): started together, one trains the originals while the other
# trains the patched scripts.
LONGEST_FIRST = [
    "test_end_to_end.py", "test_fixtures.py", "test_step_timing.py", "test_cli_conventions.py",
    "test_verify.py", "test_verify_mutants.py", "test_gpu_proof.py", "test_producer_where_users_train.py",
    "test_check.py", "test_producer_holds.py", "test_verify_classes.py", "test_prefetch_lean.py",
    "test_ab.py", "test_producer_faults.py", "test_val_end_to_end.py", "test_cli.py", "test_gpu_loaders.py",
    "test_verify_edited.py",
]


def pytest_collection_modifyitems(items):
    # Stable: each file's tests stay together and in their order; other files keep theirs.
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


def pytest_configure(config):
    # xdist's loadfile would otherwise hand out the files with the most tests first
    # (--loadscope-reorder, its default), whatever their time: the collection order instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # A test run started in the background of a non-interactive shell (`make test &`)
    # inherits SIGINT ignored, and so would every process it starts: the Ctrl-C tests
    # would see scripts that never get their KeyboardInterrupt. A handler (unlike an
    # ignore) is reset to the default across exec, so the children get Python's own.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def one_torchrun_at_a_time():
    """Held while a test runs torchrun jobs: two 2-rank CPU jobs of two test workers at
    once put four ranks on a 2-core machine. A lock file that every worker locks in turn
    (flock), released when the test ends."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "patch-prefetch-torchrun.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def import_source(tmp_path, monkeypatch):
    """`import_source(prefix, source)`: `source` written as module `<prefix>_<test>` in
    tmp_path and imported (a spawned child can import it by name too); unloaded after."""
    import importlib

    names = []

    def load(prefix: str, source: str):
        name = f"{prefix}_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        names.append(name)
        return importlib.import_module(name)

    yield load
    for name in names:
        sys.modules.pop(name, None)
