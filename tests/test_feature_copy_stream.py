"""copy_stream: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`)."""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch
from test_feature_train_prefetch import HEAD

TOGGLES = (
    '    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))\n'
    '    train_copy_stream = int(os.environ.get("TRAIN_COPY_STREAM", 1))\n'
)
MAIN = "def main(device):\n    train_loader = Loader(device)\n    for step in range(3):\n        x = train_loader.next_batch(4)\n"

REWRITES = [
    pytest.param(
        HEAD + MAIN,
        HEAD.replace("import torch\n", "import torch\n" + RUNTIME)
        .replace('    seed = int(os.environ.get("SEED", 1337))\n', '    seed = int(os.environ.get("SEED", 1337))\n' + TOGGLES)
        .replace("return x.to(self.device, non_blocking=True)", "return _h2d(x, self.device, Hyperparameters.train_copy_stream)")
        + "def main(device):\n    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)\n    for step in range(3):\n        x = train_loader.next_batch(4)\n",
        id="h2d-in-the-training-loader-only",
    ),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    assert_patch(before, after, only=["train_prefetch", "copy_stream"])


NOOPS = [
    pytest.param(HEAD.replace("return x.to(self.device, non_blocking=True)", "return x") + MAIN, id="loader-without-a-device-copy"),
    pytest.param(HEAD + "def main(device):\n    calib_loader = Loader(device)\n    x = calib_loader.next_batch(4)\n", id="no-training-loader"),
    pytest.param("import numpy as np\nclass Loader:\n    def next_batch(self, n):\n        return np.zeros(n)\ntrain_loader = Loader()\nx = train_loader.next_batch(4)\n", id="script-without-torch"),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="copy_stream")
