"""templates/prefetch_lean.py started by spawn, as plain Python: a generator run ahead in a spawned process.

Each test builds a small importable module (a generator that, like nanochat's loader,
refills one buffer it keeps and yields views of it with a state dict) and compares what
`_spawn_generator` hands out with what the generator itself yields.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from patcher.proof.host_cuda import cuda_on_host
from patcher.templates.prefetch_lean import _spawn_generator

REPO = Path(__file__).resolve().parents[1]

SOURCE = textwrap.dedent(
    '''
    import torch

    def gen(n, device="cpu", fail_at=None, stop=None):
        buffer = torch.empty(2, 3, dtype=torch.long, device=device)
        for k in range(n if stop is None else stop):
            if k == fail_at:
                raise ValueError(f"bad row group {k}")
            buffer.copy_(torch.arange(6).view(2, 3) * (k + 1))
            yield buffer[0], buffer[1], {"pq_idx": k // 3, "rg_idx": k % 3, "epoch": 1}

    def gen_shapes(device="cpu"):
        # batch 1 is larger than batch 0 (whose tensors size the shared slots), batch 2 smaller
        for k, rows in enumerate((2, 40, 1, 2)):
            wide = torch.arange(rows * 6, dtype=torch.float16).view(6, rows).t() * (k + 1)  # not contiguous
            yield {"x": wide, "mask": wide > 3, "count": torch.tensor(k * 7), "k": k, "name": f"b{k}"}

    def gen_split(split, device="cpu"):
        # like nanochat's loader: the split selects the files; each batch says where it was built
        import os
        assert split in ["train", "val"]
        for k in range(3):
            yield torch.arange(4, device=device) + k + (100 if split == "val" else 0), {"pid": os.getpid(), "k": k}

    class ShardError(Exception):
        def __init__(self, path, row_group):  # other arguments than its args
            super().__init__(f"{path}: row group {row_group} is corrupt")
            self.path = path

    def gen_corrupt(device="cpu"):
        yield torch.zeros(2)
        raise ShardError("shard_00003.parquet", 5)

    class HoldsALock(Exception):
        def __init__(self, message):
            super().__init__(message)
            import threading
            self.lock = threading.Lock()  # does not pickle

    def gen_lock(device="cpu"):
        yield torch.zeros(2)
        raise HoldsALock("no lock at batch 1")

    def gen_count(device="cpu"):
        # the number of tensors in a batch shrinks, then grows
        for k, n in enumerate((2, 2, 1, 1, 2, 2)):
            yield tuple(torch.full((2, 3), k * 10 + i) for i in range(n))

    def gen_nice(device="cpu"):
        import os
        yield torch.zeros(1, device=device), os.nice(0)
    '''
)


@pytest.fixture
def module(import_source):
    return import_source("spawn_gen", SOURCE)


def expected(module, **arguments):
    return [(a.clone(), b.clone(), dict(s)) for a, b, s in module.gen(**arguments)]


def test_same_batches_and_states_each_valid_after_the_next(module, capsys):
    arguments = {"n": 7, "device": "cpu", "fail_at": None, "stop": None}
    got = []
    for batch in _spawn_generator(module.gen, arguments, "device"):
        got.append(batch)
    want = expected(module, n=7)
    assert len(got) == 7
    for (a, b, s), (x, y, t) in zip(want, got):  # every batch still holds its values after all later ones
        assert torch.equal(a, x) and torch.equal(b, y) and s == t and type(t) is dict
    assert "runs in the training process" not in capsys.readouterr().err  # the producer was spawned
    assert not multiprocessing.active_children()


def test_cuda_path_through_pinned_staging(module, capsys):
    arguments = {"n": 5, "device": "cuda", "fail_at": None, "stop": None}
    with cuda_on_host():
        got = [(x.cpu().clone(), y.cpu().clone(), s) for x, y, s in _spawn_generator(module.gen, arguments, "device")]
    want = expected(module, n=5)
    assert all(torch.equal(a, x) and torch.equal(b, y) and s == t for (a, b, s), (x, y, t) in zip(want, got)) and len(got) == 5
    assert "runs in the training process" not in capsys.readouterr().err


def test_cuda_path_when_the_number_of_tensors_shrinks_then_grows(module):
    # one ring per leaf (templates/staging.py, `_ring_h2d`): a leaf that comes back gets its ring
    with cuda_on_host():
        got = [tuple(t.cpu().clone() for t in batch) for batch in _spawn_generator(module.gen_count, {"device": "cuda"}, "device")]
    want = list(module.gen_count())
    assert [len(b) for b in got] == [2, 2, 1, 1, 2, 2]
    assert all(torch.equal(g, w) for gb, wb in zip(got, want) for g, w in zip(gb, wb))
    assert not multiprocessing.active_children()


def test_error_reaches_the_caller_at_its_batch_with_the_traceback(module):
    arguments = {"n": 9, "device": "cpu", "fail_at": 4, "stop": None}
    got = []
    with pytest.raises(ValueError, match="bad row group 4") as raised:
        for batch in _spawn_generator(module.gen, arguments, "device"):
            got.append(batch)
    assert len(got) == 4
    assert "Traceback" in str(raised.value.__cause__) and "in gen" in str(raised.value.__cause__)
    assert not multiprocessing.active_children()


def test_the_scripts_own_exception_arrives_as_itself(module):
    # Its class takes other arguments than its args: rebuilt without its __init__, so the
    # script's own `except ShardError:` catches it, with its attributes.
    batches = _spawn_generator(module.gen_corrupt, {"device": "cpu"}, "device")
    assert torch.equal(next(batches), torch.zeros(2))
    with pytest.raises(module.ShardError) as raised:
        next(batches)
    assert type(raised.value) is module.ShardError and raised.value.path == "shard_00003.parquet"
    assert str(raised.value) == "shard_00003.parquet: row group 5 is corrupt"
    assert "in gen_corrupt" in str(raised.value.__cause__)  # the producer's traceback
    assert not multiprocessing.active_children()


def test_an_exception_that_does_not_pickle_arrives_as_a_runtime_error_naming_it(module):
    # the error transport every producer process shares (templates/staging.py, `_producer_error`)
    batches = _spawn_generator(module.gen_lock, {"device": "cpu"}, "device")
    assert torch.equal(next(batches), torch.zeros(2))
    with pytest.raises(RuntimeError, match="^prefetch: HoldsALock in the producer: no lock at batch 1$") as raised:
        next(batches)
    assert "in gen_lock" in str(raised.value.__cause__)
    assert not multiprocessing.active_children()


def test_a_process_the_script_forks_and_exits_leaves_the_producer_alone(module, tmp_path):
    # A raw fork of the training process whose child leaves through sys.exit: Python's exit
    # there runs multiprocessing's exit hook, which must not terminate (nor try to join)
    # the training process's producer. Run in a process of its own: a fork of pytest would
    # go on running tests.
    script = tmp_path / "fork_and_exit.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        import torch
        sys.path.insert(0, {str(tmp_path)!r})
        from {module.__name__} import gen
        from patcher.templates.prefetch_lean import _spawn_generator
        got = []
        for k, batch in enumerate(_spawn_generator(gen, {{"n": 6, "device": "cpu", "fail_at": None, "stop": None}}, "device")):
            got.append(batch)
            if k == 1:
                child = os.fork()
                if child == 0:
                    sys.exit(0)
                print("fork exit", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
        want = [(a.clone(), b.clone(), s) for a, b, s in gen(6)]  # the original reuses its buffer
        print("batches", len(got), all(torch.equal(a, x) and torch.equal(b, y) for (a, b, _), (x, y, _) in zip(got, want)))
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["fork exit 0", "batches 6 True"], done.stdout + done.stderr
    assert "Error" not in done.stderr and "runs in the training process" not in done.stderr, done.stderr


def test_prefetch_off_is_the_original(module):
    generator = _spawn_generator(module.gen, {"n": 3, "device": "cpu", "fail_at": None, "stop": None}, "device", prefetch=False)
    first = next(generator)
    assert not multiprocessing.active_children()
    second = next(generator)
    assert first[0].data_ptr() == second[0].data_ptr()  # the original's own reused buffer


def test_a_module_not_importable_by_name_runs_here_and_says_why(module, capsys, monkeypatch):
    monkeypatch.setattr(module.gen, "__module__", "__main__")
    got = [(a.clone(), b.clone(), s) for a, b, s in _spawn_generator(module.gen, {"n": 4, "device": "cpu", "fail_at": None, "stop": None}, "device")]
    assert [s for *_, s in got] == [s for *_, s in expected(module, n=4)]
    assert "cannot be imported by name in a spawned process" in capsys.readouterr().err


def test_only_the_training_split_spawns_a_producer(module, capsys):
    """A val build runs the original here (no child: its start would cost each evaluation
    seconds); a train build spawns; every_split spawns for val too; the values are the same."""
    import os

    def run(split, every_split=False):
        generator = _spawn_generator(module.gen_split, {"split": split, "device": "cpu"}, "device", split_param="split", train_split="train", every_split=every_split)
        first = next(generator)
        children = multiprocessing.active_children()
        batches = [first, *generator]
        assert not multiprocessing.active_children()
        return [(x.clone(), s["k"]) for x, s in batches], {s["pid"] for _, s in batches}, children

    for split in ("train", "val"):
        want = [(x.clone(), s["k"]) for x, s in module.gen_split(split)]
        for every_split in (False, True):
            if split == "train" and every_split:
                continue
            got, pids, children = run(split, every_split)
            assert len(got) == len(want) == 3 and all(torch.equal(a, b) and j == k for (a, j), (b, k) in zip(want, got))
            if split == "val" and not every_split:
                assert pids == {os.getpid()} and not children  # built here, no child started
            else:
                assert len(pids) == 1 and os.getpid() not in pids and [c.pid for c in children] == list(pids)
    assert "runs in the training process" not in capsys.readouterr().err  # the val build is the default, not a fallback


def test_close_ends_the_producer_of_the_training_split(module):
    generator = _spawn_generator(module.gen_split, {"split": "train", "device": "cpu"}, "device", split_param="split", train_split="train")
    next(generator)
    assert multiprocessing.active_children()
    generator.close()
    assert not multiprocessing.active_children()


def test_batches_larger_or_smaller_than_the_first_and_any_dtype(module):
    """Slots are sized by the first batch: a larger one travels in the message, a smaller one in the slot."""
    import gc

    gc.collect()  # a mapping an earlier test's traceback kept (a cycle through its generator's frame) goes first

    def mapped() -> int:
        return open("/proc/self/maps").read().count("memfd:prefetch-slots")

    # Counted against what this process already maps: loaders of other tests in this
    # worker (the order of files varies) are not this test's to judge.
    before = mapped()
    want = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in module.gen_shapes()]
    generator = _spawn_generator(module.gen_shapes, {"device": "cpu"}, "device", depth=1)
    got = [next(generator)]
    assert mapped() > before  # shared through an anonymous file
    got += list(generator)
    del generator
    assert len(got) == len(want) == 4
    for w, g in zip(want, got):  # every batch still holds its values after all later ones
        assert g.keys() == w.keys() and g["k"] == w["k"] and g["name"] == w["name"]
        for key in ("x", "mask", "count"):
            assert g[key].dtype == w[key].dtype and g[key].shape == w[key].shape and torch.equal(g[key], w[key])
    assert not multiprocessing.active_children()
    assert mapped() > before  # the first batch is lent: views of its slot
    del got, g
    assert mapped() == before  # unmapped when the loader and its batches end


def test_the_producer_yields_the_cpu_to_the_training_process(module):
    import os

    (_, niceness), = list(_spawn_generator(module.gen_nice, {"device": "cpu"}, "device"))
    assert niceness > os.nice(0)
