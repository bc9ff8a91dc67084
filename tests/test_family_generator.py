"""Family `generator` (patcher/families/generator.py): recognition, the survey of its
sites, and train_prefetch's before -> after and noop tables, whole outputs (runtime
block as `RUNTIME`).

A data generator `train_loader = gen(...)` advanced with `next()` or `.send()` runs
ahead on a thread (`_prefetch_iterator`); the survey refuses, with the reason, a site
used beyond that, never advanced, or a generator that already loads in the
background, draws from a global RNG or calls a collective.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.patch import patch_source
from patcher.families.registry import judge

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_fixture_generator_is_recognised():
    verdicts = judge(cst.parse_module((FIXTURES / "generator_toplevel.py").read_text(encoding="utf-8")))
    assert [(i.target, i.function, i.family, i.training, i.reason) for i in verdicts.iterators] == [
        ("train_loader", "distributed_data_generator", "generator", True, None),
        ("val_loader", "distributed_data_generator", "generator", False, "`val_loader` is not the training data source"),
    ]


REWRITES = [
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(train_loader)
""",
        """\
import torch
import torch.distributed as dist
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = _prefetch_iterator(lambda: data_generator("x", 512, 64), prefetch=TRAIN_PREFETCH, copy_stream=False)
for step in range(10):
    x, y = next(train_loader)
""",
        "`train_loader` (generator data_generator) built at line 13 runs ahead on a background thread",
        id="advanced-with-next",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = train_loader.send((1024, 64) if step == 5 else None)
""",
        """\
import torch
import torch.distributed as dist
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = _prefetch_iterator(lambda: data_generator("x", 512, 64), prefetch=TRAIN_PREFETCH, copy_stream=False)
for step in range(10):
    x, y = train_loader.send((1024, 64) if step == 5 else None)
""",
        "`train_loader` (generator data_generator) built at line 13 runs ahead on a background thread",
        id="advanced-with-send-of-new-sizes",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(train_loader)
val_loader = data_generator('v', 512, 64)
xv, yv = next(val_loader)
""",
        """\
import torch
import torch.distributed as dist
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = _prefetch_iterator(lambda: data_generator("x", 512, 64), prefetch=TRAIN_PREFETCH, copy_stream=False)
for step in range(10):
    x, y = next(train_loader)
val_loader = data_generator('v', 512, 64)
xv, yv = next(val_loader)
""",
        "`train_loader` (generator data_generator) built at line 13 runs ahead on a background thread",
        id="validation-generator-beside-it-left-alone",
    ),
]

NOOPS = [
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = train_loader.throw(ValueError)
""",
        "`train_loader` is used as `train_loader.throw`, not only with next()",
        13,
        id="used-beyond-next",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        noise = torch.randint(0, 9, (1,))
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(train_loader)
""",
        "data_generator draws from the global torch RNG (torch.randint); a background thread would change the draw order",
        13,
        id="global-torch-rng",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        dist.all_reduce(buf)
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(train_loader)
""",
        "data_generator calls dist.all_reduce (a collective); it must stay on the training thread",
        13,
        id="collective",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = 0, 0
""",
        "`train_loader` is never advanced with next()",
        13,
        id="never-advanced",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        batches = shard.load_async()
        batch = batches.get()
        new = yield batch
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(train_loader)
""",
        "data_generator already loads data in the background (shard.load_async); not wrapped again",
        14,
        id="yields-what-its-threads-built",
    ),
    pytest.param(
        """\
import threading
import torch

def data_generator(pattern, num_tokens, seq_len):
    tokens = torch.arange(100_000)
    while True:
        worker = threading.Thread(target=print)
        worker.start()
        yield from tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x = next(train_loader)
""",
        "data_generator already loads data in the background (threading.Thread); not wrapped again",
        11,
        id="yields-from-what-its-threads-built",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        shard.load_async()
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(train_loader)
""",
        "`train_loader`: data_generator loads shards in the background (shard.load_async) and builds each batch on the caller's thread: "
        "not run ahead (a fork would not copy its threads, a producer thread would take GIL time from the training loop); its H2D copies get pinned staging",
        13,
        id="threads-load-only-shards",
    ),
    pytest.param(
        """\
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        pass
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

val_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = next(val_loader)
""",
        "`val_loader` is not the training data source",
        13,
        id="validation-generator-only",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="train_prefetch")
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert {i.family for i in result.verdicts.iterators} == {"generator"}


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert {i.family for i in result.verdicts.iterators} == {"generator"}


def test_sends_are_surveyed():
    source = REWRITES[1].values[0]
    sites = [i for i in judge(cst.parse_module(source)).iterators if i.training]
    assert [cst.Module([]).code_for_node(c.args[0].value) for c in sites[0].sends] == ["(1024, 64) if step == 5 else None"]


def test_its_own_copies_are_noted_on_the_copy_stream():
    result = patch_source(REWRITES[0].values[0])
    copy_notes = [(n.applied, n.reason) for n in result.notes if n.feature == "copy_stream"]
    assert copy_notes == [(True, "`train_loader` (generator data_generator): its own H2D copies run on the copy stream, on the prefetch thread")]
    assert "def _prefetch_iterator(" in result.source and "def data_generator(" in result.source
    compile(result.source, "out.py", "exec")
