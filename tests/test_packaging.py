"""What `pip install` puts on a user's machine: one top-level package, `patcher`, with the
injected runtime inside it (`patcher/templates/`), and the Python versions it supports."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    """pyproject.toml, read with tomllib (Python 3.11 on; the tests that need it skip on 3.10)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_only_top_level_package_installed_is_patcher():
    config = pyproject()
    # A top-level `templates` in site-packages would shadow a user's own `templates`.
    setuptools = pytest.importorskip("setuptools")
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(where=str(ROOT), include=include)
    assert {name.split(".")[0] for name in packages} == {"patcher"}
    assert "patcher.templates" in packages
    assert "package-data" not in config["tool"]["setuptools"], "package data outside patcher/ would install beside it"


def test_the_runtime_is_read_from_inside_the_package():
    from patcher.render import render

    assert render.TEMPLATE_DIR == ROOT / "patcher" / "templates"
    assert (render.TEMPLATE_DIR / "prefetch_lean.py").is_file()


def test_the_supported_python_versions_are_stated_where_pip_and_a_reader_look():
    config = pyproject()
    assert config["project"]["requires-python"] == ">=3.10"
    first_screen = (ROOT / "README.md").read_text().split("## Quick start", 1)[0]
    assert "Python 3.10 or later" in " ".join(first_screen.split())
