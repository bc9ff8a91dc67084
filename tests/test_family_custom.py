"""Family `custom` (patcher/families/custom.py): recognition, and train_prefetch's
before -> after and noop tables, whole outputs (runtime block as `RUNTIME`).

Any other class with `next_batch` (the catch-all) is rebuilt on the CPU by
`_make_train_loader` where that is exact: the refusals here are those every loader
rebuilt on the CPU has (patcher/families/loader_plan.py), a loader that already uses
threads first among them.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.patch import patch_source
from patcher.proof.verify import verify
from patcher.families.registry import judge

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fixture_loader_is_recognised():
    verdicts = judge(cst.parse_module((FIXTURES / "custom_loader.py").read_text(encoding="utf-8")))
    assert dict(verdicts.families) == {"WindowLoader": "custom"}


REWRITES = [
    pytest.param(
        """\
import os
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

def main(device):
    train_loader = Loader(device)
    for step in range(3):
        x = train_loader.next_batch(4)
""",
        """\
import os
import torch
"""
        + RUNTIME
        + """\

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False)
    for step in range(3):
        x = train_loader.next_batch(4)
""",
        "`train_loader` built at line 18 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="run-constant-argument",
    ),
    pytest.param(
        """\
import os
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

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        """\
import os
import torch
"""
        + RUNTIME
        + """\

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False)
    x = train_loader.next_batch(4)
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False)
    x = train_loader.next_batch(4)
""",
        "`train_loader` built at line 18, 20 prefetches; a child process forked once, at the first batch, builds the batches; the rebuild at line 20 resets it, without another fork (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="rebuilt-after-warmup-both-rewritten",
    ),
    pytest.param(
        """\
import os
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

def main(device):
    train_loader = Loader(device)
    n = 4
    for step in range(3):
        n = n * 2
        x = train_loader.next_batch(n)
""",
        """\
import os
import torch
"""
        + RUNTIME
        + """\

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False, rollback=True, host_copy=False)
    n = 4
    for step in range(3):
        n = n * 2
        x = train_loader.next_batch(n)
""",
        "`train_loader` built at line 18 prefetches; a thread of this process builds the batches (the thread runtime: the snapshot rollback); per-step argument `n`: batches queued with older values are dropped and the loader restored from a snapshot",
        id="per-step-argument-gets-rollback",
    ),
    pytest.param(
        """\
import os
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

def main(device):
    batches = Loader(device)
    for step in range(3):
        x = batches.next_batch(4)
""",
        """\
import os
import torch
"""
        + RUNTIME
        + """\

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    batches = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False, name='batches')
    for step in range(3):
        x = batches.next_batch(4)
""",
        "`batches` built at line 18 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="loader-in-another-variable-gets-its-name",
    ),
    pytest.param(
        """\
import os
import threading
from concurrent.futures import ThreadPoolExecutor
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

SAVERS = ThreadPoolExecutor(1)

def _prefetch_shard(index):
    threading.Thread(target=print, args=(index,), daemon=True).start()

def _shard_value(index):
    SAVERS = [index % 7]
    return SAVERS[0]

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def _prefetch_shard(self, index):
        return _shard_value(index)

    def next_batch(self, n):
        self.i = self._prefetch_shard(self.i + 1)
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
    SAVERS.submit(print, x)
""",
        """\
import os
import threading
from concurrent.futures import ThreadPoolExecutor
import torch
"""
        + RUNTIME
        + """\

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))

SAVERS = ThreadPoolExecutor(1)

def _prefetch_shard(index):
    threading.Thread(target=print, args=(index,), daemon=True).start()

def _shard_value(index):
    SAVERS = [index % 7]
    return SAVERS[0]

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def _prefetch_shard(self, index):
        return _shard_value(index)

    def next_batch(self, n):
        self.i = self._prefetch_shard(self.i + 1)
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=False)
    x = train_loader.next_batch(4)
    SAVERS.submit(print, x)
""",
        "`train_loader` built at line 32 prefetches; the script starts threads (line 9, 12): where one runs at the first batch, a thread of this process builds the batches; else a child process forked once, at the first batch, builds the batches",
        id="thread-helper-and-pool-the-loader-does-not-reach",
    ),
]

