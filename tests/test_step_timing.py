"""Step timing: the runtime (templates/step_timing.py), the transform
(patcher/transforms/step_timing.py) on sources and fixtures, and fixture runs on CPU.
The exact rewrites, whole outputs, are the tables of test_feature_step_timing.py; here
the transform's notes (reasons, lines) and the fixtures.

Timing values are never asserted (they vary); the tests look at which fields are
logged, on which steps, what each wrapped call returns, and how many times
`torch.cuda.synchronize` is called (a counting stand-in, CUDA reported in use).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import libcst as cst
import pytest
import torch

import patcher.templates.step_timing as step_timing_mod
from fixture_training import original_runs, run_env, shard_dir
from patcher.demo import STEP_LINE
from patcher.patch import features_from, patch_source
from patcher.transforms.features import FEATURES
from patcher.read.source import read_script, render
from patcher.templates.copy_stream import _h2d, _h2d_timers
from patcher.templates.step_timing import _force_sync_toggles, _StepTimer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DATA_WAIT_FIELDS = ["data_wait_ms", "step_ms", "data_wait_total_ms", "data_wait_p50_ms", "data_wait_p99_ms"]
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


@pytest.mark.parametrize("mode", [0, 3, -1])
def test_off_only_calls_and_logs_nothing(sync_calls, mode):
    timer = _StepTimer()
    lines = _run_steps(timer, mode, 1, 5)
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
    assert list(_fields("x " + steps[0][1])) == DATA_WAIT_FIELDS  # no process producer here: no ring_empty
    waits = [float(_fields("x " + rest)["data_wait_ms"]) for _, rest in steps]
    assert float(_fields("x " + steps[-1][1])["data_wait_total_ms"]) == pytest.approx(sum(waits), abs=0.02)
    last = _fields("x " + steps[-1][1])
    assert float(last["data_wait_p50_ms"]) == pytest.approx(sorted(waits)[1], abs=0.006) and float(last["data_wait_p99_ms"]) == pytest.approx(max(waits), abs=0.006)


def test_data_wait_counts_the_hand_outs_that_found_no_batch_built():
    # The process producer (templates/prefetch_lean.py) builds batches 2 and 3 ahead, then
    # waits at batch 4 for a gate: hand-outs 2 and 3 find a batch built, hand-out 4
    # finds the ring empty (the producer behind), and the line says 1/3.
    import multiprocessing

    from patcher.proof.compare import queued_batches
    from patcher.templates.prefetch_lean import _make_train_loader

    gate = multiprocessing.get_context("fork").Event()

    class Gated:
        def __init__(self, device):
            self.calls = 0

        def next_batch(self, n):
            self.calls += 1
            if self.calls > 3:
                gate.wait(30)
            return torch.arange(n) + self.calls

    timer, lines = _StepTimer(), []
    timer.next_step(2, 200, lines.append)
    loader = _make_train_loader(lambda d: Gated(d), torch.device("cpu"), queue_depth=2, name="gated")
    try:
        assert torch.equal(loader.next_batch(4), torch.arange(4) + 1)
        _wait_until(lambda: queued_batches(loader) >= 2)  # batches 2 and 3 built
        timer.ring[:] = 0, 0
        opener = threading.Thread(target=lambda: (_wait_until(lambda: timer.ring[0] == 3), gate.set()))
        opener.start()  # opens the gate once hand-out 4 has looked at the ring
        got = [loader.next_batch(4) for _ in range(3)]
        opener.join()
        assert all(torch.equal(g, torch.arange(4) + k) for g, k in zip(got, (2, 3, 4)))
        timer.next_step(2, 200, lines.append)
        assert timer.ring == [3, 1] and lines[-1].endswith(" ring_empty:1/3")
    finally:
        gate.set()
        loader.shutdown()


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_breakdown_times_a_real_h2d_copy():
    timer = _StepTimer()
    lines: list[str] = []
    timer.next_step(1, 1, lines.append)
    host = torch.arange(1 << 20, dtype=torch.int64)
    x = timer.time("batch", lambda: _h2d(host, "cuda", False))
    timer.next_step(1, 1, lines.append)
    assert torch.equal(x.cpu(), host)
    fields = _fields("x " + LINE.findall(lines[-1])[0][1])
    assert float(fields["h2d_ms"]) > 0.0


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


# ---------------------------------------------------------------------------
# Transform
# ---------------------------------------------------------------------------

HEAD = '''
import os
import torch

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 10))

class Loader:
    def __init__(self, pattern, device):
        self.device = device
        self.pos = 0

    def next_batch(self, tokens, seq_len):
        self.pos += tokens
        x = torch.arange(self.pos, self.pos + tokens).reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)
'''

MAIN_LOOP = '''
def main():
    args = Hyperparameters()
    device = torch.device("cpu")
    def log0(msg):
        print(msg)
    train_loader = Loader("x", device)
    for warmup_step in range(2):
        for micro_step in range(2):
            x, y = train_loader.next_batch(64, 8)
            warmup_loss = model(x, y)
            warmup_loss.backward()
        for opt in optimizers:
            opt.step()
    step = 0
    while True:
        if step % 5 == 0:
            val_loss = eval_val(args, model)
        if step == args.iterations:
            break
        for micro_step in range(2):
            x, y = train_loader.next_batch(64, 8)
            with torch.autocast(device_type="cpu", enabled=False):
                loss = model(x, y)
            (loss * 0.5).backward()
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = 0.1
        for opt in optimizers:
            opt.step()
        step += 1
'''


def _timing(source: str, enabled=None):
    result = patch_source(source, set(FEATURES) if enabled is None else enabled)  # step timing is opt-in
    return result, [n for n in result.notes if n.feature == "step_timing"]


def test_note_names_the_main_loop_and_its_validation():
    # What the rewrite wraps (not the warm-up step): test_feature_step_timing.py.
    _, notes = _timing(HEAD + MAIN_LOOP)
    assert "val line" in notes[0].reason and notes[0].line == HEAD.count("\n") + MAIN_LOOP[: MAIN_LOOP.index("while True")].count("\n") + 1


def test_patched_script_is_already_patched():
    once = patch_source(HEAD + MAIN_LOOP, features_from(["step_timing"], None)).source
    again = patch_source(once)
    assert again.already_patched and again.source == once


FIXTURE_NAMES = [
    "tokenstream_readable", "tokenstream_validating", "shuffled_minified", "coprime_dataclass",
    "curriculum", "batch_switch", "document_packing", "wrapped_lzma_raw", "wrapped_lzma_oneline",
]


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixtures_get_the_step_timing(name):
    script = read_script(FIXTURES / f"{name}.py")
    result, notes = _timing(script.source)
    assert [n.applied for n in notes] == [True], notes
    tree = cst.parse_module(result.source)
    assert tree.code.count("_step_timer.next_step(") == 1
    for phase in ("batch", "forward", "backward", "optimizer"):
        assert f'_step_timer.time("{phase}",' in tree.code
    assert ('_step_timer.time("val",' in tree.code) == (name == "tokenstream_validating")


@pytest.mark.parametrize("name", ["generator_toplevel", "no_loader"])
def test_fixtures_without_a_training_step(name):
    result, notes = _timing(read_script(FIXTURES / f"{name}.py").source)
    assert not any(n.applied for n in notes)
    assert "_step_timer" not in result.source


# ---------------------------------------------------------------------------
# Fixture runs on CPU
# ---------------------------------------------------------------------------

SYNC_COUNTER = textwrap.dedent(
    """
    import runpy, sys, torch
    calls = []
    torch.cuda.is_initialized = lambda: True  # CUDA "in use": the breakdown would synchronise
    torch.cuda.synchronize = lambda *a, **k: calls.append(1)
    runpy.run_path(sys.argv[1], run_name="__main__")
    print("sync_calls:" + str(len(calls)))
    """
)
RUNS = {
    ("tokenstream_validating", "original"): {},
    ("tokenstream_validating", "breakdown"): {"TRAINING_TIMING_BREAKDOWN": "1", "TRAINING_TIMING_EVERY": "5"},
    ("tokenstream_validating", "data_wait"): {"TRAINING_TIMING_BREAKDOWN": "2", "TRAINING_TIMING_EVERY": "5"},
    ("tokenstream_validating", "off"): {},
    ("shuffled_minified", "original"): {},
    ("shuffled_minified", "breakdown"): {"TRAINING_TIMING_BREAKDOWN": "1"},
}


# The original runs trained once for test_fixtures.py too (fixture_training.py).
SHARED_ORIGINALS = ["shuffled_minified"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = shard_dir(tmp_path_factory)
    out = tmp_path_factory.mktemp("patched")
    counter = out / "count_sync.py"
    counter.write_text(SYNC_COUNTER)
    paths = {}
    for name in {n for n, _ in RUNS}:
        script = read_script(FIXTURES / f"{name}.py")
        paths[name] = out / f"{name}.py"
        paths[name].write_text(render(script, patch_source(script.source, set(FEATURES)).source))

    def run(key):
        name, mode = key
        script = FIXTURES / f"{name}.py" if mode == "original" else paths[name]
        env = run_env(data, **RUNS[key])
        done = subprocess.run([sys.executable, str(counter), str(script)], env=env, cwd=out, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{key}: {done.stderr[-2000:]}"
        return done.stdout

    here = [key for key in RUNS if not (key[1] == "original" and key[0] in SHARED_ORIGINALS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = dict(zip(here, pool.map(run, here)))
    for (name, _), done in original_runs(tmp_path_factory, [(name, 0) for name in SHARED_ORIGINALS]).items():
        assert done.returncode == 0, f"{name}: {done.stderr[-2000:]}"
        found[(name, "original")] = done.stdout
    return found


@pytest.mark.parametrize("key", [k for k in RUNS if k[1] != "original"])
def test_losses_stay_bit_identical(runs, key):
    reference = STEP_LINE.findall(runs[(key[0], "original")])
    assert len(reference) >= 20
    assert STEP_LINE.findall(runs[key]) == reference


def test_breakdown_run_logs_every_field(runs):
    out = runs[("tokenstream_validating", "breakdown")]
    assert "patch_prefetch train_prefetch:0 train_copy_stream:0 training_timing_breakdown:1" in out
    assert "step_timing mode:breakdown every:5 (synchronising every phase; forced off: TRAIN_PREFETCH=0 TRAIN_COPY_STREAM=0)" in out
    steps = {int(n): _fields("x " + rest) for n, rest in LINE.findall(out)}
    # 24 steps, VAL_LOSS_EVERY=8: validations at the top of steps 1, 9 and 17
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 17, 20]
    for n, fields in steps.items():
        assert list(fields) == BREAKDOWN_FIELDS
        assert (float(fields["val_ms"]) > 0) == (n in (1, 9, 17))
        assert float(fields["forward_ms"]) > 0 and float(fields["backward_ms"]) > 0
    assert int(re.search(r"sync_calls:(\d+)", out).group(1)) > 0
    minified = runs[("shuffled_minified", "breakdown")]
    assert len(LINE.findall(minified)) >= 10 and "h2d_ms:-" not in minified


def test_data_wait_run_never_synchronises(runs):
    out = runs[("tokenstream_validating", "data_wait")]
    assert "patch_prefetch train_prefetch:1 train_copy_stream:1 training_timing_breakdown:2" in out
    assert "step_timing mode:data_wait every:5" in out
    steps = LINE.findall(out)
    assert [int(n) for n, _ in steps] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20]
    assert all(list(_fields("x " + rest)) == DATA_WAIT_FIELDS + ["ring_empty"] for _, rest in steps)
    hand_outs = [int(_fields("x " + rest)["ring_empty"].split("/")[1]) for _, rest in steps]
    assert hand_outs == sorted(hand_outs) and hand_outs[-1] >= 20  # the process producer's hand-outs, counted
    assert "sync_calls:0" in out


def test_timing_off_logs_no_timing(runs):
    out = runs[("tokenstream_validating", "off")]
    assert "step_timing" not in out and "sync_calls:0" in out

