"""`verify` for a data-loader module, the "module" driver (module mode): nanochat's `dataloader.py`.

The loader is the one a "module" family finds (`registry.module_loaders`); none is named here.

The module is not a script: nothing in it builds the loader. The harness builds it the
way `scripts/base_train.py` does, `loader(tokenizer, B, T, split="train", device=...,
resume_state_dict=...)`, for every rank, on a synthetic parquet corpus it writes with
pyarrow (a test extra, never a runtime dependency), with a byte-level test tokenizer
(`ByteTokenizer`: the two methods the loader calls, `get_bos_token_id()` and
`encode(texts, prepend=, num_threads=)`), or with `tokenizer="bpe"` a real BPE built as
nanochat's `RustBPETokenizer.train_from_iterator` builds it (`BPETokenizer`: rustbpe
trained on the synthetic corpus, wrapped in a `tiktoken.Encoding`). What the module imports from its own package
and the harness supplies (`get_dist_info` from the launcher's RANK / WORLD_SIZE,
`list_parquet_files` over the corpus) is written as stub modules beside it and named in
the notes. Both modules are imported by name from that package, so that the patched
one's spawned producer imports it as in a run.

Compared, for every rank: each batch's inputs, targets and state dict (dtype, shape,
bytes; values), when handed out and again after the next one is taken; then a resume
from the state dict of a batch part-way through, both modules resumed from it. The
verdict says whether the run crossed a row-group boundary, a file boundary and an
epoch; "identical" only where the states show it did.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import libcst as cst
import torch

from patcher.families import registry
from patcher.families.base import ModuleLoader
from patcher.proof.compare import CannotVerify, Difference, InFlight, VerifyResult, first_difference

# What the harness supplies for helpers the module imports from its own package.
STUBS = {
    "get_dist_info": (
        "def get_dist_info():\n"
        "    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))\n"
        "    return world > 1, rank, int(os.environ.get('LOCAL_RANK', rank)), world\n"
    ),
    "list_parquet_files": (
        "def list_parquet_files(data_dir=None, warn_on_legacy=False):\n"
        "    data_dir = data_dir or os.environ['PATCH_PREFETCH_PARQUET_DIR']\n"
        "    return sorted(os.path.join(data_dir, f) for f in os.listdir(data_dir) if f.endswith('.parquet'))\n"
    ),
}
# Arguments of the loader the harness sets by name (small, so that the run crosses row
# groups, files and epochs in a few dozen batches); every other parameter keeps its default.
CALL = {"B": 2, "T": 24, "split": "train", "tokenizer_threads": 1, "tokenizer_batch_size": 6, "buffer_size": 12}
# Batches per rank when `verify` is given none.
DEFAULT_BATCHES = 40
FILES, ROW_GROUPS, DOCS_PER_GROUP = 3, 3, 6
# The split of the loader an evaluation builds (the last parquet file, as in nanochat).
VAL_SPLIT = "val"


class ByteTokenizer:
    """A test tokenizer: token id = byte + 1, BOS = 0. Picklable (a spawned producer gets a copy)."""

    def get_bos_token_id(self) -> int:
        return 0

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """Ids of one string or a list of strings, with `prepend` / `append` ids."""
        if isinstance(text, str):
            return self.encode([text], prepend, append)[0]
        return [([prepend] if prepend is not None else []) + [b + 1 for b in t.encode("utf-8")] + ([append] if append is not None else []) for t in text]


# nanochat's tokenizer.py: the split pattern and special tokens its RustBPETokenizer trains with.
BPE_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
BPE_SPECIAL_TOKENS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>", "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
BPE_VOCAB = 512


class BPETokenizer:
    """nanochat's tokenizer as `RustBPETokenizer.train_from_iterator` builds it (nanochat/tokenizer.py):
    a rustbpe BPE trained on `texts` with nanochat's split pattern, its mergeable ranks wrapped
    in a `tiktoken.Encoding` with nanochat's special tokens (BOS = `<|bos|>`). Token ids are
    ints below `vocab_size`. Picklable (a spawned producer gets a copy; tiktoken pickles).
    Raises ImportError when rustbpe or tiktoken is not installed."""

    def __init__(self, texts: list[str], vocab_size: int = BPE_VOCAB):
        import rustbpe
        import tiktoken

        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(iter(texts), vocab_size - len(BPE_SPECIAL_TOKENS), pattern=BPE_SPLIT_PATTERN)
        ranks = {bytes(k): v for k, v in trainer.get_mergeable_ranks()}
        special = {name: len(ranks) + i for i, name in enumerate(BPE_SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name="rustbpe", pat_str=trainer.get_pattern(), mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = self.enc.n_vocab

    def get_bos_token_id(self) -> int:
        return self.enc.encode_single_token("<|bos|>")

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """Ids of one string or a list of strings, with `prepend` / `append` ids (nanochat's `encode`)."""
        if isinstance(text, str):
            return self.encode([text], prepend, append, num_threads)[0]
        return [([prepend] if prepend is not None else []) + ids + ([append] if append is not None else []) for ids in self.enc.encode_ordinary_batch(text, num_threads=num_threads)]


def corpus_texts(seed: int = 0) -> list[list[str]]:
    """The synthetic corpus's documents, per file: FILES lists of ROW_GROUPS * DOCS_PER_GROUP strings of 3-60 characters."""
    rng = random.Random(seed)
    return [["".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(3, 60))) for _ in range(ROW_GROUPS * DOCS_PER_GROUP)] for _ in range(FILES)]


