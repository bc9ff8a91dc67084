"""GPU proof of two real loaders, original against patched: host time per batch behind a queued GPU load, and exact batches.

    python bench/gpu_loaders.py {generator,module} ORIGINAL PATCHED --json OUT.json
        [--dry-run] [--steps N] [--load-ms T]

ORIGINAL is the real script, PATCHED what `patch-prefetch ORIGINAL -o PATCHED` made of
it beforehand (nothing is patched here; on the GPU machine `gpu_proof.py`'s stage 0 has
installed the wheels `patcher` needs). The module stage's stand-ins (package, tokenizer,
corpus) are `module_verify`'s and `module_bench`'s. Exit 0: the stage ran and every batch of the patched side equals the
original's; 1: a batch differs (OUT.json has `first_difference`); 2: it could not run
(one line why). OUT.json keys: stage, device, dry_run, sizes, load_ms, host_ms, ratio,
batches_compared, exact, first_difference, notes (and a few more per stage).

Stage `generator` (modded-nanogpt's `train_gpt.py`, `distributed_data_generator`; the
dry-run input is fixtures/generator_shards.py): both scripts' definitions are loaded
(top-level imports, functions, classes and cheap assignments, as
`check.definitions_only` keeps them; missing packages stubbed; `args =
Hyperparameters()` set), synthetic shards are written with the script's BOS id, and
both generators are driven as the script's loop drives them on one GPU: rank 0 of 1,
`grad_accum_steps` as the script computes it for a world size of 1, `next()` then
`.send(args)` once per micro-step, the sent value `(batch_size, max_seq_len,
grad_accum_steps)` of the script's own training stages on every micro-step of a
stage's first step and None otherwise (at least two stage changes). Each micro-step
first queues the GPU load (bf16 matmuls calibrated once with CUDA events to about
`--load-ms`) on the compute stream, then times on the host only the `send`: the time
the host is blocked (a pageable `.to("cuda", non_blocking=True)` waits behind the
queued load; the patched pinned copy on the copy stream should not). The two sides
alternate one optimizer step (`grad_accum_steps` micro-steps) at a time, with a
`torch.cuda.synchronize()` between turns (untimed), so the host's load and the GPU's
queue fall on both alike. The first step of each side (first shard read, allocator
warm-up) is compared but not in the host figures.

Stage `module` (nanochat's `nanochat/dataloader.py`; the dry-run input is
fixtures/bestfit_packing.py): both modules are put in a package beside stand-ins for
what they import from it (`get_dist_info`, `list_parquet_files`), as `module_verify`
does, and their loader is called as `scripts/base_train.py` calls it,
`loader(tokenizer, B, T, split="train", device=..., resume_state_dict=None)`, on a
synthetic parquet corpus (as `module_bench.write_corpus`) with a byte-level tokenizer
(`module_verify.ByteTokenizer`'s ids), at base_train's defaults B=32, T=2048. Two
cases, each for both sides: `device=torch.device("cuda", 0)` (what base_train passes:
`torch.device("cuda", 0) == "cuda"` is False, so the original stages through pageable
memory with a synchronous copy) and `device="cuda"` (the original's pinned,
asynchronous path). Each batch: `torch.cuda.synchronize()` (base_train syncs at each
step's start), the queued GPU load, then `next()` timed on the host. A few warm-up
batches are drawn first (the patched side's spawned producer starts then: its start
is reported apart); the sides alternate every 5 batches.

Exactness, both stages: what each batch holds is cloned on the device right after it
is handed out (queued on the compute stream: what the model would read there), numpy
arrays copied, state dicts copied; after `torch.cuda.synchronize()` every field of
every batch of the patched side is compared with the original's on the CPU
(`torch.equal`, `np.array_equal`, `==`).

`--dry-run`: tiny sizes, run in seconds on a CPU under `cuda_on_host` (the scripts'
CUDA paths with host memory; a copy from pinned memory runs when its result is first
read, here the clone at hand-out, so the dry run proves the values, not the timing:
`verify --run-ahead` models that); no GPU load there (load_ms 0; the JSON says so). With real CUDA, `--dry-run` keeps the tiny sizes
and the GPU load.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patcher.check.stubs import StubFinder  # noqa: E402
from patcher.proof.host_cuda import cuda_on_host  # noqa: E402
from patcher.proof.module_bench import write_corpus  # noqa: E402
from patcher.proof.module_verify import ByteTokenizer, package_importable, write_package  # noqa: E402
from patcher.proof.shards import write_shards  # noqa: E402

DEFAULT_STEPS = {"generator": 120, "module": 60}
DRY_STEPS = {"generator": 24, "module": 10}
DEFAULT_LOAD_MS = 5.0
# nanochat scripts/base_train.py defaults (--device-batch-size, --max-seq-len)
NANOCHAT_B, NANOCHAT_T = 32, 2048
DRY_B, DRY_T = 2, 128
MODULE_WARMUP = 3
MODULE_BLOCK = 5
# the largest per-micro-step token count a dry run keeps (the script's stages scaled down)
DRY_MAX_LOCAL = 2048
DOC_LEN_REAL, DOC_LEN_DRY = (256, 2048), (16, 160)


class CannotRun(Exception):
    """The stage cannot run here: one line why (exit 2)."""


class PatchedRaised(Exception):
    """The patched side raised where the original handed out a batch (a difference: exit 1)."""

    def __init__(self, batch: int, error: BaseException):
        super().__init__(batch, error)
        self.batch, self.error = batch, error

    def difference(self, case: str | None = None) -> dict:
        return {"case": case, "batch": self.batch, "field": None, "why": f"the patched side raised {type(self.error).__name__}: {_line(self.error)}"}


def _line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def draw(side: int, index: int, take):
    """`take()` (a batch of one side); the original's exception is CannotRun, the patched side's PatchedRaised."""
    try:
        return take()
    except Exception as error:
        if side == 0:
            raise CannotRun(f"the original raised at batch {index}: {type(error).__name__}: {_line(error)}") from None
        raise PatchedRaised(index, error) from None


# --------------------------------------------------------------------------- shared


def stats(values: list[float]) -> dict:
    """mean, median, p90 and max of `values` (ms), and their count."""
    if not values:
        return {"n": 0, "mean": None, "median": None, "p90": None, "max": None}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"n": len(values), "mean": round(statistics.fmean(values), 4), "median": round(statistics.median(values), 4), "p90": round(p90, 4), "max": round(ordered[-1], 4)}


def ratio(host: dict) -> float | None:
    """patched / original of the mean host ms."""
    original, patched = host["original"]["mean"], host["patched"]["mean"]
    return round(patched / original, 4) if original else None


class GpuLoad:
    """A few bf16 matmuls queued on the compute stream, calibrated once with CUDA events
    to about `target_ms`; each `queue()` is timed with its own pair of events."""

    def __init__(self, target_ms: float, enabled: bool):
        self.enabled = enabled and target_ms > 0
        self.target_ms = target_ms if self.enabled else 0.0
        self.events: list = []
        self.n = self.count = 0
        self.matmul_ms = 0.0
        if not self.enabled:
            return
        for n in (8192, 4096, 2048, 1024, 512):
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(a)
            per = self._time(a, b, out)
            if per <= target_ms / 2 or n == 512:  # at least two matmuls: a few, not one long one
                break
        self.a, self.b, self.out, self.n, self.matmul_ms = a, b, out, n, per
        self.count = max(1, round(target_ms / per))

    @staticmethod
    def _time(a, b, out, reps: int = 10) -> float:
        for _ in range(3):
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            torch.matmul(a, b, out=out)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    def queue(self) -> None:
        if not self.enabled:
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.count):
            torch.matmul(self.a, self.b, out=self.out)
        end.record()
        self.events.append((start, end))

    def measured(self) -> list[float]:
        """ms of every queued load (call after `torch.cuda.synchronize()`)."""
        return [start.elapsed_time(end) for start, end in self.events]

    def report(self) -> dict:
        measured = self.measured()
        return {"enabled": self.enabled, "target_ms": self.target_ms, "matmul": f"bf16 {self.n}x{self.n} @ {self.n}x{self.n}" if self.enabled else None,
                "matmuls_per_load": self.count, "matmul_ms": round(self.matmul_ms, 4), "measured_ms": stats(measured)}


def synchronize(real_cuda: bool) -> None:
    """The host waits for the GPU, as base_train does at each step's start. Under
    `cuda_on_host` (a dry run) the simulated stream honours it too: the copies still in
    flight run, so a batch is not read later than a GPU run that syncs would read it."""
    if real_cuda or torch.cuda.is_available():
        torch.cuda.synchronize()


def snapshot(item):
    """What a batch holds now: tensors cloned where they are (a device clone is queued on
    the current stream, after whatever wrote them), numpy arrays and dicts copied."""
    if isinstance(item, torch.Tensor):
        return item.detach().clone()
    if isinstance(item, np.ndarray):
        return np.array(item, copy=True)
    if isinstance(item, dict):
        return {k: snapshot(v) for k, v in item.items()}
    if isinstance(item, (tuple, list)):
        return type(item)(snapshot(v) for v in item) if not hasattr(item, "_fields") else type(item)(*(snapshot(v) for v in item))
    return item


def on_cpu(item):
    if isinstance(item, torch.Tensor):
        return item.cpu()
    if isinstance(item, dict):
        return {k: on_cpu(v) for k, v in item.items()}
    if isinstance(item, (tuple, list)) and not hasattr(item, "_fields"):
        return type(item)(on_cpu(v) for v in item)
    return item


def _few(values, at: int, k: int = 6) -> list:
    start = max(0, at - 1)
    return [v.item() if hasattr(v, "item") else v for v in values[start:start + k]]


def field_difference(expected, got) -> str | None:
    """Why `got` is not `expected` (one field of a batch), or None when equal."""
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)):
            return f"type {type(expected).__name__} vs {type(got).__name__}"
        if expected.dtype != got.dtype or expected.shape != got.shape:
            return f"dtype/shape {expected.dtype} {tuple(expected.shape)} vs {got.dtype} {tuple(got.shape)}"
        if torch.equal(expected, got):
            return None
        a, b = expected.reshape(-1), got.reshape(-1)
        at = int((a != b).nonzero()[0, 0]) if a.numel() else 0
        return f"values differ from flat index {at}: original {_few(a, at)} vs patched {_few(b, at)}"
    if isinstance(expected, np.ndarray) or isinstance(got, np.ndarray):
        if not (isinstance(expected, np.ndarray) and isinstance(got, np.ndarray)):
            return f"type {type(expected).__name__} vs {type(got).__name__}"
        if expected.dtype != got.dtype or expected.shape != got.shape:
            return f"dtype/shape {expected.dtype} {expected.shape} vs {got.dtype} {got.shape}"
        if np.array_equal(expected, got):
            return None
        a, b = expected.reshape(-1), got.reshape(-1)
        at = int(np.flatnonzero(a != b)[0])
        return f"values differ from flat index {at}: original {_few(a, at)} vs patched {_few(b, at)}"
    if isinstance(expected, dict) and isinstance(got, dict):
        if expected.keys() != got.keys():
            return f"keys {sorted(expected)} vs {sorted(got)}"
        for key in expected:
            why = field_difference(expected[key], got[key])
            if why:
                return f"[{key!r}]: {why}"
        return None
    if type(expected) is not type(got):
        return f"type {type(expected).__name__} vs {type(got).__name__}"
    return None if expected == got else f"{expected!r} vs {got!r}"


def compare(originals: list, patched: list, what: str = "") -> tuple[int, dict | None]:
    """(batches compared, first difference or None) of two lists of snapshots (on the device)."""
    compared = 0
    for index, (expected, got) in enumerate(zip(originals, patched)):
        expected, got = on_cpu(expected), on_cpu(got)
        fields_e = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        fields_g = list(got) if isinstance(got, (tuple, list)) else [got]
        if len(fields_e) != len(fields_g):
            return compared, {"case": what or None, "batch": index, "field": None, "why": f"{len(fields_e)} fields vs {len(fields_g)}"}
        for field, (e, g) in enumerate(zip(fields_e, fields_g)):
            why = field_difference(e, g)
            if why:
                return compared, {"case": what or None, "batch": index, "field": field, "why": why}
        compared += 1
    if len(originals) != len(patched):
        return compared, {"case": what or None, "batch": compared, "field": None, "why": f"{len(originals)} batches vs {len(patched)}"}
    return compared, None


# ------------------------------------------------------------- definitions (ast, no libcst)

CHEAP_CALLS = frozenset({
    "os.environ.get", "environ.get", "os.getenv", "getenv", "int", "float", "str", "bool", "bytes", "tuple", "list", "dict", "set",
    "frozenset", "len", "min", "max", "abs", "round", "range", "object", "Path", "pathlib.Path", "os.path.join", "os.path.dirname",
    "os.path.basename", "os.path.abspath", "os.path.expanduser", "TypeVar", "typing.TypeVar", "namedtuple", "collections.namedtuple",
    "NamedTuple", "field", "dataclasses.field", "re.compile", "logging.getLogger", "uuid.uuid4", "uuid.uuid1", "time.time", "repr",
})
_CHEAP_KINDS = (ast.Constant, ast.Name, ast.Attribute, ast.JoinedStr, ast.FormattedValue, ast.Tuple, ast.List, ast.Set, ast.Dict,
                ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Subscript, ast.Slice, ast.Starred)
_counter = itertools.count()


def dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _cheap(node) -> bool:
    """Literals, names, attributes, containers and arithmetic of those, allowlisted calls
    (as `check.import_smoke._is_cheap_expr`)."""
    if isinstance(node, ast.Lambda):
        return True
    if isinstance(node, ast.Call):
        return dotted(node.func) in CHEAP_CALLS and all(_cheap(a) for a in node.args) and all(_cheap(k.value) for k in node.keywords)
    if isinstance(node, ast.Subscript) and dotted(node.value) in ("os.environ", "environ"):
        return False
    if not isinstance(node, _CHEAP_KINDS):
        return False
    return all(_cheap(child) for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr))


def _import_time_calls(node) -> list[str]:
    """Dotted names of calls a statement makes when it runs (not inside function bodies)."""
    names = []

    def walk(n):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in n.decorator_list:
                walk(d)
            return
        if isinstance(n, ast.Lambda):
            return
        if isinstance(n, ast.Call) and dotted(n.func):
            names.append(dotted(n.func))
        for child in ast.iter_child_nodes(n):
            walk(child)

    walk(node)
    return names


def _is_definition(stmt) -> bool:
    """A top-level statement that only defines things and is safe to run (as `check.definitions_only` keeps)."""
    if any(n.startswith(("torch.cuda.", "cuda.")) or n.rsplit(".", 1)[-1] == "init_process_group" for n in _import_time_calls(stmt)):
        return False
    if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)):
        return True
    if isinstance(stmt, ast.Assign):
        return not any(isinstance(n, ast.Call) for t in stmt.targets for n in ast.walk(t)) and _cheap(stmt.value)
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return (stmt.value is None or _cheap(stmt.value)) and not any(isinstance(n, ast.Call) for n in ast.walk(stmt.target))
    if isinstance(stmt, ast.Try):
        blocks = [stmt.body, stmt.orelse, stmt.finalbody] + [h.body for h in stmt.handlers]
        return any(isinstance(s, (ast.Import, ast.ImportFrom)) for s in stmt.body) and all(_is_definition(s) for b in blocks for s in b)
    if isinstance(stmt, ast.If):
        return dotted(stmt.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    return False


def load_definitions(source: str, filename: str, notes: list[str]) -> types.ModuleType:
    """The script's definitions as a fresh module (registered in sys.modules first: the
    dataclass import trap), one top-level statement at a time; a cheap assignment that
    fails (`rank = int(os.environ["RANK"])`) is skipped; packages that are not installed
    are stubbed. Raises CannotRun for a definition or import that fails."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as error:
        raise CannotRun(f"{filename}:{error.lineno}: does not parse here ({error.msg})") from None
    module = types.ModuleType(f"_gpu_loaders_script_{next(_counter)}")
    module.__file__ = filename
    sys.modules[module.__name__] = module
    finder = StubFinder(filename)
    sys.meta_path.append(finder)
    kept = skipped = 0
    try:
        for stmt in tree.body:
            if not _is_definition(stmt):
                continue
            code = compile(ast.Module(body=[stmt], type_ignores=[]), filename, "exec")
            try:
                exec(code, module.__dict__)
                kept += 1
            except Exception as error:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    skipped += 1
                    continue
                raise CannotRun(f"{filename}:{stmt.lineno}: its definitions do not load here ({type(error).__name__}: {error})") from None
    finally:
        sys.meta_path.remove(finder)
    stubbed = sorted({v.__name__.partition(".")[0] if type(v).__name__ == "_StubModule" else str(v.__module__) for v in module.__dict__.values()
                      if type(v).__name__ in ("_StubModule", "_StubMeta")})
    notes.append(f"{Path(filename).name}: definitions loaded ({kept} top-level statements; {skipped} assignments that need the launcher skipped)"
                 + (f"; stubbed (not installed here): {', '.join(stubbed)}" if stubbed else ""))
    return module


