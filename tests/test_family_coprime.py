"""Family `coprime` (patcher/families/coprime.py): recognition, and train_prefetch's
before -> after and noop tables, whole outputs (runtime block as `RUNTIME`).

The coprime-stride `DistributedTokenLoader` (numpy memmaps, its own
`np.random.Generator`) is rebuilt on the CPU by `_make_train_loader`: the forked
producer for run-constant arguments, the thread runtime with a snapshot rollback for a
batch-size schedule; refused where it draws from a global RNG, or changes arrays in
place under a per-step argument.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.families.registry import judge

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fixture_loader_is_recognised():
    verdicts = judge(cst.parse_module((FIXTURES / "coprime_dataclass.py").read_text(encoding="utf-8")))
    assert dict(verdicts.families) == {"DistributedTokenLoader": "coprime"}


REWRITES = [
    pytest.param(
        """\
import math

import numpy as np
import torch

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokens = np.arange(10_000, dtype=np.uint16)
        self.rng = np.random.Generator(np.random.PCG64(len(pattern)))
        self.stride = self._pick_coprime_stride(len(self.tokens))
        self.pos = 0

    def _pick_coprime_stride(self, n):
        stride = int(self.rng.integers(1, n))
        while math.gcd(stride, n) != 1:
            stride += 1
        return stride

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = global_tokens // (self.world_size * grad_accum_steps)
        start = (self.pos + self.rank * local) % (len(self.tokens) - local - 1)
        self.pos += self.stride
        chunk = torch.from_numpy(self.tokens[start : start + local + 1].astype(np.int64))
        x = chunk[:-1].reshape(-1, seq_len)
        y = chunk[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, rank, world_size, device):
    train_loader = DistributedTokenLoader(h.train_files, rank, world_size, device)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.train_seq_len, 1)
""",
        """\
import math

