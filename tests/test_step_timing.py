"""Step timing: the runtime (templates/step_timing.py), the transform
(patcher/transforms/step_timing.py) on sources and fixtures, and fixture runs on CPU.

Timing values are never asserted (they vary); the tests look at which fields are
logged, on which steps, what each wrapped call returns, and how many times
`torch.cuda.synchronize` is called (a counting stand-in, CUDA reported in use).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import libcst as cst
import pytest
import torch

import templates.step_timing as step_timing_mod
from patcher.demo import STEP_LINE
from patcher.patch import features_from, patch_source
from patcher.shards import write_shards
from patcher.source import read_script, render
from templates.copy_stream import _h2d, _h2d_timers
from templates.step_timing import _force_sync_toggles, _StepTimer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
BREAKDOWN_FIELDS = ["batch_cpu_ms", "h2d_ms", "forward_ms", "backward_ms", "optimizer_ms", "val_ms", "step_ms"]
LINE = re.compile(r"^step_timing step:(\d+) (.*)$", re.M)


# ---------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------


@pytest.fixture
def sync_calls(monkeypatch):
    """Counts torch.cuda.synchronize calls, with CUDA reported in use."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    return calls


def _fields(line: str) -> dict[str, str]:
    return dict(part.split(":", 1) for part in line.split()[1:])


def _run_steps(timer: _StepTimer, mode: int, every: int, steps: int, val_at=(), h2d=True) -> list[str]:
    """Drive `steps` training steps the way a patched loop does; returns the log lines."""
    lines: list[str] = []
    for step in range(steps + 1):
        timer.next_step(mode, every, lines.append)
        if step == steps:
            break
        if step in val_at:
            timer.time("val", lambda: 0.0)
        if h2d:
            x, y = timer.time("batch", lambda: (_h2d(torch.ones(2, 3), "cpu", False), torch.zeros(2, 3)))
        else:
            x, y = timer.time("batch", lambda: (torch.ones(2, 3), torch.zeros(2, 3)))
        loss = timer.time("forward", lambda: (x - y).sum())
        timer.time("backward", lambda: None)
        timer.time("optimizer", lambda: None)
        assert loss.item() == 6.0
    return lines


def test_off_only_calls_and_logs_nothing(sync_calls):
    timer = _StepTimer()
    lines = _run_steps(timer, 0, 1, 5)
    assert lines == [] and sync_calls == []
    assert timer.time("batch", lambda: 42) == 42


def test_breakdown_logs_every_field_and_synchronises(sync_calls):
    timer = _StepTimer()
    lines = _run_steps(timer, 1, 200, 3)
    assert lines[0].startswith("step_timing mode:breakdown every:200")
    assert "forced off:" in lines[0]
    steps = LINE.findall("\n".join(lines))
    assert [int(n) for n, _ in steps] == [1, 2, 3]
    for _, rest in steps:
        fields = _fields("x " + rest)
        assert list(fields) == BREAKDOWN_FIELDS
        assert all(float(v) >= 0.0 for v in fields.values())
    # batch, h2d (inside batch), forward, backward, optimizer: two synchronisations each
    assert len(sync_calls) == 3 * 5 * 2
    assert _h2d_timers == []  # the batch phase unregisters itself


def test_breakdown_without_h2d_copy_says_so(sync_calls):
    lines = _run_steps(_StepTimer(), 1, 200, 1, h2d=False)
    assert "h2d_ms:-" in lines[1]


def test_data_wait_never_synchronises(sync_calls):
    timer = _StepTimer()
    lines = _run_steps(timer, 2, 200, 4, val_at=(2,))
    assert sync_calls == []
    assert lines[0].startswith("step_timing mode:data_wait")
    steps = LINE.findall("\n".join(lines))
    assert [int(n) for n, _ in steps] == [1, 2, 3, 4]
    assert list(_fields("x " + steps[0][1])) == ["data_wait_ms", "step_ms", "data_wait_total_ms"]
    waits = [float(_fields("x " + rest)["data_wait_ms"]) for _, rest in steps]
    assert float(_fields("x " + steps[-1][1])["data_wait_total_ms"]) == pytest.approx(sum(waits), abs=0.02)


def test_first_ten_steps_then_every_n(sync_calls):
    lines = _run_steps(_StepTimer(), 2, 7, 30)
    assert [int(n) for n, _ in LINE.findall("\n".join(lines))] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 21, 28]
    lines = _run_steps(_StepTimer(), 2, 0, 15)
    assert [int(n) for n, _ in LINE.findall("\n".join(lines))] == list(range(1, 11))


def test_steps_with_validation_are_logged(sync_calls):
    lines = _run_steps(_StepTimer(), 1, 100, 25, val_at=(17,))
    logged = {int(n): _fields("x " + rest) for n, rest in LINE.findall("\n".join(lines))}
    assert sorted(logged) == list(range(1, 11)) + [18]


def test_phases_before_the_loop_are_not_timed(sync_calls):
    timer = _StepTimer()
    assert timer.time("batch", lambda: 7) == 7  # e.g. a warm-up step through a shared step function
    assert sync_calls == []
    lines: list[str] = []
    timer.next_step(1, 1, lines.append)
    timer.next_step(1, 1, lines.append)
    assert _fields("x " + LINE.findall(lines[1])[0][1])["forward_ms"] == "0.00"


def test_exception_in_a_phase_propagates_and_unregisters(sync_calls):
    timer = _StepTimer()
    timer.next_step(1, 1, lambda line: None)

    def boom():
        raise RuntimeError("loader failed")

    with pytest.raises(RuntimeError, match="loader failed"):
        timer.time("batch", boom)
    assert _h2d_timers == [] and timer._open == []


@pytest.mark.parametrize(
    "env, forced",
    [
        ({"TRAINING_TIMING_BREAKDOWN": "1"}, ["TRAIN_PREFETCH", "TRAIN_COPY_STREAM"]),
        ({"TRAINING_TIMING_BREAKDOWN": "2", "TRAIN_PREFETCH": "1"}, []),
        ({"TRAINING_TIMING_BREAKDOWN": "0"}, []),
        ({}, []),
        ({"TRAINING_TIMING_BREAKDOWN": "yes"}, []),
    ],
)
def test_breakdown_forces_prefetch_and_copy_stream_off(env, forced):
    environ = dict(env)
    assert _force_sync_toggles(environ) == forced
    for name in forced:
        assert environ[name] == "0"
    if not forced:
        assert environ == env


def test_header_names_the_forced_toggles(monkeypatch):
    monkeypatch.setattr(step_timing_mod, "_step_timing_forced", ["TRAIN_PREFETCH", "TRAIN_COPY_STREAM"])
    lines: list[str] = []
    _StepTimer().next_step(1, 5, lines.append)
    assert "forced off: TRAIN_PREFETCH=0 TRAIN_COPY_STREAM=0" in lines[0]
