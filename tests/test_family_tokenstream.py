"""Family `tokenstream` (patcher/families/tokenstream.py): recognition, and train_prefetch's
before -> after and noop tables, whole outputs (runtime block as `RUNTIME`).

A `DistributedTokenLoader` built on a `TokenStream` is rebuilt on the CPU by
`_make_train_loader`: the forked producer for run-constant arguments, the thread runtime
for a `seq_len` curriculum (reshaped at hand-out), a batch-size schedule (rollback) or
attribute reads. What the rewritten scripts do (same batches, rollback, wrap-around) is
tested in test_templates.py, test_verify.py and the end-to-end runs.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.families.registry import data_sources, judge
from patcher.patch import patch_source

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("fixture", ["tokenstream_readable.py", "tokenstream_validating.py", "curriculum.py", "batch_switch.py"])
def test_fixture_loader_is_recognised(fixture):
    verdicts = judge(cst.parse_module((FIXTURES / fixture).read_text(encoding="utf-8")))
    assert dict(verdicts.families) == {"DistributedTokenLoader": "tokenstream"}


REWRITES = [
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "`train_loader` built at line 23 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="run-constant-arguments-forked-producer",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = train_loader.next_batch(512, 64, 1)
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False)
    x, y = train_loader.next_batch(512, 64, 1)
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "`train_loader` built at line 23, 25 prefetches; a child process forked once, at the first batch, builds the batches; the rebuild at line 25 resets it, without another fork (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="rebuilt-after-warmup-both-constructions-rewritten",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    B, T = 512, 64
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(B, T, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    B, T = 512, 64
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False)
    for step in range(10):
        x, y = train_loader.next_batch(B, T, 1)
""",
        "`train_loader` built at line 24 prefetches; a child process forked once, at the first batch, builds the batches (a thread of this process instead where threads other than torch's own run at the first batch)",
        id="parallel-assignment-names-are-run-constants",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False, reshape_arg=1, host_copy=False)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
""",
        "`train_loader` built at line 23 prefetches; a thread of this process builds the batches (the thread runtime: next_batch's `seq_len` changes during the run, applied at hand-out)",
        id="seq-len-curriculum-reshaped-at-hand-out",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    batch_tokens = 512
    for step in range(10):
        batch_tokens = batch_tokens * 2
        x, y = train_loader.next_batch(batch_tokens, 64, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False, rollback=True, host_copy=False)
    batch_tokens = 512
    for step in range(10):
        batch_tokens = batch_tokens * 2
        x, y = train_loader.next_batch(batch_tokens, 64, 1)
""",
        "`train_loader` built at line 23 prefetches; a thread of this process builds the batches (the thread runtime: the snapshot rollback); per-step argument `batch_tokens`: batches queued with older values are dropped and the loader restored from a snapshot",
        id="batch-size-schedule-gets-rollback",
    ),
    pytest.param(
        """\
import torch

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0

    def take(self, n):
        self.pos += n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank = rank
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = train_loader.next_batch(512, 64, 1)
    print(train_loader.rank)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0

    def take(self, n):
        self.pos += n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank = rank
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False, host_copy=False, attrs=True, replay=True)
    x, y = train_loader.next_batch(512, 64, 1)
    print(train_loader.rank)
""",
        "`train_loader` built at line 24 prefetches; a thread of this process builds the batches (the thread runtime: the script uses `train_loader` beyond next_batch); reading train_loader.rank first replays the loader to the caller's position (exact, costs one pass)",
        id="attribute-read-settles-the-loader",
    ),
    pytest.param(
        """\
import torch

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
        self.last = torch.zeros(1, dtype=torch.int64)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        self.last.copy_(local[-1:])
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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
        self.last = torch.zeros(1, dtype=torch.int64)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        self.last.copy_(local[-1:])
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False, reshape_arg=1)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
""",
        "`train_loader` built at line 25 prefetches; a thread of this process builds the batches (the thread runtime: next_batch's `seq_len` changes during the run, applied at hand-out)",
        id="loader-writing-a-kept-array-keeps-the-host-copy",
    ),
    pytest.param(
        """\
import torch

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
        self.drawn: list = [[] for _ in range(2)]

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        self.drawn[0] = [1, 2]
        self.drawn[1][0] = 3
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
""",
        """\
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\

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
        self.drawn: list = [[] for _ in range(2)]

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        self.drawn[0] = [1, 2]
        self.drawn[1][0] = 3
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = _make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, prefetch=TRAIN_PREFETCH, copy_stream=False, reshape_arg=1, host_copy=False)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
""",
        "`train_loader` built at line 26 prefetches; a thread of this process builds the batches (the thread runtime: next_batch's `seq_len` changes during the run, applied at hand-out)",
        id="writes-into-a-list-attribute-are-not-array-writes",
    ),
]

