"""The report's "expect" lines: bytes H2D per micro-step per rank, pinned or pageable,
the step loop's syncs, and what the premise measurements imply."""

from __future__ import annotations

from pathlib import Path

import pytest

from patcher.patch import patch_source
from patcher.expect import expectations

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TOKENSTREAM = (FIXTURES / "tokenstream_readable.py").read_text()


def _lines(source: str) -> list[str]:
    result = patch_source(source)
    return expectations(result.verdicts, set(result.applied))


def test_a_token_loader_line_reads_its_bytes_and_syncs_from_the_script():
    [line] = _lines(TOKENSTREAM)  # two constructions of one loader (the warm-up rebuild): one line
    # TRAIN_BATCH_TOKENS 1024, grad_accum_steps = 2 // world_size: 512 tokens a rank's micro-batch, x and y int64
    assert line.startswith("`train_loader`: 8 KiB H2D per micro-step per rank (512 tokens, x and y as int64, 2 copies)")
    assert "pageable in the original, pinned, on the copy stream patched" in line
    assert "1 every step (line 338)" in line and "run `ab` to know" in line


def test_the_root_script_shape_gives_the_premise_figures():
    """1 MiB a micro-step, as the root script's defaults give: the 1 MB row of the premise,
    8 micro-steps on one GPU, one on eight."""
    source = TOKENSTREAM.replace('"TRAIN_BATCH_TOKENS", 1024', '"TRAIN_BATCH_TOKENS", 524_288').replace("grad_accum_steps = 2 // world_size", "grad_accum_steps = 8 // world_size")
    [line] = _lines(source)
    assert "1.0 MiB H2D per micro-step per rank (65,536 tokens" in line
    assert "a 1.0 MiB pageable copy blocks the host about 0.13 ms, a pinned one 0.03 ms" in line
    assert "2.03 ms a step on 1 GPU (8 micro-steps; 0.3 %" in line and "0.25 ms a step on 8 GPUs (1 micro-step; 0.3 %" in line
    assert "expect under 1 % of a step" in line


@pytest.mark.parametrize(
    "fixture, said",
    [
        ("generator_shards.py", "18.95 ms -> 1.34 ms of host time per `.send()`"),
        ("document_packing.py", "its own thread builds and pins the batches ahead (pinned in the original), its H2D copies now on the copy stream"),
        ("bestfit_packing.py", "58.73 ms -> 0.88 ms of host time per `next()`"),
        ("no_loader.py", None),
    ],
)
def test_other_loaders_quote_what_was_measured_or_say_nothing(fixture, said):
    lines = _lines((FIXTURES / fixture).read_text())
    assert [said in line for line in lines] == ([True] if said else [])