def _eval(node, names: dict):
    """An arithmetic expression of numbers and `names`; raises ValueError otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, names)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, names), _eval(node.right, names)
        ops = {ast.Add: lambda: a + b, ast.Sub: lambda: a - b, ast.Mult: lambda: a * b, ast.FloorDiv: lambda: a // b,
               ast.Div: lambda: a / b, ast.Mod: lambda: a % b, ast.Pow: lambda: a ** b}
        if type(node.op) in ops:
            return ops[type(node.op)]()
    raise ValueError(ast.dump(node)[:80])


# --------------------------------------------------------------------------- generator


def training_stages(source: str, filename: str) -> tuple[list[tuple[int, int]], int, str]:
    """The script's training stages as (batch_size, max_seq_len), its grad_accum_steps for
    a world size of 1, and where they were read. Raises CannotRun."""
    tree = ast.parse(source, filename)
    classes = {s.name: [a.target.id for a in s.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)] for s in tree.body if isinstance(s, ast.ClassDef)}
    grad_accum, stages, where = None, None, None
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1 or not isinstance(stmt.targets[0], ast.Name):
            continue
        name = stmt.targets[0].id
        if name == "grad_accum_steps":
            with contextlib.suppress(ValueError, ZeroDivisionError):
                grad_accum = int(_eval(stmt.value, {"world_size": 1}))
        elif name.upper().endswith("STAGES") and isinstance(stmt.value, ast.List) and stmt.value.elts and all(isinstance(e, ast.Call) for e in stmt.value.elts):
            found = []
            for call in stmt.value.elts:
                fields = classes.get(dotted(call.func) or "", [])
                values = dict(zip(fields, call.args))
                values.update({k.arg: k.value for k in call.keywords if k.arg})
                seq = values.get("train_max_seq_len", values.get("max_seq_len"))
                if "batch_size" not in values or seq is None:
                    break
                try:
                    found.append((int(_eval(values["batch_size"], {})), int(_eval(seq, {}))))
                except ValueError:
                    break
            else:
                stages, where = found, f"{name} (line {stmt.lineno})"
    if not stages:
        raise CannotRun(f"{filename}: no list of training stages (`*STAGES = [Stage(batch_size=..., max_seq_len=...), ...]`) whose sizes this can read")
    return stages, grad_accum or 1, where


def send_schedule(stages: list[tuple[int, int]], grad_accum: int, micro_steps: int) -> tuple[list, list[tuple[int, int]]]:
    """What the loop hands the generator at each micro-step (the first is `next()`): the
    stage tuple `(batch_size, max_seq_len, grad_accum_steps)` on every micro-step of a new
    stage's first step (as modded-nanogpt's `train_loader_send_args`), None otherwise; and
    the stages in the order run. The distinct stages split the steps evenly."""
    distinct = [s for i, s in enumerate(stages) if i == 0 or s != stages[i - 1]]
    order = list(distinct)
    while len(distinct) > 1 and len(order) < 3:  # at least two stage changes
        order.append(distinct[len(order) % len(distinct)])
    steps = micro_steps // grad_accum
    per = max(1, steps // len(order))
    schedule = []
    for step in range(steps):
        index = min(step // per, len(order) - 1)
        change = index > 0 and step == index * per
        for _ in range(grad_accum):
            schedule.append((*order[index], grad_accum) if change else None)
    return schedule, order


def shard_plan(order, grad_accum: int, micro_steps: int, doc_len: tuple[int, int]) -> tuple[int, int]:
    """(train shards, tokens per shard) so that each side's run crosses shard boundaries
    and never runs out (modded-nanogpt does not cycle its files): the tokens a micro-step
    uses are its local tokens times the share a `max_seq_len` cut leaves of a document."""
    lo, hi = doc_len
    need = 0
    per = max(1, micro_steps // max(1, len(order)))
    for batch_size, seq in order:
        kept = statistics.fmean(min(d, seq) for d in range(lo, hi + 1))
        need += per * (batch_size // grad_accum) * ((lo + hi) / 2) / kept
    need = int(need * 1.5) + 4 * hi
    tokens = max(20_000, need // 3)
    return math.ceil(need / tokens) + 2, tokens


def run_generator(original: Path, patched: Path, steps: int, load_ms: float, dry_run: bool) -> dict:
    real_cuda = torch.cuda.is_available()
    if not real_cuda and not dry_run:
        raise CannotRun("no CUDA device here (--dry-run drives the CUDA path with host memory on a CPU)")
    notes: list[str] = []
    sources = [original.read_text(), patched.read_text()]
    stages, grad_accum, where = training_stages(sources[0], str(original))
    scale = 1
    if dry_run:
        largest = max(b // grad_accum for b, _ in stages)
        while largest // scale > DRY_MAX_LOCAL:
            scale *= 2
        if scale > 1:
            if any((b // scale) % grad_accum for b, _ in stages):
                raise CannotRun(f"the stages' batch sizes {[b for b, _ in stages]} do not scale down by {scale} for a dry run")
            stages = [(b // scale, max(16, s // scale)) for b, s in stages]
            notes.append(f"dry run: the script's stage batch sizes and sequence lengths divided by {scale}")
    schedule, order = send_schedule(stages, grad_accum, steps)
    steps = len(schedule)
    if len(order) < 2:
        notes.append("the script has one training stage: no stage change sent")
    doc_len = DOC_LEN_DRY if dry_run else DOC_LEN_REAL
    train_shards, tokens_per_shard = shard_plan(order, grad_accum, steps, doc_len)
    warm = grad_accum  # the first step of each side: compared, not timed
    block = grad_accum
    if steps <= warm:
        raise CannotRun(f"--steps {steps} leaves nothing to time after the first step ({grad_accum} micro-steps)")

    torch.set_num_threads(min(4, torch.get_num_threads()))
    host_context = contextlib.nullcontext() if real_cuda else cuda_on_host(notes)
    with tempfile.TemporaryDirectory(prefix="gpu-loaders-generator-") as data, host_context:
        modules = [load_definitions(source, str(path), notes) for source, path in zip(sources, (original, patched))]
        for module in modules:
            if not hasattr(module, "distributed_data_generator"):
                raise CannotRun(f"{module.__file__}: no `distributed_data_generator` among its definitions")
            if "Hyperparameters" in module.__dict__:
                module.__dict__.setdefault("args", module.Hyperparameters())  # left out of the definitions
        bos = int(getattr(modules[0], "BOS_ID", 1))
        args = getattr(modules[0], "args", None)
        vocab = min(65536, max(bos + 1, int(getattr(args, "vocab_size", 50257))))
        write_shards(data, train_shards=train_shards, val_shards=0, tokens_per_shard=tokens_per_shard, vocab_size=vocab, bos_id=bos, doc_len_range=doc_len)
        pattern = os.path.join(data, "fineweb_train_*.bin")
        first_bs, first_seq = order[0]
        generators = [m.distributed_data_generator(pattern, first_bs, first_seq, grad_accum_steps=grad_accum) for m in modules]
        load = GpuLoad(load_ms, real_cuda)
        position, host, kept, first, raised = [0, 0], [[], []], [[], []], [None, None], None
        try:
            while position[0] < steps or position[1] < steps:
                for side, generator in enumerate(generators):
                    synchronize(real_cuda)  # each side's turn starts with an idle GPU
                    for _ in range(min(block, steps - position[side])):
                        index = position[side]
                        load.queue()
                        t0 = time.perf_counter()
                        item = draw(side, index, (lambda: next(generator)) if index == 0 else (lambda: generator.send(schedule[index])))
                        elapsed = (time.perf_counter() - t0) * 1e3
                        if index >= warm:
                            host[side].append(elapsed)
                        elif index == 0:
                            first[side] = round(elapsed, 3)
                        kept[side].append(snapshot(item))
                        del item
                        position[side] += 1
            synchronize(real_cuda)
        except PatchedRaised as error:
            raised = error
            synchronize(real_cuda)
        finally:
            for generator in generators:
                generator.close()
        compared, difference = compare(kept[0][: len(kept[1])] if raised else kept[0], kept[1])
        if raised and difference is None:
            difference = raised.difference()
    host_ms = {"original": stats(host[0]), "patched": stats(host[1])}
    notes.append(f"stages sent: {where} of {original.name}, distinct in order {order}; rank 0 of 1 (dist not initialised), grad_accum_steps {grad_accum} "
                 f"(the script's value for a world size of 1): the same local tokens per micro-step as a rank of {grad_accum}")
    notes.append(f"timed: the send (next() for the first) only; the script's loop does no .to() of its own on the yielded values; the first step ({warm} micro-steps) of each side is compared but not timed")
    notes.append(f"sides alternate one step ({block} micro-steps) at a time with a synchronize between turns (untimed); each micro-step queues the load, then sends")
    notes.append(f"shards: synthetic, {train_shards} x {tokens_per_shard} tokens, BOS {bos} (the script's BOS_ID), documents of {doc_len[0]}-{doc_len[1]} tokens")
    if not load.enabled:
        notes.append("no GPU load: a dry run on a CPU (load_ms 0); host ms is the generator's own CPU time here, no H2D wait is shown")
    return {
        "stage": "generator",
        "sizes": {"stages": [list(s) for s in stages], "stages_run": [[b, s, grad_accum] for b, s in order], "grad_accum_steps": grad_accum,
                  "tokens_per_micro_step": [b // grad_accum for b, _ in order], "micro_steps": steps, "timed_micro_steps_per_side": steps - warm,
                  "block_micro_steps": block, "world_size": 1, "train_shards": train_shards, "tokens_per_shard": tokens_per_shard,
                  "doc_len_range": list(doc_len), "scale": scale},
        "load": load.report(),
        "load_ms": round(statistics.fmean(load.measured()), 4) if load.enabled else 0.0,
        "host_ms": host_ms,
        "first_send_ms": {"original": first[0], "patched": first[1]},
        "ratio": ratio(host_ms),
        "batches_compared": compared,
        "exact": difference is None and compared == steps,
        "first_difference": difference,
        "notes": notes,
    }


# --------------------------------------------------------------------------- module

def loader_function(source: str, filename: str) -> tuple[str, str, list[str]]:
    """(name, device parameter, parameter names) of the module's loader generator: a
    top-level function with parameters `tokenizer`, `B`, `T` and a device that yields."""
    tree = ast.parse(source, filename)
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef):
            params = [a.arg for a in stmt.args.posonlyargs + stmt.args.args + stmt.args.kwonlyargs]
            yields = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(stmt))
            device = next((p for p in params if p == "device" or p.endswith("device")), None)
            if yields and device and {"B", "T"} <= set(params) and params[0] == "tokenizer":
                return stmt.name, device, params
    raise CannotRun(f"{filename}: no loader generator `f(tokenizer, B, T, ..., device=...)` at top level")


@contextlib.contextmanager
def stderr_captured(into: list):
    """Descriptor 2 (this process's and the children it starts) into a file; its text appended to `into`, and echoed, on exit."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode("utf-8", "replace")
            into.append(text)
            if text:
                sys.stderr.write("".join(f"  [captured] {line}\n" for line in text.splitlines()))
                sys.stderr.flush()


def run_module(original: Path, patched: Path, steps: int, load_ms: float, dry_run: bool) -> dict:
    real_cuda = torch.cuda.is_available()
    if not real_cuda and not dry_run:
        raise CannotRun("no CUDA device here (--dry-run drives the CUDA path with host memory on a CPU)")
    try:
        import importlib

        importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise CannotRun("needs pyarrow (the loader reads parquet; pip install pyarrow)") from None
    notes: list[str] = []
    sources = [original.read_text(), patched.read_text()]
    name, device_param, params = loader_function(sources[0], str(original))
    B, T = (DRY_B, DRY_T) if dry_run else (NANOCHAT_B, NANOCHAT_T)
    warmup, block = MODULE_WARMUP, MODULE_BLOCK
    per_case = warmup + steps
    # byte-level ids: about 1,300 tokens a document, ~35 % cropped by best fit; 1,000 in the buffer
    docs = max(4000 if not dry_run else 2400, (per_case * B * (T + 1) * 2) // 900)
    cases = [("device_index", torch.device("cuda", 0)), ("device_str", "cuda")]
    torch.set_num_threads(min(4, torch.get_num_threads()))
    host_ms, ratios, producer, first = {}, {}, {}, {}
    compared_total, difference = 0, None
    with tempfile.TemporaryDirectory(prefix="gpu-loaders-module-") as tmp:
        tmp = Path(tmp)
        package, stubbed = write_package(tmp, sources[0], sources[1], original.stem, [])
        data = tmp / "data"
        data.mkdir()
        write_corpus(data, docs)
        load = GpuLoad(load_ms, real_cuda)
        host_context = contextlib.nullcontext() if real_cuda else cuda_on_host(notes)
        with package_importable(tmp, package), host_context:
            os.environ.update(PATCH_PREFETCH_PARQUET_DIR=str(data), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
            import importlib

            tokenizer = ByteTokenizer()
            functions = [getattr(importlib.import_module(f"{package}.{m}"), name) for m in ("_verify_original", original.stem)]
            call = {"split": "train", "resume_state_dict": None}
            call = {k: v for k, v in call.items() if k in params}
            for case, device in cases:
                said: list[str] = []
                host, kept, children = [[], []], [[], []], set(multiprocessing.active_children())
                with stderr_captured(said):
                    generators = [f(tokenizer, B, T, **call, **{device_param: device}) for f in functions]
                    raised, spawned, starts = None, [], [None, None]
                    try:
                        for side, generator in enumerate(generators):
                            for n in range(warmup):
                                synchronize(real_cuda)  # a step each, as in base_train
                                t0 = time.perf_counter()
                                item = draw(side, n, lambda: next(generator))
                                if n == 0:
                                    starts[side] = round((time.perf_counter() - t0) * 1e3, 3)
                                    if side == 1:
                                        spawned = [p.name for p in set(multiprocessing.active_children()) - children]
                                kept[side].append(snapshot(item))
                                del item
                        while len(host[0]) < steps or len(host[1]) < steps:
                            for side, generator in enumerate(generators):
                                for _ in range(min(block, steps - len(host[side]))):
                                    synchronize(real_cuda)  # base_train syncs at each step's start
                                    load.queue()
                                    t0 = time.perf_counter()
                                    item = draw(side, warmup + len(host[side]), lambda: next(generator))
                                    host[side].append((time.perf_counter() - t0) * 1e3)
                                    kept[side].append(snapshot(item))
                                    del item
                        synchronize(real_cuda)
                    except PatchedRaised as error:
                        raised = error
                        synchronize(real_cuda)
                    finally:
                        for generator in generators:
                            generator.close()
                text = "".join(said)
                lines = [line for line in text.splitlines() if "prefetch:" in line or "runs without prefetch" in line]
                fell_back = any("runs in the training process" in line or "runs without prefetch" in line for line in lines)
                producer[case] = {"ran": bool(spawned) and not fell_back, "children": spawned, "said": lines}
                first[case] = {"original_first_next_ms": starts[0], "patched_first_next_ms": starts[1]}
                host_ms[case] = {"original": stats(host[0]), "patched": stats(host[1])}
                ratios[case] = ratio(host_ms[case])
                count, diff = compare(kept[0][: len(kept[1])] if raised else kept[0], kept[1], what=case)
                compared_total += count
                if raised and diff is None:
                    diff = raised.difference(case)
                if diff is not None and difference is None:
                    difference = diff
                if raised:
                    notes.append(f"{case}: the patched side raised at batch {raised.batch}; the cases after it were not run")
                    break
    notes.append(f"{original.name}: loader `{name}` called as base_train calls it: {name}(tokenizer, B={B}, T={T}, "
                 + ", ".join(f"{k}={v!r}" for k, v in call.items()) + f", {device_param}=...); its other parameters at their defaults")
    notes.append(f"package stand-ins for what the module imports from its own package: {', '.join(stubbed) or 'none'} (rank 0 of 1)")
    notes.append("tokenizer: byte-level stand-in (module_verify.ByteTokenizer: id = byte + 1, BOS 0; pure Python, slower than nanochat's own)")
    notes.append(f"corpus: synthetic parquet, 3 files x {docs // 2} documents (module_bench.write_corpus's shape; the last file is the val split)")
    notes.append(f"per case and side: {warmup} warm-up batches (compared, not timed; the producer's start is among them), then {steps} timed next() "
                 f"behind the queued load, after a synchronize each (base_train syncs each step); the sides alternate every {block} batches")
    notes.append("device_index: device=torch.device('cuda', 0), as base_train passes it (the original's `device == 'cuda'` is False: pageable, synchronous copy); "
                 "device_str: device='cuda' (the original's pinned, non-blocking copy)")
    if not load.enabled:
        notes.append("no GPU load: a dry run on a CPU (load_ms 0); host ms is the loader's own CPU time here (the patched side: a producer process fills its queue), no H2D wait is shown")
    else:
        for case, host in host_ms.items():
            own, patched = host["original"]["median"], host["patched"]["median"]
            # Only where the patched side visibly waits: then the load may be too short
            # for the producer to get ahead of the batches it builds.
            if own and patched is not None and patched >= own / 2 and load.target_ms < own:
                notes.append(f"{case}: the patched next() still waited (median {patched} ms against the original's {own} ms) and the load ({load.target_ms} ms) "
                             f"is shorter than the original's next(): the producer may not get further ahead than its queue; a --load-ms above "
                             f"{own} ms (a real step) shows what prefetch hides")
    for case, state in producer.items():
        if not state["ran"]:
            notes.append(f"{case}: the patched side's producer did not run: " + ("; ".join(state["said"]) or "no child process was seen"))
    expected = 2 * (warmup + steps)
    return {
        "stage": "module",
        "sizes": {"B": B, "T": T, "batches_per_case": steps, "warmup_batches": warmup, "block_batches": block, "corpus_documents": 3 * (docs // 2),
                  "cases": {c: repr(d) for c, d in cases}},
        "load": load.report(),
        "load_ms": round(statistics.fmean(load.measured()), 4) if load.enabled else 0.0,
        "host_ms": host_ms,
        "ratio": ratios,
        "producer": producer,
        "producer_start_ms": {c: v["patched_first_next_ms"] for c, v in first.items()},
        "first_next_ms": first,
        "batches_compared": compared_total,
        "exact": difference is None and compared_total == expected,
        "first_difference": difference,
        "notes": notes,
    }


# --------------------------------------------------------------------------- CLI


def summary(report: dict) -> str:
    lines = [f"{report['stage']} on {report['device']}{' (dry run)' if report['dry_run'] else ''}: load {report['load_ms']} ms/step, "
             f"{report['batches_compared']} batches compared, {'exact' if report['exact'] else 'NOT exact'}"]
    cases = report["host_ms"].items() if report["stage"] == "module" else [("", report["host_ms"])]
    for case, host in cases:
        o, p = host["original"], host["patched"]
        r = report["ratio"][case] if case else report["ratio"]
        lines.append(f"  {case + ': ' if case else ''}host ms per {'next' if case else 'send'}: original mean {o['mean']} median {o['median']} p90 {o['p90']} max {o['max']}; "
                     f"patched mean {p['mean']} median {p['median']} p90 {p['p90']} max {p['max']}; ratio {r}")
    if report.get("producer"):
        for case, state in report["producer"].items():
            lines.append(f"  {case}: producer {'ran' if state['ran'] else 'did NOT run'}, start {report['producer_start_ms'][case]} ms")
    if report["first_difference"]:
        lines.append(f"  first difference: {report['first_difference']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("stage", choices=("generator", "module"))
    parser.add_argument("original", type=Path)
    parser.add_argument("patched", type=Path)
    parser.add_argument("--json", type=Path, required=True, help="where the report goes")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, on a CPU under cuda_on_host (no GPU load there)")
    parser.add_argument("--steps", type=int, default=None, help=f"generator: micro-steps (default {DEFAULT_STEPS['generator']}, dry run {DRY_STEPS['generator']}); "
                        f"module: timed batches per case (default {DEFAULT_STEPS['module']}, dry run {DRY_STEPS['module']})")
    parser.add_argument("--load-ms", type=float, default=DEFAULT_LOAD_MS, help="GPU load queued before each send / next (ms; bf16 matmuls)")
    args = parser.parse_args(argv)
    steps = args.steps or (DRY_STEPS if args.dry_run else DEFAULT_STEPS)[args.stage]
    started = time.perf_counter()
    try:
        for path in (args.original, args.patched):
            if not path.is_file():
                raise CannotRun(f"{path}: no such file")
        if args.patched.read_text() == args.original.read_text():
            raise CannotRun(f"{args.patched}: the same text as {args.original} (patch it first: patch-prefetch ORIGINAL -o PATCHED)")
        run = run_generator if args.stage == "generator" else run_module
        report = run(args.original, args.patched, steps, args.load_ms, args.dry_run)
    except CannotRun as error:
        print(f"gpu_loaders {args.stage}: cannot run: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # the scripts' own errors: one line, not a traceback
        print(f"gpu_loaders {args.stage}: cannot run: {type(error).__name__}: {_line(error)}", file=sys.stderr)
        return 2
    report = {
        "stage": report.pop("stage"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (cuda_on_host)",
        "dry_run": args.dry_run,
        "scripts": {"original": str(args.original), "patched": str(args.patched)},
        "torch": torch.__version__,
        **report,
        "wall_s": round(time.perf_counter() - started, 3),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(summary(report))
    return 0 if report["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
