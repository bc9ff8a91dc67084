"""The producer of ShuffledSequenceLoader batches.

- `templates/prefetch_loader.py` (the thread runtime, where a script needs it): the
  prefetched batches are the original's, and reading the loader's own state settles it
  where the caller is (its RNG and start lists replayed by the script's `next_batch`).
- The patch: the forked producer (templates/prefetch_lean.py) runs the script's own
  `next_batch` in a child, with or without `--producer-toggles`, which add only the
  depth toggle `TRAIN_PREFETCH_QUEUE`.
- verify: identical on the fixture with the producer toggles, at two depths.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import numpy as np
import pytest

from patcher.patch import patch_source
from patcher.proof.harness import load_module, unload
from patcher.proof.shards import write_shard
from patcher.proof.verify import verify
from patcher.read.source import read_script, render
from patcher.templates.prefetch_loader import _make_train_loader
import test_templates
from test_templates import CPU, assert_batch_equal, direct_batches, prefetch_threads

clean_prefetchers = test_templates.clean_prefetchers  # the same autouse fixture here

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FIXTURE = FIXTURES / "shuffled_minified.py"


@pytest.fixture(scope="module")
def script():
    """The fixture's definitions (ShuffledSequenceLoader, _get_shard_memmap) as a module,
    unloaded after this file's tests (its memmap cache holds every test's shards open)."""
    module = load_module(FIXTURE.read_text(), str(FIXTURE))
    yield module
    unload(module)


def hparams(pattern, seq_len, rank=0, world_size=1):
    return types.SimpleNamespace(train_files=pattern, train_seq_len=seq_len, rank=rank, world_size=world_size)


def write_sized_shards(directory, sizes, seed):
    rng = np.random.default_rng(seed)
    for index, size in enumerate(sizes):
        write_shard(os.path.join(directory, f"fineweb_train_{index:06d}.bin"), rng.integers(0, 65536, size=size))
    return os.path.join(directory, "fineweb_train_*.bin")


# ---------------------------------------------------------------------------
# Through the thread runtime: batches and RNG state after k batches
# ---------------------------------------------------------------------------


def test_prefetched_shuffled_batches_and_rng_state(script, tmp_path):
    h = hparams(write_sized_shards(tmp_path, [700, 450, 300], 4), 16)
    make = lambda d: script.ShuffledSequenceLoader(h, d)
    want, direct = direct_batches(make, [(16 * 6, 1)] * 25)
    wrapper = _make_train_loader(make, CPU, queue_depth=2, host_copy=False, attrs=True, replay=True)
    for w in want:
        assert_batch_equal(wrapper.next_batch(16 * 6, 1), w)
    assert len(prefetch_threads()) == 1
    # Reading the loader's own state settles it where the caller is (a replay of next_batch).
    assert wrapper.rng.bit_generator.state == direct.rng.bit_generator.state
    assert wrapper.start_inds == direct.start_inds
    assert not prefetch_threads()


# ---------------------------------------------------------------------------
# The patch: the forked producer, with or without the producer toggles
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("producer_toggles", [False, True], ids=["default", "producer-toggles"])
def test_the_loader_runs_in_a_forked_child_with_or_without_producer_toggles(producer_toggles):
    # Every byte counts against the artifact cap: the depth toggle comes with
    # --producer-toggles only. Either way the patch gets the lean runtime, whose forked
    # child runs the script's own next_batch.
    result = patch_source(FIXTURE.read_text(), producer_toggles=producer_toggles)
    sites = [line for line in result.source.splitlines() if "_make_train_loader(lambda" in line]
    depth = "queue_depth=Hyperparameters.train_prefetch_queue," if producer_toggles else ""
    assert len(sites) == 2 and all(line.endswith(f"{depth}copy_stream=Hyperparameters.train_copy_stream)") for line in sites)
    assert "def _produce(" in result.source
    assert ("train_prefetch_queue" in result.source) == producer_toggles
    for absent in ("def _stage(", "_SettlingLoader", "host_copy", "class _Worker"):
        assert absent not in result.source, absent
    note = next(n for n in result.notes if n.feature == "train_prefetch")
    assert "child process forked once, at the first batch" in note.reason and "TRAIN_PREFETCH" not in note.reason


# ---------------------------------------------------------------------------
# End to end: verify
# ---------------------------------------------------------------------------


def write_patched(tmp_path):
    script = read_script(FIXTURE)
    out = tmp_path / "shuffled_patched.py"
    out.write_text(render(script, patch_source(script.source, producer_toggles=True).source, rewrap=False))
    return out


@pytest.mark.parametrize("depth, shard_tokens", [(1, None), (4, 300)])
def test_verify_identical_with_the_producer_toggles(tmp_path, monkeypatch, depth, shard_tokens):
    # shard_tokens=300: small shards, so that the loader reshuffles within the run.
    monkeypatch.setenv("TRAIN_PREFETCH_QUEUE", str(depth))
    result = verify(FIXTURE, write_patched(tmp_path), batches=24, world_size=2, shard_tokens=shard_tokens)
    assert result.identical, result.difference
    assert f"TRAIN_PREFETCH_QUEUE={depth}" in " ".join(result.notes)
