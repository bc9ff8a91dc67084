"""Fuzz run of `patch-prefetch` over mutated training scripts: tracebacks, hangs, exit codes.

    python bench/fuzz.py [--count 10000] [--seed 1] [--jobs 1] [--out SUMMARY.json] [--failures DIR]

Inputs are built from the shapes of real records, the bundled fixtures (parameter-golf
TokenStream and ShuffledSequenceLoader scripts, readable and minified, lzma-wrapped,
modded-nanogpt generators, a nanochat best-fit packer, a round loop, ...) plus wrappers
built here from them (lzma raw / xz, zlib, bz2, gzip; base85, base64; one piece or
many). Input number N is made by `random.Random(f"{seed}:{N}")` alone, so one input is
made again, whatever ran before it, with `--start N --count 1`. An input is one of:

- statement mutations (libcst; mostly valid Python that reaches the survey and the
  transforms): statements deleted, duplicated, swapped, moved to another block,
  wrapped in `if`/`for`/`try`/`with`/`def`, inlined out of their block; names and
  attributes renamed (one use or all, `next_batch` and friends included); call arguments
  dropped, duplicated, swapped, made keywords or starred, replaced by constants; numbers
  changed; statements spliced in from another fixture or from a list of awkward ones;
  minified forms (`;`-joined lines, one-line bodies, tab indentation); a top-level
  slice of the script; the result re-wrapped in the seed's own exec wrapper or a new one;
- text and byte mutations (mostly bad input): a token deleted, inserted or swapped,
  a truncation, deep nesting, CRLF line endings, a BOM, byte flips in a wrapper's encoded
  literal or in its compressed payload, a payload mutated and re-packed, a
  decompression bomb, raw byte flips, insertions, deletions (invalid UTF-8, NUL bytes);
- both, statement mutations first.

Each command runs in a child forked from this process (patcher already imported, so a
run costs what the command costs), in its own process group and working directory,
with stdout and stderr captured; a child past its bound is killed with its group (an
alarm in this process would not stop a loop in C code, a kill does). Commands per input:

- patch: `patch-prefetch IN -o OUT --json --no-check` plus flags drawn per input
  (`--diagnostics --with round_overlap`, `--only F`, `--skip F`, `--diff`,
  `--producer-toggles`, `--no-rewrap`, `--byte-breakdown`); every `--check-every`-th
  input without `--no-check` (the Python 3.10 compile and the import smoke, which
  spawn processes; `--timeout 20`);
- repatch: every `--repatch-every`-th input that patched (exit 0): the output patched
  again with the same flags: exit 0 and the same bytes ("already patched"), or exit 3
  where the first patch injected no runtime (the MLP square rewrite leaves no mark);
- check: `patch-prefetch check IN --no-import --json` every `--check-cmd-every`-th input;
- verify: `patch-prefetch verify IN OUT --batches 4 --json` every `--verify-every`-th
  input that patched.

Failures: a traceback (an exception escaping the command, or "Traceback" in its
output), a hang (a command past its bound: `--timeout` seconds, 5 times that with the
check or for verify), a death by signal, an exit code outside the command's set
(patch 0/2/3, 4 with the check), a --json stdout that is not one JSON document, an
exit 2 whose stderr is not one line naming the input, an input file changed, an output
written by a failed patch, a file left where the command ran (a temporary file), a
repatch that changes the output or misses the runtime the patch injected. Each failing
input is saved under `--failures` as SEED-NNNNNN-COMMAND-KIND.py with a .txt beside it
(how the input was made, the command to run it again, its stderr and stdout). A verify that finds different batches (exit 1) is
listed apart ("differs"), with its input saved: a lead to read, not a crash.

Prints progress on stderr, the summary as JSON on stdout (and to `--out`), and last a
verdict line naming what ran. Exit 0 when there was no failure, 1 otherwise.
"""

from __future__ import annotations

import argparse
import base64
import bz2
import contextlib
import dataclasses
import functools
import gzip
import io
import json
import lzma
import os
import random
import resource
import selectors
import signal
import statistics
import sys
import tempfile
import time
import tokenize
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patcher.cli import main as cli_main  # noqa: E402
from patcher.read.source import MAX_SOURCE_BYTES, SourceError, read_script  # noqa: E402
from patcher.read.wrapper import _ENCODERS, _compress, build_literal, render_module  # noqa: E402
from patcher.transforms.features import DIAGNOSTICS, FEATURES, INJECTED_NAMES  # noqa: E402

PATCH_EXITS = {0, 2, 3}
PATCH_CHECK_EXITS = {0, 2, 3, 4}
CHECK_EXITS = {0, 1, 2}
VERIFY_EXITS = {0, 1, 2, 3}
DEFAULT_FAILURES = Path(tempfile.gettempdir()) / "patch-prefetch-fuzz"
INSERT_POOL = ["(", ")", "[", "]", "{", "}", ":", ",", ".", "=", "+", "*", "**", "lambda", "def", "class", "if", "else",
               "return", "yield", "not", "None", "0", "1.5", "'s'", 'f"{x}"', "\n", "\t", "    ", "\\\n", "#", "@",
               "next_batch", "self", "import", "async", "await", "\\", '"""', "'", "\r", "\ufeff", "é", "\x0c"]
NAME_POOL = ["next_batch", "take", "reset", "send", "__next__", "__iter__", "__init__", "tokens", "pos", "files", "file_idx",
             "train_loader", "val_loader", "calib_loader", "loader", "device", "cuda", "to", "pin_memory", "non_blocking",
             "DistributedTokenLoader", "TokenStream", "ShuffledSequenceLoader", "DocumentPackingLoader", "DistributedDataLoader",
             "distributed_data_generator", "Hyperparameters", "main", "log0", "log", "x", "y", "self", "range", "torch", "np",
             "os", "environ", "get", "square", "relu", "leaky_relu", "linear", "eval_val", "step", "args", "h", "rank",
             "world_size", "grad_accum_steps", "train_seq_len", "train_batch_tokens", "seq_len", "global_tokens", "print",
             "exec", "__file__", "__name__", "threading", "Thread", "start", "_load_shard", "memmap", "fromfile", "iter", "next"]