NOOPS = [
    pytest.param(
        """\
import os
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

def main(device):
    calib_loader = Loader(device)
    x = calib_loader.next_batch(4)
""",
        "`calib_loader` is not the training loader",
        7,
        id="calibration-loader-is-not-the-training-loader",
    ),
    pytest.param(
        """\
import os
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

def main(device):
    train_loader = Loader(device)
""",
        "`train_loader` has no next_batch call where it is built",
        7,
        id="built-but-never-drawn",
    ),
    pytest.param(
        """\
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1; torch.manual_seed(0)
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "loader draws from the global torch RNG (torch.manual_seed); a background thread would change the draw order",
        7,
        id="global-torch-rng",
    ),
    pytest.param(
        """\
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1; dist.barrier()
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "loader calls torch.distributed (dist.barrier) inside next_batch; it must stay on the main thread",
        7,
        id="collective-in-next-batch",
    ),
    pytest.param(
        """\
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0; self.t = threading.Thread(target=print)

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "Loader already prefetches (threads in the loader); not wrapped again",
        7,
        id="loader-already-prefetches",
    ),
    pytest.param(
        """\
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i, device=self.device)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "loader uses self.device beyond the final H2D copy (self.device); cannot build it on the CPU",
        7,
        id="device-used-beyond-the-copy",
    ),
    pytest.param(
        """\
import torch
from concurrent.futures import ThreadPoolExecutor

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0

    def take(self, n):
        self.pos += n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.device = device
        self.stream = TokenStream(pattern)
        self.pool = ThreadPoolExecutor(1)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.pool.submit(self.stream.take, global_tokens // grad_accum_steps + 1).result()
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "DistributedTokenLoader already prefetches (threads in the loader); not wrapped again",
        12,
        id="tokenstream-loader-on-a-thread-pool-is-custom-and-already-prefetches",
    ),
    pytest.param(
        """\
import os
import threading
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

def _prefetch_shard(index, out):
    worker = threading.Thread(target=out.append, args=(index,), daemon=True)
    worker.start()
    return worker

def _next_shard(index):
    out = []
    _prefetch_shard(index, out).join()
    return out[0]

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i = _next_shard(self.i + 1)
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader.next_batch` reaches `_next_shard` (line 13), then `_prefetch_shard` (line 8), which starts a thread (threading.Thread, line 9): a forked producer would not have it; not wrapped",
        18,
        id="helper-two-calls-away-starts-a-thread",
    ),
    pytest.param(
        """\
import os
from concurrent.futures import ThreadPoolExecutor
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

POOL = ThreadPoolExecutor(2)

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i = POOL.submit(int, self.i + 1).result()
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader.next_batch` uses `POOL` (line 8), a thread pool built at module level (ThreadPoolExecutor): a forked producer would not have its workers; not wrapped",
        10,
        id="module-level-thread-pool-submitted-to-in-next-batch",
    ),
    pytest.param(
        """\
import os
import concurrent.futures
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

_READERS: concurrent.futures.Executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)

def _read_all(indices):
    return list(_READERS.map(int, indices))

class Loader:
    def __init__(self, device):
        self.device = device
        self.shards = _read_all([1, 2, 3])
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.shards[self.i % 3])
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader.__init__` reaches `_read_all` (line 10), which uses `_READERS` (line 8), a thread pool built at module level (concurrent.futures.ThreadPoolExecutor): a forked producer would not have its workers; not wrapped",
        13,
        id="helper-maps-over-a-module-level-pool-in-init",
    ),
    pytest.param(
        """\
import os
import threading
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Reader(threading.Thread):
    def run(self):
        self.value = 1

class ShardReader(Reader):
    pass

class Loader:
    def __init__(self, device):
        self.device = device
        self.reader = ShardReader(daemon=True)
        self.reader.start()
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader.__init__` builds `ShardReader` (line 12), a subclass of threading.Thread: a forked producer would not have it; not wrapped",
        15,
        id="builds-a-thread-subclass-of-the-script",
    ),
    pytest.param(
        """\
import os
from concurrent.futures import ThreadPoolExecutor
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

_pool = None

def shard_pool():
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1)
    return _pool

class Loader:
    def __init__(self, device):
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i = shard_pool().submit(int, self.i + 1).result()
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader.next_batch` reaches `shard_pool` (line 10), which starts a thread pool (ThreadPoolExecutor, line 13): a forked producer would not have its workers; not wrapped",
        16,
        id="helper-creates-a-global-pool-on-first-use",
    ),
    pytest.param(
        """\
import os
import threading
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

def _watch(loader):
    threading.Thread(target=print, daemon=True).start()

class Loader:
    def __init__(self, device, hooks=(_watch,)):
        self.device = device
        self.i = 0
        for hook in hooks:
            hook(self)

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader.__init__` reaches `_watch` (line 8), which starts a thread (threading.Thread, line 9): a forked producer would not have it; not wrapped",
        11,
        id="default-argument-hook-starts-a-thread",
    ),
    pytest.param(
        """\
import os
import threading
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class Loader(threading.Thread):
    def __init__(self, device):
        super().__init__(daemon=True)
        self.device = device
        self.i = 0

    def next_batch(self, n):
        self.i += 1
        x = torch.full((n,), self.i)
        return x.to(self.device, non_blocking=True)

def main(device):
    train_loader = Loader(device)
    x = train_loader.next_batch(4)
""",
        "`Loader` is a subclass of threading.Thread: a forked producer would not have its thread; not wrapped",
        8,
        id="loader-is-a-thread-subclass",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="train_prefetch")
    assert result.applied == ["train_prefetch", "env_toggles"]
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert list(result.verdicts.families.values()) == ["custom"]


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert list(result.verdicts.families.values()) == ["custom"]


def test_fixture_patched_gives_the_original_batches(tmp_path):
    patched = tmp_path / "patched.py"
    patched.write_text(patch_source((FIXTURES / "custom_loader.py").read_text(encoding="utf-8")).source)
    result = verify(FIXTURES / "custom_loader.py", patched, batches=16)
    assert result.identical, result.difference


# Batches that are not a plain (x, y) pair: each is handed out with its own values
# (the shard index changes at every call on the verify's small shards).
RETURN_PAIR = "        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)\n"
STRUCTURED_RETURNS = {
    "tuple-with-counter": "        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), self.shard\n",
    "dict-with-state": '        return {"x": x.to(self.device, non_blocking=True), "state": {"shard": self.shard, "offset": self.offset, "name": f"s{self.shard}"}}\n',
}


@pytest.mark.parametrize("name", list(STRUCTURED_RETURNS))
def test_structured_batches_verify_identical_and_a_frozen_value_is_caught(tmp_path, name):
    source = (FIXTURES / "custom_loader.py").read_text(encoding="utf-8")
    assert source.count(RETURN_PAIR) == 1
    original = tmp_path / "train_gpt.py"
    original.write_text(source.replace(RETURN_PAIR, STRUCTURED_RETURNS[name]))
    patched = tmp_path / "patched.py"
    text = patch_source(original.read_text()).source
    patched.write_text(text)
    result = verify(original, patched, batches=12)
    assert result.identical, result.difference
    # A runtime that handed out the first batch's values again would be caught, at the value's path.
    # (Each batch's message read for its slot, but the first message's values kept.)
    frozen = "_hand_out(message[1],"
    assert text.count(frozen) == 1
    patched.write_text(text.replace(frozen, "_hand_out(self.__dict__.setdefault('first', message[1]),"))
    result = verify(original, patched, batches=12)
    assert not result.identical
    assert result.difference.field == {"tuple-with-counter": 2, "dict-with-state": "['state']['shard']"}[name], result.difference