NOOPS = [
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    calib_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = calib_loader.next_batch(512, 64, 1)
""",
        "`calib_loader` is not the training loader",
        11,
        id="calibration-loader-is-not-the-training-loader",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
""",
        "`train_loader` has no next_batch call where it is built",
        11,
        id="built-but-never-drawn",
    ),
    pytest.param(
        """\
import torch

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0
        torch.manual_seed(0)

    def take(self, n):
        self.pos += n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "loader draws from the global torch RNG (torch.manual_seed); a background thread would change the draw order",
        12,
        id="global-torch-rng",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        dist.barrier()
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "loader calls torch.distributed (dist.barrier) inside next_batch; it must stay on the main thread",
        11,
        id="collective-in-next-batch",
    ),
    pytest.param(
        """\
import torch

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

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        pad = torch.zeros(1, device=self.device)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "loader uses self.device beyond the final H2D copy (self.device); cannot build it on the CPU",
        11,
        id="device-used-beyond-the-copy",
    ),
    pytest.param(
        """\
import torch

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0
        self.seen = [0]

    def take(self, n):
        self.pos += n
        self.seen[0] = n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    batch_tokens = 512
    for step in range(10):
        batch_tokens = batch_tokens * 2
        x, y = train_loader.next_batch(batch_tokens, 64, 1)
""",
        "next_batch gets per-step argument `batch_tokens` and TokenStream assigns into self.seen[0], so queued batches cannot be rolled back cheaply",
        29,
        id="per-step-argument-on-a-loader-that-changes-a-list-in-place",
    ),
    pytest.param(
        """\
import torch

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0

    def take(self, n):
        self.pos += n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size):
        self.device = torch.device("cpu")
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "DistributedTokenLoader.__init__ takes no `device` parameter to build it on the CPU",
        11,
        id="init-takes-no-device",
    ),
    pytest.param(
        """\
import torch

class TokenStream:
    def __init__(self, pattern):
        self.tokens, self.pos = torch.arange(10_000), 0

    def take(self, n):
        self.pos += n
        return self.tokens[self.pos - n : self.pos]

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device=None):
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local = self.stream.take(global_tokens // grad_accum_steps + 1)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

def main(device):
    train_loader = DistributedTokenLoader("x", 0, 1)
    for step in range(10):
        x, y = train_loader.next_batch(512, 64, 1)
""",
        "`train_loader = DistributedTokenLoader(...)` passes no device argument",
        23,
        id="construction-passes-no-device",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="train_prefetch")
    assert [n.reason for n in result.notes if n.feature == "train_prefetch"] == [note]
    assert list(result.verdicts.families.values()) == ["tokenstream"]


@pytest.mark.parametrize("before, reason, line", NOOPS)
def test_noops(before, reason, line):
    result = assert_noop(before, reason, line, only="train_prefetch")
    assert list(result.verdicts.families.values()) == ["tokenstream"]


@pytest.mark.parametrize("fixture, runtime, options", [
    ("tokenstream_readable.py", "prefetch_lean", {"host_copy": False}),  # run constants: the forked producer
    ("curriculum.py", "prefetch_loader", {"reshape_arg": 1, "host_copy": False}),  # seq_len applied at hand-out
    ("batch_switch.py", "prefetch_loader", {"rollback": True, "host_copy": False}),  # a batch-size schedule
])
def test_the_plan_names_its_runtime_and_options_as_data(fixture, runtime, options):
    # What train_prefetch writes is the plan's: the thread runtime where an option needs
    # it; the forked runtime gets none of the plan's options (host_copy is the thread
    # runtime's alone).
    source = (FIXTURES / fixture).read_text(encoding="utf-8")
    [variable] = data_sources(judge(cst.parse_module(source)))
    assert (variable.plan.runtime, dict(variable.plan.options)) == (runtime, options)
    assert ("host_copy=False" in patch_source(source).source) == (runtime == "prefetch_loader")