CONSTANT_POOL = ["0", "1", "-1", "2", "3", "7", "1024", "2**31", "10**9", "True", "False", "None", "0.5", "'cuda'", "''", "x"]
# Statements a real record could hold somewhere, spliced in whole (a few do not compile: bad input).
SNIPPETS = [
    "import threading\n", "threading.Thread(target=print, daemon=True).start()\n", "from __future__ import annotations\n",
    "global train_loader\n", "del train_loader\n", "train_loader = None\n",
    "x, y = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)\n",
    "x, y = train_loader.next_batch(step, args.train_seq_len)\n",
    "train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)\n",
    "train_loader = ShuffledSequenceLoader(h, device)\n",
    "for x, y in train_loader:\n    pass\n", "train_loader = iter(train_loader)\n", "next_batch = train_loader.next_batch\n",
    "x, y = next(train_loader)\n", "train_loader.send((1, 2))\n", "torch.cuda.synchronize()\n",
    "os.environ['TRAIN_PREFETCH'] = '0'\n", "__wrapper_size__ = 123\n",
    "exec(open(__file__.replace('train_gpt.py', 'train_gpt_decode.py')).read())\n",
    "import lzma as L, base64 as B\n", "exec(L.decompress(B.b85decode('')))\n",
    "@dataclass\nclass Hyperparameters:\n    x: int = 1\n",
    "class DistributedTokenLoader:\n    def next_batch(self, *a):\n        return a\n",
    "def next_batch(self):\n    yield from self\n", "async def main():\n    await x\n",
    "if __name__ == '__main__':\n    main()\n", "match x:\n    case 1:\n        pass\n",
    "self.pos += 1\n", "np.random.seed(0)\n", "random.shuffle(self.files)\n", "torch.distributed.barrier()\n",
    "x = x.to(self.device, non_blocking=True)\n", "return x.cuda(), y.cuda()\n", "yield x, y\n",
    "train_loader.next_batch = lambda *a: a\n", "setattr(train_loader, 'next_batch', None)\n",
    "with torch.no_grad():\n    x, y = train_loader.next_batch(1, 2, 3)\n",
    "try:\n    x, y = train_loader.next_batch(1, 2, 3)\nexcept StopIteration:\n    pass\n",
    "x = torch.relu(self.fc(x)).square()\n", "x = F.leaky_relu(F.linear(x, w.to(x.dtype)), negative_slope=0.5).square()\n",
    "type X = int\n", "def f[T](x: T) -> T:\n    return x\n", "x = f'{d[\"k\"]}'\n", "lambda: (yield)\n",
]
WRAP_TEMPLATES = [
    "if True:\n    pass\n", "if __name__ == '__main__':\n    pass\n", "for _ in range(1):\n    pass\n",
    "while True:\n    pass\n", "with contextlib.nullcontext():\n    pass\n", "try:\n    pass\nexcept Exception:\n    pass\n",
    "try:\n    pass\nfinally:\n    pass\n", "def _scope():\n    pass\n", "class _Scope:\n    pass\n", "async def _scope():\n    pass\n",
]


# --------------------------------------------------------------------------- seeds


class Seed:
    """One starting point. name: fixture (and wrapping); text: the file's text; script:
    it as read (None where read_script refuses it); module: the plain source parsed
    (None where it does not read). Both are made on first use, once."""

    def __init__(self, name: str, text: str, base: "Seed | None" = None):
        self.name, self.text, self.base = name, text, base

    @functools.cached_property
    def script(self):
        return _read_text(self.text)

    @functools.cached_property
    def module(self) -> cst.Module | None:
        if self.base is not None:  # a wrapping of a plain fixture: the same payload
            return self.base.module
        script = self.script
        if script is None:
            return None
        return script.module if script.module is not None else cst.parse_module(script.source)


def _wrap(code: str, codec: str, encoding: str, width: int | None, raw: bool = False, size: bool = True) -> str:
    """`code` in an exec wrapper: `codec` compression, `encoding` text, pieces of `width`
    characters; with `size`, a `__wrapper_size__` line holding the file's size, as records have."""
    data = code.encode("utf-8", "surrogatepass")
    kw = ""
    if codec == "lzma":
        blob = lzma.compress(data, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}]) if raw else lzma.compress(data)
        kw = ',format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]' if raw else ""
        head = "import lzma as L,base64 as B"
    elif codec == "zlib":
        blob, head = zlib.compress(data, 9), "import zlib as L,base64 as B"
    elif codec == "bz2":
        blob, head = bz2.compress(data), "import bz2 as L,base64 as B"
    else:
        blob, head = gzip.compress(data, mtime=0), "import gzip as L,base64 as B"
    enc = {"b85decode": base64.b85encode, "b64decode": base64.b64encode}[encoding](blob).decode()
    if width:
        literal = "\n".join(f'"{enc[i:i + width]}"' for i in range(0, len(enc), width))
    else:
        literal = f'"{enc}"'
    tail = f"exec(L.decompress(B.{encoding}({literal}){kw}))\n"
    if not size:
        return f"{head}\n{tail}"
    n = 0
    while True:  # the size counts its own digits
        text = f"{head}\n__wrapper_size__={n}\n{tail}"
        if len(text.encode("utf-8", "surrogatepass")) == n:
            return text
        n = len(text.encode("utf-8", "surrogatepass"))


# label -> _wrap arguments (codec, encoding, piece width, raw lzma, size line)
WRAPPINGS = [("lzma-raw-b85", ("lzma", "b85decode", 100, True, True)), ("xz-b85-1", ("lzma", "b85decode", None, False, False)),
             ("zlib-b64", ("zlib", "b64decode", 76, False, True)), ("bz2-b85", ("bz2", "b85decode", 200, False, True)),
             ("gzip-b64", ("gzip", "b64decode", None, False, False))]


def _read_text(text: str):
    """`text` as read_script reads it from a file (None where it refuses it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False, encoding="utf-8", errors="surrogatepass", newline="") as f:
        f.write(text)
    try:
        return read_script(f.name)
    except (SourceError, OSError, ValueError, RecursionError, MemoryError):
        return None
    finally:
        os.unlink(f.name)


def seeds() -> list[Seed]:
    """Every seed: each fixture, and each plain fixture in every wrapping of WRAPPINGS."""
    out = []
    for path in sorted((ROOT / "fixtures").glob("*.py")):
        if path.name == "make_wrapped.py":
            continue
        text = path.read_text()
        plain = Seed(path.name, text)
        out.append(plain)
        if path.stem.startswith("wrapped_"):
            continue
        for label, how in WRAPPINGS:
            out.append(Seed(f"{path.stem}.{label}", _wrap(text, *how), base=plain))
    return out


# --------------------------------------------------------------------------- text and byte mutations


def _tokens(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the tokens of `text` (as far as it tokenizes)."""
    # Lines as tokenize reads them (only \n, \r\n and \r end a line, not \x0c or U+2028).
    lines = io.StringIO(text, newline="").readlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans = []
    try:
        for tok in tokenize.generate_tokens(iter(lines).__next__):
            if tok.type in (tokenize.ENDMARKER, tokenize.DEDENT) or tok.start == tok.end:
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            if r0 - 1 < len(starts) and r1 - 1 < len(starts):
                spans.append((starts[r0 - 1] + c0, starts[r1 - 1] + c1))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return spans


def _token_mutation(text: str, rng: random.Random) -> str:
    spans = _tokens(text)
    if not spans:
        return text[: rng.randrange(len(text) + 1)]
    kind = rng.choice(["delete", "insert", "swap"])
    a, b = spans[rng.randrange(len(spans))]
    if kind == "delete":
        return text[:a] + text[b:]
    if kind == "insert":
        at = rng.choice((a, b))
        return text[:at] + rng.choice(INSERT_POOL) + " " * rng.randrange(2) + text[at:]
    c, d = spans[rng.randrange(len(spans))]
    if (a, b) > (c, d):
        a, b, c, d = c, d, a, b
    if b > c:
        return text
    return text[:a] + text[c:d] + text[b:c] + text[a:b] + text[d:]


