"""Real Python interpreters to check with: `find_python("3.10")` on PATH or under pyenv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path





DEFAULT_TARGET = "3.10"
PROBE_TIMEOUT_S = 20.0  # starting an interpreter to ask its version


# --------------------------------------------------------------------------- find_python


def find_python(target: str = DEFAULT_TARGET) -> tuple[str | None, str]:
    """Find a real interpreter for `target` and return (path, version), e.g. ("/.../python3.10", "3.10.13").

    target: a version "MAJOR.MINOR", or a path (or command name) of an interpreter.
    A path that is a file is used as given. For a version the search order is
    `pythonX.Y` on PATH, then `<pyenv root>/versions/X.Y*/bin/pythonX.Y`, newest patch
    first (`pyenv root` when pyenv is installed, else $PYENV_ROOT or ~/.pyenv). Every
    candidate is run once to read its `sys.version`; a discovered interpreter is
    returned by its real executable (not a pyenv shim) and must match MAJOR.MINOR.
    Returns (None, "") when nothing usable is found. Never raises.
    """
    version = parse_version(target)
    if version is None:
        path = target if os.path.isfile(target) else shutil.which(target)
        probed = _probe(path) if path else None
        return (target if os.path.isfile(target) else path, probed[1]) if probed else (None, "")
    for candidate in _candidates(target):
        probed = _probe(candidate)
        if probed is not None and parse_version(probed[1]) == version:
            return probed
    return None, ""


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) of "3.10" or "3.10.13"; None for anything else (a path, "3.10-dev")."""
    parts = text.strip().split(".")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def _candidates(target: str) -> list[str]:
    """Interpreter paths to try for version `target`, best first."""
    name = f"python{target}"
    found = [shutil.which(name)]
    versions = Path(_pyenv_root()) / "versions"
    if versions.is_dir():
        dirs = [d for d in versions.iterdir() if d.name == target or d.name.startswith(target + ".")]
        for d in sorted(dirs, key=_patch_key, reverse=True):
            found.append(str(d / "bin" / name))
    return [p for p in found if p and os.path.isfile(p)]


def _patch_key(directory: Path) -> tuple[int, str]:
    """Sort key for pyenv version folders: numeric patch level, then the name."""
    tail = directory.name.split(".")[2:3]
    return (int(tail[0]) if tail and tail[0].isdigit() else -1, directory.name)


@lru_cache(maxsize=1)
def _pyenv_root() -> str:
    """`pyenv root` if pyenv is installed, else $PYENV_ROOT or ~/.pyenv."""
    if shutil.which("pyenv"):
        try:
            out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")


@lru_cache(maxsize=32)
def _probe(path: str) -> tuple[str, str] | None:
    """(sys.executable, "3.10.13") reported by running `path`, or None if it does not run."""
    code = "import sys;print(sys.version.split()[0]);print(sys.executable)"
    try:
        out = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or len(lines) != 2 or parse_version(lines[0].rstrip("+")) is None:
        return None
    return lines[1] or path, lines[0]
