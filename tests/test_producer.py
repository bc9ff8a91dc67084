"""The numpy assembly of ShuffledSequenceLoader batches.

- `templates/shuffled_assembly.py`: plan + gather give the original `next_batch`'s
  batches bit for bit, and leave the loader (its RNG, its start lists) exactly where
  the original leaves it, over seeds, batch sizes, sequence lengths and shard sizes
  that cross shards and use them all up (the reshuffle).
- `templates/prefetch_loader.py` with `assembly=`: the prefetched batches and the
  loader's state are the original's; a plan's or a gather's error is re-raised at its
  batch with the worker's traceback.
- `patcher/families/shuffled.py`: the known `next_batch` is recognised in minified and readable
  form; altered shapes are not, and the patch then keeps the script's own `next_batch`.
- verify: identical on the fixture with TRAIN_PREFETCH_NUMPY 0/1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
import types
from pathlib import Path

import libcst as cst
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patcher.families.shuffled import recognise_shuffled
from patcher.demo import STEP_LINE
from patcher.proof.harness import load_module, unload
from patcher.patch import patch_source
from patcher.proof.shards import write_shard, write_shards
from patcher.read.source import read_script, render
from patcher.proof.verify import verify
from templates.prefetch_loader import _make_train_loader
from templates.shuffled_assembly import _shuffled_gather, _shuffled_plan
import test_templates
from test_templates import CPU, assert_batch_equal, direct_batches, prefetch_threads

clean_prefetchers = test_templates.clean_prefetchers  # the same autouse fixture here

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FIXTURE = FIXTURES / "shuffled_minified.py"


@pytest.fixture(scope="module")
def script():
    """The fixture's definitions (ShuffledSequenceLoader, _get_shard_memmap) as a module,
    unloaded after this file's tests (its memmap cache holds every test's shards open)."""
    module = load_module(FIXTURE.read_text(), str(FIXTURE))
    yield module
    unload(module)


def hparams(pattern, seq_len, rank=0, world_size=1):
    return types.SimpleNamespace(train_files=pattern, train_seq_len=seq_len, rank=rank, world_size=world_size)


def write_sized_shards(directory, sizes, seed):
    rng = np.random.default_rng(seed)
    for index, size in enumerate(sizes):
        write_shard(os.path.join(directory, f"fineweb_train_{index:06d}.bin"), rng.integers(0, 65536, size=size))
    return os.path.join(directory, "fineweb_train_*.bin")


def assert_same_state(a, b):
    assert a.rng.bit_generator.state == b.rng.bit_generator.state
    assert a.start_inds == b.start_inds


# ---------------------------------------------------------------------------
# Plan + gather == the original next_batch
# ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    seq_len=st.integers(1, 48),
    rows=st.integers(0, 24),
    world_size=st.integers(1, 3),
    grad_accum=st.sampled_from([1, 2]),
    extra=st.lists(st.integers(0, 400), min_size=0, max_size=5),
    batches=st.integers(1, 12),
    data=st.data(),
)
def test_plan_and_gather_match_next_batch(script, seed, seq_len, rows, world_size, grad_accum, extra, batches, data):
    # Shard sizes from "no sequence at all" up to a few hundred tokens: small enough that
    # the rows of a batch come from several shards and the run uses every shard up.
    sizes = [seq_len + 2 + extra[0] if extra else seq_len + 2] + [max(1, n) for n in extra[1:]]
    sizes += [seq_len + 2] * max(0, world_size - len(sizes))
    rank = data.draw(st.integers(0, world_size - 1))
    global_tokens = rows * seq_len * world_size * grad_accum + data.draw(st.integers(0, seq_len - 1))
    script._MMAP_CACHE.clear()
    script._SHARD_NTOKENS_CACHE.clear()
    with tempfile.TemporaryDirectory() as directory:
        h = hparams(write_sized_shards(directory, sizes, seed), seq_len, rank, world_size)
        original, planned = script.ShuffledSequenceLoader(h, CPU), script.ShuffledSequenceLoader(h, CPU)
        if sum(len(s) for s in original.start_inds) == 0:
            return  # this rank's shards hold no sequence: the original cannot draw either
        for _ in range(batches):
            want = original.next_batch(global_tokens, grad_accum)
            got = _shuffled_gather(_shuffled_plan(planned, "_get_shard_memmap", global_tokens, grad_accum))
            assert_batch_equal(got, want)
            assert all(t.is_contiguous() for t in got)
            assert_same_state(planned, original)


class _RngProxy:
    """Any RNG object but numpy.random.Generator itself; counts its choice() calls."""

    def __init__(self, rng):
        self._rng, self.choices = rng, 0

    def choice(self, *args, **kwargs):
        self.choices += 1
        return self._rng.choice(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._rng, name)


def test_plan_keeps_rng_choice_for_other_generators(script, tmp_path):
    # The direct draw (cdf + one uniform) is only proven for numpy.random.Generator itself;
    # any other RNG object goes through its own choice(), and the batches stay exact.
    script._MMAP_CACHE.clear()
    h = hparams(write_sized_shards(tmp_path, [200, 130, 90], 3), 16)
    original, planned = script.ShuffledSequenceLoader(h, CPU), script.ShuffledSequenceLoader(h, CPU)
    original.rng, planned.rng = np.random.default_rng(5), _RngProxy(np.random.default_rng(5))
    for _ in range(6):  # 48 rows from about 25 sequences: the shards are reset within the run
        assert_batch_equal(_shuffled_gather(_shuffled_plan(planned, "_get_shard_memmap", 16 * 8, 1)), original.next_batch(16 * 8, 1))
        assert planned.start_inds == original.start_inds
        assert planned.rng.bit_generator.state == original.rng.bit_generator.state
    assert planned.rng.choices == 6 * 8


def test_reshuffle_and_several_shards_are_exercised(script, tmp_path):
    # The property above covers these paths; this pins one case where both surely happen.
    script._MMAP_CACHE.clear()
    h = hparams(write_sized_shards(tmp_path, [200, 130, 90], 1), 16)
    original, planned = script.ShuffledSequenceLoader(h, CPU), script.ShuffledSequenceLoader(h, CPU)
    sequences = sum(len(s) for s in original.start_inds)
    reshuffles = 0
    for _ in range(6):
        left = sum(len(s) for s in planned.start_inds)
        plan = _shuffled_plan(planned, "_get_shard_memmap", 16 * 8, 1)
        assert len(plan[3]) >= 2  # rows from several shards in one batch
        reshuffles += left < 8
        assert_batch_equal(_shuffled_gather(plan), original.next_batch(16 * 8, 1))
        assert_same_state(planned, original)
    assert 6 * 8 > sequences and reshuffles >= 1  # every shard used up, then reshuffled


def test_gather_owns_fresh_memory(script, tmp_path):
    h = hparams(write_sized_shards(tmp_path, [500, 500], 2), 8)
    loader = script.ShuffledSequenceLoader(h, CPU)
    plan = _shuffled_plan(loader, "_get_shard_memmap", 64, 1)
    x, y = _shuffled_gather(plan)
    x2, _ = _shuffled_gather(plan)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 8)
    assert x.data_ptr() != x2.data_ptr()  # each gather writes a new buffer
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gather_pinned(script, tmp_path):
    h = hparams(write_sized_shards(tmp_path, [500, 500], 3), 8)
    a, b = script.ShuffledSequenceLoader(h, CPU), script.ShuffledSequenceLoader(h, CPU)
    x, y = _shuffled_gather(_shuffled_plan(a, "_get_shard_memmap", 64, 1), pin=True)
    assert x.is_pinned() and y.is_pinned()
    assert_batch_equal((x, y), b.next_batch(64, 1))


# ---------------------------------------------------------------------------
# Through the prefetcher: batches and RNG state after k batches
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("numpy_assembly", [True, False])
def test_prefetched_shuffled_batches_and_rng_state(script, tmp_path, numpy_assembly):
    h = hparams(write_sized_shards(tmp_path, [700, 450, 300], 4), 16)
    make = lambda d: script.ShuffledSequenceLoader(h, d)
    want, direct = direct_batches(make, [(16 * 6, 1)] * 25)
    assembly = "_get_shard_memmap" if numpy_assembly else None
    wrapper = _make_train_loader(make, CPU, queue_depth=2, assembly=assembly, host_copy=False, attrs=True, replay=True)
    for w in want:
        assert_batch_equal(wrapper.next_batch(16 * 6, 1), w)
    assert len(prefetch_threads()) == 1
    # Reading the loader's own state settles it where the caller is (replayed by plans).
    assert wrapper.rng.bit_generator.state == direct.rng.bit_generator.state
    assert wrapper.start_inds == direct.start_inds
    assert not prefetch_threads()


class Counter:
    """A loader whose state is a counter; next_batch(k) -> (tensor [n, n+1, ..., n+k-1],)."""

    def __init__(self, device, fail_at=None):
        self.n, self.fail_at = 0, fail_at

    def next_batch(self, k):
        if self.fail_at is not None and self.n == self.fail_at:
            raise ValueError("plan failed")
        self.n += k
        return (torch.arange(self.n - k, self.n),)


class FakeAssembly:
    """plan: Counter.next_batch's state change, numbered; gather: the plan's batch, except
    that the gather of plan `fail_gather` raises."""

    def __init__(self, fail_gather=None):
        self.fail_gather = fail_gather

    def plan(self, loader, args):
        first = loader.n
        loader.next_batch(*args)
        return first, args[0]

    def gather(self, plan, pin=False):
        if plan[0] // plan[1] == self.fail_gather:
            raise ValueError("gather failed")
        return (torch.arange(plan[0], plan[0] + plan[1]),)


def faked(monkeypatch, assembly: FakeAssembly) -> str:
    """The runtime's plan and gather replaced by `assembly`'s; returns the `assembly=` value to pass."""
    import templates.prefetch_loader

    monkeypatch.setattr(templates.prefetch_loader, "_shuffled_plan", lambda loader, getter, *args: assembly.plan(loader, args))
    monkeypatch.setattr(templates.prefetch_loader, "_shuffled_gather", assembly.gather)
    return "_fake_getter"


def expected(count, k=3):
    return [(torch.arange(i * k, (i + 1) * k),) for i in range(count)]


# ---------------------------------------------------------------------------
# Errors of the assembly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 4])
def test_plan_error_reraised_at_its_batch_with_the_worker_traceback(k, clean_prefetchers, monkeypatch):
    _, created = clean_prefetchers
    wrapper = _make_train_loader(lambda d: Counter(d, fail_at=3 * k), CPU, queue_depth=2, assembly=faked(monkeypatch, FakeAssembly()))
    created.append(wrapper)
    for got, want in zip([wrapper.next_batch(3) for _ in range(k)], expected(k)):
        assert_batch_equal(got, want)
    with pytest.raises(ValueError, match="^plan failed$") as info:
        wrapper.next_batch(3)
    text = "".join(traceback.format_exception(info.type, info.value, info.value.__traceback__))
    assert 'raise ValueError("plan failed")' in text


def test_gather_error_reraised_at_its_batch(clean_prefetchers, monkeypatch):
    _, created = clean_prefetchers
    wrapper = _make_train_loader(lambda d: Counter(d), CPU, queue_depth=2, assembly=faked(monkeypatch, FakeAssembly(fail_gather=5)))
    created.append(wrapper)
    for got, want in zip([wrapper.next_batch(3) for _ in range(5)], expected(5)):
        assert_batch_equal(got, want)
    with pytest.raises(ValueError, match="^gather failed$") as info:
        wrapper.next_batch(3)
    assert "in gather" in "".join(traceback.format_tb(info.value.__traceback__))


# ---------------------------------------------------------------------------
# Recognition and the transform
# ---------------------------------------------------------------------------

READABLE = '''
import numpy as np
import torch

def _get_shard_memmap(file):
    return np.load(file)

class ShuffledSequenceLoader:
    def __init__(self, h, device):
        self.device = device

    def next_batch(self, global_tokens: int, grad_accum_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of random windows."""
        device_tokens = global_tokens // (self.world_size * grad_accum_steps)
        device_batch_size = device_tokens // self.seq_len
        remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
        x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
        for bi in range(device_batch_size):
            total = remaining.sum()
            if total <= 0:
                for si in range(len(self.files)):
                    self._reset_shard(si)
                remaining = np.array(
                    [len(s) for s in self.start_inds], dtype=np.float64
                )
                total = remaining.sum()
            probs = remaining / total
            si = int(self.rng.choice(len(self.files), p=probs))  # weighted by what is left
            start_ind = self.start_inds[si].pop()
            remaining[si] -= 1
            mm = _get_shard_memmap(self.files[si])
            window = torch.as_tensor(
                np.array(mm[start_ind : start_ind + self.seq_len + 1], dtype=np.int64)
            )
            x[bi] = window[:-1]
            y[bi] = window[1:]
        return x.to(self.device, non_blocking=True), y.to(
            self.device, non_blocking=True
        )
