"""Injected runtime: per-step timing of the training loop (feature `step_timing`).

`patch-prefetch` renders the body of this module into a training script and wraps
the parts of one training step in `_step_timer.time(phase, lambda: <the script's
call>)`: the batch (`train_loader.next_batch(...)`), the forward (`model(x, y)`), the
backward (`loss.backward()`), the optimizer step (`opt.step()`) and the validation
(`eval_val(...)`); the first statement of the training loop's body becomes
`_step_timer.next_step(<TRAINING_TIMING_BREAKDOWN>, <TRAINING_TIMING_EVERY>, log0)`.

Modes (`TRAINING_TIMING_BREAKDOWN`):

- 0: off. `time` calls the script's own call and returns what it returns.
- 1: breakdown. Each phase is bracketed by `torch.cuda.synchronize()` (when CUDA is
  in use), so its wall time is the GPU work it queued: batch CPU ms, H2D ms, forward,
  backward, optimizer and validation ms, and the whole step. Work run ahead on other
  threads or streams would blur the phases, so `TRAIN_PREFETCH` and
  `TRAIN_COPY_STREAM` are forced to 0 while it is on (before the script reads them),
  and the first log line says so. H2D ms is the time inside the loader's `_h2d` copies
  (`templates/copy_stream.py`); a loader whose copies do not go through `_h2d` logs
  `h2d_ms:-` and its copies count as batch CPU time.
- 2: data wait. Only the wall time of the main thread's batch call is measured, with
  `time.perf_counter()` and no synchronisation, so training runs at full speed with
  prefetch and copy stream as configured: a data wait near 0 ms means data is off the
  critical path. Each line also gives the wait's p50 and p99 over the steps so far and,
  for a loader prefetched by the process producer (templates/prefetch_lean.py), how
  many of its hand-outs found no batch built (`ring_empty:k/n`): a wait with the ring
  empty is the producer not keeping up; a wait with batches built is the hand-out's
  own cost.

A step's line is logged for the first 10 steps, then every `TRAINING_TIMING_EVERY`
steps, and, in breakdown mode, for every step that ran a validation (a step's line
counts the validation run at the top of its loop iteration). Lines look like
`step_timing step:3 batch_cpu_ms:1.20 h2d_ms:0.31 forward_ms:40.02 ...`.
The idea of synchronising around each phase is the usual one for CUDA timing
(kernels run asynchronously; `torch.cuda.Event` timing would be the alternative
that needs no host synchronisation, at the cost of one event pair per phase).
"""

import os
import time

import torch

from patcher.templates.copy_stream import _h2d_timers, _ring_timers

# Toggles that run work ahead of the training thread; the breakdown switches them off.
_SYNC_FORCED_OFF = ("TRAIN_PREFETCH", "TRAIN_COPY_STREAM")
_BREAKDOWN = 1
_DATA_WAIT = 2
# Phases in log order; "batch" includes "h2d", which is logged apart.
_PHASES = ("batch", "h2d", "forward", "backward", "optimizer", "val")


def _force_sync_toggles(environ):
    """Switch prefetch and copy stream off when the timing breakdown is on.

    Takes: environ: a mutable mapping of environment variables (`os.environ`), read
    before the script's Hyperparameters read their toggles.
    Returns: the names set to "0" (list of str; empty unless
    `TRAINING_TIMING_BREAKDOWN` is 1).
    """
    try:
        mode = int(environ.get("TRAINING_TIMING_BREAKDOWN", "0"))
    except ValueError:
        return []
    if mode != _BREAKDOWN:
        return []
    for name in _SYNC_FORCED_OFF:
        environ[name] = "0"
    return list(_SYNC_FORCED_OFF)


_step_timing_forced = _force_sync_toggles(os.environ)


def _cuda_in_use():
    return torch.cuda.is_initialized()


class _Phase:
    """Context manager timing one phase of the breakdown (synchronised on CUDA)."""

    def __init__(self, timer, name):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.timer._sync()
        self.timer._open.append(self.name)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.timer._sync()
        elapsed_ms = 1000.0 * (time.perf_counter() - self.start)
        self.timer._open.pop()
        self.timer._add(self.name, elapsed_ms)
        return False


