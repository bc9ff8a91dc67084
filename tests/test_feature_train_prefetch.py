"""train_prefetch: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

Behaviour of the rewritten scripts (same batches, rollback, wrap-around) is tested in
test_transforms.py, test_templates.py and the end-to-end runs; these tables pin down
exactly what the rewrite changes in the script's own code.
"""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch

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

PATCHED_HEAD = HEAD.replace("import torch\n", "import torch\n" + RUNTIME).replace(
    '    seed = int(os.environ.get("SEED", 1337))\n',
    '    seed = int(os.environ.get("SEED", 1337))\n'
    '    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))\n'
)

MAKE = "_make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False"

REWRITES = [
    pytest.param(
        HEAD + "def main(device):\n    train_loader = Loader(device)\n    for step in range(3):\n        x = train_loader.next_batch(4)\n",
        PATCHED_HEAD + f"def main(device):\n    train_loader = {MAKE})\n    for step in range(3):\n        x = train_loader.next_batch(4)\n",
        id="run-constant-argument",
    ),
    pytest.param(
        HEAD + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
        PATCHED_HEAD + f"def main(device):\n    train_loader = {MAKE})\n    x = train_loader.next_batch(4)\n    train_loader = {MAKE})\n    x = train_loader.next_batch(4)\n",
        id="rebuilt-after-warmup-both-rewritten",
    ),
    pytest.param(
        HEAD + "def main(device):\n    train_loader = Loader(device)\n    n = 4\n    for step in range(3):\n        n = n * 2\n        x = train_loader.next_batch(n)\n",
        PATCHED_HEAD + f"def main(device):\n    train_loader = {MAKE}, rollback=True, host_copy=False)\n    n = 4\n    for step in range(3):\n        n = n * 2\n        x = train_loader.next_batch(n)\n",
        id="per-step-argument-gets-rollback",
    ),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    result = assert_patch(before, after, only="train_prefetch")
    assert result.applied == ["train_prefetch", "env_toggles"]


NOOPS = [
    pytest.param(HEAD + "def main(device):\n    calib_loader = Loader(device)\n    x = calib_loader.next_batch(4)\n", id="calibration-loader-is-not-the-training-loader"),
    pytest.param(HEAD + "def main(device):\n    train_loader = Loader(device)\n", id="built-but-never-drawn"),
    pytest.param(HEAD.replace("self.i += 1", "self.i += 1; torch.manual_seed(0)") + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n", id="global-torch-rng"),
    pytest.param(HEAD.replace("self.i += 1", "self.i += 1; dist.barrier()") + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n", id="collective-in-next-batch"),
    pytest.param(HEAD.replace("self.i = 0", "self.i = 0; self.t = threading.Thread(target=print)") + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n", id="loader-already-prefetches"),
    pytest.param(HEAD.replace("x = torch.full((n,), self.i)", "x = torch.full((n,), self.i, device=self.device)") + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n", id="device-used-beyond-the-copy"),
    pytest.param("import mlx.core as mx\nclass Loader:\n    def next_batch(self, n):\n        return mx.zeros(n)\ndef main():\n    train_loader = Loader()\n    x = train_loader.next_batch(4)\n", id="mlx-script-no-torch"),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="train_prefetch")


def test_the_prefetch_depth_toggle_comes_with_the_producer_toggles():
    # A default patch prefetches 2 batches ahead with no TRAIN_PREFETCH_QUEUE (a tuning
    # knob costs counted bytes); `--producer-toggles` adds it and passes it on.
    from patcher.patch import patch_source

    source = HEAD + "def main(device):\n    train_loader = Loader(device)\n    for step in range(3):\n        x = train_loader.next_batch(4)\n"
    default = patch_source(source)
    assert "TRAIN_PREFETCH_QUEUE" not in default.source and "queue_depth" not in default.runtime
    assert "self.depth, self.taken = 2, 0" in default.runtime
    tuned = patch_source(source, producer_toggles=True)
    assert 'train_prefetch_queue = int(os.environ.get("TRAIN_PREFETCH_QUEUE", 2))' in tuned.source
    assert "queue_depth=Hyperparameters.train_prefetch_queue" in tuned.source
    assert "self.depth, self.taken = max(1, int(queue_depth)), 0" in tuned.runtime