def _deep(rng: random.Random) -> str:
    n = rng.choice([50, 99, 150, 199, 250, 1000, 5000, 20000])
    shape = rng.choice(["paren", "bracket", "call", "unary", "sum", "lambda", "indent"])
    if shape == "paren":
        return "x = " + "(" * n + "1" + ")" * n + "\n"
    if shape == "bracket":
        return "x = " + "[" * n + "]" * n + "\n"
    if shape == "call":
        return "x = " + "f(" * n + ")" * n + "\n"
    if shape == "unary":
        return "x = " + "-" * n + "1\n"
    if shape == "sum":
        return "x = " + "+".join(["1"] * n) + "\n"
    if shape == "lambda":
        return "x = " + "lambda: " * n + "1\n"
    return "".join("    " * i + "if x:\n" for i in range(min(n, 300))) + "    " * min(n, 300) + "pass\n"


def _splice_line(text: str, insert: str, rng: random.Random) -> str:
    lines = text.splitlines(True)
    at = rng.randrange(len(lines) + 1)
    return "".join(lines[:at]) + insert + "".join(lines[at:])


def _repack(script, payload: str, rng: random.Random, flip: bool) -> str | None:
    """The wrapper `script` was read from, holding `payload` instead, packed as the tool
    packs it (same codec, encoding, pieces); with `flip`, bits of the compressed payload
    flipped. None where it cannot be packed (a payload that is not UTF-8)."""
    w = script.wrapper
    try:
        blob = _compress(w.codec, payload.encode("utf-8"), w.compress_kwargs[0])
    except UnicodeEncodeError:
        return None
    if flip:
        blob = bytearray(blob)
        for _ in range(rng.randrange(1, 4)):
            if blob:
                blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        blob = bytes(blob)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))  # libcst prints a literal of N pieces N levels deep
    try:
        return render_module(w, build_literal(w, _ENCODERS[w.encoding](blob).decode("ascii")))
    finally:
        sys.setrecursionlimit(limit)


