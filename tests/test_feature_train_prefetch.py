"""train_prefetch as a feature: what it says where no family is asked, the producer toggles,
and the family units it asks (patcher/families/).

Each family's before -> after and noop tables are in tests/test_family_<name>.py; what
the rewritten scripts do (same batches, rollback, wrap-around) is tested in
test_templates.py, test_verify.py and the end-to-end runs.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.families import registry
from patcher.families.base import DataVariable, Family, Plan
from patcher.patch import patch_source

ROOT = Path(__file__).resolve().parent.parent

# A loader of the `custom` family that other features' tables build on
# (test_feature_copy_stream.py, test_feature_env_toggles.py).
HEAD = '''import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

'''

NOOPS = [
    pytest.param(
        """\
import mlx.core as mx
class Loader:
    def next_batch(self, n):
        return mx.zeros(n)
def main():
    train_loader = Loader()
    x = train_loader.next_batch(4)
""",
        "script does not use torch (MLX or other framework)",
        None,
        id="mlx-script-no-torch",
    ),
    pytest.param(
        """\
import torch

def main(tokens):
    for step in range(3):
        x = tokens[step : step + 4]
""",
        "no loader with next_batch or data generator found",
        None,
        id="no-loader-and-no-generator",
    ),
    pytest.param(
        """\
import torch

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        return torch.zeros(n).to(self.device, non_blocking=True)

def main(device):
    loaders = [Loader(device)]
    x = loaders[0].next_batch(4)
""",
        "Loader defined but never built as `name = Loader(...)`",
        3,
        id="loader-never-assigned-to-a-name",
    ),
]



@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noop(before, reason, line):
    assert_noop(before, reason, line, only="train_prefetch")


def test_the_prefetch_depth_toggle_comes_with_the_producer_toggles():
    # A default patch prefetches 2 batches ahead with no TRAIN_PREFETCH_QUEUE (a tuning
    # knob costs counted bytes); `--producer-toggles` adds it and passes it on.
    source = HEAD + "def main(device):\n    train_loader = Loader(device)\n    for step in range(3):\n        x = train_loader.next_batch(4)\n"
    default = patch_source(source)
    assert "TRAIN_PREFETCH_QUEUE" not in default.source and "queue_depth" not in default.runtime
    assert "self.depth, self.lent, self.lock = 2, {}, threading.Lock()\n" in default.runtime
    tuned = patch_source(source, producer_toggles=True)
    assert 'train_prefetch_queue = int(os.environ.get("TRAIN_PREFETCH_QUEUE", 2))' in tuned.source
    assert "queue_depth=Hyperparameters.train_prefetch_queue" in tuned.source
    assert "self.depth, self.lent, self.lock = min(max(1, int(queue_depth)), 250), {}, threading.Lock()" in tuned.runtime


@pytest.mark.parametrize("unit", registry.UNITS, ids=lambda u: u.name)
def test_every_family_has_its_fixture_and_its_test_file(unit):
    # Adding a family is adding its unit, its fixture fixtures/<name>*.py and its test
    # file tests/test_family_<name>.py; the fixture is one of that family.
    assert (ROOT / "tests" / f"test_family_{unit.name}.py").is_file()
    fixtures = sorted((ROOT / "fixtures").glob(f"{unit.name}*.py"))
    assert fixtures
    families = set()
    for path in fixtures:
        verdicts = registry.judge(cst.parse_module(path.read_text(encoding="utf-8")))
        families |= {*verdicts.families.values()} | {i.family for i in verdicts.iterators}
    assert unit.name in families


STRANGE = """\
import torch

class StrangeLoader:
    def next_batch(self):
        return torch.zeros(4)

train_loader = StrangeLoader()
for step in range(3):
    x = train_loader.next_batch()
"""


def test_a_family_is_asked_through_its_unit_alone(monkeypatch):
    # A unit added to the registry is recognised before the catch-all and decides, by
    # its plan and producer, what train_prefetch writes: no other list of families.
    asked = []

    def plan(variable: DataVariable, verdicts) -> Plan:
        asked.append((variable.target, variable.lines, variable.loader.name))
        return Plan(note="runs ahead as the strange family says")

    strange = Family("strange", "loader_class", lambda loader: loader.name == "StrangeLoader", plan, producer="_prefetch_next_batch", runtime="prefetch_loader", order=1)
    monkeypatch.setattr(registry, "UNITS", [strange, *registry.UNITS])
    monkeypatch.setitem(registry.BY_NAME, "strange", strange)
    result = assert_patch(
        STRANGE,
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

class StrangeLoader:
    def next_batch(self):
        return torch.zeros(4)

train_loader = _prefetch_next_batch(lambda: StrangeLoader(), prefetch=TRAIN_PREFETCH, copy_stream=False)
for step in range(3):
    x = train_loader.next_batch()
""",
        only="train_prefetch",
    )
    assert asked == [("train_loader", "7", "StrangeLoader")]
    assert [(n.applied, n.reason, n.line) for n in result.notes if n.feature == "train_prefetch"] == [(True, "runs ahead as the strange family says", 7)]


def test_a_family_declares_a_known_kind_and_producer_and_generators_their_refusals():
    def plan(variable, verdicts):
        return Plan()

    with pytest.raises(ValueError, match="kind 'thread'"):
        Family("x", "loader_class", bool, plan, producer=None, runtime=None, kind="thread")
    with pytest.raises(ValueError, match="driver 'two words'"):
        Family("x", "two words", bool, plan, producer=None, runtime=None)
    with pytest.raises(ValueError, match="producer '_prefetch_loader'"):
        Family("x", "loader_class", bool, plan, producer="_prefetch_loader", runtime=None)
    with pytest.raises(ValueError, match="`refuse` is for generator families"):
        Family("x", "generator", bool, plan, producer="_prefetch_iterator", runtime="prefetch_loader", kind="generator")
    with pytest.raises(ValueError, match="`refuse` is for generator families"):
        Family("x", "loader_class", bool, plan, producer=None, runtime=None, refuse=lambda site, function, index: None)
