"""bench/run_ahead.py on our miniature of nanochat's loader (fixtures/bestfit_packing.py:
one pinned staging buffer and one device buffer, pinned and copied asynchronously only
when `device == "cuda"`), under the host model of asynchronous copies."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("run_ahead", ROOT / "bench" / "run_ahead.py")
run_ahead = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(run_ahead)
FIXTURE = ROOT / "fixtures" / "bestfit_packing.py"


def test_called_with_a_device_object_it_never_races_and_drains_the_run_ahead_at_every_next():
    rows = list(run_ahead.cases(FIXTURE, None, 6, range(3), calls=(("device", torch.device("cuda", 0)),)))
    assert [(k, verdict, blocking, asynchronous) for _, _, k, verdict, blocking, asynchronous in rows] == [(k, "identical over 6 batches", 1.0, 0.0) for k in range(3)]


def test_called_with_the_string_its_one_pinned_buffer_changes_batch_0_once_the_host_runs_ahead():
    rows = list(run_ahead.cases(FIXTURE, None, 6, range(3), calls=(("string", "cuda"),)))
    verdicts = [(k, verdict.split(" (")[0], blocking, asynchronous) for _, _, k, verdict, blocking, asynchronous in rows]
    assert verdicts == [(0, "identical over 6 batches", 0.0, 1.0), (1, "batch 0 differs", 0.0, 1.0), (2, "batch 0 differs", 0.0, 1.0)]


def test_the_patched_module_is_free_of_it(tmp_path):
    from patcher.patch import patch_source

    patched = tmp_path / FIXTURE.name
    patched.write_text(patch_source(FIXTURE.read_text()).source)
    rows = [r for r in run_ahead.cases(FIXTURE, patched, 6, (2,), calls=(("string", "cuda"),)) if r[0] == "patched"]
    assert [(verdict, blocking) for _, _, _, verdict, blocking, _ in rows] == [("identical over 6 batches", 0.0)]
