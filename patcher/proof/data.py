"""Synthetic data for a verify run, sized and placed for the script being verified.

Train shards for a loader class (sized from what the ranks read per call, so that the
run crosses shard boundaries and wraps around) and for a data generator (where the
script looks for them, with documents starting at the BOS id the script aligns to);
validation tokens for the evaluation loops. The shard file format itself is
`patcher.proof.shards`.
"""

from __future__ import annotations

import collections
import math
import os

import libcst as cst
import libcst.matchers as m
import numpy as np
import torch

from patcher.cst_walk import walk
from patcher.proof.harness import HarnessError, point_at_shards
from patcher.proof.recipes import IteratorRecipe
from patcher.proof.shards import DOC_LEN_RANGE, read_shard, shard_name, write_shard, write_shards


# Document lengths (tokens, BOS included) for scripts sized for web text.
WEB_DOC_LEN_RANGE = (128, 1024)


def write_loader_shards(data_dir: str, read_per_call: int, per_rank_call: int, seq_len: int, calls: int, seed: int, shard_tokens: int | None = None, train_shards: int = 4) -> int:
    """Write `train_shards` (4) train shards and 1 val shard for a loader class into `data_dir`
    (vocabulary 256, documents starting with BOS 1); returns the tokens per shard.

    The shards together hold about 3/5 of what all ranks read in `calls` calls (each
    call reads `read_per_call` tokens: its global tokens over the gradient accumulation
    steps, shared by the ranks), so every loader crosses shard boundaries, wraps around
    and (per-rank shard lists) reshuffles within the run; each shard still holds two
    per-rank batches of the largest call (`per_rank_call` tokens, rows of `seq_len` + 1).
    `shard_tokens`, where given, is the size instead (at least two rows)."""
    floor = 2 * (per_rank_call + seq_len + 1)
    if shard_tokens is None:
        tokens_per_shard = max(math.ceil(read_per_call * calls * 0.6 / 4), floor, 8 * (seq_len + 1))
    else:
        tokens_per_shard = max(int(shard_tokens), 2 * (seq_len + 1))
    write_shards(data_dir, train_shards=train_shards, val_shards=1, tokens_per_shard=tokens_per_shard, vocab_size=256, seed=seed, bos_id=1)
    return tokens_per_shard


def write_iterator_shards(recipe: IteratorRecipe, modules, root: str, tokens_per_item: int, items: int, seed: int, notes: list[str] | None, shard_tokens: int | None = None) -> "ShardMarks":
    """Shards for a data generator where the scripts look: `Hyperparameters.train_files`
    (pointed there in each of `modules`), or the glob literal of the construction
    (relative to the working directory, `root`); enough for `items` items of
    `tokens_per_item` tokens on every rank, or of `shard_tokens` tokens each where given
    (`--shard-tokens`: a generator that divides its argument by gradient accumulation
    reads far less than the sizing assumes). Notes what it wrote (where `notes` is not
    None). The train shards are marked (`ShardMarks`, returned) so that the boundaries a
    run crosses can be counted from the tokens it yields."""
    # Relative to the working directory (`root`): some scripts glob with Path.cwd().glob().
    data_dir = "data"
    call = cst.parse_expression(recipe.original[-1])
    literals = [n.evaluated_value for n in m.findall(call, m.SimpleString()) if "*" in str(n.evaluated_value)]
    if literals:
        data_dir = os.path.dirname(literals[0]) or "."
    hp_info = recipe.survey.hyperparameters
    for module in modules:
        cls = module.__dict__.get(hp_info.name) if hp_info is not None else None
        for name in ("args", "h", "hparams", "hyperparameters"):
            if name not in module.__dict__ and recipe.binds(name):
                try:
                    recipe.evaluate(name, module)
                except HarnessError:
                    continue
            value = module.__dict__.get(name)
            if cls is not None and isinstance(value, cls):
                point_at_shards(value, data_dir, os.path.join(data_dir, "fineweb_train_*.bin"))
    # Four shards holding 1.5 times what the run reads (a generator may walk the files
    # once, without wrapping around); every shard crossed, each holds several items.
    # An argument may be per rank (older generators: `batch_size` tokens for each of
    # `world_size` ranks per item): sized as if every rank read it.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tokens_per_shard = max(math.ceil(tokens_per_item * world_size * items * 1.5 / 4), 4 * tokens_per_item * world_size + 2)
    if shard_tokens is not None:
        tokens_per_shard = int(shard_tokens)
    bos_id, doc_lens = shard_documents(recipe, modules[0])
    vocab_size = max(256, bos_id + 1)
    write_shards(os.path.join(root, data_dir), train_shards=4, val_shards=1, tokens_per_shard=tokens_per_shard, vocab_size=vocab_size, seed=seed, bos_id=bos_id, doc_len_range=doc_lens)
    marks = ShardMarks(bos_id, vocab_size, 4, doc_lens)
    for index in range(4):
        marks.mark(os.path.join(root, data_dir, shard_name("train", index)), index)
    if notes is not None:
        notes.append(f"4 shards x {tokens_per_shard} tokens in {data_dir}/, documents starting with BOS {bos_id}" + ("" if shard_tokens is not None else f"; {tokens_per_item} tokens per item"))
    return marks


