"""Family `bestfit_packing` (patcher/families/bestfit_packing.py): nanochat's data-loader
module patched as a module, recognised by structure; its before -> after table (whole
outputs, runtime block as `RUNTIME`) and noop table (the reason, exact), the rewrite of
the fixture, the inner reader's site, and `verify` on the fixture.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest
from patch_tables import RUNTIME, assert_noop, assert_patch

from patcher.families.bestfit_packing import loader_generators
from patcher.patch import patch_source
from patcher.families.registry import judge

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "bestfit_packing.py"
SOURCE = FIXTURE.read_text(encoding="utf-8")
SIGNATURE = 'def packed_loader_with_state(tokenizer, B, T, split, tokenizer_threads=2, tokenizer_batch_size=16, device="cuda", resume_state_dict=None, buffer_size=24):'


def test_fixture_is_recognised_by_structure():
    [loader] = loader_generators(cst.parse_module(SOURCE))
    assert (loader.name, loader.device, loader.refusal) == ("packed_loader_with_state", "device", None)
    assert loader.split == ("split", "train")  # from `assert split in ("train", "val")`
    # the inner reader's site belongs to the family, and is not run ahead on its own
    [site] = judge(cst.parse_module(SOURCE)).iterators
    assert (site.target, site.function, site.family, site.training) == ("batches", "_document_batches", "bestfit_packing", False)
    assert site.reason == "`batches` is read inside packed_loader_with_state, which runs whole in a spawned producer (module mode)"


def test_module_rewrite_keeps_the_original_and_the_signature():
    result = patch_source(SOURCE, enabled={"train_prefetch", "env_toggles"})
    out = result.source
    assert out.count(SIGNATURE) == 1  # the public function, same parameters
    assert "def _original_" + SIGNATURE[4:] in out  # the original, renamed only
    assert 'yield from _spawn_generator(_original_packed_loader_with_state, {"tokenizer": tokenizer, "B": B, "T": T, "split": split,' in out
    assert '"device", prefetch=TRAIN_PREFETCH, split_param=\'split\', train_split=\'train\', every_split=TRAIN_PREFETCH_EVERY_SPLIT)' in out
    assert 'TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))' in out
    assert 'TRAIN_PREFETCH_EVERY_SPLIT = int(os.environ.get("TRAIN_PREFETCH_EVERY_SPLIT", 0))' in out
    [note] = [n for n in result.notes if n.feature == "train_prefetch"]
    assert note.applied and "a build with `split` other than 'train' runs the original in the training process" in note.reason
    # everything else of the module is byte-identical
    body = SOURCE.split("def _document_batches", 1)[1]
    assert body.replace("def packed_loader_with_state(", "def _original_packed_loader_with_state(", 1).split("def packed_loader(*args")[0] in out
    assert "def _spawn_producer(" in out and "def _make_train_loader" not in out
    # the module imports no os: the toggle block imports it once, the runtime not again
    imported = [a.name.value for n in cst.parse_module(out).body if m.matches(n, m.SimpleStatementLine(body=[m.Import()])) for a in n.body[0].names if isinstance(a.name, cst.Name)]
    assert imported.count("os") == 1 and "mmap" in imported
    again = patch_source(out)
    assert again.already_patched and again.source == out


def variant(old: str, new: str) -> str:
    assert old in SOURCE
    return SOURCE.replace(old, new, 1)


REWRITES = [
    pytest.param(
        """\
import pyarrow.parquet as pq
import torch


def document_batches(path):
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        yield pf.read_row_group(i).column("text").to_pylist()


train_loader = document_batches("train.parquet")
for step in range(3):
    texts = next(train_loader)
""",
        """\
import pyarrow.parquet as pq
import torch
import os
TRAIN_PREFETCH = int(os.environ.get("TRAIN_PREFETCH", 1))
"""
        + RUNTIME
        + """\


def document_batches(path):
    pf = pq.ParquetFile(path)
    for i in range(pf.num_row_groups):
        yield pf.read_row_group(i).column("text").to_pylist()


train_loader = _prefetch_iterator(lambda: document_batches("train.parquet"), prefetch=TRAIN_PREFETCH, copy_stream=False)
for step in range(3):
    texts = next(train_loader)