def text_mutations(text: str, rng: random.Random) -> tuple[str, list[str]]:
    """One to three text mutations of `text`; returns (text, names of the mutations)."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choice(["token", "token", "token", "truncate", "deep", "flip", "payload", "payload", "crlf", "bom", "bomb"])
        script = None
        if kind in ("flip", "payload", "bomb"):
            script = _read_text(text)
            if script is None or not script.wrapped:
                kind = "token"
        if kind == "token":
            text = _token_mutation(text, rng)
        elif kind == "truncate":
            text = text[: rng.randrange(len(text) + 1)]
        elif kind == "deep":
            text = _splice_line(text, _deep(rng), rng)
        elif kind == "crlf":
            text = text.replace("\r\n", "\n").replace("\n", "\r\n")
        elif kind == "bom":
            text = "\ufeff" + text.lstrip("\ufeff")
        elif kind == "flip":  # characters of the encoded literal (base85/64 alphabet or not)
            spans = [s for s in _tokens(text) if s[0] < len(text) and text[s[0]] in "\"'bB" and s[1] - s[0] > 20]
            if spans:
                a, b = rng.choice(spans)
                chars = list(text)
                for _ in range(rng.randrange(1, 4)):
                    i = rng.randrange(a + 1, b - 1)
                    chars[i] = chr(rng.randrange(33, 127)) if chars[i] not in "\"'\n\\" else chars[i]
                text = "".join(chars)
        else:  # payload, bomb
            payload = (" " * (MAX_SOURCE_BYTES + rng.randrange(1, 4096))) if kind == "bomb" else _token_mutation(script.source, rng)
            flip = kind == "payload" and rng.random() < 0.3
            repacked = _repack(script, payload, rng, flip)
            if repacked is None:
                continue
            text = repacked
            kind = "payload-byteflip" if flip else kind
        done.append(kind)
    return text, done


def byte_mutations(data: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    """One to three raw byte mutations (the result need not be UTF-8)."""
    data = bytearray(data)
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.choice(["bitflip", "insert", "delete", "duplicate", "truncate", "nul"])
        at = rng.randrange(len(data) + 1)
        if kind == "bitflip" and data:
            for _ in range(rng.randrange(1, 5)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == "insert":
            data[at:at] = bytes(rng.choice([0x80, 0xFF, 0xC3, 0xE2, 0x00, 0x0C, 0x0B, 0x1A, rng.randrange(256)]) for _ in range(rng.randrange(1, 4)))
        elif kind == "delete":
            del data[at : at + rng.randrange(1, 64)]
        elif kind == "duplicate":
            data[at:at] = data[at : at + rng.randrange(1, 200)]
        elif kind == "truncate":
            del data[at:]
        elif kind == "nul":
            data[at:at] = b"\x00"
        done.append(f"byte-{kind}")
    return bytes(data), done


# --------------------------------------------------------------------------- statement mutations (libcst)

BODY_KINDS = (cst.Module, cst.IndentedBlock)  # bodies of statements
SMALL_KINDS = (cst.SimpleStatementLine, cst.SimpleStatementSuite)  # bodies of small statements
COMPOUND_WITH_BLOCK = (cst.If, cst.For, cst.While, cst.With, cst.Try, cst.FunctionDef, cst.ClassDef)


def _walk(node: cst.CSTNode, kinds: tuple, found: list, path: list) -> None:
    """Append (node, path) for every node of `kinds` under `node`, in pre-order; a path is
    the (field, index or None) steps from the root. Plain recursion over the dataclass
    fields: a libcst visitor costs about ten times as much."""
    if isinstance(node, kinds):
        found.append((node, tuple(path)))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if isinstance(value, cst.CSTNode):
            path.append((f.name, None))
            _walk(value, kinds, found, path)
            path.pop()
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, cst.CSTNode):
                    path.append((f.name, i))
                    _walk(item, kinds, found, path)
                    path.pop()


_FOUND: dict = {}  # (id(module), kinds) -> (module, [(node, path)]): a seed is walked once, not once per input


def _found(module: cst.Module, kinds: tuple) -> list:
    key = (id(module), kinds)
    if key not in _FOUND or _FOUND[key][0] is not module:
        found: list = []
        _walk(module, kinds, found, [])
        if len(_FOUND) > 256:
            _FOUND.pop(next(iter(_FOUND)))
        _FOUND[key] = (module, found)
    return _FOUND[key][1]


def _numbered(module: cst.Module, kinds: tuple, where=lambda node: True) -> list[tuple[int, cst.CSTNode]]:
    """(pre-order number, node) of the nodes of `kinds` in `module` that `where` accepts."""
    return [(i, n) for i, (n, _) in enumerate(_found(module, kinds)) if where(n)]


def _replace_at(node: cst.CSTNode, path: tuple, change) -> cst.CSTNode:
    if not path:
        return change(node)
    (name, i), rest = path[0], path[1:]
    value = getattr(node, name)
    if i is None:
        return node.with_changes(**{name: _replace_at(value, rest, change)})
    items = list(value)
    items[i] = _replace_at(items[i], rest, change)
    return node.with_changes(**{name: type(value)(items) if isinstance(value, tuple) else items})


def _edit(module: cst.Module, kinds: tuple, edits: dict) -> cst.Module:
    """`module` with node number i (of `_numbered(module, kinds)`) replaced by
    `edits[i](node)`, the deepest first, so that an edit of a block sees the edits made
    inside it; only the nodes on the way down are rebuilt."""
    found = _found(module, kinds)
    for i in sorted(edits, key=lambda i: -len(found[i][1])):
        module = _replace_at(module, found[i][1], edits[i])
    return module


def _pick(rng: random.Random, items: list):
    return items[rng.randrange(len(items))] if items else None


def _statement_bodies(module: cst.Module, nonempty: bool = True) -> list[tuple[int, cst.CSTNode]]:
    return _numbered(module, BODY_KINDS + SMALL_KINDS, lambda n: len(n.body) > 0 or not nonempty)


def _same_family(a: cst.CSTNode, b: cst.CSTNode) -> bool:
    return isinstance(a, BODY_KINDS) == isinstance(b, BODY_KINDS)


def _with_body(holder: cst.CSTNode, body: list) -> cst.CSTNode:
    if not body and isinstance(holder, SMALL_KINDS):
        body = [cst.Pass()]
    return holder.with_changes(body=body)


def _m_delete(module, rng, ctx):
    i, holder = _pick(rng, _statement_bodies(module)) or (None, None)
    if holder is None:
        return None
    k = rng.randrange(len(holder.body))
    n = rng.choice([1, 1, 1, 2, 5])
    return _edit(module, BODY_KINDS + SMALL_KINDS, {i: lambda u: _with_body(u, list(u.body[:k]) + list(u.body[k + n :]))})


def _m_duplicate(module, rng, ctx):
    i, holder = _pick(rng, _statement_bodies(module)) or (None, None)
    if holder is None:
        return None
    k, at = rng.randrange(len(holder.body)), rng.randrange(len(holder.body) + 1)
    return _edit(module, BODY_KINDS + SMALL_KINDS, {i: lambda u: u.with_changes(body=list(u.body[:at]) + [u.body[k]] + list(u.body[at:]))})


def _m_swap(module, rng, ctx):
    i, holder = _pick(rng, _numbered(module, BODY_KINDS + SMALL_KINDS, lambda n: len(n.body) > 1)) or (None, None)
    if holder is None:
        return None
    a, b = rng.sample(range(len(holder.body)), 2)

    def swap(u):
        body = list(u.body)
        body[a], body[b] = body[b], body[a]
        return u.with_changes(body=body)

    return _edit(module, BODY_KINDS + SMALL_KINDS, {i: swap})


def _m_move(module, rng, ctx):
    """A statement taken out of one block and put into another of the same kind."""
    holders = _statement_bodies(module)
    src = _pick(rng, holders)
    if src is None:
        return None
    targets = [h for h in _statement_bodies(module, nonempty=False) if _same_family(h[1], src[1]) and h[0] != src[0]]
    dst = _pick(rng, targets)
    if dst is None:
        return None
    k = rng.randrange(len(src[1].body))
    moved = src[1].body[k]
    at = rng.randrange(len(dst[1].body) + 1)
    edits = {
        src[0]: lambda u: _with_body(u, list(u.body[:k]) + list(u.body[k + 1 :])),
        dst[0]: lambda u: u.with_changes(body=list(u.body[:at]) + [moved] + list(u.body[at:])),
    }
    return _edit(module, BODY_KINDS + SMALL_KINDS, edits)


def _m_wrap(module, rng, ctx):
    """A statement (or a run of them) put inside an if/for/while/with/try/def/class."""
    i, holder = _pick(rng, _numbered(module, BODY_KINDS, lambda n: len(n.body) > 0)) or (None, None)
    if holder is None:
        return None
    k = rng.randrange(len(holder.body))
    n = rng.choice([1, 1, 2, 4])
    template = cst.parse_statement(rng.choice(WRAP_TEMPLATES))

    def wrap(u):
        inner = list(u.body[k : k + n])
        if isinstance(template, cst.While):
            inner.append(cst.SimpleStatementLine([cst.Break()]))
        stmt = template.with_changes(body=template.body.with_changes(body=inner))
        return u.with_changes(body=list(u.body[:k]) + [stmt] + list(u.body[k + n :]))

    return _edit(module, BODY_KINDS, {i: wrap})


def _m_inline(module, rng, ctx):
    """A compound statement replaced by its own block (a function's body at its level, ...)."""
    def inlinable(n):
        return any(isinstance(s, COMPOUND_WITH_BLOCK) and isinstance(s.body, cst.IndentedBlock) for s in n.body)

    i, holder = _pick(rng, _numbered(module, BODY_KINDS, inlinable)) or (None, None)
    if holder is None:
        return None
    k = _pick(rng, [j for j, s in enumerate(holder.body) if isinstance(s, COMPOUND_WITH_BLOCK) and isinstance(s.body, cst.IndentedBlock)])
    return _edit(module, BODY_KINDS, {i: lambda u: u.with_changes(body=list(u.body[:k]) + list(u.body[k].body.body) + list(u.body[k + 1 :]))})


def _names_in(module: cst.Module) -> list[str]:
    return sorted({n.value for _, n in _numbered(module, (cst.Name,))})


def _new_name(rng: random.Random, module: cst.Module) -> str:
    if rng.random() < 0.6:
        return rng.choice(NAME_POOL)
    names = _names_in(module)
    return rng.choice(names) if names else "x"


def _m_rename_attr(module, rng, ctx):
    i, node = _pick(rng, _numbered(module, (cst.Attribute,))) or (None, None)
    if node is None:
        return None
    name = _new_name(rng, module)
    return _edit(module, (cst.Attribute,), {i: lambda u: u.with_changes(attr=cst.Name(name))})


def _m_rename_one(module, rng, ctx):
    i, node = _pick(rng, _numbered(module, (cst.Name,))) or (None, None)
    if node is None:
        return None
    name = _new_name(rng, module)
    return _edit(module, (cst.Name,), {i: lambda u: u.with_changes(value=name)})


def _m_rename_all(module, rng, ctx):
    """Every use of one name renamed (definitions, attributes, keywords alike)."""
    names = _names_in(module)
    if not names:
        return None
    old = rng.choice(["next_batch", "train_loader", "DistributedTokenLoader", "TokenStream", "take", "device", "main"] if rng.random() < 0.3 else names)
    new = _new_name(rng, module) if rng.random() < 0.5 else old + rng.choice(["_", "2", "_v2", "X"])
    hits = {i: (lambda u: u.with_changes(value=new)) for i, n in _numbered(module, (cst.Name,)) if n.value == old}
    return _edit(module, (cst.Name,), hits) if hits else None


def _constant(rng: random.Random) -> cst.BaseExpression:
    return cst.parse_expression(rng.choice(CONSTANT_POOL))


def _m_call_args(module, rng, ctx):
    i, call = _pick(rng, _numbered(module, (cst.Call,))) or (None, None)
    if call is None:
        return None
    op = rng.choice(["drop", "duplicate", "swap", "constant", "add", "keyword", "star", "clear"])
    const, word = _constant(rng), rng.choice(NAME_POOL)

    def change(u):
        args = list(u.args)
        k = rng.randrange(len(args)) if args else None
        if op == "drop" and args:
            del args[k]
        elif op == "duplicate" and args:
            args.insert(rng.randrange(len(args) + 1), args[k])
        elif op == "swap" and len(args) > 1:
            a, b = rng.sample(range(len(args)), 2)
            args[a], args[b] = args[b], args[a]
        elif op == "constant" and args:
            args[k] = args[k].with_changes(value=const)
        elif op == "keyword" and args:
            args[k] = args[k].with_changes(keyword=cst.Name(word), equal=cst.AssignEqual(), star="")
        elif op == "star" and args:
            args[k] = args[k].with_changes(star=rng.choice(["*", "**"]), keyword=None, equal=cst.MaybeSentinel.DEFAULT)
        elif op == "clear":
            args = []
        else:  # add
            args.insert(rng.randrange(len(args) + 1), cst.Arg(const))
        # the last argument's explicit comma stays where it was: take commas off, the default puts them back
        args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in args]
        return u.with_changes(args=args)

    return _edit(module, (cst.Call,), {i: change})


