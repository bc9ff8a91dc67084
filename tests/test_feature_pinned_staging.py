"""Feature `pinned_staging` (patcher/transforms/pinned_staging.py, templates/pinned_staging.py).

A data generator whose threads load only shards (modded-nanogpt's 2026
`distributed_data_generator`) is not run ahead; its own `.to(device, non_blocking=True)`
copies go through pinned memory on the copy stream. The template as plain
Python on CPU (pass-through) and on the CUDA path driven with host memory (a pinned
copy of each tensor, dtypes), the rewrite as a before -> after table, and
verify on the fixture across two stage changes, catching a pinned buffer reused too early.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from patch_tables import RUNTIME, assert_noop, assert_patch

import patcher.templates.pinned_staging as staging
from patcher.patch import patch_source
from patcher.proof.host_cuda import cuda_on_host
from patcher.proof.verify import verify
from patcher.read.source import read_script, render

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
STAGE_SENDS = ["(STAGES[1].batch_size, STAGES[1].max_seq_len, grad_accum_steps)", "(STAGES[2].batch_size, STAGES[2].max_seq_len, grad_accum_steps)"]


def test_without_cuda_it_is_the_original_call():
    # CPU only (no CUDA): the value comes back as `.to(..., non_blocking=True)` gives it,
    # and what has no `.to()` (a tuple of tensors) fails as the original call does.
    t = torch.arange(10, dtype=torch.int32)
    assert staging._pinned_h2d(t, "cpu") is t  # .to() of a tensor already there is the tensor itself
    assert staging._pinned_h2d(t, device="cpu") is t
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'to'"):
        staging._pinned_h2d((t, np.arange(3)), "cpu")


def test_staging_off_is_the_original_call_on_cuda():
    # The original call copies from pageable memory: it reads its source at the call, so
    # nothing is left in flight (a staged copy, from pinned memory, would be).
    from patcher.proof.host_cuda import active_copies

    with cuda_on_host():
        t = torch.arange(6)
        out = staging._pinned_h2d(t, "cuda", staging=False)
        assert not active_copies().pending and torch.equal(out, t) and out.data_ptr() != t.data_ptr()
        staged = staging._pinned_h2d(t, "cuda")
        assert len(active_copies().pending) == 1 and torch.equal(staged, t)


def test_each_tensor_is_copied_to_pinned_memory_before_its_copy():
    # The stand-in's H2D keeps viewing its source (the worst case of a copy in flight):
    # the source rewritten right after the call must not change what was handed out.
    with cuda_on_host():
        sources = [torch.full((4,), i, dtype=torch.int32) for i in range(3)]
        outs = [staging._pinned_h2d(t, "cuda") for t in sources]
    for t in sources:
        t.fill_(-1)
    assert [o.tolist() for o in outs] == [[i] * 4 for i in range(3)]


def test_a_tensor_pinned_already_is_copied_too():
    # A loader may rewrite the pinned buffer it hands out; `pin_memory()` returns a pinned
    # tensor itself, as torch does (the stand-in's own `pin_memory` copies). Set inside
    # the stand-in, which restores both methods as it leaves.
    with cuda_on_host():
        t = torch.arange(5)
        torch.Tensor.is_pinned = lambda self: True
        torch.Tensor.pin_memory = lambda self: self
        out = staging._pinned_h2d(t, "cuda")
    assert out.data_ptr() != t.data_ptr() and out.tolist() == list(range(5))


def test_every_tensor_keeps_its_dtype_and_shape():
    with cuda_on_host():
        a, b = torch.arange(5), (torch.arange(12, dtype=torch.int16).view(3, 4).t())  # b: not contiguous
        out_a, out_b = staging._pinned_h2d(a, "cuda"), staging._pinned_h2d(b, device="cuda")
    assert out_a.tolist() == a.tolist() and torch.equal(out_b, b) and out_b.dtype == torch.int16 and out_b.data_ptr() != b.data_ptr()


STAGED_GENERATOR = """\
import threading
import torch

def batches(pattern, num_tokens):
    next_shard = threading.Thread(target=print)
    next_shard.start()
    tokens = torch.arange(100_000)
    while True:
        buf = tokens[:num_tokens]
        new = yield buf.to(device="cuda", non_blocking=True), buf.to(device="cuda", dtype=torch.int64, non_blocking=True), buf.numpy()
        if new is not None:
            num_tokens = new