""",
        "`train_loader` (generator document_batches) built at line 11 runs ahead on a background thread",
        id="reader-outside-a-loader-runs-ahead-as-a-generator",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    # a reader site of this family outside any loader generator gets the generator
    # family's producer and runtime (its plan names them), not this family's spawned one
    result = assert_patch(before, after, only="train_prefetch")
    assert [(n.applied, n.reason) for n in result.notes if n.feature == "train_prefetch"] == [(True, note)]


NOOPS = [
    pytest.param(
        variant(SIGNATURE, "def packed_loader_with_state(tokenizer, B, T, split, *args, device=\"cuda\", resume_state_dict=None, buffer_size=24, tokenizer_threads=2, tokenizer_batch_size=16):"),
        "packed_loader_with_state takes *args, **kwargs or positional-only parameters; its arguments cannot be passed by name to a spawned producer",
        id="star-args",
    ),
    pytest.param(
        variant("    rows = torch.empty((B, row_len), dtype=torch.long)\n", "    rows = torch.empty((B, row_len), dtype=torch.long)\n    rows = rows.to(device)\n"),
        "packed_loader_with_state uses `device` beyond the device buffer's `device=` and a pinning flag; built on the CPU in a producer its batches could differ",
        id="device-used-in-packing",
    ),
    pytest.param(
        variant("    docs = []\n", "    docs = []\n    random.shuffle(docs)\n"),
        "packed_loader_with_state draws from the global random module (random.shuffle); a spawned producer draws from its own RNG state",
        id="global-rng",
    ),
]


@pytest.mark.parametrize("before, reason", NOOPS)
def test_noop(before, reason):
    assert_noop(before, reason, 49, only="train_prefetch")


def test_without_a_split_assertion_every_build_spawns():
    # no parameter known to name the split: nothing says which build is the long-lived one
    source = variant('    assert split in ("train", "val")\n', "")
    [loader] = loader_generators(cst.parse_module(source))
    assert loader.refusal is None and loader.split is None
    out = patch_source(source, enabled={"train_prefetch", "env_toggles"}).source
    assert '"device", prefetch=TRAIN_PREFETCH)' in out and "TRAIN_PREFETCH_EVERY_SPLIT" not in out


def test_not_this_family_without_the_pinned_copy():
    # a generator that packs but never stages into pinned memory is not a module loader
    source = variant("pin_memory=use_cuda", "dtype=torch.long").replace(", dtype=torch.long, dtype=torch.long", ", dtype=torch.long")
    assert loader_generators(cst.parse_module(source)) == []


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """One `verify` of the fixture against its default patch, read by the tests below
    (each run spawns a producer per rank and phase)."""
    pytest.importorskip("pyarrow")
    from patcher.proof.verify import verify

    patched = tmp_path_factory.mktemp("verify") / "bestfit_packing.py"
    patched.write_text(patch_source(SOURCE).source)
    return verify(FIXTURE, patched, batches=12)


def test_verify_the_fixture_identical(verified):
    assert verified.identical and verified.prefetched, verified.difference
    assert any("row group boundary" in n and "file boundary" in n for n in verified.notes)
    assert not any(n.startswith("partial") for n in verified.notes)


def test_verify_checks_the_val_split_runs_here(verified):
    assert "split='val' (rank 0, 6 batches): run in the training process, no producer started (only split='train' spawns one)" in verified.notes


def verify_wrong(tmp_path, old, new):
    pytest.importorskip("pyarrow")
    from patcher.proof.verify import verify

    patched = tmp_path / "bestfit_packing.py"
    source = patch_source(SOURCE).source
    assert old in source
    patched.write_text(source.replace(old, new))
    return verify(FIXTURE, patched, batches=6)


def test_verify_catches_a_wrong_state(tmp_path):
    result = verify_wrong(tmp_path, 'state = {"pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch}', 'state = {"pq_idx": pq_idx, "rg_idx": rg_idx + 1, "epoch": epoch}')
    assert not result.identical and result.difference.field is not None


def test_verify_catches_a_val_build_that_spawns(tmp_path):
    result = verify_wrong(tmp_path, "every_split=TRAIN_PREFETCH_EVERY_SPLIT", "every_split=1")
    assert not result.identical and "started a producer process" in result.difference.what


def test_a_patched_module_is_already_patched():
    # the spawned producer's entry point marks train_prefetch as present, like
    # _make_train_loader; its H2D through the shared pinned ring brings copy_stream's `_h2d`
    patched = patch_source(SOURCE).source
    again = patch_source(patched)
    assert again.source == patched
    [note] = again.notes
    assert (note.feature, note.applied, note.reason) == ("all", False, "already patched (copy_stream, train_prefetch present); nothing to do")
