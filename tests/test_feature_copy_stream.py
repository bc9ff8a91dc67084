"""copy_stream: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

`_h2d` itself (copy stream, `wait_stream`, `record_stream`, the CPU path) is tested in
test_templates.py; these tables pin down exactly which copies the rewrite routes through
it and, for every script it leaves alone, the reason it gives.
"""

from __future__ import annotations

import pytest
from patch_tables import assert_noop, assert_patch, notes_of

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
MAIN = "def main(device):\n    train_loader = Loader(device)\n    for step in range(3):\n        x = train_loader.next_batch(4)\n"

REWRITES = [
    pytest.param(
        HEAD + MAIN,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))
    train_copy_stream = int(os.environ.get("TRAIN_COPY_STREAM", 1))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return _h2d(x, self.device, Hyperparameters.train_copy_stream)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)
    for step in range(3):
        x = train_loader.next_batch(4)
''',
        (True, "Loader.next_batch H2D at line 15 on the copy stream", 7),
        id="h2d-in-the-training-loader-only",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only=["train_prefetch", "copy_stream"])
    assert notes_of(result, "copy_stream") == [note]


def _head_with(old: str, new: str) -> str:
    """HEAD with its one `old` text replaced by `new` (what the row changes)."""
    assert HEAD.count(old) == 1
    return HEAD.replace(old, new)


NOOPS = [
    pytest.param(
        _head_with("return x.to(self.device, non_blocking=True)", "return x") + MAIN,
        "Loader.next_batch has no `.to(self.device, non_blocking=True)` copy",
        7,
        id="loader-without-a-device-copy",
    ),
    pytest.param(
        _head_with("return x.to(self.device, non_blocking=True)", "return x.to(self.device)") + MAIN,
        "Loader.next_batch has no `.to(self.device, non_blocking=True)` copy",
        7,
        id="blocking-copy-is-not-the-loader-h2d",
    ),
    pytest.param(
        HEAD + "def main(device):\n    calib_loader = Loader(device)\n    x = calib_loader.next_batch(4)\n",
        "no training loader construction found",
        None,
        id="no-training-loader",
    ),
    pytest.param(
        "import numpy as np\nclass Loader:\n    def next_batch(self, n):\n        return np.zeros(n)\ntrain_loader = Loader()\nx = train_loader.next_batch(4)\n",
        "script does not use torch (MLX or other framework)",
        None,
        id="script-without-torch",
    ),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="copy_stream")
