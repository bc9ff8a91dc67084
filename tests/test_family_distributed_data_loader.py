"""Family `distributed_data_loader` (patcher/families/distributed_data_loader.py):
recognition, train_prefetch's before -> after and noop tables, whole outputs (runtime
block as `RUNTIME`), and the fixture verified.

The older modded-nanogpt `DistributedDataLoader` takes no device and moves its batch
to the GPU itself: its own `next_batch()` runs ahead on a thread
(`_prefetch_next_batch`), with constant arguments only.
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
    verdicts = judge(cst.parse_module((FIXTURES / "distributed_data_loader.py").read_text(encoding="utf-8")))
    assert dict(verdicts.families) == {"DistributedDataLoader": "distributed_data_loader"}


REWRITES = [
    pytest.param(
        """\
import os
import torch

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = DistributedDataLoader("x", B, T, ddp_rank, 1)
for step in range(10):
    x, y = train_loader.next_batch()
""",
        """\
import os
import torch
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = _prefetch_next_batch(lambda: DistributedDataLoader("x", B, T, ddp_rank, 1), prefetch=TRAIN_PREFETCH, copy_stream=False)
for step in range(10):
    x, y = train_loader.next_batch()
""",
        "`train_loader` built at line 16: next_batch() runs ahead on a background thread, its own .cuda() copies on the copy stream",
        id="next-batch-runs-ahead-on-a-thread",
    ),
]

WITH_THE_COPY_STREAM = [
    pytest.param(
        """\
import os
import torch

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = DistributedDataLoader("x", B, T, ddp_rank, 1)
for step in range(10):
    x, y = train_loader.next_batch()
""",
        """\
import os
import torch
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))
"""
        + RUNTIME
        + """\

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = _prefetch_next_batch(lambda: DistributedDataLoader("x", B, T, ddp_rank, 1), prefetch=TRAIN_PREFETCH, copy_stream=TRAIN_COPY_STREAM)
for step in range(10):
    x, y = train_loader.next_batch()
""",
        "`train_loader` built at line 16: next_batch() runs ahead on a background thread, its own .cuda() copies on the copy stream",
        id="with-the-copy-stream-its-cuda-copies-on-it",
    ),
]

NOOPS = [
    pytest.param(
        """\
import os
import torch

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self, rows=4):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = DistributedDataLoader("x", B, T, ddp_rank, 1)
for step in range(10):
    x, y = train_loader.next_batch(step)
""",
        "next_batch gets per-step argument `step` and moves batches to the GPU itself; only constant arguments run ahead",
        18,
        id="per-step-argument",
    ),
    pytest.param(
        """\
import os
import torch

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T * int(torch.randint(1, 3, ()))
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = DistributedDataLoader("x", B, T, ddp_rank, 1)
for step in range(10):
    x, y = train_loader.next_batch()
""",
        "loader draws from the global torch RNG (torch.randint); a background thread would change the draw order",
        4,
        id="global-torch-rng",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="train_prefetch")
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert list(result.verdicts.families.values()) == ["distributed_data_loader"]


@pytest.mark.parametrize("before, after, note", WITH_THE_COPY_STREAM)
def test_rewrites_with_the_copy_stream(before, after, note):
    result = assert_patch(before, after, only=["train_prefetch", "copy_stream"])
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert [(n.applied, n.reason) for n in result.notes if n.feature == "copy_stream"] == [
        (True, "DistributedDataLoader.next_batch moves its batch to the GPU itself: those copies run on the copy stream, on the prefetch thread")
    ]


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert list(result.verdicts.families.values()) == ["distributed_data_loader"]


def test_runtime_constants_bring_their_own_import_when_the_script_imports_os_late():
    # `import os` comes after the first class: the runtime's constants need their own.
    source = (
        "class SOAP:\n    pass\n\n"
        + REWRITES[0].values[0]
    )
    result = patch_source(source)
    assert result.applied[:2] == ["train_prefetch", "copy_stream"]
    head = result.source.split("TRAIN_PREFETCH = ", 1)[0]
    assert "import os" in head
    exec(compile(result.source.split("train_loader = ", 1)[0], "out.py", "exec"), {})  # runs: no NameError


def test_fixture_patched_gives_the_original_batches(tmp_path):
    patched = tmp_path / "patched.py"
    patched.write_text(patch_source((FIXTURES / "distributed_data_loader.py").read_text(encoding="utf-8")).source)
    assert "train_loader = _prefetch_next_batch(lambda: DistributedDataLoader(args.input_bin, B, T, ddp_rank, ddp_world_size), prefetch=" in patched.read_text()
    result = verify(FIXTURES / "distributed_data_loader.py", patched, batches=16)
    assert result.identical, result.difference
