"""Family `shuffled` (patcher/families/shuffled.py): recognition, and train_prefetch's
before -> after and noop tables, whole outputs (runtime block as `RUNTIME`).

A `ShuffledSequenceLoader` is rebuilt on the CPU by `_make_train_loader` and run by
the forked producer, with or without the producer toggles (which add only
`TRAIN_PREFETCH_QUEUE`). Its batches through the producers are tested in
test_producer.py.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch, shown

from patcher.patch import features_from, patch_source
from patcher.families.registry import judge

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fixture_loader_is_recognised():
    verdicts = judge(cst.parse_module((FIXTURES / "shuffled_minified.py").read_text(encoding="utf-8")))
    assert dict(verdicts.families) == {"ShuffledSequenceLoader": "shuffled"}


REWRITES = [
    pytest.param(
        """\
import numpy as np
import torch

_MEMMAPS = {}

def _get_shard_memmap(file):
    if file not in _MEMMAPS:
        _MEMMAPS[file] = np.memmap(file, dtype=np.uint16, mode="r", offset=1024)
    return _MEMMAPS[file]

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.files = h.train_files[h.rank :: h.world_size]
        self.world_size, self.seq_len, self.device = h.world_size, h.train_seq_len, device
        self.rng = np.random.Generator(np.random.PCG64(h.rank))
        self.start_inds = [[] for _ in self.files]
        for si in range(len(self.files)):
            self._reset_shard(si)

    def _reset_shard(self, si):
        windows = (len(_get_shard_memmap(self.files[si])) - 1) // self.seq_len
        self.start_inds[si] = list(self.rng.permutation(windows) * self.seq_len)

    def next_batch(self, global_tokens, grad_accum_steps):
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = ShuffledSequenceLoader(h, device)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        """\
import numpy as np
import torch

_MEMMAPS = {}
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

def _get_shard_memmap(file):
    if file not in _MEMMAPS:
        _MEMMAPS[file] = np.memmap(file, dtype=np.uint16, mode="r", offset=1024)
    return _MEMMAPS[file]

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.files = h.train_files[h.rank :: h.world_size]
        self.world_size, self.seq_len, self.device = h.world_size, h.train_seq_len, device
        self.rng = np.random.Generator(np.random.PCG64(h.rank))
        self.start_inds = [[] for _ in self.files]
        for si in range(len(self.files)):
            self._reset_shard(si)

    def _reset_shard(self, si):
        windows = (len(_get_shard_memmap(self.files[si])) - 1) // self.seq_len
        self.start_inds[si] = list(self.rng.permutation(windows) * self.seq_len)

    def next_batch(self, global_tokens, grad_accum_steps):
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = _make_train_loader(lambda loader_device: ShuffledSequenceLoader(h, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        "`train_loader` built at line 48 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="forked-producer-by-default",
    ),
]

PRODUCER_TOGGLE_REWRITES = [
    pytest.param(
        """\
import numpy as np
import torch

_MEMMAPS = {}

def _get_shard_memmap(file):
    if file not in _MEMMAPS:
        _MEMMAPS[file] = np.memmap(file, dtype=np.uint16, mode="r", offset=1024)
    return _MEMMAPS[file]

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.files = h.train_files[h.rank :: h.world_size]
        self.world_size, self.seq_len, self.device = h.world_size, h.train_seq_len, device
        self.rng = np.random.Generator(np.random.PCG64(h.rank))
        self.start_inds = [[] for _ in self.files]
        for si in range(len(self.files)):
            self._reset_shard(si)

    def _reset_shard(self, si):
        windows = (len(_get_shard_memmap(self.files[si])) - 1) // self.seq_len
        self.start_inds[si] = list(self.rng.permutation(windows) * self.seq_len)

    def next_batch(self, global_tokens, grad_accum_steps):
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = ShuffledSequenceLoader(h, device)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        """\
import numpy as np
import torch

_MEMMAPS = {}
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
TRAIN_PREFETCH_QUEUE = int(os.environ.get("TRAIN_PREFETCH_QUEUE", 2))
"""
        + RUNTIME
        + """\

def _get_shard_memmap(file):
    if file not in _MEMMAPS:
        _MEMMAPS[file] = np.memmap(file, dtype=np.uint16, mode="r", offset=1024)
    return _MEMMAPS[file]

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.files = h.train_files[h.rank :: h.world_size]
        self.world_size, self.seq_len, self.device = h.world_size, h.train_seq_len, device
        self.rng = np.random.Generator(np.random.PCG64(h.rank))
        self.start_inds = [[] for _ in self.files]
        for si in range(len(self.files)):
            self._reset_shard(si)

    def _reset_shard(self, si):
        windows = (len(_get_shard_memmap(self.files[si])) - 1) // self.seq_len
        self.start_inds[si] = list(self.rng.permutation(windows) * self.seq_len)

    def next_batch(self, global_tokens, grad_accum_steps):
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = _make_train_loader(lambda loader_device: ShuffledSequenceLoader(h, loader_device), device, prefetch=TRAIN_PREFETCH, queue_depth=TRAIN_PREFETCH_QUEUE, copy_stream=False)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        "`train_loader` built at line 48 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="producer-toggles-forked-producer-with-a-depth-toggle",
    ),
]

NOOPS = [
    pytest.param(
        """\