def _m_number(module, rng, ctx):
    i, node = _pick(rng, _numbered(module, (cst.Integer, cst.Float))) or (None, None)
    if node is None:
        return None
    const = _constant(rng)
    return _edit(module, (cst.Integer, cst.Float), {i: lambda u: const})


def _m_splice(module, rng, ctx):
    """A statement of another fixture, or one of SNIPPETS, put into a block of this one."""
    donor = rng.choice(ctx["donors"]).module if rng.random() < 0.5 else None
    if donor is not None:
        holders = _numbered(donor, BODY_KINDS + SMALL_KINDS, lambda n: len(n.body) > 0)
        _, holder = _pick(rng, holders)
        stmt = rng.choice(holder.body)
    else:
        stmt = _pick(rng, ctx["snippets"])
        if stmt is None:
            return None
    compound = not isinstance(stmt, cst.BaseSmallStatement)
    dst = _pick(rng, [h for h in _statement_bodies(module, nonempty=False) if isinstance(h[1], BODY_KINDS) == compound])
    if dst is None:
        return None
    at = rng.randrange(len(dst[1].body) + 1)
    return _edit(module, BODY_KINDS + SMALL_KINDS, {dst[0]: lambda u: u.with_changes(body=list(u.body[:at]) + [stmt] + list(u.body[at:]))})


def _m_join_lines(module, rng, ctx):
    """Minified style: consecutive simple lines of a block joined with `;`."""
    def runs(n):
        return any(isinstance(a, cst.SimpleStatementLine) and isinstance(b, cst.SimpleStatementLine) for a, b in zip(n.body, n.body[1:]))

    i, holder = _pick(rng, _numbered(module, BODY_KINDS, runs)) or (None, None)
    if holder is None:
        return None
    starts = [j for j, (a, b) in enumerate(zip(holder.body, holder.body[1:])) if isinstance(a, cst.SimpleStatementLine) and isinstance(b, cst.SimpleStatementLine)]
    k = rng.choice(starts)
    end = k + 1
    while end < len(holder.body) and isinstance(holder.body[end], cst.SimpleStatementLine) and end - k < rng.choice([2, 4, 50]):
        end += 1

    def join(u):
        lines = u.body[k:end]
        smalls = [s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for line in lines for s in line.body]
        joined = lines[0].with_changes(body=smalls, trailing_whitespace=lines[-1].trailing_whitespace)
        return u.with_changes(body=list(u.body[:k]) + [joined] + list(u.body[end:]))

    return _edit(module, BODY_KINDS, {i: join})


def _m_one_line_body(module, rng, ctx):
    """Minified style: a block of simple statements made one line (`def f(): a; b`)."""
    def simple_block(n):
        return isinstance(n, cst.IndentedBlock) and n.body and all(isinstance(s, cst.SimpleStatementLine) for s in n.body)

    i, block = _pick(rng, _numbered(module, (cst.IndentedBlock,), simple_block)) or (None, None)
    if block is None:
        return None

    def one_line(u):
        smalls = [s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) for line in u.body for s in line.body]
        return cst.SimpleStatementSuite(body=smalls)

    return _edit(module, (cst.IndentedBlock,), {i: one_line})


def _m_tabs(module, rng, ctx):
    return module.with_changes(default_indent=rng.choice(["\t", " ", "  ", "        "]))


def _m_top_slice(module, rng, ctx):
    """A run of top-level statements only (imports kept with a coin's chance)."""
    body = list(module.body)
    if len(body) < 2:
        return None
    a = rng.randrange(len(body))
    b = a + rng.randrange(1, len(body) - a + 1)
    keep = [s for s in body[:a] if rng.random() < 0.5 and isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], (cst.Import, cst.ImportFrom))]
    return module.with_changes(body=keep + body[a:b])


STATEMENT_MUTATIONS = {
    "stmt-delete": (_m_delete, 3), "stmt-duplicate": (_m_duplicate, 2), "stmt-swap": (_m_swap, 2), "stmt-move": (_m_move, 2),
    "stmt-wrap": (_m_wrap, 2), "stmt-inline": (_m_inline, 2), "rename-attr": (_m_rename_attr, 2), "rename-one": (_m_rename_one, 2),
    "rename-all": (_m_rename_all, 2), "call-args": (_m_call_args, 3), "number": (_m_number, 1), "splice": (_m_splice, 3),
    "join-lines": (_m_join_lines, 1), "one-line-body": (_m_one_line_body, 1), "tabs": (_m_tabs, 1), "top-slice": (_m_top_slice, 1),
}


def statement_mutations(module: cst.Module, rng: random.Random, ctx: dict, count: int) -> tuple[cst.Module, list[str]]:
    """`count` statement mutations of `module` drawn by weight; returns (module, names).
    A mutation that libcst refuses to build (a node it will not render) is skipped."""
    names = list(STATEMENT_MUTATIONS)
    weights = [STATEMENT_MUTATIONS[n][1] for n in names]
    done = []
    for _ in range(count):
        name = rng.choices(names, weights)[0]
        try:
            changed = STATEMENT_MUTATIONS[name][0](module, rng, ctx)
        except (cst.CSTValidationError, cst.ParserSyntaxError, ValueError, TypeError, IndexError):
            ctx["skipped"][name] += 1
            continue
        if changed is not None:
            module = changed
            done.append(name)
    return module, done


# --------------------------------------------------------------------------- inputs


@dataclass
class Case:
    """Input number `index`: its bytes, where it came from, and the patch flags drawn for it."""

    index: int
    data: bytes
    origin: str
    mutations: list[str]
    flags: list[str]
    valid: bool | None = None  # compiles under this Python (None: not tried)


