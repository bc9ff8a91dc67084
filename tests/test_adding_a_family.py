"""Adding a family is adding its unit, its fixture and its test file, nothing else.

A family module written outside the package (a directory put on `patcher.families`'
path) is found by `registry.discover`, classifies what the survey found, plans through
`registry.data_sources`, and, as a "module" driver family of its own, is the one whose
loader generators module mode rewrites with its producer and `verify` drives: no
transform or proof module names it. Its fixture joins the lists of fixtures the
training runs take, and its missing test file is reported.
"""

from __future__ import annotations

import sys
import textwrap

import libcst as cst
import pytest
from test_fixtures import NOT_RUN, family_fixtures, missing_parts, runnable

import patcher.families
from patcher.families import registry
from patcher.patch import patch_source
from patcher.proof import module_verify

ZIGZAG = '''\
"""Family `zigzag`: generator functions named `zigzag_*`; a module's `zigzag_loader` runs in a spawned producer."""

import libcst as cst

from patcher.families.base import SPAWN_GENERATOR, Family, ModuleLoader, Plan


def recognise(function):
    return function.name.value.startswith("zigzag_")


def refuse(site, function, index):
    return None


def plan(variable, survey):
    return Plan(refusal=f"`{variable.target}`: zigzag readers stay on the training thread", line=variable.line)


def module_sources(module, index):
    return [ModuleLoader(s, "device") for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == "zigzag_loader"]


UNIT = Family("zigzag", "module", recognise, plan, producer=SPAWN_GENERATOR, runtime="spawn_generator", order=1, refuse=refuse, module_sources=module_sources)
'''

SCRIPT = """\
import torch

def zigzag_reader(n):
    while True:
        yield torch.zeros(n)

train_loader = zigzag_reader(4)
for step in range(3):
    x = next(train_loader)
"""

MODULE = """\
import torch

def zigzag_loader(B, device="cpu"):
    while True:
        yield torch.zeros(B, device=device)
"""


@pytest.fixture
def zigzag(tmp_path, monkeypatch):
    """The units with `zigzag` discovered from `tmp_path/families`, in the registry for the test."""
    (tmp_path / "families").mkdir()
    (tmp_path / "families" / "zigzag.py").write_text(ZIGZAG, encoding="utf-8")
    monkeypatch.setattr(patcher.families, "__path__", [*patcher.families.__path__, str(tmp_path / "families")])
    try:
        units = registry.discover()
        monkeypatch.setattr(registry, "UNITS", units)
        monkeypatch.setattr(registry, "BY_NAME", {u.name: u for u in units})
        yield units
    finally:
        sys.modules.pop("patcher.families.zigzag", None)


def test_the_registry_finds_the_new_family_and_the_survey_is_classified_with_it(zigzag):
    assert [u.name for u in zigzag][0] == "zigzag" and "custom" in [u.name for u in zigzag]
    surveyed = registry.survey(cst.parse_module(SCRIPT))
    [site] = surveyed.iterators
    assert (site.target, site.family, site.training, site.reason) == ("train_loader", "zigzag", True, None)
    [variable] = registry.data_sources(surveyed)
    assert (variable.family.name, variable.plan.driver, variable.plan.producer) == ("zigzag", "module", "_spawn_generator")
    result = patch_source(SCRIPT, enabled={"train_prefetch"})
    assert result.source == SCRIPT
    assert [(n.applied, n.reason, n.line) for n in result.notes] == [(False, "`train_loader`: zigzag readers stay on the training thread", 7)]


def test_a_module_family_is_rewritten_and_verified_through_its_declared_driver(zigzag):
    [loader] = registry.module_loaders(cst.parse_module(MODULE))
    assert (loader.name, loader.family.name, loader.family.driver) == ("zigzag_loader", "zigzag", "module")
    assert module_verify.module_loader(MODULE).family.name == "zigzag"  # what verify and bench dispatch on
    out = patch_source(MODULE, enabled={"train_prefetch"}).source
    assert "def _original_zigzag_loader(B, device=\"cpu\"):" in out
    assert 'yield from _spawn_generator(_original_zigzag_loader, {"B": B, "device": device}, "device", prefetch=1)' in out  # the toggle comes with env_toggles


def test_its_fixture_joins_the_runs_and_a_missing_test_file_is_reported(zigzag, tmp_path):
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "fixtures" / "zigzag_reader.py").write_text(SCRIPT, encoding="utf-8")
    new = [u for u in zigzag if u.name == "zigzag"]
    assert family_fixtures(new, tmp_path / "fixtures") == {"zigzag": ["zigzag_reader"]}
    assert runnable(zigzag, NOT_RUN, directory=tmp_path / "fixtures") == ["zigzag_reader"]
    assert missing_parts(new, tmp_path) == ["zigzag: no tests/test_family_zigzag.py"]
    (tmp_path / "tests" / "test_family_zigzag.py").write_text(textwrap.dedent("def test_zigzag():\n    pass\n"), encoding="utf-8")
    assert missing_parts(new, tmp_path) == []
    (tmp_path / "fixtures" / "zigzag_reader.py").unlink()
    assert missing_parts(new, tmp_path) == ["zigzag: no fixtures/zigzag*.py"]
