"""Injected runtime: round-loop overlap (feature `round_overlap`, opt-in).

A round-loop trainer (DeepXube's `Train`, `deepxube/base/trainer.py`) runs each round
as: start an update (the data workers get the target network and the sampling
settings) → block until the round's data is collected → end the update (the
workers' search summary) → train on the round → save, and copy the network to the
target file. `patch-prefetch --with round_overlap` adds an overlapped copy of that
round (`_round_overlap_update_step`) that, right after a round's end-update, starts
the next round's collection on a thread into a second buffer, then trains:

    cold round k:  clear, start(k), collect(k), end(k), [start(k+1), thread collects k+1], train(k), save, copy
    warm round k:  wait for k, swap buffers, end(k), publish, [start(k+1), thread ...], train(k), save, stage copy

The idea is DeepXube pull request #11 (a prefetch thread and a second buffer); this
runtime differs where that one was timing-dependent or lossy:

- Staleness is one round, fixed and stated. While a round is in flight its workers
  (and the network-runner processes they start) read the target file, so the
  trainer's copy to the target file is staged (`copy_target`) and published with an
  atomic `os.replace` (`publish`) only once that round has ended: the file a round
  reads never changes from its dispatch to its end, and holds the target parameters
  as they stood at dispatch (those after round k-1 for round k+1).
- A round is dispatched only when the loop will use it (`dispatch(..., more=...)`:
  the iteration count after this round's training is below the bound), so no round
  is wasted and nothing is waited for at the end.
- The end-update of a round runs in the update step that trains on it, so its
  summary is keyed to that round's first iteration, as in the original.
- A failed collection ends the run as the original's does: the round being trained
  trains to its end and is saved, and the collection's own exception (the same object,
  the collection thread's traceback on it) is raised when the failed round's data is
  needed (`receive`), where the original's collection raised it; the script's own
  `except` clauses see it unchanged. A child process that was alive at dispatch and
  exits with a non-zero code while `receive` waits raises `RoundCollectionError`
  there (the original would wait for its data for ever).
- `close` (on any exception in the update step, and at exit) stops the collection
  thread (it is woken by `unblock`, which puts a sentinel on the data queue) and
  publishes a staged target copy, so no thread is left behind.

`ROUND_OVERLAP=0` routes the update step to the original code, call for call.
"""

import atexit
import copy
import multiprocessing
import os
import shutil
import sys
import threading
import time
import weakref


class RoundCollectionError(RuntimeError):
    """A data worker died while the round collected in the background was waited for
    (its pid and exit code in the message)."""


class _RoundCancelled(Exception):
    """Raised on the collection thread when `close` asks it to stop."""


_ROUND_OVERLAP_LIVE = weakref.WeakSet()
_ROUND_OVERLAP_POLL_S = 0.2


