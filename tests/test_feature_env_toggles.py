"""env_toggles: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

Each row also gives env_toggles' own report lines exactly: where the toggles went and
whether (and why not) the start-up log line was added.
"""

from __future__ import annotations

import pytest
from patch_tables import assert_noop, assert_patch, notes_of

FEATURES = {"train_prefetch", "copy_stream", "env_toggles"}

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
MAIN = "def main(device):\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n"
LOG0 = "def log0(msg):\n    print(msg)\n\n"


def _head_with(*edits: tuple[str, str]) -> str:
    """HEAD with each (old, new) edit made, each `old` found once (what the row's input changes)."""
    head = HEAD
    for old, new in edits:
        assert head.count(old) == 1
        head = head.replace(old, new)
    return head


# The records' start-up listing of their settings (2026-04 on), over `vars(...)` of a class or an instance.
LISTING = "def main(device):\n    h = Hyperparameters()\n    for k, v in sorted(vars({of}).items()):\n        if not k.startswith('_'):\n            log0(f'{{k}}: {{v}}')\n"

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

ADDED_TO_CLASS = (True, "TRAIN_PREFETCH, TRAIN_COPY_STREAM added to Hyperparameters", 4)
NOT_LOGGED = (False, "no log function in reach of the loader construction; toggles not logged", None)

REWRITES = [
    pytest.param(
        HEAD + LOG0 + "def main(device):\n    log0('start')\n    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
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

def log0(msg):
    print(msg)

def main(device):
    log0('start')
    log0(f"patch_prefetch train_prefetch:{Hyperparameters.train_prefetch} train_copy_stream:{Hyperparameters.train_copy_stream}")
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [ADDED_TO_CLASS, (True, "toggles logged through log0 before line 22", 22)],
        id="copies-the-class-idiom-and-logs-once",
    ),
    pytest.param(
        _head_with(('class Hyperparameters:\n    seed = int(os.environ.get("SEED", 1337))\n\n', "")) + MAIN,
        '''\
import os
import torch
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))
#<runtime>

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return _h2d(x, self.device, TRAIN_COPY_STREAM)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=TRAIN_COPY_STREAM)
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [(True, "TRAIN_PREFETCH, TRAIN_COPY_STREAM added as module constants", None), NOT_LOGGED],
        id="module-constants-without-a-class",
    ),
    pytest.param(
        _head_with(('seed = int(os.environ.get("SEED", 1337))', "seed = 1337")) + LOG0 + MAIN,
        '''\
import os
import torch
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))
#<runtime>

class Hyperparameters:
    seed = 1337

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return _h2d(x, self.device, TRAIN_COPY_STREAM)

def log0(msg):
    print(msg)

def main(device):
    log0(f"patch_prefetch train_prefetch:{TRAIN_PREFETCH} train_copy_stream:{TRAIN_COPY_STREAM}")
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=TRAIN_COPY_STREAM)
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [
            (True, "TRAIN_PREFETCH, TRAIN_COPY_STREAM added as module constants (Hyperparameters has no env line with an int default to copy)", None),
            (True, "toggles logged through log0 before line 21", 21),
        ],
        id="module-constants-where-the-class-has-no-env-line",
    ),
    pytest.param(
        _head_with(
            ("import torch\n", "import torch\nfrom dataclasses import dataclass\n"),
            ("class Hyperparameters:\n    seed = int(", "@dataclass\nclass Hyperparameters:\n    seed: int = int("),
        )
        + MAIN,
        '''\
import os
import torch
from dataclasses import dataclass
#<runtime>

@dataclass
class Hyperparameters:
    seed: int = int(os.environ.get("SEED", 1337))
    train_prefetch: int = int(os.environ.get("TRAIN_PREFETCH", 1))
    train_copy_stream: int = int(os.environ.get("TRAIN_COPY_STREAM", 1))

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
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [(True, "TRAIN_PREFETCH, TRAIN_COPY_STREAM added to Hyperparameters", 6), NOT_LOGGED],
        id="dataclass-annotated-fields",
    ),
    pytest.param(
        _head_with(
            ("import torch\n", "import torch\n_e = lambda k, d, t: t(os.environ.get(k, d))\n"),
            ('seed = int(os.environ.get("SEED", 1337))', 'seed = _e("SEED", 1337, int)'),
        )
        + MAIN,
        '''\
import os
import torch
_e = lambda k, d, t: t(os.environ.get(k, d))
#<runtime>

class Hyperparameters:
    seed = _e("SEED", 1337, int)
    train_prefetch = _e("TRAIN_PREFETCH", 1, int)
    train_copy_stream = _e("TRAIN_COPY_STREAM", 1, int)

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
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [(True, "TRAIN_PREFETCH, TRAIN_COPY_STREAM added to Hyperparameters", 5), NOT_LOGGED],
        id="the-scripts-own-env-helper-copied",
    ),
    pytest.param(
        MINIFIED,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));n=2;train_prefetch=int(os.environ.get('TRAIN_PREFETCH',1));train_copy_stream=int(os.environ.get('TRAIN_COPY_STREAM',1))\n"
            "class L:\n"
            "\tdef __init__(self,h,device):self.device=device;self.i=0\n"
            "\tdef next_batch(self,a,b):self.i+=1;x=torch.full((a,),self.i);return _h2d(x,self.device,Hyperparameters.train_copy_stream),_h2d(x,self.device,Hyperparameters.train_copy_stream)\n"
            "def main(h,device):\n"
            "\ttrain_loader=_make_train_loader(lambda loader_device:L(h,loader_device),device,prefetch=Hyperparameters.train_prefetch,copy_stream=Hyperparameters.train_copy_stream)\n"
            "\tfor i in range(3):x,y=train_loader.next_batch(h.n,h.n)\n"
        ),
        FEATURES,
        [(True, "TRAIN_PREFETCH, TRAIN_COPY_STREAM added to Hyperparameters", 2), NOT_LOGGED],
        id="minified-one-line-class",
    ),
    pytest.param(
        HEAD + LOG0 + LISTING.format(of="type(h)") + "    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
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

def log0(msg):
    print(msg)

def main(device):
    h = Hyperparameters()
    for k, v in sorted(vars(type(h)).items()):
        if not k.startswith('_'):
            log0(f'{k}: {v}')
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [ADDED_TO_CLASS, (True, "toggles logged by the script's own listing of Hyperparameters", 22)],
        id="no-log-line-where-the-script-lists-its-class-attributes",
    ),
    pytest.param(
        HEAD + LOG0 + LISTING.format(of="h") + "    train_loader = Loader(device)\n    x = train_loader.next_batch(4)\n",
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

def log0(msg):
    print(msg)

def main(device):
    h = Hyperparameters()
    for k, v in sorted(vars(h).items()):
        if not k.startswith('_'):
            log0(f'{k}: {v}')
    log0(f"patch_prefetch train_prefetch:{Hyperparameters.train_prefetch} train_copy_stream:{Hyperparameters.train_copy_stream}")
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [ADDED_TO_CLASS, (True, "toggles logged through log0 before line 25", 25)],
        id="a-listing-of-the-instance-holds-no-class-attribute-so-the-log-line-stays",
    ),
    pytest.param(
        HEAD + "def setup():\n    def log0(msg):\n        print(msg)\n    return log0\n\n" + MAIN,
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

def setup():
    def log0(msg):
        print(msg)
    return log0

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)
    x = train_loader.next_batch(4)