train_loader = batches("x", 512)
for step in range(10):
    x, y, n = train_loader.send(1024 if step == 5 else None)
"""


STAGED_AFTER = """\
import threading
import torch
import os
TRAIN_COPY_STREAM = int(os.environ.get("TRAIN_COPY_STREAM", 1))
TRAIN_PINNED_STAGING = int(os.environ.get("TRAIN_PINNED_STAGING", 1))
#<runtime>

def batches(pattern, num_tokens):
    next_shard = threading.Thread(target=print)
    next_shard.start()
    tokens = torch.arange(100_000)
    while True:
        buf = tokens[:num_tokens]
        new = yield _pinned_h2d(buf, device="cuda", staging=TRAIN_PINNED_STAGING, copy_stream=TRAIN_COPY_STREAM), buf.to(device="cuda", dtype=torch.int64, non_blocking=True), buf.numpy()
        if new is not None:
            num_tokens = new

train_loader = batches("x", 512)
for step in range(10):
    x, y, n = train_loader.send(1024 if step == 5 else None)
"""


def test_rewrite_of_a_staged_generator():
    # The plain H2D copy is staged; the one that also casts is not a plain copy and stays.
    assert RUNTIME in STAGED_AFTER
    result = assert_patch(STAGED_GENERATOR, STAGED_AFTER, only=["pinned_staging", "copy_stream"])
    notes = [(n.feature, n.applied, n.line) for n in result.notes if n.feature in ("pinned_staging", "copy_stream")]
    assert notes == [("copy_stream", True, 14), ("pinned_staging", True, 4)]
    assert "def _pinned_h2d(" in result.runtime and "def _prefetch_iterator(" not in result.runtime


def test_default_patch_notes_why_it_is_not_run_ahead():
    result = assert_patch(STAGED_GENERATOR, STAGED_AFTER.replace("TRAIN_COPY_STREAM = int", "TRAIN_COPY_STREAM = int", 1))
    reasons = [(n.applied, n.reason, n.line) for n in result.notes if n.feature == "train_prefetch"]
    assert reasons == [(False, "`train_loader`: batches loads shards in the background (threading.Thread) and builds each batch on the caller's thread: "
                        "not run ahead (a fork would not copy its threads, a producer thread would take GIL time from the training loop); its H2D copies get pinned staging", 14)]
    compile(result.source, "out.py", "exec")


def test_no_staged_generator_is_a_noop():
    assert_noop(
        "import torch\n\ndef gen():\n    while True:\n        yield torch.zeros(2).to(device='cuda', non_blocking=True)\n\ntrain_loader = gen()\nx = next(train_loader)\n",
        "no data generator that builds its batches on the training thread while its threads load shards",
        None,
        only="pinned_staging",
    )


def patched_fixture(tmp_path: Path, breakage=None) -> tuple[Path, Path]:
    original = FIXTURES / "generator_shards.py"
    script = read_script(original)
    source = patch_source(script.source).source
    if breakage is not None:
        assert breakage[0] in source, "the runtime changed; update this test's breakage"
        source = source.replace(*breakage)
    out = tmp_path / "generator_shards_patched.py"
    out.write_text(render(script, source, rewrap=False))
    return original, out


def test_fixture_is_staged_not_run_ahead():
    result = patch_source((FIXTURES / "generator_shards.py").read_text())
    applied = {n.feature for n in result.notes if n.applied}
    assert {"pinned_staging", "copy_stream"} <= applied and "train_prefetch" not in applied
    assert result.source.count("_pinned_h2d(") == 5  # four call sites and the definition


def test_verify_identical_across_two_stage_changes(tmp_path):
    original, out = patched_fixture(tmp_path)
    result = verify(original, out, batches=24, world_size=2, sends=STAGE_SENDS)
    assert result.identical, result.difference
    assert result.staged and not result.prefetched
    assert result.batches_compared == 2 * 24
    assert any("of (1024, 64, 2), (768, 64, 2) (--send)" in n for n in result.notes)
    assert any("stage changes at item 8, 16 of 24" in n for n in result.notes)
    assert any("staged copies on the CUDA path" in n for n in result.notes)
    assert result.exercised[0] == "2 stage changes (given, None sent between)" and not result.skipped


def test_verify_without_flags_synthesizes_stage_changes_and_crosses_shards(tmp_path):
    # The fixture sends a loop variable's stage (not evaluable outside training): the
    # changes are made from the construction's (512, 32, 2) and the generator's
    # `num_tokens, max_seq_len, grad_accum_steps = new_args`, None sent in between.
    original, out = patched_fixture(tmp_path)
    result = verify(original, out, world_size=2)
    assert result.identical, result.difference
    assert any("of (1024, 64, 2), (1536, 64, 2)" in n and "None sent at the other items" in n for n in result.notes)
    assert result.exercised[0] == "2 stage changes (synthesized, None sent between)"
    crossed = int(result.exercised[1].split()[0])
    assert crossed >= 1 and result.exercised[1].endswith("shard boundaries (fewest of any rank)" if crossed > 1 else "shard boundary (fewest of any rank)")
    assert not result.skipped


def test_verify_without_flags_catches_a_generator_that_drops_the_sent_arguments(tmp_path):
    original, out = patched_fixture(tmp_path, ("            num_tokens, max_seq_len, grad_accum_steps = new_args\n", "            pass\n"))
    result = verify(original, out, world_size=2)
    assert not result.identical
    assert (result.difference.phase, result.difference.batch) == ("train", 64 // 3)


def test_verify_says_partial_where_no_boundary_is_crossed(tmp_path, capsys):
    # Shards far larger than the run reads: no boundary crossed, and the verdict says so.
    from patcher.cli import main

    original, out = patched_fixture(tmp_path)
    assert main(["verify", str(original), str(out), "--batches", "12", "--shard-tokens", "4000000"]) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("partial: 24 batches identical over 2 ranks, 2 stage changes (synthesized, None sent between); not exercised: shard boundaries (no rank crossed one with shards of 4000000 tokens)"), verdict


def test_verify_catches_a_buffer_reused_before_the_batch_is_done(tmp_path):
    # One pinned buffer per shape and dtype, kept on the function, instead of a block the
    # allocator hands out again only once its copy has finished: the next batch's copy
    # rewrites it while this batch's copy is still in flight (the host runs ahead).
    original, out = patched_fixture(tmp_path, ("torch.empty_like(tensor, pin_memory=True)", "_staged_h2d.__dict__.setdefault((tensor.shape, tensor.dtype), torch.empty_like(tensor, pin_memory=True))"))
    result = verify(original, out, batches=24, world_size=2, sends=STAGE_SENDS)
    assert not result.identical
    assert (result.difference.batch, result.difference.field) == (0, 0) and "bytes differ" in result.difference.what
    assert result.difference.configuration == "the staged copies on the CUDA path (host memory)"


def test_verify_catches_a_send_that_takes_effect_late(tmp_path):
    # A generator that drops the new stage's arguments: the batch after the change differs.
    original, out = patched_fixture(tmp_path, ("            num_tokens, max_seq_len, grad_accum_steps = new_args\n", "            pass\n"))
    result = verify(original, out, batches=24, world_size=2, sends=STAGE_SENDS)
    assert not result.identical
    assert result.difference.batch == 8


def test_a_loader_that_pins_its_batches_on_its_own_thread_is_not_staged_again():
    # parameter-golf's DocumentPackingLoader: batches prepared and pinned on its batch
    # thread, H2D from pinned memory routed by copy_stream. Noted, with the class's line.
    result = patch_source((FIXTURES / "document_packing.py").read_text())
    notes = [(n.applied, n.reason, n.line) for n in result.notes if n.feature == "pinned_staging"]
    assert notes == [(False, "DocumentPackingLoader pins each batch on its own thread (`.pin_memory()`: torch's caching host allocator reuses those blocks once their copies finish) "
                      "and its H2D copies, from that pinned memory, are copy_stream's: no pageable copy left to stage", 30)]
    assert "_pinned_h2d" not in result.source


def test_verify_leaves_no_shard_thread_reading_its_removed_directory(tmp_path, monkeypatch):
    # The generator's own shard threads (`DocShard.load_async`) are joined before the
    # synthetic shards are removed: none is left running, none fails on a missing file.
    import threading

    failures = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_type.__name__))
    original, out = patched_fixture(tmp_path)
    before = set(threading.enumerate())
    result = verify(original, out, batches=12, world_size=2)
    assert result.identical, result.difference
    assert [t.name for t in threading.enumerate() if t not in before and not t.daemon] == []
    assert failures == []
