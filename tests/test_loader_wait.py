"""bench/loader_wait.py prints waits in the orientation `patch-prefetch bench` prints:
patched / original, with the word that says which side waited less."""
from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("loader_wait", Path(__file__).resolve().parent.parent / "bench" / "loader_wait.py")
loader_wait = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(loader_wait)


def wait(original_ms: float, patched_ms: float) -> str:
    return loader_wait._wait({"wait_ms_original_total": original_ms, "wait_ms_patched_total": patched_ms})


def test_a_shorter_patched_wait_reads_as_less_below_one():
    assert wait(100.0, 2.2) == "0.022 less"


def test_a_longer_patched_wait_reads_as_longer_above_one():
    assert wait(100.0, 140.0) == "1.4 longer"


def test_no_original_wait_gives_no_ratio():
    assert wait(0.0, 1.0) == "-"


def test_a_ratio_that_prints_as_one_reads_as_long():
    assert wait(1000.0, 999.0) == "1 as long"


def test_the_producer_rate_reads_patched_over_original_with_its_word():
    assert loader_wait._built({"producer_ratio": 0.11}) == "0.11 fewer"
    assert loader_wait._built({"producer_ratio": 1.3}) == "1.3 more"
    assert loader_wait._built({"producer_ratio": None}) == "-"
