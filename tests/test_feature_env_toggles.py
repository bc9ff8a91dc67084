"""env_toggles: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`)."""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch
from test_feature_train_prefetch import HEAD

FEATURES = ["train_prefetch", "copy_stream", "env_toggles"]
MAKE = "_make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch={p}, copy_stream={c})"
CLASS = MAKE.format(p="Hyperparameters.train_prefetch", c="Hyperparameters.train_copy_stream")
PATCHED_CLASS_HEAD = (
    HEAD.replace("import torch\n", "import torch\n" + RUNTIME)
    .replace(
        '    seed = int(os.environ.get("SEED", 1337))\n',
        '    seed = int(os.environ.get("SEED", 1337))\n'
        '    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))\n'
        '    train_copy_stream = int(os.environ.get("TRAIN_COPY_STREAM", 1))\n',
    )
    .replace("return x.to(self.device, non_blocking=True)", "return _h2d(x, self.device, Hyperparameters.train_copy_stream)")
)
NO_CLASS = HEAD.replace('class Hyperparameters:\n    seed = int(os.environ.get("SEED", 1337))\n\n', "")
LOG_LINE = 'log0(f"patch_prefetch train_prefetch:{Hyperparameters.train_prefetch} train_copy_stream:{Hyperparameters.train_copy_stream}")'

# The records' start-up listing of their settings (2026-04 on), over `vars(...)` of `of`.
LISTING = (
    "def log0(msg):\n    print(msg)\n\n"
    "def main(device):\n"
    "    h = Hyperparameters()\n"
    "    for k, v in sorted(vars({of}).items()):\n"
    "        if not k.startswith('_'):\n"
    "            log0(f'{{k}}: {{v}}')\n"
)

MINIFIED = (
    "import os,torch\n"
    "class Hyperparameters():seed=int(os.environ.get('SEED',1));n=2\n"
    "class L:\n"
    "\tdef __init__(self,h,device):self.device=device;self.i=0\n"
    "\tdef next_batch(self,a,b):self.i+=1;x=torch.full((a,),self.i);return x.to(self.device,non_blocking=True),x.to(self.device,non_blocking=True)\n"
    "def main(h,device):\n"
    "\ttrain_loader=L(h,device)\n"
    "\tfor i in range(3):x,y=train_loader.next_batch(h.n,h.n)\n"
)
MINIFIED_AFTER = (
    "import os,torch\n"
    + RUNTIME
    + "class Hyperparameters():seed=int(os.environ.get('SEED',1));n=2;train_prefetch=int(os.environ.get('TRAIN_PREFETCH',1));train_copy_stream=int(os.environ.get('TRAIN_COPY_STREAM',1))\n"
    "class L:\n"
    "\tdef __init__(self,h,device):self.device=device;self.i=0\n"
    "\tdef next_batch(self,a,b):self.i+=1;x=torch.full((a,),self.i);return _h2d(x,self.device,Hyperparameters.train_copy_stream),_h2d(x,self.device,Hyperparameters.train_copy_stream)\n"
    "def main(h,device):\n"
    "\ttrain_loader=_make_train_loader(lambda loader_device:L(h,loader_device),device,prefetch=Hyperparameters.train_prefetch,copy_stream=Hyperparameters.train_copy_stream)\n"
    "\tfor i in range(3):x,y=train_loader.next_batch(h.n,h.n)\n"
)

REWRITES = [
    pytest.param(
        HEAD + "def log0(msg):\n    print(msg)\n\ndef main(device):\n    log0('start')\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
        PATCHED_CLASS_HEAD + f"def log0(msg):\n    print(msg)\n\ndef main(device):\n    log0('start')\n    {LOG_LINE}\n    train_loader = {CLASS}\n    x = train_loader.next_batch(4)\n",
        id="copies-the-class-idiom-and-logs-once",
    ),
    pytest.param(
        NO_CLASS + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
        NO_CLASS.replace(
            "import torch\n",
            "import torch\n"
            'TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))\n'
            'TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))\n' + RUNTIME,
        ).replace("return x.to(self.device, non_blocking=True)", "return _h2d(x, self.device, TRAIN_COPY_STREAM)")
        + "def main(device):\n    train_loader = " + MAKE.format(p="TRAIN_PREFETCH", c="TRAIN_COPY_STREAM") + "\n    x = train_loader.next_batch(4)\n",
        id="module-constants-without-a-class",
    ),
    pytest.param(MINIFIED, MINIFIED_AFTER, id="minified-one-line-class"),
    pytest.param(
        HEAD + LISTING.format(of="type(h)") + "    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
        PATCHED_CLASS_HEAD + LISTING.format(of="type(h)") + f"    train_loader = {CLASS}\n    x = train_loader.next_batch(4)\n",
        id="no-log-line-where-the-script-lists-its-class-attributes",
    ),
    pytest.param(
        HEAD + LISTING.format(of="h") + "    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
        PATCHED_CLASS_HEAD + LISTING.format(of="h") + f"    {LOG_LINE}\n    train_loader = {CLASS}\n    x = train_loader.next_batch(4)\n",
        id="a-listing-of-the-instance-holds-no-class-attribute-so-the-log-line-stays",
    ),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    assert_patch(before, after, enabled=set(FEATURES))


def test_skipped_env_toggles_inlines_the_defaults():
    before = HEAD + "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n"
    after = (
        HEAD.replace("import torch\n", "import torch\n" + RUNTIME).replace("return x.to(self.device, non_blocking=True)", "return _h2d(x, self.device, 1)")
        + "def main(device):\n    train_loader = " + MAKE.format(p="1", q="2", c="1") + "\n    x = train_loader.next_batch(4)\n"
    )
    assert_patch(before, after, enabled={"train_prefetch", "copy_stream"})


NOOPS = [
    pytest.param(HEAD + "def main(device):\n    calib_loader = Loader(device)\n", id="nothing-injected-to-switch"),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="env_toggles")
