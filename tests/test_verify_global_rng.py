"""verify gives the original and the patched script the same global random state.

A loader that draws from Python's global `random` (here `random.shuffle` of its shard
list) is left on the training thread by the patch, so the patched script draws exactly
what the original draws, as each would in a process of its own. verify runs both in one
process: each side must start from the same state and keep its own.
"""
from __future__ import annotations

from pathlib import Path

from patcher.patch import patch_source
from patcher.proof.verify import verify

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "shuffled_minified.py"
LOOP = "for bi in range(device_batch_size):\n\t\t\t"


def _scripts(tmp_path, patched_extra: str = "") -> tuple[Path, Path]:
    text = FIXTURE.read_text()
    assert text.count(LOOP) == 1
    original = text.replace(LOOP, LOOP + "random.shuffle(self.files);")
    result = patch_source(original)
    assert any("global random module" in n.reason for n in result.notes if n.feature == "train_prefetch" and not n.applied)
    a, b = tmp_path / "original.py", tmp_path / "patched.py"
    a.write_text(original)
    b.write_text(result.source.replace("random.shuffle(self.files);", "random.shuffle(self.files);" + patched_extra))
    return a, b


def test_a_loader_on_the_global_random_module_verifies_identical(tmp_path):
    # Before: "bytes differ" at rank 0, warm-up batch 0: the patched side started from
    # the state the original's draws had left.
    result = verify(*_scripts(tmp_path), batches=2, warmup=2)
    assert result.identical, result.difference


def test_one_more_draw_on_the_patched_side_still_differs(tmp_path):
    # The state is shared out per side, not reset before every batch: an extra draw shows.
    result = verify(*_scripts(tmp_path, "random.random();"), batches=2, warmup=2)
    assert not result.identical and result.difference.rank == 0