def make_tokenizer(kind: str, seed: int = 0):
    """(tokenizer, how the verdict names it) for `kind` "byte" (`ByteTokenizer`) or "bpe"
    (`BPETokenizer` trained on the synthetic corpus). Raises CannotVerify when "bpe" lacks rustbpe or tiktoken."""
    if kind == "byte":
        return ByteTokenizer(), "byte-level stand-in"
    try:
        tokenizer = BPETokenizer([t for texts in corpus_texts(seed) for t in texts])
    except ImportError as error:
        raise CannotVerify(f"--tokenizer bpe needs rustbpe and tiktoken (pip install rustbpe tiktoken): {error}") from None
    return tokenizer, f"rustbpe BPE, vocab {tokenizer.vocab_size}, trained on the synthetic corpus"


def write_corpus(directory: Path, seed: int = 0) -> list[Path]:
    """FILES parquet files of ROW_GROUPS row groups of DOCS_PER_GROUP documents (column `text`, 3-60 characters)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for f, texts in enumerate(corpus_texts(seed)):
        path = directory / f"shard_{f:05d}.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=DOCS_PER_GROUP)
        paths.append(path)
    return paths


def module_loader(source: str) -> ModuleLoader | None:
    """The first loader generator that module mode rewrites in `source` (a "module"
    family's, `registry.module_loaders`), or None: then `source` is no data-loader module."""
    return next((lg for lg in registry.module_loaders(cst.parse_module(source)) if lg.refusal is None), None)


def verify_module(original: str, patched: str, original_path, batches: int | None = None, world_size: int = 2, seed: int = 0, tokenizer: str = "byte"):
    """Compare the original and patched module's loader for ranks 0..world_size-1. Returns a
    `VerifyResult` (`tokenizer` set to how the verdict names it); raises CannotVerify (one
    line) when the module cannot be driven.

    tokenizer: "byte" (a byte-level stand-in) or "bpe" (`BPETokenizer`, needs rustbpe and tiktoken)."""
    started = time.perf_counter()
    loader = module_loader(original)
    if loader is None:
        raise CannotVerify(f"{original_path}: no data-loader generator that module mode rewrites")
    name = loader.name
    batches = batches or DEFAULT_BATCHES
    notes: list[str] = []
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise CannotVerify("needs pyarrow (pip install 'patch-prefetch[test]')") from None
    params = [p for p in loader.function.params.params + loader.function.params.kwonly_params]
    missing = [p.name.value for p in params if p.default is None and p.name.value not in CALL and p.name.value not in ("tokenizer", loader.device)]
    if missing:
        raise CannotVerify(f"{name} needs {', '.join(missing)}, which the harness does not know how to give")
    call = {k: v for k, v in CALL.items() if k in {p.name.value for p in params}}
    tok, tokenizer_name = make_tokenizer(tokenizer, seed)
    with tempfile.TemporaryDirectory(prefix="verify-module-") as tmp:
        tmp = Path(tmp)
        package, stubbed = write_package(tmp, original, patched, Path(original_path).stem, notes)
        data = tmp / "data"
        data.mkdir()
        write_corpus(data, seed)
        notes.append(f"synthetic corpus: {FILES} parquet files x {ROW_GROUPS} row groups x {DOCS_PER_GROUP} documents (the last file is the val split); tokenizer: {tokenizer_name}")
        notes.append(f"stubbed for the module: {', '.join(stubbed)}; called as {name}(tokenizer, {', '.join(f'{k}={v!r}' for k, v in call.items())}, device=...)")
        compared, seen = 0, {"row group": 0, "file": 0, "epoch": 0}
        with package_importable(tmp, package):
            os.environ["PATCH_PREFETCH_PARQUET_DIR"] = str(data)
            for rank in range(world_size):
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
                modules = [importlib.import_module(f"{package}.{m}") for m in ("_verify_original", Path(original_path).stem)]
                original_fn, patched_fn = (getattr(m, name) for m in modules)
                reference = _draw(original_fn(tok, **call, **{loader.device: "cpu"}), batches)
                _count_crossings(reference, seen)
                for device in ("cuda-on-host", "cpu"):
                    difference = _compare(reference, patched_fn, dict(call, tokenizer=tok), loader.device, device, rank, "train")
                    if difference:
                        return VerifyResult(False, world_size, compared, difference, notes, time.perf_counter() - started, tokenizer=tokenizer_name)
                    compared += len(reference)
                    if rank:
                        break
                state = reference[len(reference) // 2][2]
                resumed = _draw(original_fn(tok, **call, resume_state_dict=state, **{loader.device: "cpu"}), batches // 2)
                difference = _compare(resumed, patched_fn, dict(call, tokenizer=tok, resume_state_dict=state), loader.device, "cuda-on-host", rank, f"resumed from {state}")
                if difference:
                    return VerifyResult(False, world_size, compared, difference, notes, time.perf_counter() - started, tokenizer=tokenizer_name)
                compared += len(resumed)
                if rank == 0 and loader.split is not None and loader.split[0] in call:
                    # another split's build runs the original here: no producer, same batches
                    other = dict(call, **{loader.split[0]: VAL_SPLIT})
                    val = _draw(original_fn(tok, **other, **{loader.device: "cpu"}), batches // 2)
                    difference = _compare(val, patched_fn, dict(other, tokenizer=tok), loader.device, "cuda-on-host", rank, f"{loader.split[0]}={VAL_SPLIT!r}", spawned=False)
                    if difference:
                        return VerifyResult(False, world_size, compared, difference, notes, time.perf_counter() - started, tokenizer=tokenizer_name)
                    compared += len(val)
                    notes.append(f"{loader.split[0]}={VAL_SPLIT!r} (rank 0, {len(val)} batches): run in the training process, no producer started (only {loader.split[0]}={loader.split[1]!r} spawns one)")
        crossed = [k for k, v in seen.items() if v]
        notes.append(f"rank states crossed: {', '.join(f'{k} boundary x{seen[k]}' for k in crossed) or 'nothing'}; each rank also resumed from the state dict of its batch {batches // 2}")
        notes.append("patched loader run on the CUDA path driven with host memory (pinned ring, events) for every rank, and on a CPU device for rank 0; each batch re-checked after the next is taken" + ("; the val build's batches as handed out (it keeps the original's lifetime)" if loader.split is not None else ""))
        result = VerifyResult(True, world_size, compared, None, notes, time.perf_counter() - started, tokenizer=tokenizer_name)
        if len(crossed) < 3:
            result.notes.append("partial: the run did not cross a row group, a file and an epoch boundary")
        return result


@contextlib.contextmanager
def package_importable(tmp: Path, package: str):
    """Within it, `package` (written under `tmp` by `write_package`) can be imported and the
    caller may set environment variables; on exit `sys.path`, `os.environ` and
    `sys.modules` are as they were (the package's modules dropped)."""
    env = dict(os.environ)
    sys.path.insert(0, str(tmp))
    try:
        yield
    finally:
        sys.path.remove(str(tmp))
        os.environ.clear()
        os.environ.update(env)
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]


def write_package(tmp: Path, original: str, patched: str, stem: str, notes: list[str]) -> tuple[str, list[str]]:
    """Write the package both modules live in (`<pkg>/_verify_original.py`, `<pkg>/<stem>.py`)
    and the stubs of what they import from it. Returns (package name, stubbed names)."""
    module = cst.parse_module(original)
    imports = {}
    for statement in module.body:
        for small in statement.body if isinstance(statement, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.ImportFrom) and small.module is not None and not isinstance(small.names, cst.ImportStar):
                dotted = cst.Module([]).code_for_node(small.module)
                for alias in small.names:
                    imports.setdefault(dotted, []).append(alias.name.value)
    own = [d for d in imports if "." in d and importlib.util.find_spec(d.split(".")[0]) is None]
    packages = sorted({d.split(".")[0] for d in own}) or ["loader_module"]
    package = packages[0]
    root = tmp / package
    root.mkdir()
    (root / "__init__.py").write_text("")
    stubbed = []
    for dotted in own:
        parts = dotted.split(".")
        unknown = [n for n in imports[dotted] if n not in STUBS]
        if unknown:
            raise CannotVerify(f"the module imports {', '.join(unknown)} from {dotted}, which the harness cannot supply")
        target = tmp.joinpath(*parts[:-1], parts[-1] + ".py")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("import os\n\n" + "\n".join(STUBS[n] for n in imports[dotted]))
        stubbed += [f"{dotted}.{n}" for n in imports[dotted]]
    (root / "_verify_original.py").write_text(original)
    (root / f"{stem}.py").write_text(patched)
    return package, stubbed


def _draw(generator, count: int) -> list:
    """`count` batches of `generator`, each copied when drawn (the original reuses its buffers)."""
    out = []
    for _ in range(count):
        inputs, targets, state = next(generator)
        out.append((inputs.clone(), targets.clone(), dict(state)))
    generator.close()
    return out


def _count_crossings(reference: list, seen: dict) -> None:
    """Count the row-group, file and epoch changes between consecutive batches' states."""
    for (_, _, a), (_, _, b) in zip(reference, reference[1:]):
        seen["row group"] += a["rg_idx"] != b["rg_idx"]
        seen["file"] += a["pq_idx"] != b["pq_idx"]
        seen["epoch"] += a["epoch"] != b["epoch"]


def _compare(reference: list, patched_fn, arguments: dict, device_param: str, device: str, rank: int, phase: str, spawned: bool = True) -> Difference | None:
    """The first difference between `reference` and the patched loader's batches, or None.

    spawned: whether the patched loader must run in a spawned producer (True) or in this
    process, starting no child (False: another split than the training one)."""
    import multiprocessing

    from patcher.proof.host_cuda import cuda_on_host

    on_host = device == "cuda-on-host"
    # A split left in the training process runs the original's own code: its copies are
    # compared as the original's are (at the end of each micro-step), not run ahead.
    context = cuda_on_host(run_ahead=None if spawned else 0) if on_host else _nothing()
    said = io.StringIO()
    with context, contextlib.redirect_stderr(said):
        children = set(multiprocessing.active_children())
        generator = patched_fn(**arguments, **{device_param: "cuda" if on_host else "cpu"})
        previous = None  # (index, batch) compared last: the spawned path promises it one `next()` longer
        in_flight = InFlight()
        index = 0
        try:
            for index, expected in enumerate(reference):
                got = next(generator)
                if index == 0 and not spawned and set(multiprocessing.active_children()) - children:
                    return Difference(rank, f"{phase} ({device})", 0, None, "the patched loader started a producer process for a split that should run in the training process")
                if spawned and previous is not None:
                    difference = first_difference(reference[previous[0]], previous[1])
                    if difference:
                        return Difference(rank, f"{phase} ({device}, after the next was taken)", previous[0], difference[0], difference[1])
                for which, batch in in_flight.drawn(index, got):
                    difference = first_difference(reference[which], batch)
                    if difference:
                        return Difference(rank, f"{phase} ({device}, handed out)", which, difference[0], difference[1])
                    previous = which, batch
            for which, batch in in_flight.landed():
                difference = first_difference(reference[which], batch)
                if difference:
                    return Difference(rank, f"{phase} ({device}, handed out)", which, difference[0], difference[1])
        except Exception as error:
            return Difference(rank, f"{phase} ({device})", index, None, f"the patched loader raised {type(error).__name__}: {error}")
        finally:
            generator.close()
    if spawned and "runs in the training process" in said.getvalue():  # the fallback path proves nothing about the producer
        return Difference(rank, f"{phase} ({device})", 0, None, "the patched loader did not start its spawned producer: " + said.getvalue().strip())
    return None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