class Maker:
    """Makes input number N of a seeded run (`make(N)`), the same whatever was made before."""

    def __init__(self, seed: int):
        self.seed = seed
        self.pool = seeds()
        self.ctx = {"donors": [s for s in self.pool if s.base is None], "snippets": [], "skipped": Counter()}
        for snippet in SNIPPETS:
            try:
                stmt = cst.parse_statement(snippet)
            except cst.ParserSyntaxError:  # newer syntax than libcst reads: text mutations still reach it
                continue
            self.ctx["snippets"].append(stmt)
            if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
                self.ctx["snippets"].append(stmt.body[0])  # also as a small statement, for `;` lines

    def make(self, index: int) -> Case:
        rng = random.Random(f"{self.seed}:{index}")
        mode = rng.choices(["stmt", "text", "both", "pristine"], [45, 35, 17, 3])[0]
        seed = rng.choice(self.pool)
        mutations: list[str] = []
        origin = seed.name
        text = seed.text
        valid = None
        if mode in ("stmt", "both", "pristine") and seed.module is None:
            mode = "text"
        if mode in ("stmt", "both", "pristine"):
            count = 0 if mode == "pristine" else rng.choice([1, 1, 2, 2, 3, 4, 6])
            module, mutations = statement_mutations(seed.module, rng, self.ctx, count)
            source = module.code
            try:
                compile(source, "<fuzz>", "exec", dont_inherit=True)
                valid = True
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                valid = False
            if seed.base is not None or seed.name.startswith("wrapped_"):  # back into the seed's own wrapper
                text = _repack(seed.script, source, rng, flip=False) or source
            elif rng.random() < 0.12:
                label, how = rng.choice(WRAPPINGS)
                text = _wrap(source, *how)
                mutations.append(f"wrap-{label}")
            else:
                text = source
        if mode in ("text", "both"):
            if mode == "text" and rng.random() < 0.5:  # a slice of lines, sometimes wrapped
                lines = text.splitlines(True)
                a = rng.randrange(len(lines))
                text = "".join(lines[a : a + rng.randrange(1, 120)])
                origin = f"{origin}[{a}:]"
                if rng.random() < 0.3 and text.strip():
                    text = _wrap(text, "lzma", "b85decode", rng.choice([None, 50, 100]), size=rng.random() < 0.5)
            text, more = text_mutations(text, rng)
            mutations += more
            valid = None
        data = text.encode("utf-8", "surrogatepass")
        if mode in ("text", "both") and rng.random() < 0.3:
            data, more = byte_mutations(data, rng)
            mutations += more
        return Case(index, data, origin, mutations, self._flags(rng, seed), valid)

    @staticmethod
    def _flags(rng: random.Random, seed: Seed) -> list[str]:
        flags = []
        r = rng.random()
        if r < 0.25:
            flags += ["--diagnostics", "--with", "round_overlap"]
        elif r < 0.35:
            flags += ["--only", rng.choice(FEATURES)]
        elif r < 0.42:
            flags += ["--skip", rng.choice(FEATURES)]
        elif r < 0.47:
            flags += ["--with", rng.choice(DIAGNOSTICS + ["round_overlap"])]
        if rng.random() < 0.1:
            flags.append("--diff")
        if rng.random() < 0.05:
            flags.append("--producer-toggles")
        if rng.random() < 0.1 and seed.script is not None and seed.script.wrapped:
            flags.append("--no-rewrap")
        if rng.random() < 0.01:
            flags.append("--byte-breakdown")
        return flags


# --------------------------------------------------------------------------- running


@dataclass
class Run:
    """One command of one input, as it ran."""

    command: str
    argv: list[str]
    code: int | None = None  # exit status (None: killed or signalled)
    signal: int | None = None
    hung: bool = False
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    rss_kb: int = 0


@dataclass
class _Child:
    pid: int
    pidfd: int
    deadline: float
    started: float
    run: Run
    slot: "Slot"
    allowed: set = field(default_factory=set)


@dataclass
class Slot:
    """A working directory and the commands still to run there for one input."""

    path: Path
    case: Case | None = None
    queue: list = field(default_factory=list)
    runs: list = field(default_factory=list)


def start_child(run: Run, slot: Slot, bound: float, allowed: set[int] = frozenset()) -> _Child:
    """Fork a child that runs `patch-prefetch run.argv` in `slot`'s directory (what a
    mutated script's run writes stays there), its output in `slot`'s files."""
    out_path, err_path = slot.path / "stdout.txt", slot.path / "stderr.txt"
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setpgid(0, 0)
            os.chdir(slot.path)
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), (2, err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                got = os.open(path, flags, 0o644)
                os.dup2(got, fd)
                os.close(got)
            sys.stdin, sys.stdout, sys.stderr = open(0, closefd=False), open(1, "w", closefd=False), open(2, "w", closefd=False)
            try:
                code = cli_main(run.argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 98
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 97
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 96)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # also here: a kill right after the fork must find the group
    now = time.monotonic()
    return _Child(pid, os.pidfd_open(pid), now + bound, now, run, slot, set(allowed))


def _reap(child: _Child, hung: bool) -> None:
    run = child.run
    if hung:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    _, status, rusage = os.wait4(child.pid, 0)
    os.close(child.pidfd)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)  # what the command started and left (a worker about to see its stdin close)
    run.seconds = time.monotonic() - child.started
    run.rss_kb = rusage.ru_maxrss
    run.hung = hung
    if not hung:
        run.code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        run.signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    for name in ("stdout", "stderr"):
        path = child.slot.path / f"{name}.txt"
        setattr(run, name, path.read_text(errors="replace") if path.exists() else "")


# --------------------------------------------------------------------------- classifying


def problems(case: Case, run: Run, slot: Path, src: Path, out: Path, allowed: set[int], first_applied: list[str] = ()) -> list[str]:
    """What is wrong with `run` (empty: nothing). Kinds: hang, signal, traceback, exit,
    json, message, modified, wrote, leftover, idempotence. first_applied: the features the
    input's patch applied (for a repatch)."""
    found = []
    if run.hung:
        return ["hang"]
    if run.signal is not None:
        found.append("signal")
    if run.code == 97 or "Traceback (most recent call last)" in run.stderr or "Traceback (most recent call last)" in run.stdout:
        found.append("traceback")
    elif run.code is not None and run.code not in allowed:
        found.append("exit")
    if "--json" in run.argv and run.code is not None and run.code != 97:
        try:
            document = json.loads(run.stdout)
        except ValueError:
            found.append("json")
        else:
            if run.command == "patch" and run.code == 2 and document.get("exit_code") != 2:
                found.append("json")
    if run.command in ("patch", "repatch") and run.code == 2:
        lines = run.stderr.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("patch-prefetch: error:") or run.argv[0] not in lines[0]:
            found.append("message")
    if src.read_bytes() != case.data:
        found.append("modified")
        src.write_bytes(case.data)
    present = {p.name for p in slot.iterdir()}
    if run.command == "patch" and run.code not in (0, 4, None) and "out.py" in present:
        found.append("wrote")
    if present - {"train_gpt.py", "stdout.txt", "stderr.txt", "out.py", "out2.py"}:
        found.append("leftover")  # a temporary file, or something the command wrote where it ran
    if run.command == "repatch" and run.code == 0 and (slot / "out2.py").read_bytes() != out.read_bytes():
        found.append("idempotence")
    if run.command == "repatch" and run.code == 3 and set(first_applied) & set(INJECTED_NAMES):
        # exit 3 (nothing to patch) is right after a pure rewrite (the MLP square), which
        # leaves no mark; a runtime the first patch injected must be seen: "already patched"
        found.append("idempotence")
    return found