import numpy as np
import torch

_MEMMAPS = {}

def _get_shard_memmap(file):
    if file not in _MEMMAPS:
        _MEMMAPS[file] = np.memmap(file, dtype=np.uint16, mode="r", offset=1024)
    return _MEMMAPS[file]

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.files = h.train_files[h.rank :: h.world_size]
        self.world_size, self.seq_len, self.device = h.world_size, h.train_seq_len, device
        self.rng = np.random.Generator(np.random.PCG64(h.rank))
        self.start_inds = [[] for _ in self.files]
        for si in range(len(self.files)):
            self._reset_shard(si)

    def _reset_shard(self, si):
        windows = (len(_get_shard_memmap(self.files[si])) - 1) // self.seq_len
        self.start_inds[si] = list(self.rng.permutation(windows) * self.seq_len)

    def next_batch(self, global_tokens, grad_accum_steps):
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def calibrate(h, device):
    calib_loader = ShuffledSequenceLoader(h, device)
    for step in range(4):
        x, y = calib_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        "`calib_loader` is not the training loader",
        11,
        id="gptq-calibration-loader-is-not-the-training-loader",
    ),
    pytest.param(
        """\
import numpy as np
import torch

_MEMMAPS = {}

def _get_shard_memmap(file):
    if file not in _MEMMAPS:
        _MEMMAPS[file] = np.memmap(file, dtype=np.uint16, mode="r", offset=1024)
    return _MEMMAPS[file]

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.files = h.train_files[h.rank :: h.world_size]
        self.world_size, self.seq_len, self.device = h.world_size, h.train_seq_len, device
        self.rng = np.random.Generator(np.random.PCG64(h.rank))
        self.start_inds = [[] for _ in self.files]
        for si in range(len(self.files)):
            self._reset_shard(si)

    def _reset_shard(self, si):
        windows = (len(_get_shard_memmap(self.files[si])) - 1) // self.seq_len
        self.start_inds[si] = list(self.rng.permutation(windows) * self.seq_len)

    def next_batch(self, global_tokens, grad_accum_steps):
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = ShuffledSequenceLoader(h, device)
    for step in range(10):
        tokens = h.train_batch_tokens * (1 + step // 5)
        x, y = train_loader.next_batch(tokens, h.grad_accum_steps)
""",
        "next_batch gets per-step argument `tokens` and ShuffledSequenceLoader assigns into self.start_inds[si], so queued batches cannot be rolled back cheaply",
        51,
        id="per-step-argument-on-a-loader-that-pops-its-lists",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="train_prefetch")
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert list(result.verdicts.families.values()) == ["shuffled"]


@pytest.mark.parametrize("before, after, note", PRODUCER_TOGGLE_REWRITES)
def test_rewrites_with_the_producer_toggles(before, after, note):
    result = patch_source(before, features_from(["train_prefetch"], None), producer_toggles=True)
    assert shown(result) == after
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert list(result.verdicts.families.values()) == ["shuffled"]


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert list(result.verdicts.families.values()) == ["shuffled"]
