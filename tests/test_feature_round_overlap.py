"""round_overlap: recognition, refusals, the switch, and the overlapped order, on the
miniature round-loop trainer (fixtures/round_loop.py) and on DeepXube's trainer where
a checkout is present."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from patch_tables import assert_noop, assert_patch

from patcher.patch import features_from, patch_source
from patcher.templates import round_overlap as runtime

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "round_loop.py"
PY310 = Path("/root/.pyenv/versions/3.10.13/bin/python3.10")
DEEPXUBE = Path("/work/real/forestagostinelli+deepxube")
DEEPXUBE_MIRROR = Path("/work/.mirror/forestagostinelli+deepxube/repo")


def _patched(tmp_path, source=None, name="round_loop_patched"):
    result = patch_source(source or FIXTURE.read_text(), features_from(None, None, ["round_overlap"]))
    path = tmp_path / f"{name}.py"
    path.write_text(result.source)
    return result, path


def _load(path, switch):
    spec = importlib.util.spec_from_file_location(path.stem + f"_{switch}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if hasattr(module, "ROUND_OVERLAP"):
        module.ROUND_OVERLAP = switch
    return module


def _original():
    return _load(FIXTURE, None)


def _run(module, tmp_path, sub, **kwargs):
    d = tmp_path / sub
    d.mkdir()
    return module.run(str(d), **kwargs)


def _no_collection_thread():
    return not [t for t in threading.enumerate() if t.name.startswith("round_overlap_collect")]


def test_not_in_a_default_patch_nor_with_diagnostics():
    assert "round_overlap" not in features_from(None, None)
    assert "round_overlap" not in features_from(None, None, diagnostics=True)
    assert "round_overlap" in features_from(None, None, ["round_overlap"])
    assert patch_source(FIXTURE.read_text()).source == FIXTURE.read_text()


def test_switched_off_runs_the_original_calls_exactly(tmp_path):
    _, path = _patched(tmp_path)
    original = _run(_original(), tmp_path, "original", rounds=5)
    off = _run(_load(path, 0), tmp_path, "off", rounds=5)
    assert off == original
    assert [c[0] for c in original["calls"]].count("start_update") == 5


def test_sync_main_path_is_left_as_it_is(tmp_path):
    _, path = _patched(tmp_path)
    original = _run(_original(), tmp_path, "original", rounds=3, sync_main=True)
    on = _run(_load(path, 1), tmp_path, "on", rounds=3, sync_main=True)
    assert on == original


def test_switched_on_follows_the_documented_overlapped_order(tmp_path):
    _, path = _patched(tmp_path)
    on = _run(_load(path, 1), tmp_path, "on", rounds=4)
    calls = on["calls"]
    main = [c[:2] for c in calls if c[0] in ("start_update", "end_update", "round_done", "done")]
    # cold round 0: start 0, collect 0, end 0, start 1, train 0; then end k, start k+1, train k; the last round dispatches nothing
    assert main == [["start_update", 0], ["end_update", 0], ["start_update", 1], ["round_done", 0],
                    ["end_update", 1], ["start_update", 2], ["round_done", 3],
                    ["end_update", 2], ["start_update", 3], ["round_done", 6],
                    ["end_update", 3], ["round_done", 9], ["done", 12]]
    # every piece of round r is collected between start_update(r) and end_update(r)
    for r in range(4):
        at = [i for i, c in enumerate(calls) if c[0] == "get_update_data" and c[1] == r]
        assert len(at) == 2
        assert calls.index(["start_update", r, *next(c[2:] for c in calls if c[:2] == ["start_update", r])]) < min(at)
        assert max(at) < calls.index(["end_update", r])
    # staleness: round k+1 is generated from the target as it stood after round k-1 (a snapshot at dispatch)
    after = {c[1]: c[2] for c in calls if c[0] == "round_done"}  # first itr of the round -> value after it
    started = {c[1]: c[3] for c in calls if c[0] == "start_update"}
    assert started[0] == started[1] == 0.0
    assert started[2] == after[0] and started[3] == after[3]
    # summaries keyed to the round whose data they describe
    assert on["summary"] == {"0": {"round": 0, "version": 0.0}, "3": {"round": 1, "version": 0.0}, "6": {"round": 2, "version": after[0]}, "9": {"round": 3, "version": after[3]}}
    assert _no_collection_thread()
    # the target file ends with the last round's network (the staged copy was published)
    assert float((tmp_path / "on" / "nnet_targ.txt").read_text()) == on["value"]
    assert not list((tmp_path / "on").glob("*.round_overlap*"))


def test_collection_error_is_raised_after_the_round_in_training_is_saved(tmp_path, monkeypatch):
    _, path = _patched(tmp_path)
    module = _load(path, 1)
    real_record = module.record

    def record(*call):
        real_record(*call)
        if call[0] == "train_itr" and call[1] == 3:  # round 1 trains: round 2, in flight, fails before iteration 4
            for thread in threading.enumerate():
                if thread.name.startswith("round_overlap_collect"):
                    thread.join(10)

    monkeypatch.setattr(module, "record", record)
    with pytest.raises(ValueError, match="^generation of round 2 failed$") as info:
        _run(module, tmp_path, "fail", rounds=4, fail_at_round=2)
    # the collection's own exception object, the collection thread's frames on its traceback
    assert type(info.value) is ValueError and info.value.args == ("generation of round 2 failed",)
    assert "get_update_data" in [entry.name for entry in info.traceback]
    # round 1 trains to its end and is saved, as in the original; round 2 never starts training
    trained = [c[1] for c in module.CALLS if c[0] == "train_itr"]
    assert trained == [0, 1, 2, 3, 4, 5]
    assert [c[:2] for c in module.CALLS if c[0] == "round_done"] == [["round_done", 0], ["round_done", 3]]
    assert float((tmp_path / "fail" / "nnet_targ.txt").read_text()) == module.CALLS[-1][2]
    assert not list((tmp_path / "fail").glob("*.round_overlap*"))
    assert _no_collection_thread()


def test_dead_worker_is_raised_when_its_round_is_needed_and_leaves_no_thread(tmp_path, monkeypatch):
    import multiprocessing

    _, path = _patched(tmp_path)
    module = _load(path, 1)
    original_start = module.FakeUpdater.start_update
    children = []

    def start_update(self, step_probs, num_gen):
        if self.round == 1:  # round 2's worker dies and delivers nothing
            self.round += 1
            child = multiprocessing.get_context("fork").Process(target=os._exit, args=(3,), name="fake_worker")
            child.start()
            children.append(child)
            return
        original_start(self, step_probs, num_gen)

    monkeypatch.setattr(module.FakeUpdater, "start_update", start_update)
    with pytest.raises(module.RoundCollectionError, match="exited with code 3"):
        _run(module, tmp_path, "dead", rounds=4)
    children[0].join(10)
    assert _no_collection_thread()
    # found while round 2 is waited for: round 1 (trained beside it) was trained and saved
    assert ["round_done", 3] in [c[:2] for c in module.CALLS]


def test_ctrl_c_during_training_leaves_no_thread_and_publishes_the_target(tmp_path, monkeypatch):
    _, path = _patched(tmp_path)
    module = _load(path, 1)
    original_start = module.FakeUpdater.start_update

    def start_update(self, step_probs, num_gen):
        original_start(self, step_probs, num_gen)
        if self.round == 2:
            while not self.from_q.empty():  # round 2's data never comes: its thread stays blocked
                self.from_q.get()

    real_record = module.record

    def record(*call):
        real_record(*call)
        if call[0] == "train_itr" and call[1] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(module.FakeUpdater, "start_update", start_update)
    monkeypatch.setattr(module, "record", record)
    with pytest.raises(KeyboardInterrupt):
        _run(module, tmp_path, "ctrlc", rounds=4)
    assert _no_collection_thread()
    assert not list((tmp_path / "ctrlc").glob("*.round_overlap*"))


def test_copy_target_is_staged_while_a_round_is_in_flight(tmp_path):
    state = runtime._RoundOverlap()
    src, dst = tmp_path / "net", tmp_path / "targ"
    src.write_text("new")
    dst.write_text("old")
    state.copy_target(str(src), str(dst))
    assert dst.read_text() == "new"  # nothing in flight: copied now
    src.write_text("newer")
    release = threading.Event()
    state.thread = threading.Thread(target=release.wait)
    state.thread.start()
    state.copy_target(str(src), str(dst))
    assert dst.read_text() == "new"  # the round in flight reads an unchanged file
    state.publish()
    assert dst.read_text() == "newer"
    release.set()
    state.thread.join()



class _Times:
    def __init__(self):
        self.times = {}

    def record_time(self, name, elapsed):
        self.times[name] = self.times.get(name, 0.0) + elapsed


class _Buffer(list):
    pass


def test_warm_round_records_its_wait_and_cold_round_does_not():
    state = runtime._RoundOverlap()
    times = _Times()
    collected = []
    assert state.receive(_Buffer(), lambda: collected.append("cold"), times) is not None
    assert collected == ["cold"] and times.times == {}
    release = threading.Event()

    def collect(buffer, thread_times):
        release.wait(10)
        buffer.append("round 2")

    first = _Buffer(["round 1"])
    assert state.dispatch(first, lambda: None, collect, lambda: None, times, more=True)
    assert not state.dispatch(first, lambda: None, collect, lambda: None, times, more=True)  # one round in flight at most
    release.set()
    received = state.receive(first, lambda: collected.append("never"), times)
    assert received == ["round 2"] and state.spare is first
    assert collected == ["cold"] and "up_wait" in times.times and times.times["up_wait"] >= 0.0
    assert _no_collection_thread()


def test_warns_once_when_training_threads_take_every_core(monkeypatch, capsys):
    class FakeTorch:
        @staticmethod
        def get_num_threads():
            return os.cpu_count()

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    monkeypatch.setattr(runtime, "_ROUND_OVERLAP_WARNED", [])
    for _ in range(2):
        state = runtime._RoundOverlap()
        assert state.dispatch(_Buffer(), lambda: None, lambda buffer, t: None, lambda: None, _Times(), more=True)
        state.receive(_Buffer(), lambda: None)
    err = capsys.readouterr().err
    assert err.count("round_overlap: training uses") == 1 and f"on {os.cpu_count()} cores" in err


def test_no_warning_when_training_leaves_cores(monkeypatch, capsys):
    class FakeTorch:
        @staticmethod
        def get_num_threads():
            return max(1, (os.cpu_count() or 1) - 1)

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    monkeypatch.setattr(runtime, "_ROUND_OVERLAP_WARNED", [])
    state = runtime._RoundOverlap()
    state.dispatch(_Buffer(), lambda: None, lambda buffer, t: None, lambda: None, _Times(), more=True)
    state.receive(_Buffer(), lambda: None)
    if (os.cpu_count() or 1) > 1:
        assert "round_overlap: training uses" not in capsys.readouterr().err


REFUSED = {
    "no_else": ("        else:\n            loss = self._train_sync_main(num_gen, times)\n            self._end_update(itr_init, times)\n", "", "has no else"),
    "train_before_end": ("            self._end_update(itr_init, times)\n            loss = self._train(times)\n", "            loss = self._train(times)\n            self._end_update(itr_init, times)\n", "is not `self.<collect>"),
    "no_target_copy": ("            shutil.copy(self.nnet_file, self.nnet_targ_file)\n", "            pass\n", "shutil.copy"),
    "no_start": ("        self.updater.start_update(list(self.status.step_probs), num_gen)\n", "", "start_update"),
}


@pytest.mark.parametrize("case", sorted(REFUSED), ids=sorted(REFUSED))
def test_refused_with_reason_and_line(case):
    old, new, why = REFUSED[case]
    source = FIXTURE.read_text()
    assert old in source
    source = source.replace(old, new)
    result = patch_source(source, features_from(None, None, ["round_overlap"]))
    note = next(n for n in result.notes if n.feature == "round_overlap")
    assert not note.applied and why in note.reason
    assert result.source == source


def _deepxube_trainers():
    found = []
    if (DEEPXUBE / "deepxube/base/trainer.py").exists():
        found.append(pytest.param((DEEPXUBE / "deepxube/base/trainer.py").read_text(), id="head"))
    if DEEPXUBE_MIRROR.exists():
        out = subprocess.run(["git", "-C", str(DEEPXUBE_MIRROR), "show", "4262fe3:deepxube/base/trainer.py"], capture_output=True, text=True)
        if out.returncode == 0:
            found.append(pytest.param(out.stdout, id="base"))
    return found or [pytest.param(None, marks=pytest.mark.skip(reason="no DeepXube checkout"))]


@pytest.mark.parametrize("source", _deepxube_trainers())
def test_deepxube_trainer_patches_and_compiles(source, tmp_path):
    result = patch_source(source, features_from(None, None, ["round_overlap"]))
    note = next(n for n in result.notes if n.feature == "round_overlap")
    assert note.applied, note.reason
    assert "if ROUND_OVERLAP and not self.updater.up_args.sync_main:" in result.source
    assert patch_source(result.source, features_from(None, None, ["round_overlap"])).already_patched
    path = tmp_path / "trainer.py"
    path.write_text(result.source)
    for python in [sys.executable] + ([str(PY310)] if PY310.exists() else []):
        subprocess.run([python, "-m", "py_compile", str(path)], check=True)



# One table pair, as for every feature: a round loop rewritten (whole output; runtime
# block as `RUNTIME`), and one left alone with its reason and line.
ROUND_LOOP = """\
import shutil