def signature(run: Run) -> str:
    """Where a traceback came from: its last frame in patcher/ and the exception line."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    frames = [line.strip() for line in lines if line.strip().startswith('File "') and "/patcher/" in line]
    tail = lines[-1].strip() if lines else "(no output)"
    where = frames[-1].split("/patcher/", 1)[1].replace('", line ', ":").split(",")[0] if frames else "?"
    return f"{where}: {tail[:160]}"


# --------------------------------------------------------------------------- the run


@dataclass
class Options:
    count: int = 10_000
    seed: int = 1
    start: int = 0
    jobs: int = 1
    timeout: float = 20.0
    check_every: int = 50
    repatch_every: int = 10
    check_cmd_every: int = 20
    verify_every: int = 25
    failures: Path = DEFAULT_FAILURES
    out: Path | None = None
    progress: bool = True


def _commands_after(case: Case, slot: Slot, opts: Options, done: Run) -> list[tuple[str, list[str], set[int], float]]:
    """Commands that follow `done` for this input (repatch and verify need a written output)."""
    src, out = slot.path / "train_gpt.py", slot.path / "out.py"
    follow = []
    n = case.index
    if done.command == "patch" and done.code == 0 and out.exists():
        if opts.repatch_every and n % opts.repatch_every == 0:
            follow.append(("repatch", [str(out), "-o", str(slot.path / "out2.py"), "--json", "--no-check"] + case.flags, {0, 3}, opts.timeout))
        if opts.verify_every and n % opts.verify_every == 0:
            follow.append(("verify", ["verify", str(src), str(out), "--batches", "4", "--json"], VERIFY_EXITS, 5 * opts.timeout))
    return follow


def _first_commands(case: Case, slot: Slot, opts: Options) -> list[tuple[str, list[str], set[int], float]]:
    src, out = slot.path / "train_gpt.py", slot.path / "out.py"
    checked = bool(opts.check_every) and case.index % opts.check_every == 0
    argv = [str(src), "-o", str(out), "--json"] + (["--timeout", str(opts.timeout)] if checked else ["--no-check"]) + case.flags
    commands = [("patch", argv, PATCH_CHECK_EXITS if checked else PATCH_EXITS, 5 * opts.timeout if checked else opts.timeout)]
    if opts.check_cmd_every and case.index % opts.check_cmd_every == 0:
        commands.append(("check", ["check", str(src), "--no-import", "--json"], CHECK_EXITS, opts.timeout))
    return commands


def run_fuzz(opts: Options) -> dict:
    """Run inputs opts.start .. opts.start + opts.count - 1; returns the summary (see `summary`)."""
    maker = Maker(opts.seed)
    opts.failures.mkdir(parents=True, exist_ok=True)
    tally = {"exits": {c: Counter() for c in ("patch", "repatch", "check", "verify")}, "failures": [], "differs": [],
             "times": {c: [] for c in ("patch", "repatch", "check", "verify", "input")}, "mutations": Counter(),
             "valid": Counter(), "by_input": {}, "reasons": Counter(), "peak_kb": 0, "inputs": 0, "kinds": Counter(), "checked": 0, "slowest": []}
    started = time.monotonic()
    indices = iter(range(opts.start, opts.start + opts.count))
    selector = selectors.DefaultSelector()
    running: dict[int, _Child] = {}
    with tempfile.TemporaryDirectory(prefix="pp-fuzz-") as tmp:
        slots = [Slot(Path(tmp) / f"slot{j}") for j in range(max(1, opts.jobs))]
        for slot in slots:
            slot.path.mkdir()

        def next_input(slot: Slot) -> bool:
            index = next(indices, None)
            if index is None:
                slot.case = None
                return False
            case = maker.make(index)
            for leftover in slot.path.iterdir():
                leftover.unlink()
            (slot.path / "train_gpt.py").write_bytes(case.data)
            slot.case, slot.runs, slot.queue = case, [], _first_commands(case, slot, opts)
            tally["mutations"].update(case.mutations)
            tally["valid"][str(case.valid)] += 1
            tally["checked"] += "--no-check" not in slot.queue[0][1]
            return True

        def launch(slot: Slot) -> None:
            command, argv, allowed, bound = slot.queue.pop(0)
            if command == "patch":
                (slot.path / "out.py").unlink(missing_ok=True)
            child = start_child(Run(command, argv), slot, bound, allowed)
            running[child.pid] = child
            selector.register(child.pidfd, selectors.EVENT_READ, child)

        try:
            for slot in slots:
                if next_input(slot):
                    launch(slot)
            _loop(running, selector, opts, tally, started, next_input, launch)
        finally:  # Ctrl-C or a bug here: no child left running
            for child in running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(child.pid, 0)
    return summary(opts, tally, started)


def _loop(running, selector, opts, tally, started, next_input, launch) -> None:
    """Reap children as they end or pass their bound; start what follows in their slot."""
    while running:
        now = time.monotonic()
        wait = max(0.0, min(c.deadline for c in running.values()) - now)
        ready = {key.data.pid for key, _ in selector.select(timeout=wait)}
        now = time.monotonic()
        for pid in list(running):
            child = running[pid]
            over = pid not in ready and now > child.deadline
            if pid not in ready and not over:
                continue
            selector.unregister(child.pidfd)
            del running[pid]
            _reap(child, hung=over)
            _account(child, opts, tally)
            slot = child.slot
            slot.queue += _commands_after(slot.case, slot, opts, child.run)
            if not slot.queue:
                _finish_input(slot, tally)
                if opts.progress and tally["inputs"] % 250 == 0:
                    print(f"{tally['inputs']} inputs, {len(tally['failures'])} failures, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
                    if opts.out:
                        opts.out.write_text(json.dumps(summary(opts, tally, started), indent=2) + "\n")
                if not next_input(slot):
                    continue
            launch(slot)


def _account(child: _Child, opts: Options, tally: dict) -> None:
    run, slot, case = child.run, child.slot, child.slot.case
    slot.runs.append(run)
    tally["exits"][run.command]["hang" if run.hung else (f"signal {run.signal}" if run.signal is not None else str(run.code))] += 1
    tally["times"][run.command].append(run.seconds)
    if run.command == "patch":
        tally["by_input"].setdefault(str(case.valid), Counter())[str(run.code)] += 1
        if run.code == 2:
            tally["reasons"][_reason(run.stderr, str(slot.path / "train_gpt.py"))] += 1
    tally["peak_kb"] = max(tally["peak_kb"], run.rss_kb)
    found = problems(case, run, slot.path, slot.path / "train_gpt.py", slot.path / "out.py", child.allowed, _applied(slot.runs[0]))
    if run.command == "verify" and run.code == 1:
        tally["differs"].append(_save(case, run, "differs", opts))
    for kind in found:
        tally["kinds"][kind] += 1
    if found:
        tally["failures"].append(_save(case, run, found[0], opts) | {"kinds": found})


def _applied(run: Run) -> list[str]:
    """The features a patch run applied, from its --json report."""
    try:
        return list(json.loads(run.stdout).get("applied") or [])
    except (ValueError, AttributeError):
        return []


def _finish_input(slot: Slot, tally: dict) -> None:
    tally["inputs"] += 1
    total = sum(r.seconds for r in slot.runs)
    tally["times"]["input"].append(total)
    tally["slowest"] = sorted(tally["slowest"] + [(round(total, 2), slot.case.index)], reverse=True)[:5]


def _save(case: Case, run: Run, kind: str, opts: Options) -> dict:
    """Keep the input and what the command said; returns the failure's entry."""
    stem = opts.failures / f"{opts.seed}-{case.index:06d}-{run.command}-{kind}"
    saved = stem.with_suffix(".py")
    saved.write_bytes(case.data)
    # The command as run, on the saved input (a repatch or verify needs the patch's output first).
    slot_dir = str(Path(run.argv[1] if run.command in ("check", "verify") else run.argv[0]).parent)
    argv = [a.replace(f"{slot_dir}/train_gpt.py", str(saved)).replace(slot_dir, tempfile.gettempdir()) for a in run.argv]
    note = {"index": case.index, "seed": opts.seed, "command": run.command, "origin": case.origin, "mutations": case.mutations,
            "exit": run.code, "signal": run.signal, "hung": run.hung, "seconds": round(run.seconds, 2),
            "reproduce": "patch-prefetch " + " ".join(argv), "again": f"python bench/fuzz.py --seed {opts.seed} --start {case.index} --count 1"}
    stem.with_suffix(".txt").write_text(json.dumps(note, indent=1) + "\n--- stderr\n" + run.stderr[-6000:] + "\n--- stdout\n" + run.stdout[-2000:])
    return {"input": str(stem.with_suffix(".py")), "index": case.index, "command": run.command, "kind": kind,
            "signature": signature(run) if kind == "traceback" else (run.stderr.strip().splitlines() or [""])[-1][:200]}


