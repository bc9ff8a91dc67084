"""Injected runtime: a progress line every N validation batches (feature `val_progress`).

The evaluation loop's iterable `batches` becomes `_val_progress(batches, log, every,
label)`: the same items, in order, and after every `every`-th batch (and after the
last) one line through the script's own log function, e.g.
`eval_val batch:16/64 elapsed_ms:812`. With `every` 0 (`VAL_PROGRESS_LOG_EVERY=0`,
the default) nothing is logged. Elapsed time is host wall time since the first batch
was asked for; the GPU may still be running queued work.
"""

import time


def _val_progress(batches, log, every, label="val", total=None):
    """Yield the items of `batches` unchanged, logging progress every `every` items.

    Takes: batches: any iterable (its `len()`, when it has one, is the total); log:
    `str -> None`, the script's log function; every: int, batches between lines (0 or
    less: never); label: str, the line's first word (the evaluation function's name);
    total: the number of batches, for iterables without a `len()` (prefetched ones).
    Yields: the items of `batches`. Logs `"{label} batch:{done}/{total} elapsed_ms:{ms}"`
    (ms: int, host wall time) when the next item is asked for after a multiple of
    `every`, and once after the last item.
    """
    if every <= 0:
        yield from batches
        return
    if total is None:
        total = len(batches) if hasattr(batches, "__len__") else "?"
    started = time.perf_counter()
    done = 0
    for item in batches:
        if done and done % every == 0:
            log(f"{label} batch:{done}/{total} elapsed_ms:{1000.0 * (time.perf_counter() - started):.0f}")
        yield item
        done += 1
    if done:
        log(f"{label} batch:{done}/{total} elapsed_ms:{1000.0 * (time.perf_counter() - started):.0f}")
