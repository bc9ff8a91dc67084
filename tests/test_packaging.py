"""What `pip install` puts on a user's machine: one top-level package, `patcher`, with the
injected runtime inside it as `patcher.templates` (kept at the top of the repository as
`templates/`, mapped in by `package-dir`), and the Python versions it supports."""
from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    """pyproject.toml, read with tomllib (Python 3.11 on; the tests that need it skip on 3.10)."""
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def top_level(wheel: Path) -> set[str]:
    """The names a wheel puts at the top of site-packages, its .dist-info folder left out."""
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/")[0] for name in archive.namelist()} - {n.split("/")[0] for n in archive.namelist() if n.split("/")[0].endswith(".dist-info")}


def test_every_package_of_the_tree_is_listed_and_the_runtime_is_mapped_in():
    config = pyproject()["tool"]["setuptools"]
    setuptools = pytest.importorskip("setuptools")
    # A subpackage added to patcher/ and not to the list would be left out of the wheel.
    found = setuptools.find_packages(where=str(ROOT), include=["patcher", "patcher.*"])
    assert sorted(config["packages"]) == sorted(found + ["patcher.templates"])
    assert config["package-dir"] == {"patcher.templates": "templates"}
    assert not (ROOT / "patcher" / "templates").exists(), "the runtime lives in templates/ at the top"
    assert "package-data" not in config, "package data outside patcher/ would install beside it"


def test_the_runtime_is_read_from_the_top_level_folder():
    from patcher.render import render

    assert render.TEMPLATE_DIR == ROOT / "templates"
    assert (render.TEMPLATE_DIR / "prefetch_lean.py").is_file()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` builds from this tree (no dependencies, no build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, cwd=out)
    [built] = out.glob("patch_prefetch-*.whl")
    return built


def test_the_wheel_holds_patcher_alone_and_a_planted_templates_is_caught(wheel, tmp_path):
    assert top_level(wheel) == {"patcher"}
    with zipfile.ZipFile(wheel) as archive:
        assert "patcher/templates/prefetch_lean.py" in archive.namelist()
    planted = tmp_path / wheel.name
    planted.write_bytes(wheel.read_bytes())
    with zipfile.ZipFile(planted, "a") as archive:
        archive.writestr("templates/__init__.py", "")
    assert top_level(planted) == {"patcher", "templates"}


def test_the_wheel_installed_in_a_fresh_environment_patches_a_fixture(wheel, tmp_path):
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # The dependencies (libcst, torch, ...) come from this environment's site-packages, as a
    # plain path: its .pth files (an editable install of this tree among them) are not run.
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in sys.path if path.endswith("site-packages")))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True)
    where = subprocess.run([str(python), "-c", "import patcher, patcher.templates as t; print(patcher.__file__); print(t.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert all(path.startswith(str(site)) for path in where), where
    out = tmp_path / "patched.py"
    run = subprocess.run([str(env / "bin" / "patch-prefetch"), str(ROOT / "fixtures" / "tokenstream_readable.py"), "-o", str(out), "--no-check", "-q"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "def _make_train_loader" in out.read_text() and "import patcher" not in out.read_text()


def test_the_supported_python_versions_are_stated_where_pip_and_a_reader_look():
    config = pyproject()
    assert config["project"]["requires-python"] == ">=3.10"
    first_screen = (ROOT / "README.md").read_text().split("## Quick start", 1)[0]
    assert "Python 3.10 or later" in " ".join(first_screen.split())


def test_a_source_checkout_without_an_install_finds_the_runtime(tmp_path):
    # As the GPU proof runs on a bare machine: the checkout on PYTHONPATH, no install
    # (-S: no site-packages, so no editable install's finder either).
    done = subprocess.run([sys.executable, "-S", "-c", "import patcher.templates as t; print(t.__file__)"],
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "templates" / "__init__.py")