'''


def recognise(source):
    module = cst.parse_module(source)
    cls = next(s for s in module.body if isinstance(s, cst.ClassDef) and s.name.value == "ShuffledSequenceLoader")
    return recognise_shuffled(cls, module)


def test_recognises_the_minified_fixture_and_the_readable_record_shape():
    for source in (FIXTURE.read_text(), READABLE, READABLE.replace("_get_shard_memmap", "_shard_tokens")):
        result = recognise(source)
        assert result.recognised, result.reason
    assert recognise(READABLE).getter == "_get_shard_memmap"
    assert recognise(READABLE.replace("_get_shard_memmap", "_shard_tokens")).getter == "_shard_tokens"


@pytest.mark.parametrize(
    "old, new, why",
    [
        ("dtype=np.int64)\n", "dtype=np.int32)\n", "int32"),
        ("self.seq_len + 1]", "self.seq_len]", "start_ind"),
        ("p=probs", "p=None", "None"),
        ("self.rng.choice(len(self.files), p=probs)", "self.rng.integers(len(self.files))", "integers"),
        ("start_ind = self.start_inds[si].pop()", "start_ind = self.start_inds[si].pop(0)", "1 args"),
        ("            remaining[si] -= 1\n", "            remaining[si] -= 1\n            self.seen += 1\n", "`self.seen += 1` where the known shape has `mm = <shard getter>"),
        ("            remaining[si] -= 1\n", "", "where the known shape has `remaining[si] -= 1`"),
        ("            self.device, non_blocking=True\n        )\n", "            self.device, non_blocking=True\n        )\n        del x\n", "8 statements where the known shape has 7"),
        ("if total <= 0:", "if total < 1:", "known shape"),
        ("x[bi] = window[:-1]\n            y[bi] = window[1:]", "y[bi] = window[1:]\n            x[bi] = window[:-1]", "`y`"),
        ("    def next_batch(self, global_tokens: int, grad_accum_steps: int)", "    def next_batch(self, global_tokens: int, grad_accum_steps: int = 1)", "parameters"),
        ("    def next_batch(self, global_tokens", "    @staticmethod\n    def next_batch(self, global_tokens", "decorated"),
        ("mm = _get_shard_memmap(self.files[si])", "mm = _other(self.files[si])", "shard getter"),
        ("def _get_shard_memmap(file):\n    return np.load(file)\n", "_get_shard_memmap = np.load\n", "module level"),
        ("import numpy as np\n", "import numpy as npy\nnp = npy\n", "numpy"),
    ],
)
def test_rejects_altered_shapes(old, new, why):
    assert old in READABLE
    result = recognise(READABLE.replace(old, new, 1))
    assert not result.recognised
    assert why in result.reason


def test_patch_uses_the_numpy_assembly_only_when_recognised():
    source = FIXTURE.read_text()
    result = patch_source(source, producer_toggles=True)
    assert "assembly='_get_shard_memmap'if Hyperparameters.train_prefetch_numpy else None" in result.source
    assert "def _shuffled_gather(" in result.source
    note = next(n for n in result.notes if n.feature == "train_prefetch")
    assert "recognised" in note.reason and "TRAIN_PREFETCH_NUMPY" in note.reason
    altered = source.replace("dtype=np.int64))", "dtype=np.int64)).clone()", 1)
    assert altered != source
    fallback = patch_source(altered, producer_toggles=True)
    assert "assembly=" not in fallback.source and "train_prefetch_numpy" not in fallback.source
    assert "def _shuffled_gather(" not in fallback.source and "def _shuffled_plan(" not in fallback.source
    note = next(n for n in fallback.notes if n.feature == "train_prefetch")
    line = next(i for i, text in enumerate(altered.splitlines(), 1) if ".clone()" in text)
    assert "numpy assembly not used" in note.reason and "own next_batch" in note.reason and f"at line {line}" in note.reason


def test_default_patch_runs_the_loader_in_a_child_without_producer_toggles():
    # Every byte counts against the artifact cap: the numpy assembly and the tuning
    # toggles come with --producer-toggles only. A default patch gets
    # the lean runtime, whose forked child runs the script's own next_batch.
    result = patch_source(FIXTURE.read_text())
    sites = [line for line in result.source.splitlines() if "_make_train_loader(lambda" in line]
    assert len(sites) == 2 and all(line.endswith("copy_stream=Hyperparameters.train_copy_stream)") for line in sites)
    assert "def _produce(" in result.source
    for absent in ("train_prefetch_numpy", "train_prefetch_queue", "def _stage(", "assembly", "_shuffled_plan", "host_copy"):
        assert absent not in result.source, absent
    note = next(n for n in result.notes if n.feature == "train_prefetch")
    assert "child process forked once, at the first batch" in note.reason and "TRAIN_PREFETCH" not in note.reason


def test_other_loader_families_get_no_numpy_assembly():
    # No dead code in scripts that cannot use it, with or without the producer toggles.
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    for result in (patch_source(source), patch_source(source, producer_toggles=True)):
        sites = [line for line in result.source.splitlines() if "= _make_train_loader(lambda" in line]
        assert len(sites) == 2 and not any("assembly=" in line for line in sites)
        assert "train_prefetch_numpy" not in result.source and "def _shuffled_plan(" not in result.source


# ---------------------------------------------------------------------------
# End to end: verify and a training run
# ---------------------------------------------------------------------------


def write_patched(tmp_path, source=None):
    script = read_script(FIXTURE)
    out = tmp_path / "shuffled_patched.py"
    out.write_text(render(script, patch_source(source or script.source, producer_toggles=True).source, rewrap=False))
    return out


@pytest.mark.parametrize("numpy_on", [1, 0])
@pytest.mark.parametrize("shard_tokens", [None, 300])
def test_verify_identical_with_the_numpy_toggle(tmp_path, monkeypatch, numpy_on, shard_tokens):
    monkeypatch.setenv("TRAIN_PREFETCH_NUMPY", str(numpy_on))
    result = verify(FIXTURE, write_patched(tmp_path), batches=24, world_size=2, shard_tokens=shard_tokens)
    assert result.identical, result.difference
    assert f"TRAIN_PREFETCH_NUMPY={numpy_on}" in " ".join(result.notes)


def test_verify_catches_a_gather_that_shifts_y(tmp_path):
    out = write_patched(tmp_path)
    text = out.read_text()
    broken = text.replace("out[1,picked]=windows[:,1:]", "out[1,picked]=windows[:,:-1]", 1)  # the runtime in the fixture's minified style
    assert broken != text
    out.write_text(broken)
    result = verify(FIXTURE, out, batches=16, world_size=2)
    assert not result.identical and result.difference.field == 1


def test_training_losses_identical_with_the_numpy_assembly(tmp_path):
    data = tmp_path / "shards"
    write_shards(data)
    patched = write_patched(tmp_path)

    def run(path, **env):
        full = dict(os.environ, DATA_PATH=str(data), OMP_NUM_THREADS="1", **env)
        done = subprocess.run([sys.executable, str(path)], env=full, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    reference = STEP_LINE.findall(run(FIXTURE))
    out = run(patched)
    assert "train_prefetch_numpy:1" in out
    assert STEP_LINE.findall(out) == reference and len(reference) > 20
