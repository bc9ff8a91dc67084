"""Adding a family is adding its unit, its fixture and its test file, nothing else.

A family module written outside the package (a directory put on `patcher.families`'
path) is found by `registry.discover`, judges what the survey found, plans through
`registry.data_sources`, and, as a "module" driver family of its own, is the one whose
loader generators module mode rewrites with its producer and `verify` drives: no
transform or proof module names it. Its fixture joins the lists of fixtures the
training runs take, and its missing test file is reported. A family with a driver of
its own names it in its unit; the driver is defined once, in `verify.DRIVERS`, and
`verify` drives the family's data source with it because the plan names it.
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


def plan(variable, verdicts):
    return Plan(refusal=f"`{variable.target}`: zigzag readers stay on the training thread", line=variable.line)


def module_sources(module, index):
    return [ModuleLoader(s, "device") for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == "zigzag_loader"]


UNIT = Family("zigzag", "module", recognise, plan, producer=SPAWN_GENERATOR, runtime="prefetch_lean", order=1, kind="generator", refuse=refuse, module_sources=module_sources)
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


def test_the_registry_finds_the_new_family_and_the_survey_is_judged_with_it(zigzag):
    assert [u.name for u in zigzag][0] == "zigzag" and "custom" in [u.name for u in zigzag]
    verdicts = registry.judge(cst.parse_module(SCRIPT))
    [site] = verdicts.iterators
    assert (site.target, site.family, site.training, site.reason) == ("train_loader", "zigzag", True, None)
    [variable] = registry.data_sources(verdicts)
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


STRIPES = '''\
"""Family `stripes`: a `StripeLoader` class, verified by a driver of its own, `stripes`."""

from patcher.families.base import Family, Plan


def recognise(loader):
    return loader.name == "StripeLoader"


def plan(variable, verdicts):
    return Plan(refusal=f"`{variable.target}`: stripes are verified, not prefetched", line=variable.line)


UNIT = Family("stripes", "stripes", recognise, plan, producer=None, runtime=None, order=1)
'''

STRIPED_SCRIPT = """\
import torch

class StripeLoader:
    def __init__(self, n, device):
        self.n, self.device = n, device

    def next_batch(self):
        return torch.zeros(self.n, device=self.device)

def main():
    train_loader = StripeLoader(4, "cpu")
    for step in range(3):
        x = train_loader.next_batch()
"""


def test_a_family_with_a_driver_of_its_own_is_verified_with_it(tmp_path, monkeypatch):
    """The unit names the driver, `verify.DRIVERS` defines it: nothing else names either,
    and verify takes it before the "loader_class" driver (which would read this script too)
    because the family's plan names it."""
    from patcher.proof import verify as verify_module
    from patcher.proof.compare import VerifyResult

    (tmp_path / "families").mkdir()
    (tmp_path / "families" / "stripes.py").write_text(STRIPES, encoding="utf-8")
    monkeypatch.setattr(patcher.families, "__path__", [*patcher.families.__path__, str(tmp_path / "families")])
    try:
        units = registry.discover()
    finally:
        sys.modules.pop("patcher.families.stripes", None)
    monkeypatch.setattr(registry, "UNITS", units)
    driven = []

    def run(recipe, run, compare):
        driven.append(recipe)
        return VerifyResult(identical=True, world_size=run.world_size, batches_compared=5, notes=list(run.notes))

    stripes = verify_module.Driver("stripes", str, lambda original, patched: "the stripes recipe", None, run, 5)
    monkeypatch.setitem(verify_module.DRIVERS, "stripes", stripes)
    assert verify_module.DRIVERS["loader_class"].read(STRIPED_SCRIPT, STRIPED_SCRIPT)  # the generic driver reads it too
    verify_module.verdicts_of.cache_clear()  # judged with the registry's new units
    original, edited = tmp_path / "train.py", tmp_path / "train_edited.py"
    original.write_text(STRIPED_SCRIPT, encoding="utf-8")
    edited.write_text(STRIPED_SCRIPT + "# edited by hand\n", encoding="utf-8")
    try:
        result = verify_module.verify(original, edited)
    finally:
        verify_module.verdicts_of.cache_clear()
    assert driven == ["the stripes recipe"] and result.identical and result.batches_compared == 5
    assert {u.driver for u in units} == {*verify_module.DRIVERS}  # the driver is defined where verify keeps them


def test_the_survey_keeps_facts_and_the_verdicts_are_frozen_beside_it():
    """What the families decide is never written into the survey's records: the survey
    of a staged generator still calls the `Shard` built inside it a candidate, its verdict
    does not; verdicts, variables and plans cannot be changed after the families made them."""
    import dataclasses
    from pathlib import Path

    from patcher.survey.loaders import LoaderClass
    from patcher.survey.sites import Construction, IteratorSite
    from patcher.survey.survey import survey

    verdict_names = {"family", "prefetches", "training", "reason", "staged"}
    for record in (LoaderClass, Construction, IteratorSite):
        assert not verdict_names & {f.name for f in dataclasses.fields(record)}, record
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    module = cst.parse_module((fixtures / "generator_shards.py").read_text(encoding="utf-8"))
    facts = survey(module)
    verdicts = registry.judge(module)
    [shard] = verdicts.constructions
    assert (shard.construction.candidate, shard.training) == (True, False)
    assert "stays on the training thread" in shard.reason
    assert [(c.candidate, c.why_not) for c in facts.constructions] == [(True, None)]  # judging wrote nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdicts.prefetching = frozenset()
    with pytest.raises(TypeError):
        verdicts.families["x"] = "custom"
    [variable] = registry.data_sources(registry.judge(cst.parse_module((fixtures / "tokenstream_readable.py").read_text(encoding="utf-8"))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        variable.plan.runtime = "prefetch_loader"
    with pytest.raises(TypeError):
        variable.plan.options["rollback"] = True
