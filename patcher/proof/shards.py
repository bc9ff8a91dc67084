"""Synthetic token shards in the parameter-golf `fineweb_*.bin` format.

A shard file is a header of 256 little-endian int32 values followed by the tokens
as little-endian uint16:

    header[0] = 20240520   (magic)
    header[1] = 1          (version)
    header[2] = number of tokens in the file
    header[3:] = 0

so a shard of `n` tokens is exactly `256 * 4 + 2 * n` bytes. This is the format the
real training scripts read with `load_data_shard` / `np.memmap(..., offset=1024)`.

The token stream is synthetic but learnable, so the fixture training runs show a
falling loss: each token is the previous one plus a small random step (1, 2 or 3)
modulo the vocabulary. With `bos_id` set, documents of random length (see
`DOC_LEN_RANGE`) each begin with a BOS token, and `bos_id` appears nowhere else.

Everything is a deterministic function of the arguments (one `numpy.random.Generator`
seeded with `seed`, shards generated in order: train shards first, then val).

Command line:

    python -m patcher.proof.shards DIR [--train-shards N] [--val-shards N]
        [--tokens-per-shard N] [--vocab-size N] [--seed N] [--bos-id N]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 256 x int32 = 1024 bytes
TOKEN_BYTES = 2  # uint16

# Inclusive range of document lengths in tokens (BOS included) when `bos_id` is set.
DOC_LEN_RANGE = (16, 160)

DEFAULT_TOKENS_PER_SHARD = 2048
DEFAULT_VOCAB_SIZE = 128


def shard_name(split: str, index: int) -> str:
    """File name of shard `index` of `split` ("train" or "val"), e.g. `fineweb_train_000000.bin`."""
    return f"fineweb_{split}_{index:06d}.bin"


def _make_tokens(rng: np.random.Generator, n: int, vocab_size: int, bos_id: int | None, doc_len_range: tuple[int, int] = DOC_LEN_RANGE) -> np.ndarray:
    """Return `n` tokens, dtype uint16, shape (n,), values in [0, vocab_size).

    A walk with steps 1, 2, 3 (probabilities .6, .3, .1) modulo `vocab_size`, so that
    neighbouring windows differ; with `bos_id`, documents of `doc_len_range` tokens
    (BOS included) from position 0 on. Vectorised: verify writes shards of tens of
    millions of tokens for a script's own batch sizes.
    """
    steps = _STEPS[rng.integers(0, len(_STEPS), size=n, dtype=np.uint8)]
    start = int(rng.integers(vocab_size))
    # 3 n + vocab_size fits in uint32 for any shard this writes (n < 2**30).
    tokens = (np.cumsum(steps, dtype=np.uint32) + np.uint32(start)) % np.uint32(vocab_size)
    if bos_id is not None:
        # Ordinary tokens never equal bos_id: map them onto the other vocab_size - 1 ids.
        others = np.array([t for t in range(vocab_size) if t != bos_id], dtype=np.uint16)
        tokens = others[tokens % np.uint32(vocab_size - 1)]
        lo, hi = doc_len_range
        gaps = rng.integers(lo, hi + 1, size=n // lo + 1)
        starts = np.concatenate(([0], np.cumsum(gaps)))
        tokens[starts[starts < n]] = bos_id
    return tokens.astype(np.uint16)


# Steps of the token walk: 1, 2 and 3 with probabilities .6, .3 and .1.
_STEPS = np.array([1] * 6 + [2] * 3 + [3], dtype=np.uint8)


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` (1-D, integer values in [0, 65535]) as one shard file at `path`."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise ValueError("tokens must fit in uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0] = SHARD_MAGIC
    header[1] = SHARD_VERSION
    header[2] = tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        np.ascontiguousarray(tokens, dtype="<u2").tofile(f)


def write_shards(
    directory: str | os.PathLike,
    *,
    train_shards: int = 3,
    val_shards: int = 1,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    bos_id: int | None = None,
    doc_len_range: tuple[int, int] = DOC_LEN_RANGE,
) -> dict:
    """Write synthetic train and val shards into `directory` (created if missing).

    Takes: train_shards / val_shards: number of files of each split (>= 0 / >= 0);
    tokens_per_shard: tokens per file (>= 1); vocab_size: token ids are in
    [0, vocab_size), 2 <= vocab_size <= 65536; seed: int, the only source of
    randomness; bos_id: None, or a token id in [0, vocab_size) put at each
    document start (the first token of every shard is a document start);
    doc_len_range: inclusive (min, max) document length in tokens, BOS included.
    Writes `fineweb_train_000000.bin`, ... and `fineweb_val_000000.bin`, ...
    (see the module docstring for the byte layout).
    Returns: dict with "directory" (str), "train_files" / "val_files" (lists of str
    paths, sorted), "train_pattern" / "val_pattern" (glob strings), and the
    "tokens_per_shard", "vocab_size", "seed", "bos_id" used.
    """
    if not 2 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size must be in [2, 65536], got {vocab_size}")
    if tokens_per_shard < 1:
        raise ValueError(f"tokens_per_shard must be >= 1, got {tokens_per_shard}")
    if train_shards < 0 or val_shards < 0:
        raise ValueError("shard counts must be >= 0")
    if bos_id is not None and not 0 <= bos_id < vocab_size:
        raise ValueError(f"bos_id must be in [0, {vocab_size}), got {bos_id}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(seed))
    files: dict[str, list[str]] = {"train": [], "val": []}
    for split, count in (("train", train_shards), ("val", val_shards)):
        for i in range(count):
            path = out / shard_name(split, i)
            write_shard(path, _make_tokens(rng, tokens_per_shard, vocab_size, bos_id, doc_len_range))
            files[split].append(str(path))
    return {
        "directory": str(out),
        "train_files": files["train"],
        "val_files": files["val"],
        "train_pattern": str(out / "fineweb_train_*.bin"),
        "val_pattern": str(out / "fineweb_val_*.bin"),
        "tokens_per_shard": tokens_per_shard,
        "vocab_size": vocab_size,
        "seed": seed,
        "bos_id": bos_id,
    }


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Read one shard file, checking its header and size.

    Returns: the tokens, dtype uint16, shape (header[2],).
    Raises: ValueError when the magic, version or file size is wrong.
    """
    path = Path(path)
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header.size != HEADER_INTS:
        raise ValueError(f"{path}: short header ({header.size * 4} of {HEADER_BYTES} bytes)")
    if int(header[0]) != SHARD_MAGIC:
        raise ValueError(f"{path}: bad magic {int(header[0])}, expected {SHARD_MAGIC}")
    if int(header[1]) != SHARD_VERSION:
        raise ValueError(f"{path}: unsupported version {int(header[1])}, expected {SHARD_VERSION}")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + num_tokens * TOKEN_BYTES
    actual = path.stat().st_size
    if actual != expected:
        raise ValueError(f"{path}: size {actual} bytes, header says {num_tokens} tokens = {expected} bytes")
    tokens = np.fromfile(path, dtype="<u2", count=num_tokens, offset=HEADER_BYTES)
    return tokens.astype(np.uint16, copy=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m patcher.proof.shards",
        description="Write synthetic fineweb_{train,val}_NNNNNN.bin token shards.",
    )
    parser.add_argument("directory")
    parser.add_argument("--train-shards", type=int, default=3)
    parser.add_argument("--val-shards", type=int, default=1)
    parser.add_argument("--tokens-per-shard", type=int, default=DEFAULT_TOKENS_PER_SHARD)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bos-id", type=int, default=None)
    a = parser.parse_args(argv)
    info = write_shards(
        a.directory,
        train_shards=a.train_shards,
        val_shards=a.val_shards,
        tokens_per_shard=a.tokens_per_shard,
        vocab_size=a.vocab_size,
        seed=a.seed,
        bos_id=a.bos_id,
    )
    print(
        f"wrote {len(info['train_files'])} train + {len(info['val_files'])} val shards of "
        f"{info['tokens_per_shard']} tokens (vocab {info['vocab_size']}) to {info['directory']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
