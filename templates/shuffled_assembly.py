"""Injected runtime: ShuffledSequenceLoader batches assembled in numpy (feature `train_prefetch`).

Only for a `ShuffledSequenceLoader` whose `next_batch` has exactly the known shape
(`patcher/survey/assembly.py` recognises it; anything else keeps the script's own
`next_batch`). The construction becomes

    train_loader = _make_train_loader(lambda loader_device: ShuffledSequenceLoader(h, loader_device), device, ...,
        assembly="_get_shard_memmap")

(with `--producer-toggles`: `assembly="_get_shard_memmap" if h.train_prefetch_numpy else None`)

and the prefetch worker builds each batch in two steps:

- `_shuffled_plan`: the loader's own draws, in the original order: per row, the shard
  drawn with `rng.choice(len(files), p=remaining / total)`, the start popped from that
  shard's list, `_reset_shard` for every shard when all are used up. The loader's state
  (its RNG, its start lists) after a plan is the state after the original `next_batch`.
  Sequential (it changes the loader), cheap: no token is read. It holds the GIL
  throughout, so for numpy's Generator the choice is computed directly (the cdf and
  one uniform, as `Generator.choice` does), with a batch's uniforms drawn at once when
  no shard runs out in it: about 4 µs a row instead of 10.
- `_shuffled_gather`: the token windows of the plan, read with one fancy index per
  shard from the memory-mapped shard arrays straight into one int64 buffer `[2, rows,
  seq_len]` (pinned when the batch goes to CUDA), one `torch.from_numpy` at the end;
  `x, y` are its two halves. It does not touch the loader, and numpy releases the GIL
  while it copies.

Exactness: the windows are `mm[start : start + seq_len + 1]` cast to int64, as in
`np.array(mm[...], dtype=np.int64)`; `x` is a window without its last token and `y`
without its first, row `bi` for the `bi`-th draw.
"""

import numpy

import torch


def _shuffled_plan(loader, memmap_getter, global_tokens, grad_accum_steps):
    """`ShuffledSequenceLoader.next_batch(global_tokens, grad_accum_steps)` without reading tokens.

    The same statements in the same order for everything that changes the loader: the
    float64 `remaining` counts, `rng.choice(..., p=probs)` per row, the pop, the reset of
    every shard when none is left. memmap_getter: the name of the script's function
    that `next_batch` calls for a shard's token array (`_get_shard_memmap`), looked up
    in the loader class's module globals, as the original `next_batch` looks it up.
    Returns the plan, `(seq_len, shard_of_row, start_of_row, shards)`: per row the
    shard index and the window start (int64 arrays), and {shard index: token array}
    for the shards the rows use.
    """
    get_memmap = type(loader).next_batch.__globals__[memmap_getter]
    device_tokens = global_tokens // (loader.world_size * grad_accum_steps)
    device_batch_size = device_tokens // loader.seq_len
    remaining = numpy.array([len(s) for s in loader.start_inds], dtype=numpy.float64)
    shard_of_row = [0] * device_batch_size
    start_of_row = [0] * device_batch_size
    # The plan holds the GIL from start to end, so it is kept short. For numpy's
    # Generator, `rng.choice(n, p=probs)` is `cdf = probs.cumsum(); cdf /= cdf[-1]`, one
    # `rng.random()`, and `cdf.searchsorted(u, side="right")`, after checks of `probs`
    # that counts over their sum always pass: done here directly. When no shard list
    # runs out within the batch (no `_reset_shard`, which draws too), the uniforms
    # are drawn at once: `rng.random(k)` is k successive `rng.random()`. `total` is a
    # sum of whole numbers (exact in float64), so counting it down gives the value
    # `remaining.sum()` would.
    rng = loader.rng
    direct = type(rng) is numpy.random.Generator
    total = remaining.sum()
    uniforms = rng.random(device_batch_size) if direct and total >= device_batch_size else None
    for bi in range(device_batch_size):
        if total <= 0:
            for si in range(len(loader.files)):
                loader._reset_shard(si)
            remaining = numpy.array([len(s) for s in loader.start_inds], dtype=numpy.float64)
            total = remaining.sum()
        probs = remaining / total
        if direct:
            cdf = probs.cumsum()
            cdf /= cdf[-1]
            si = int(cdf.searchsorted(rng.random() if uniforms is None else uniforms[bi], side="right"))
        else:
            si = int(rng.choice(len(loader.files), p=probs))
        start_of_row[bi] = loader.start_inds[si].pop()
        remaining[si] -= 1
        total -= 1
        shard_of_row[bi] = si
    shards = {si: numpy.asarray(get_memmap(loader.files[si])) for si in dict.fromkeys(shard_of_row)}
    return loader.seq_len, numpy.array(shard_of_row, dtype=numpy.int64), numpy.array(start_of_row, dtype=numpy.int64), shards


def _shuffled_gather(plan, pin=False):
    """`(x, y)`: int64 `[rows, seq_len]` each, the two halves of one fresh buffer.

    One fancy index per shard (`tokens[starts[:, None] + arange(seq_len + 1)]`) and two
    casting copies into the buffer; no Python loop over rows.
    """
    seq_len, shard_of_row, start_of_row, shards = plan
    rows = len(start_of_row)
    if pin:
        pinned = torch.empty((2, rows, seq_len), dtype=torch.int64, pin_memory=True)
        out = pinned.numpy()
    else:
        out = numpy.empty((2, rows, seq_len), dtype=numpy.int64)
    offsets = numpy.arange(seq_len + 1, dtype=numpy.int64)
    for si, tokens in shards.items():
        picked = numpy.flatnonzero(shard_of_row == si)
        windows = tokens[start_of_row[picked, None] + offsets]
        out[0, picked] = windows[:, :-1]
        out[1, picked] = windows[:, 1:]
    batch = pinned if pin else torch.from_numpy(out)
    return batch[0], batch[1]
