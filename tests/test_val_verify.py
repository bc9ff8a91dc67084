"""verify compares the evaluation loop's (x, y) batches too, and catches a broken validation prefetch."""

from __future__ import annotations

import pytest

from test_verify import patched

from patcher.proof.verify import verify


@pytest.mark.parametrize("name", ["tokenstream_readable", "shuffled_minified", "wrapped_lzma_oneline"])
def test_validation_batches_identical(tmp_path, name):
    original, out = patched(tmp_path, name)
    result = verify(original, out, batches=8, world_size=2)
    assert result.identical, result.difference
    assert result.val_batches_compared >= 8
    assert any("validation loop of eval_val" in note for note in result.notes)


SHIFTED_SLICE = ("            return val_tokens[raw_start:raw_end]\n", "            return val_tokens[raw_start + 1:raw_end + 1]\n")
# The runtime hands batch k+1 out as batch k from the third batch on.
SKIPPED_BATCH = (
    "        if pending:\n            yield _val_take(*pending, to_kwargs.get(\"dtype\"))\n        pending = built\n",
    "        if pending:\n"
    "            _val_take.handed = getattr(_val_take, 'handed', 0) + 1\n"
    "            yield _val_take(*(built if _val_take.handed == 3 else pending), to_kwargs.get(\"dtype\"))\n"
    "        pending = built\n",
)


@pytest.mark.parametrize("breakage, batch", [pytest.param(SHIFTED_SLICE, 0, id="shifted-slice"), pytest.param(SKIPPED_BATCH, 2, id="batch-handed-out-early")])
def test_broken_validation_prefetch_is_caught(tmp_path, breakage, batch):
    original, out = patched(tmp_path, "tokenstream_readable", breakage)
    result = verify(original, out, batches=8, world_size=2)
    assert not result.identical
    d = result.difference
    assert (d.rank, d.phase, d.batch) == (0, "val:eval_val", batch)