import torch


class Train:
    def train_loop(self):
        while self.itr < self.max_itrs:
            self.update_step()

    def update_step(self):
        self.db.clear()
        times = Times()
        self.updater.start_update(self.num_gen)
        if not self.updater.sync_main:
            self.collect(self.num_gen, times)
            self.end_update()
            loss = self.train()
        else:
            loss = self.train_sync_main()
        shutil.copy(self.nnet_file, self.targ_file)

    def collect(self, num_gen, times):
        while self.db.size() < num_gen:
            for data in self.updater.get_update_data():
                self.db.add(data)

    def end_update(self):
        self.updater.end_update()

    def train(self):
        for _ in range(self.up_itrs):
            self.itr += 1
        return 0.0
"""

ROUND_LOOP_AFTER = '''\
import shutil

import torch
import os
ROUND_OVERLAP = int(os.environ.get("ROUND_OVERLAP", 1))
#<runtime>


class Train:
    def train_loop(self):
        while self.itr < self.max_itrs:
            self.update_step()

    def update_step(self):
        if ROUND_OVERLAP and not self.updater.sync_main:
            return self._round_overlap_update_step()
        self.db.clear()
        times = Times()
        self.updater.start_update(self.num_gen)
        if not self.updater.sync_main:
            self.collect(self.num_gen, times)
            self.end_update()
            loss = self.train()
        else:
            loss = self.train_sync_main()
        shutil.copy(self.nnet_file, self.targ_file)

    def _round_overlap_update_step(self):
        """The update step with the next round collected while this one trains (round_overlap)."""
        _ro = _round_overlap_of(self)
        try:
            _ro.clear(self.db.clear)
            times = Times()
            _ro.start(lambda: self.updater.start_update(self.num_gen))
            self.db = _ro.receive(self.db, lambda: self.collect(self.num_gen, times), times)
            self.end_update()
            _ro.publish()
            _ro.dispatch(self.db, lambda: self.updater.start_update(self.num_gen), lambda db, t: self._round_overlap_collect(db, self.num_gen, t), lambda: self.updater.from_q.put(None), times, self.itr + self.up_itrs < self.max_itrs)
            loss = self.train()
            _ro.copy_target(self.nnet_file, self.targ_file)
        except BaseException:
            _ro.close()
            raise

    def _round_overlap_collect(self, db, num_gen, times):
        while db.size() < num_gen:
            _round_overlap_of(self).stop_point()
            for data in self.updater.get_update_data():
                db.add(data)

    def collect(self, num_gen, times):
        while self.db.size() < num_gen:
            for data in self.updater.get_update_data():
                self.db.add(data)

    def end_update(self):
        self.updater.end_update()

    def train(self):
        for _ in range(self.up_itrs):
            self.itr += 1
        return 0.0
'''


def test_rewrite_of_a_round_loop():
    result = assert_patch(ROUND_LOOP, ROUND_LOOP_AFTER, only="round_overlap")
    assert [n.line for n in result.notes if n.feature == "round_overlap" and n.applied] == [11]


def test_noop_where_a_part_of_the_round_is_not_a_method_of_the_class():
    assert_noop(ROUND_LOOP.replace("    def end_update(self):\n        self.updater.end_update()\n\n", ""), "round loop in Train.update_step: `self.end_update` is not a method of Train", 15, only="round_overlap")