''',
        FEATURES,
        [ADDED_TO_CLASS, (False, "log0 is not visible where the loader is built; toggles not logged", 23)],
        id="log0-defined-in-another-function-no-log-line",
    ),
    pytest.param(
        HEAD + MAIN,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return _h2d(x, self.device, 1)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=1, copy_stream=1)
    x = train_loader.next_batch(4)
''',
        {"train_prefetch", "copy_stream"},
        [],
        id="env_toggles-skipped-the-defaults-inlined",
    ),
]


@pytest.mark.parametrize("before, after, enabled, notes", REWRITES)
def test_rewrites(before, after, enabled, notes):
    result = assert_patch(before, after, enabled=enabled)
    assert notes_of(result, "env_toggles") == notes


NOOPS = [
    pytest.param(HEAD + "def main(device):\n    calib_loader = Loader(device)\n", "no injected behaviour to switch", None, id="nothing-injected-to-switch"),
    pytest.param(HEAD + LOG0 + MAIN, "no injected behaviour to switch", None, id="a-loader-but-no-feature-that-reads-a-toggle"),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="env_toggles")


# A data generator feeds training (modded-nanogpt's `distributed_data_generator`, its
# H2D copies staged): the toggles are logged before the generator is built.
GENERATOR = '''\
def batches(pattern, num_tokens):
    next_shard = threading.Thread(target=print)
    next_shard.start()
    tokens = torch.arange(100_000)
    while True:
        buf = tokens[:num_tokens]
        new = yield {copy}
        if new is not None:
            num_tokens = new

'''
LOOP = "train_loader = batches('x', 512)\nfor step in range(10):\n    x = train_loader.send(1024 if step == 5 else None)\n"
PLAIN_COPY = 'buf.to(device="cuda", non_blocking=True)'
STAGED_COPY = '_pinned_h2d(buf, device="cuda", staging=TRAIN_PINNED_STAGING, copy_stream=TRAIN_COPY_STREAM)'
GENERATOR_TOGGLES = '''\
import threading
import torch
import os
TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))
TRAIN_PINNED_STAGING = int(os.environ.get("TRAIN_PINNED_STAGING", 1))
#<runtime>
'''
GENERATOR_ADDED = (True, "TRAIN_COPY_STREAM, TRAIN_PINNED_STAGING added as module constants", None)


def test_the_toggles_are_logged_before_the_data_generator_is_built():
    before = "import threading\nimport torch\n\n" + LOG0 + GENERATOR.format(copy=PLAIN_COPY) + LOOP
    after = (
        GENERATOR_TOGGLES + "\n" + LOG0 + GENERATOR.format(copy=STAGED_COPY)
        + 'log0(f"patch_prefetch train_copy_stream:{TRAIN_COPY_STREAM} train_pinned_staging:{TRAIN_PINNED_STAGING}")\n' + LOOP
    )
    result = assert_patch(before, after)
    assert notes_of(result, "env_toggles") == [GENERATOR_ADDED, (True, "toggles logged through log0 before line 17", 17)]


def test_a_log_function_defined_after_the_data_generator_is_built_is_not_called():
    # At module level the call would run before the `def`: a NameError at start-up.
    before = "import threading\nimport torch\n\n" + GENERATOR.format(copy=PLAIN_COPY) + LOOP + LOG0
    after = GENERATOR_TOGGLES + "\n" + GENERATOR.format(copy=STAGED_COPY) + LOOP + LOG0
    result = assert_patch(before, after)
    assert notes_of(result, "env_toggles") == [GENERATOR_ADDED, (False, "log0 is not visible where the data generator is built; toggles not logged", 14)]