def _reason(stderr: str, path: str) -> str:
    """A bad-input message with the path and the numbers taken out, to count alike ones together."""
    line = (stderr.strip().splitlines() or [""])[0].replace("patch-prefetch: error: ", "").replace(path, "IN")
    return "".join("N" if ch.isdigit() else ch for ch in line)[:90]


def _figures(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "median s": round(statistics.median(ordered), 3), "p99 s": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 3), "max s": round(ordered[-1], 3)}


def summary(opts: Options, tally: dict, started: float) -> dict:
    """The run's figures: exits per command, failures (with their saved inputs), times."""
    traces = [f for f in tally["failures"] if "traceback" in f["kinds"]]
    hangs = [f for f in tally["failures"] if "hang" in f["kinds"]]
    by_signature = Counter(f["signature"] for f in traces)
    patch_exits = tally["exits"]["patch"]
    exits_text = ", ".join(f"{k}×{v}" for k, v in sorted(patch_exits.items(), key=lambda kv: (len(kv[0]), kv[0])))
    others = len(tally["failures"]) - len(traces) - len(hangs)
    ran = [f"patch --no-check on {tally['inputs'] - tally['checked']}", f"patch with the check on {tally['checked']}"]
    ran += [f"{c} on {sum(tally['exits'][c].values())}" for c in ("repatch", "check", "verify")]
    last = opts.start + tally["inputs"] - 1
    verdict = (f"{tally['inputs']} inputs (seed {opts.seed}, inputs {opts.start}-{last}): "
               f"{len(traces)} tracebacks in {len({f['index'] for f in traces})} inputs, {len(hangs)} hangs, "
               f"{others} other failures; patch exits: {exits_text}; commands: {', '.join(ran)}; "
               f"{len(tally['differs'])} verify differs; {time.monotonic() - started:.0f} s")
    return {
        "verdict": verdict,
        "inputs": tally["inputs"],
        "seed": opts.seed,
        "start": opts.start,
        "jobs": opts.jobs,
        "timeout s": opts.timeout,
        "tracebacks": len(traces),
        "hangs": len(hangs),
        "failures": len(tally["failures"]),
        "failure kinds": dict(tally["kinds"]),
        "traceback signatures": dict(by_signature.most_common()),
        "failed inputs": tally["failures"][:200],
        "verify differs": tally["differs"][:50],
        "exits": {c: dict(sorted(v.items())) for c, v in tally["exits"].items()},
        "times": {c: _figures(v) for c, v in tally["times"].items()},
        "slowest inputs": [{"seconds": s, "index": i} for s, i in tally["slowest"]],
        "inputs compiling": dict(tally["valid"]),
        "patch exits by input (compiles under this Python: True / False / None not tried)": {k: dict(v) for k, v in tally["by_input"].items()},
        "bad-input reasons": dict(tally["reasons"].most_common(25)),
        "mutations": dict(tally["mutations"].most_common()),
        "peak child rss MiB": round(tally["peak_kb"] / 1024, 1),
        "wall s": round(time.monotonic() - started, 1),
        "failures dir": str(opts.failures),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", "--inputs", type=int, default=10_000, help="inputs to run (default 10000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the run (default 1)")
    parser.add_argument("--start", type=int, default=0, help="number of the first input (default 0): --start N --count 1 runs input N alone")
    parser.add_argument("--jobs", type=int, default=1, help="commands run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds a patch --no-check may take before it counts as a hang (default 20; 5 times that with the check and for verify)")
    parser.add_argument("--check-every", type=int, default=50, help="patch with the check (compile under Python 3.10, import smoke) on every Nth input (default 50; 0: never)")
    parser.add_argument("--repatch-every", type=int, default=10, help="patch the output again on every Nth input that patched (default 10; 0: never)")
    parser.add_argument("--check-cmd-every", type=int, default=20, help="run `check --no-import` on every Nth input (default 20; 0: never)")
    parser.add_argument("--verify-every", type=int, default=25, help="run `verify IN OUT` on every Nth input that patched (default 25; 0: never)")
    parser.add_argument("--failures", type=Path, default=DEFAULT_FAILURES, help=f"where failing inputs are kept (default {DEFAULT_FAILURES})")
    parser.add_argument("--out", "--json", type=Path, help="write the summary here as JSON (also rewritten every 250 inputs)")
    args = parser.parse_args(argv)
    opts = Options(count=args.count, seed=args.seed, start=args.start, jobs=args.jobs, timeout=args.timeout, check_every=args.check_every,
                   repatch_every=args.repatch_every, check_cmd_every=args.check_cmd_every, verify_every=args.verify_every,
                   failures=args.failures, out=args.out)
    report = summary_and_print(opts)
    return 0 if not report["failures"] else 1


def summary_and_print(opts: Options) -> dict:
    report = run_fuzz(opts)
    text = json.dumps(report, indent=2)
    print(text)
    if opts.out:
        opts.out.write_text(text + "\n")
    print(report["verdict"])
    return report


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.exit(main())