class ShardMarks:
    """Which train shard a token came from, told by its value: shard `i` of `shards`
    holds only the ids of band `i` (the ids other than BOS, in order, cut into
    `shards` bands of `band` ids). The synthetic token walk (steps 1-3) is kept within
    the band, so neighbouring windows still differ. Counts, per (rank, phase), the
    shard changes in the tokens of the items the original generator yields
    (`observe`): the shard boundaries a run crossed, measured, not estimated."""

    def __init__(self, bos_id: int, vocab_size: int, shards: int, doc_len_range: tuple[int, int] = DOC_LEN_RANGE):
        self.bos_id, self.shards, self.doc_len_range = bos_id, shards, doc_len_range
        self.band = (vocab_size - 1) // shards
        self.last: dict = {}
        self.crossed: collections.Counter = collections.Counter()
        self.unreadable = False  # an item whose first leaf is not a tensor of token ids

    def mark(self, path: str, index: int) -> None:
        """Rewrite the shard at `path` so that its tokens other than BOS lie in band `index`."""
        tokens = read_shard(path).astype(np.int64)
        others = tokens != self.bos_id
        position = tokens - (tokens > self.bos_id)  # index among the ids other than BOS
        position = position % self.band + index * self.band
        tokens[others] = (position + (position >= self.bos_id))[others]
        write_shard(path, tokens.astype(np.uint16))

    def reset(self, key) -> None:
        """Forget what was seen for `key` (a (rank, phase) built again)."""
        self.last.pop(key, None)
        self.crossed.pop(key, None)

    def observe(self, key, item) -> None:
        """Count the shard changes in the first tensor of `item` (its token ids), continuing from the last item seen for `key`."""
        leaf = _first_tensor(item)
        if leaf is None or leaf.dtype.is_floating_point or leaf.dtype == torch.bool:
            self.unreadable = True
            return
        tokens = leaf.detach().reshape(-1).to("cpu", torch.int64)
        tokens = tokens[tokens != self.bos_id]
        bands = torch.unique_consecutive((tokens - (tokens > self.bos_id).to(torch.int64)) // self.band).tolist()
        previous = self.last.get(key)
        for band in bands:
            if previous is not None and band != previous:
                self.crossed[key] += 1
            previous = band
        self.last[key] = previous

    def crossed_by(self, rank: int) -> int:
        """Shard boundaries crossed by `rank`'s original generators, over all phases."""
        return sum(count for (r, _phase), count in self.crossed.items() if r == rank)


def _first_tensor(item):
    """The first tensor of an item (a tensor, or the first found in a tuple, list or dict), else None."""
    if isinstance(item, torch.Tensor):
        return item
    if isinstance(item, (tuple, list)):
        for value in item:
            found = _first_tensor(value)
            if found is not None:
                return found
    if isinstance(item, dict):
        return _first_tensor(list(item.values()))
    return None


def shard_tokens_for_run(read_per_item: list[int], world_size: int, largest_item: int, boundaries: float = 2.5) -> int:
    """Tokens per synthetic shard for a generator run whose rank-0 items read
    `read_per_item` tokens of a shard each, in order (measured by a short draw of the
    original, `item_read`): all ranks together read `world_size` times that, so the run
    reads about `boundaries` shards (it crosses 2 boundaries and stays within the 4
    shards of a generator that walks its files once); each shard still holds two of
    the largest items (`largest_item` tokens read per rank) of all ranks."""
    read = sum(read_per_item) * world_size
    return max(math.ceil(read / boundaries), 2 * largest_item * world_size + 2)


def item_read(item, bos_id: int, doc_len_range: tuple[int, int]) -> tuple[int, int]:
    """(tokens of the first tensor of `item`, tokens of the shard it used up, about):
    a generator that starts each row at a document and cuts documents at its sequence
    length uses up whole documents (the BOS tokens it holds times the mean document
    length of the synthetic shards), one that reads the stream straight its own length
    plus one. Raises ValueError when the item holds no tensor."""
    leaf = _first_tensor(item)
    if leaf is None:
        raise ValueError("no tensor in the item")
    numel = int(leaf.numel())
    documents = int((leaf.detach().reshape(-1) == bos_id).sum()) if not leaf.dtype.is_floating_point else 0
    return numel, max(numel + 1, documents * sum(doc_len_range) // 2)


def shard_documents(recipe: IteratorRecipe, module) -> tuple[int, tuple[int, int]]:
    """(BOS id, document length range) of the synthetic shards of a data generator: the
    script's BOS id (`script_bos_id`, else a literal one) and web-text documents, else
    BOS 1 and short documents."""
    bos_id = script_bos_id(module)
    if bos_id is None:
        bos_id = _literal_bos_id(recipe)
    # A script that names its BOS id sizes buffers for web-text documents (modded-nanogpt:
    # "median doc length is ~400"); short synthetic documents would overflow them.
    return (1, DOC_LEN_RANGE) if bos_id is None else (bos_id, WEB_DOC_LEN_RANGE)


def generator_tokens_per_item(recipe: IteratorRecipe, module, sent: list) -> int:
    """The tokens one item of the generator may hold: the largest int among the last
    construction's arguments (65536 where it has none) and among the values in `sent`
    (a batch-size schedule can ask for bigger items than the construction)."""
    sent_ints = [v for value in sent for v in _ints_in(value)]
    return max([_largest_int_argument(recipe, recipe.original[-1], module), *sent_ints])


def _largest_int_argument(recipe: IteratorRecipe, code: str, module) -> int:
    """The largest int among the construction's arguments (the tokens per item), or 65536."""
    call = cst.parse_expression(code)
    values = []
    for arg in getattr(call, "args", []):
        try:
            value = recipe.evaluate(cst.Module([]).code_for_node(arg.value), module)
        except HarnessError:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            values.append(value)
    return max(values, default=65536)


def _ints_in(value) -> list[int]:
    """The ints in a sent value: the value itself, or the items of a tuple or list."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in items if isinstance(v, int) and not isinstance(v, bool)]


def script_bos_id(module) -> int | None:
    """The BOS token id the script aligns documents to: a module-level int whose name
    says BOS (`BOS_ID = 50256` in modded-nanogpt), else None. Shards without that id
    would leave a BOS-aligned generator with no document to start from."""
    for name, value in vars(module).items():
        if "BOS" in name.upper() and isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFF:
            return value
    return None


# GPT-2's end-of-text token: the document separator of modded-nanogpt's shards.
GPT2_EOT = 50256


def _literal_bos_id(recipe: IteratorRecipe) -> int | None:
    """The BOS id a generator compares tokens with when no module-level name holds it:
    a parameter default of the generator named like BOS (`bos_id=50256`), or GPT-2's
    end-of-text id written as a literal in the script; else None."""
    for function in recipe.survey.collector.functions:
        for param in function.params.params:
            if "bos" in param.name.value.lower() and m.matches(param.default, m.Integer()):
                return int(param.default.value)
    eot = str(GPT2_EOT)
    if any(isinstance(node, cst.Integer) and node.value == eot for node in walk(recipe.survey.module)):
        return GPT2_EOT
    return None


def val_tokens_for(hparams, world_size: int, seed: int) -> torch.Tensor:
    """Synthetic validation tokens, uint16: about 4 batches per rank plus a partial one."""
    seq_len = int(getattr(hparams, "eval_seq_len", 0) or getattr(hparams, "train_seq_len", 1024))
    batch = int(getattr(hparams, "val_batch_size", 0) or getattr(hparams, "val_batch_tokens", 0) or 64 * seq_len)
    n = world_size * 4 * batch + 3 * seq_len + 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.int32).to(torch.uint16)
