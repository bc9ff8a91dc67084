"""Tests for the validation runtime: templates/prefetch_val.py, val_bytecount.py, val_progress.py.

Every expectation is the script's own code run directly: `slice.to(**kwargs)` per batch
start for `_val_prefetch`, the three byte-counting statements for `_val_byte_count`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from patcher.templates.prefetch_val import _val_prefetch
from patcher.templates.val_bytecount import _host_luts, _val_byte_count
from patcher.templates.val_progress import _val_progress

SEQ_LEN = 16


def _tokens(n=16 * 40 + 1, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32).to(torch.uint16)


def _slicer(tokens, batch_seqs, seq_end):
    def make_slice(start):
        end = min(start + batch_seqs, seq_end)
        return tokens[start * SEQ_LEN : end * SEQ_LEN + 1]

    return make_slice


def _expected(tokens, starts, make_slice, kwargs):
    return [(s, make_slice(s).to(**kwargs)) for s in starts]


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("copy_stream", [True, False])
@pytest.mark.parametrize("batch_seqs", [1, 3, 7, 40])
def test_batches_match_the_scripts_own_slices(prefetch, copy_stream, batch_seqs):
    tokens = _tokens()
    starts = range(2, 40, batch_seqs)
    make_slice = _slicer(tokens, batch_seqs, 40)
    kwargs = dict(device=torch.device("cpu"), dtype=torch.int64, non_blocking=True)
    got = list(_val_prefetch(starts, make_slice, kwargs, prefetch=prefetch, copy_stream=copy_stream))
    want = _expected(tokens, starts, make_slice, kwargs)
    assert [s for s, _ in got] == [s for s, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b)


def test_each_slice_is_built_one_batch_ahead():
    # Batch k+1's slice (and, on CUDA, its H2D) is started before batch k is handed out.
    events = []
    make_slice = _slicer(_tokens(), 4, 40)

    def recording(start):
        events.append(f"slice {start}")
        return make_slice(start)

    for start, _batch in _val_prefetch(range(0, 16, 4), recording, {"device": "cpu", "dtype": torch.int64}):
        events.append(f"run {start}")
    assert events == ["slice 0", "slice 4", "run 0", "slice 8", "run 4", "slice 12", "run 8", "run 12"]
    events.clear()
    for start, _batch in _val_prefetch(range(0, 16, 4), recording, {"device": "cpu"}, prefetch=False):
        events.append(f"run {start}")
    assert events == ["slice 0", "run 0", "slice 4", "run 4", "slice 8", "run 8", "slice 12", "run 12"]


def test_no_thread_is_started():
    # A worker thread would take the GIL from the loop that launches the model's kernels.
    before = threading.active_count()
    batches = iter(_val_prefetch(range(0, 40, 1), _slicer(_tokens(), 1, 40), {"device": "cpu"}))
    next(batches)
    assert threading.active_count() == before
    batches.close()  # what a `break` does to the loop's generator


@pytest.mark.parametrize("fail_at", [0, 3])
def test_slice_exception_reaches_the_loop_at_its_batch(fail_at):
    make_slice = _slicer(_tokens(), 2, 40)

    def failing(start):
        if start == fail_at * 2:
            raise ValueError("bad slice")
        return make_slice(start)

    seen = []
    with pytest.raises(ValueError, match="bad slice"):
        for start, _batch in _val_prefetch(range(0, 40, 2), failing, {"device": "cpu"}):
            seen.append(start)
    # Every batch before the failing one ran, as in the original loop.
    assert seen == list(range(0, fail_at * 2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("copy_stream", [True, False])
def test_cuda_batches_match_after_the_copy(copy_stream):
    tokens = _tokens(16 * 200 + 1)
    starts = range(0, 200, 9)
    make_slice = _slicer(tokens, 9, 200)
    kwargs = dict(device=torch.device("cuda"), dtype=torch.int64, non_blocking=True)
    want = _expected(tokens, starts, make_slice, kwargs)
    got = []
    for start, batch in _val_prefetch(starts, make_slice, kwargs, copy_stream=copy_stream):
        got.append((start, (batch * 1).cpu()))  # consumed on the compute stream, like the loop
    torch.cuda.synchronize()
    for (s, a), (t, b) in zip(got, want):
        assert s == t and a.dtype == b.dtype and torch.equal(a, b.cpu())


# ---------------------------------------------------------------------------
# byte counting
# ---------------------------------------------------------------------------


def _luts(vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 17, (vocab,), generator=g, dtype=torch.int16)
    space = torch.rand(vocab, generator=g) < 0.4
    boundary = torch.rand(vocab, generator=g) < 0.1
    return base, space, boundary


def _script_count(local, base, space, boundary):
    """The script's own three statements, on whatever device the tensors are."""
    x, y = local[:-1].reshape(-1, SEQ_LEN), local[1:].reshape(-1, SEQ_LEN)
    prev_ids, tgt_ids = x.reshape(-1), y.reshape(-1)
    token_bytes = base[tgt_ids].to(dtype=torch.int16)
    token_bytes += (space[tgt_ids] & ~boundary[prev_ids]).to(dtype=torch.int16)
    return token_bytes.to(torch.float64).sum()