class _RoundOverlap:
    """At most one round in flight for one trainer.

    Attributes: thread (the collection thread of the round in flight, or None), buffer
    (what it fills), spare (the buffer not in use, reused by the next dispatch), error
    (the exception the collection raised, re-raised by `receive`), children (child
    processes alive at dispatch), staged ((staged file, target file) of a deferred
    target copy, or None), dispatched (rounds dispatched so far).
    """

    def __init__(self):
        self.thread = None
        self.buffer = None
        self.spare = None
        self.times = None
        self.error = None
        self.children = []
        self.stopping = threading.Event()
        self.staged = None
        self.unblock = None
        self.dispatched = 0
        _ROUND_OVERLAP_LIVE.add(self)

    @property
    def in_flight(self):
        return self.thread is not None

    def start(self, start_update):
        """Cold start: call `start_update()` unless this round was dispatched already."""
        if self.thread is None:
            start_update()

    def clear(self, clear):
        """Call `clear()` (the buffer's) unless this round's data is collected elsewhere."""
        if self.thread is None:
            clear()

    def receive(self, db, collect, times=None):
        """This round's data buffer.

        Cold (nothing in flight): calls `collect()` (the original blocking collection
        into `db`) and returns `db`. Warm: waits for the collection thread, checking for
        dead workers every 0.2 s while it waits, and returns the buffer it filled; `db`
        becomes the spare; the wait (s) goes to `times.record_time("up_wait", s)` when a
        timing object is given, so the round's time line shows what the overlap did not
        hide. Raises what the collection raised (the same exception object, once its
        thread has ended: nothing is left running), or RoundCollectionError when a
        worker alive at dispatch exits with a non-zero code while the thread still waits.
        """
        if self.thread is None:
            collect()
            return db
        waited = time.time()
        while self.thread.is_alive():
            self.thread.join(_ROUND_OVERLAP_POLL_S)
            for child in self.children:
                if self.thread.is_alive() and child.exitcode not in (None, 0):
                    raise RoundCollectionError(f"worker {child.name} (pid {child.pid}) exited with code {child.exitcode} while round {self.dispatched} was being collected")
        if times is not None:
            times.record_time("up_wait", time.time() - waited)
        error, self.error, self.thread, received, self.buffer, self.children = self.error, None, None, self.buffer, None, []
        if error is not None:
            raise error  # the original raises it from its collection, here
        self.spare = db
        return received

    def dispatch(self, db, start_update, collect, unblock, times, more):
        """Start the next round's collection if `more` (the loop will run it).

        db: the buffer being trained on (its deep copy is the first spare). start_update:
        `() -> None`, the original start-update call (reads the step probabilities and
        target update numbers now: the snapshot at dispatch). collect: `(buffer, times)
        -> None`, the original collection into `buffer`, run on the thread. unblock: `()
        -> None`, wakes a collection blocked on its queue. times: the script's timing
        object; the thread records into a fresh one of the same type. Returns whether it
        dispatched.
        """
        if not more or self.thread is not None:
            return False
        buffer = self.spare if self.spare is not None else copy.deepcopy(db)
        self.spare = None
        buffer.clear()
        start_update()
        self.children = [p for p in multiprocessing.active_children() if p.exitcode is None]
        _warn_if_training_takes_every_core()
        self.buffer, self.times, self.unblock, self.error = buffer, type(times)(), unblock, None
        self.stopping.clear()
        self.dispatched += 1
        self.thread = threading.Thread(target=self._collect, args=(collect, buffer, self.times), name=f"round_overlap_collect_{self.dispatched}", daemon=True)
        self.thread.start()
        return True

    def _collect(self, collect, buffer, times):
        try:
            collect(buffer, times)
        except _RoundCancelled:
            pass
        except BaseException as exc:  # raised in the training thread by receive
            self.error = exc

    def stop_point(self):
        """Called at the top of each collection step on the thread: raises _RoundCancelled after `close`."""
        if self.stopping.is_set():
            raise _RoundCancelled()

    def copy_target(self, source, target):
        """The trainer's `shutil.copy(source, target)`, deferred while a round is in flight.

        Nothing in flight: copies now. In flight: copies to `target + ".round_overlap"`
        (through a temporary file) and `publish` moves it over `target` once that round
        has ended, so the file the round's workers read does not change under them.
        """
        if self.thread is None and self.staged is None:
            shutil.copy(source, target)
            return
        staged = f"{target}.round_overlap"
        shutil.copy(source, staged + ".tmp")
        os.replace(staged + ".tmp", staged)
        self.staged = (staged, target)

    def publish(self):
        """Move a staged target copy over the target file (atomic); called after a round's end-update."""
        if self.staged is not None:
            staged, target = self.staged
            os.replace(staged, target)
            self.staged = None

    def close(self):
        """Stop the round in flight (its data is dropped) and publish a staged target copy.

        Called when the update step raises (Ctrl-C included) and at interpreter exit;
        joins the collection thread (5 s at most: a thread blocked on a queue whose
        writers died is woken by `unblock`). Returns whether a round was dropped.
        """
        thread, dropped = self.thread, self.thread is not None
        if thread is not None:
            self.stopping.set()
            if thread.is_alive() and self.unblock is not None:
                try:
                    self.unblock()
                except Exception:
                    pass
            thread.join(5.0)
            self.thread, self.buffer, self.children = None, None, []
        try:
            self.publish()
        except OSError:
            pass
        return dropped


_ROUND_OVERLAP_WARNED = []


def _warn_if_training_takes_every_core():
    """Once per process: warn when torch's intra-op threads (in this, the training process)
    number at least the machine's cores while a round is generated beside them.

    Measured on DeepXube (whose `get_device()` sets 8 threads on CPU) on 2 cores: the
    training's threads and the data workers then time-slice, and an overlapped round
    took longer than the original one. Reads torch only where the script imported it.
    """
    torch = sys.modules.get("torch")
    if _ROUND_OVERLAP_WARNED or torch is None:
        return
    _ROUND_OVERLAP_WARNED.append(True)
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    if threads >= cores:
        print(f"round_overlap: training uses {threads} torch threads on {cores} cores while the next round is generated beside it; "
              f"leave the data workers cores (torch.set_num_threads(n) with n < {cores}) or the overlap only time-slices", file=sys.stderr)


def _round_overlap_of(owner):
    """The `_RoundOverlap` of a trainer object, created on first use (attribute `_round_overlap`)."""
    state = owner.__dict__.get("_round_overlap")
    if state is None:
        state = owner.__dict__["_round_overlap"] = _RoundOverlap()
    return state


def _round_overlap_close_all():
    for state in list(_ROUND_OVERLAP_LIVE):
        state.close()


atexit.register(_round_overlap_close_all)