class _StepTimer:
    """Times the phases of each training step and logs them through the script's log.

    Inert until the training loop's first `next_step` call; the mode and log function
    come with every `next_step` call (toggle values, cheap), so it needs no set-up
    statement of its own.
    """

    def __init__(self):
        self.mode = 0
        self.every = 200
        self.log = None
        self.steps = 0  # training steps completed since the loop started
        self.waits = []  # data wait mode: each step's wait (ms), for their total, p50 and p99
        self.ring = [0, 0]  # the process producer's hand-outs, and those that found no batch built (`_ring_timers`)
        self._record = {}
        self._open = []  # names of the phases being timed, innermost last
        self._step_start = None

    def next_step(self, mode, every, log):
        """Close the previous step (log it when due) and start timing the next one.

        Takes: mode: int, `TRAINING_TIMING_BREAKDOWN` (0 off, 1 breakdown, 2 data
        wait, any other value off); every: int, `TRAINING_TIMING_EVERY` (steps
        between lines after the first 10; <= 0: only the first 10); log: the
        script's log function (takes one str).
        Returns None. Call it first in the training loop's body.
        """
        now = time.perf_counter()
        if self.mode == 0 and mode in (_BREAKDOWN, _DATA_WAIT):
            self.mode, self.every, self.log = int(mode), int(every), log
            if self.mode == _DATA_WAIT:
                _ring_timers.append(self)
            log(self._header())
        elif self._step_start is not None and self.mode:
            self.steps += 1
            if self.mode == _DATA_WAIT:
                self.waits.append(self._record.get("batch", 0.0))
            if self._due():
                self.log(self._line(1000.0 * (now - self._step_start)))
        self._record = {}
        self._step_start = now if self.mode else None

    def time(self, phase, call):
        """Run `call()` (the script's own call) and return its result, timed as `phase`.

        Takes: phase: one of "batch", "forward", "backward", "optimizer", "val";
        call: a function of no arguments. Returns: what `call()` returns, unchanged.
        Data-wait mode times only "batch", without synchronising; breakdown mode
        synchronises CUDA before and after; off, it only calls.
        """
        if self.mode == 0 or self._step_start is None:
            return call()
        if self.mode == _DATA_WAIT:
            if phase != "batch":
                return call()
            start = time.perf_counter()
            out = call()
            self._add("batch", 1000.0 * (time.perf_counter() - start))
            return out
        if phase == "batch":
            # The loader's copies in `_h2d` are timed as "h2d" inside the batch phase.
            _h2d_timers.append(self)
            try:
                with _Phase(self, phase):
                    return call()
            finally:
                _h2d_timers.remove(self)
        with _Phase(self, phase):
            return call()

    def phase(self, name):
        """A context manager timing `name` (breakdown mode; used by `_h2d` for "h2d")."""
        return _Phase(self, name)

    def inside(self, name):
        """True while phase `name` is being timed (so `_h2d` does not time itself twice)."""
        return name in self._open

    def _sync(self):
        if _cuda_in_use():
            torch.cuda.synchronize()

    def _add(self, name, elapsed_ms):
        self._record[name] = self._record.get(name, 0.0) + elapsed_ms

    def _due(self):
        if self.steps <= 10 or "val" in self._record:
            return True
        return self.every > 0 and self.steps % self.every == 0

    def _header(self):
        if self.mode == _DATA_WAIT:
            return f"step_timing mode:data_wait every:{self.every} (wall time of the batch call on the main thread, no synchronisation)"
        forced = " ".join(f"{name}=0" for name in _step_timing_forced) or "none"
        return f"step_timing mode:breakdown every:{self.every} (synchronising every phase; forced off: {forced})"

    def _line(self, step_ms):
        """One log line for the step just completed; times in ms (float, 2 decimals)."""
        record = self._record
        if self.mode == _DATA_WAIT:
            wait, waits = record.get("batch", 0.0), sorted(self.waits)
            p50, p99 = waits[(len(waits) - 1) // 2], waits[round(0.99 * (len(waits) - 1))]
            ring = f" ring_empty:{self.ring[1]}/{self.ring[0]}" if self.ring[0] else ""
            return f"step_timing step:{self.steps} data_wait_ms:{wait:.2f} step_ms:{step_ms:.2f} data_wait_total_ms:{sum(self.waits):.2f} data_wait_p50_ms:{p50:.2f} data_wait_p99_ms:{p99:.2f}{ring}"
        h2d = record.get("h2d")
        fields = [
            f"batch_cpu_ms:{record.get('batch', 0.0) - (h2d or 0.0):.2f}",
            f"h2d_ms:{h2d:.2f}" if h2d is not None else "h2d_ms:-",
        ]
        fields += [f"{name}_ms:{record.get(name, 0.0):.2f}" for name in _PHASES[2:]]
        return f"step_timing step:{self.steps} {' '.join(fields)} step_ms:{step_ms:.2f}"


_step_timer = _StepTimer()