@pytest.mark.parametrize("seed", range(5))
def test_byte_count_equals_the_scripts_float64_sum(seed):
    tokens = _tokens(16 * 64 + 1, vocab=300, seed=seed)
    luts = _luts(300, seed)
    got = _val_byte_count(tokens, *luts)
    want = _script_count(tokens.to(torch.int64), *luts)
    assert isinstance(got, int)
    accumulator = torch.zeros((), dtype=torch.float64)
    accumulator += got
    assert accumulator.item() == want.item() and got > 0


def test_byte_count_respects_each_table():
    tokens = torch.tensor([5, 6, 7], dtype=torch.uint16)  # targets 6, 7; previous 5, 6
    base = torch.zeros(8, dtype=torch.int16)
    base[6], base[7] = 3, 4
    space = torch.zeros(8, dtype=torch.bool)
    boundary = torch.zeros(8, dtype=torch.bool)
    assert _val_byte_count(tokens, base, space, boundary) == 7
    space[7] = True
    assert _val_byte_count(tokens, base, space, boundary) == 8
    boundary[6] = True  # a space after a boundary token is not counted
    assert _val_byte_count(tokens, base, space, boundary) == 7


def test_host_tables_are_copied_once_per_table():
    luts = _luts(50)
    _host_luts.clear()
    tokens = _tokens(33, vocab=50)
    _val_byte_count(tokens, *luts)
    copies = {k: v[1] for k, v in _host_luts.items()}
    _val_byte_count(tokens, *luts)
    assert len(copies) == 3 and all(_host_luts[k][1] is v for k, v in copies.items())


def test_byte_count_index_error_like_the_script():
    with pytest.raises(IndexError):
        _val_byte_count(torch.tensor([1, 60]), *_luts(50))


# ---------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("every, total, logged", [(0, 7, []), (3, 7, [3, 6, 7]), (1, 3, [1, 2, 3]), (4, 8, [4, 8]), (10, 3, [3])])
def test_progress_lines_and_items(every, total, logged):
    lines = []
    items = list(_val_progress(range(total), lines.append, every, "eval_val"))
    assert items == list(range(total))
    assert [int(line.split()[1].split(":")[1].split("/")[0]) for line in lines] == logged
    assert all(line.startswith("eval_val batch:") and f"/{total} elapsed_ms:" in line for line in lines)


def test_progress_logs_after_the_batch_ran():
    events = []

    def body():
        for item in _val_progress(range(4), lambda line: events.append(line.split()[1]), 2):
            events.append(f"run {item}")

    body()
    assert events == ["run 0", "run 1", "batch:2/4", "run 2", "run 3", "batch:4/4"]


def test_progress_total_of_prefetched_batches():
    lines = []
    batches = _val_prefetch(range(0, 12, 3), _slicer(_tokens(), 3, 12), {"device": "cpu"})
    assert len(list(_val_progress(batches, lines.append, 2, total=len(range(0, 12, 3))))) == 4
    assert [line.split()[1] for line in lines] == ["batch:2/4", "batch:4/4"]
    lines.clear()
    batches = _val_prefetch(range(0, 12, 3), _slicer(_tokens(), 3, 12), {"device": "cpu"})
    assert len(list(_val_progress(batches, lines.append, 2))) == 4
    assert [line.split()[1] for line in lines] == ["batch:2/?", "batch:4/?"]  # a generator has no len()