import numpy as np
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokens = np.arange(10_000, dtype=np.uint16)
        self.rng = np.random.Generator(np.random.PCG64(len(pattern)))
        self.stride = self._pick_coprime_stride(len(self.tokens))
        self.pos = 0

    def _pick_coprime_stride(self, n):
        stride = int(self.rng.integers(1, n))
        while math.gcd(stride, n) != 1:
            stride += 1
        return stride

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = global_tokens // (self.world_size * grad_accum_steps)
        start = (self.pos + self.rank * local) % (len(self.tokens) - local - 1)
        self.pos += self.stride
        chunk = torch.from_numpy(self.tokens[start : start + local + 1].astype(np.int64))
        x = chunk[:-1].reshape(-1, seq_len)
        y = chunk[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, rank, world_size, device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader(h.train_files, rank, world_size, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.train_seq_len, 1)
""",
        "`train_loader` built at line 30 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="run-constant-arguments-forked-producer",
    ),
    pytest.param(
        """\
import math

import numpy as np
import torch

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokens = np.arange(10_000, dtype=np.uint16)
        self.rng = np.random.Generator(np.random.PCG64(len(pattern)))
        self.stride = self._pick_coprime_stride(len(self.tokens))
        self.pos = 0

    def _pick_coprime_stride(self, n):
        stride = int(self.rng.integers(1, n))
        while math.gcd(stride, n) != 1:
            stride += 1
        return stride

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = global_tokens // (self.world_size * grad_accum_steps)
        start = (self.pos + self.rank * local) % (len(self.tokens) - local - 1)
        self.pos += self.stride
        chunk = torch.from_numpy(self.tokens[start : start + local + 1].astype(np.int64))
        x = chunk[:-1].reshape(-1, seq_len)
        y = chunk[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, rank, world_size, device):
    train_loader = DistributedTokenLoader(h.train_files, rank, world_size, device)
    for step in range(10):
        tokens = h.train_batch_tokens * (1 + step // 5)
        x, y = train_loader.next_batch(tokens, h.train_seq_len, 1)
""",
        """\
import math

import numpy as np
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokens = np.arange(10_000, dtype=np.uint16)
        self.rng = np.random.Generator(np.random.PCG64(len(pattern)))
        self.stride = self._pick_coprime_stride(len(self.tokens))
        self.pos = 0

    def _pick_coprime_stride(self, n):
        stride = int(self.rng.integers(1, n))
        while math.gcd(stride, n) != 1:
            stride += 1
        return stride

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = global_tokens // (self.world_size * grad_accum_steps)
        start = (self.pos + self.rank * local) % (len(self.tokens) - local - 1)
        self.pos += self.stride
        chunk = torch.from_numpy(self.tokens[start : start + local + 1].astype(np.int64))
        x = chunk[:-1].reshape(-1, seq_len)
        y = chunk[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, rank, world_size, device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader(h.train_files, rank, world_size, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False, rollback=True, host_copy=False)
    for step in range(10):
        tokens = h.train_batch_tokens * (1 + step // 5)
        x, y = train_loader.next_batch(tokens, h.train_seq_len, 1)
""",
        "`train_loader` built at line 30 prefetches; a thread of this process builds the batches (the thread runtime: the snapshot rollback); per-step argument `tokens`: batches queued with older values are dropped and the loader restored from a snapshot",
        id="batch-size-schedule-gets-rollback",
    ),
]

NOOPS = [
    pytest.param(
        """\
import math

import numpy as np
import torch

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokens = np.arange(10_000, dtype=np.uint16)
        self.rng = np.random.Generator(np.random.PCG64(len(pattern)))
        self.stride = self._pick_coprime_stride(len(self.tokens))
        self.pos = 0

    def _pick_coprime_stride(self, n):
        stride = int(np.random.randint(1, n))
        while math.gcd(stride, n) != 1:
            stride += 1
        return stride

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = global_tokens // (self.world_size * grad_accum_steps)
        start = (self.pos + self.rank * local) % (len(self.tokens) - local - 1)
        self.pos += self.stride
        chunk = torch.from_numpy(self.tokens[start : start + local + 1].astype(np.int64))
        x = chunk[:-1].reshape(-1, seq_len)
        y = chunk[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, rank, world_size, device):
    train_loader = DistributedTokenLoader(h.train_files, rank, world_size, device)
    for step in range(10):
        x, y = train_loader.next_batch(h.train_batch_tokens, h.train_seq_len, 1)
""",
        "loader draws from the global numpy RNG (np.random.randint); a background thread would change the draw order",
        6,
        id="stride-drawn-from-the-global-numpy-rng",
    ),
    pytest.param(
        """\
import math

import numpy as np
import torch

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokens = np.arange(10_000, dtype=np.uint16)
        self.rng = np.random.Generator(np.random.PCG64(len(pattern)))
        self.stride = self._pick_coprime_stride(len(self.tokens))
        self.pos = 0
        self.order = np.arange(len(self.tokens))

    def _pick_coprime_stride(self, n):
        stride = int(self.rng.integers(1, n))
        while math.gcd(stride, n) != 1:
            stride += 1
        return stride

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = global_tokens // (self.world_size * grad_accum_steps)
        start = (self.pos + self.rank * local) % (len(self.tokens) - local - 1)
        self.pos += self.stride
        self.rng.shuffle(self.order)
        chunk = torch.from_numpy(self.tokens[start : start + local + 1].astype(np.int64))
        x = chunk[:-1].reshape(-1, seq_len)
        y = chunk[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(h, rank, world_size, device):
    train_loader = DistributedTokenLoader(h.train_files, rank, world_size, device)
    for step in range(10):
        tokens = h.train_batch_tokens * (1 + step // 5)
        x, y = train_loader.next_batch(tokens, h.train_seq_len, 1)
""",
        "next_batch gets per-step argument `tokens` and DistributedTokenLoader calls self.rng.shuffle(), so queued batches cannot be rolled back cheaply",
        35,
        id="per-step-argument-on-a-loader-that-shuffles-in-place",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="train_prefetch")
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert list(result.verdicts.families.values()) == ["coprime"]


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert list(result.verdicts.families.values()) == ["coprime"]
