"""Family `document_packing` (patcher/families/document_packing.py): recognition, and
the before -> after and noop tables, whole outputs (runtime block as `RUNTIME`).

A `DocumentPackingLoader` already builds batches ahead, so train_prefetch leaves it
alone, threads seen or not; its H2D copies still go through the copy stream.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.families.registry import judge

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fixture_loader_is_recognised():
    verdicts = judge(cst.parse_module((FIXTURES / "document_packing.py").read_text(encoding="utf-8")))
    assert {name: (family, verdicts.prefetches(name)) for name, family in verdicts.families.items()} == {"DocumentPackingLoader": ("document_packing", True)}


REWRITES = [
    pytest.param(
        """\
import torch
from concurrent.futures import ThreadPoolExecutor

class DocumentPackingLoader:
    def __init__(self, h, device):
        self.device = device
        self.tokens, self.cursor = torch.arange(10_000), 0
        self.pool = ThreadPoolExecutor(1)
        self.ahead = None

    def _prepare(self, n):
        chunk = self.tokens[self.cursor : self.cursor + n + 1]
        self.cursor += n
        starts = (chunk[:-1] == 1).nonzero().flatten().to(torch.int32)
        return chunk[:-1], chunk[1:], starts

    def next_batch(self, global_tokens, grad_accum_steps):
        n = global_tokens // grad_accum_steps
        x, y, cu_seqlens = self.ahead.result() if self.ahead is not None else self._prepare(n)
        self.ahead = self.pool.submit(self._prepare, n)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), cu_seqlens.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = DocumentPackingLoader(h, device)
    for step in range(10):
        x, y, cu_seqlens = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        """\
import torch
from concurrent.futures import ThreadPoolExecutor
import os
TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))
"""
        + RUNTIME
        + """\

class DocumentPackingLoader:
    def __init__(self, h, device):
        self.device = device
        self.tokens, self.cursor = torch.arange(10_000), 0
        self.pool = ThreadPoolExecutor(1)
        self.ahead = None

    def _prepare(self, n):
        chunk = self.tokens[self.cursor : self.cursor + n + 1]
        self.cursor += n
        starts = (chunk[:-1] == 1).nonzero().flatten().to(torch.int32)
        return chunk[:-1], chunk[1:], starts

    def next_batch(self, global_tokens, grad_accum_steps):
        n = global_tokens // grad_accum_steps
        x, y, cu_seqlens = self.ahead.result() if self.ahead is not None else self._prepare(n)
        self.ahead = self.pool.submit(self._prepare, n)
        return _h2d(x, self.device, TRAIN_COPY_STREAM), _h2d(y, self.device, TRAIN_COPY_STREAM), _h2d(cu_seqlens, self.device, TRAIN_COPY_STREAM)

def main(h, device):
    train_loader = DocumentPackingLoader(h, device)
    for step in range(10):
        x, y, cu_seqlens = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        "DocumentPackingLoader already prefetches (threads in the loader); not wrapped again",
        id="left-to-itself-its-copies-on-the-copy-stream",
    ),
]

NOOPS = [
    pytest.param(
        """\
import torch
from concurrent.futures import ThreadPoolExecutor

class DocumentPackingLoader:
    def __init__(self, h, device):
        self.device = device
        self.tokens, self.cursor = torch.arange(10_000), 0
        self.pool = ThreadPoolExecutor(1)
        self.ahead = None

    def _prepare(self, n):
        chunk = self.tokens[self.cursor : self.cursor + n + 1]
        self.cursor += n
        starts = (chunk[:-1] == 1).nonzero().flatten().to(torch.int32)
        return chunk[:-1], chunk[1:], starts

    def next_batch(self, global_tokens, grad_accum_steps):
        n = global_tokens // grad_accum_steps
        x, y, cu_seqlens = self.ahead.result() if self.ahead is not None else self._prepare(n)
        self.ahead = self.pool.submit(self._prepare, n)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True), cu_seqlens.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = DocumentPackingLoader(h, device)
    for step in range(10):
        x, y, cu_seqlens = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        "DocumentPackingLoader already prefetches (threads in the loader); not wrapped again",
        4,
        id="already-prefetches-on-a-thread-pool",
    ),
    pytest.param(
        """\
import torch

class DocumentPackingLoader:
    def __init__(self, h, device):
        self.device = device
        self.tokens, self.cursor = torch.arange(10_000), 0

    def next_batch(self, global_tokens, grad_accum_steps):
        n = global_tokens // grad_accum_steps
        chunk = self.tokens[self.cursor : self.cursor + n + 1]
        self.cursor += n
        cu_seqlens = (chunk[:-1] == 1).nonzero().flatten().to(torch.int32)
        return chunk[:-1].to(self.device, non_blocking=True), chunk[1:].to(self.device, non_blocking=True), cu_seqlens.to(self.device, non_blocking=True)

def main(h, device):
    train_loader = DocumentPackingLoader(h, device)
    for step in range(10):
        x, y, cu_seqlens = train_loader.next_batch(h.train_batch_tokens, h.grad_accum_steps)
""",
        "DocumentPackingLoader already prefetches (threads in the loader); not wrapped again",
        3,
        id="prefetches-by-design-threads-seen-or-not",
    ),
]


@pytest.mark.parametrize("before, after, reason", REWRITES)
def test_rewrites_leave_the_loader_and_route_its_copies(before, after, reason):
    result = assert_patch(before, after, only=["train_prefetch", "copy_stream"])
    assert result.applied == ["copy_stream", "env_toggles"]
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [reason]
    assert list(result.verdicts.families.values()) == ["document_packing"]


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert list(result.verdicts.families.values()) == ["document_packing"]
