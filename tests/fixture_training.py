"""The fixtures' original training runs, trained once per test run and shared by the files
that look at them (test_fixtures.py: runs, determinism; test_end_to_end.py: the reference
losses of the patched runs).

pytest-xdist puts those files in different worker processes, so the runs are shared on
disk: each (fixture, run index) has a lock file and a result file in a folder that the
workers of one test run share (the parent of each worker's basetemp). The first worker to
ask for a run trains it under its lock; the other reads the result. A worker first trains
the runs nobody holds, then waits for the ones the other worker is training.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from patcher.proof.shards import write_shards

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# The synthetic shards every fixture run trains on (documents start with token 1).
SHARDS = dict(train_shards=3, val_shards=1, tokens_per_shard=2048, vocab_size=128, seed=0, bos_id=1)


def workers() -> int:
    """Subprocesses at once: one per core this process may run on (at least 2)."""
    return max(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2))


def shared_dir(tmp_path_factory) -> Path:
    """A folder shared by every worker of this test run (this session's basetemp without xdist)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "fixture-training"
    folder.mkdir(exist_ok=True)
    return folder


class _Lock:
    """An exclusive flock on `path` (created if missing); `blocking=False` raises BlockingIOError when held."""

    def __init__(self, path: Path, blocking: bool = True):
        self.path, self.blocking = path, blocking

    def __enter__(self):
        self.file = open(self.path, "w")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BaseException:
            self.file.close()
            raise
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def shard_dir(tmp_path_factory) -> Path:
    """The shards (`SHARDS`), written once per test run."""
    folder = shared_dir(tmp_path_factory)
    directory = folder / "shards"
    with _Lock(folder / "shards.lock"):
        if not (folder / "shards.done").exists():
            write_shards(directory, **SHARDS)
            (folder / "shards.done").touch()
    return directory


def _env_names_read_by_fixtures() -> set[str]:
    names = set()
    for path in FIXTURES.glob("*.py"):
        names.update(re.findall(r"os\.environ\.get\(['\"]([A-Z0-9_]+)['\"]", path.read_text(encoding="utf-8")))
    return names | {"RANK", "WORLD_SIZE", "LOCAL_RANK"}


def run_env(shards: Path, **extra: str) -> dict[str, str]:
    """The environment of a fixture run: this one without the variables the fixtures
    read, one CPU thread, no CUDA, a fixed hash seed, DATA_PATH=`shards`, then `extra`."""
    env = dict(os.environ)
    for key in _env_names_read_by_fixtures():
        env.pop(key, None)
    env.update(DATA_PATH=str(shards), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    env.update(extra)
    return env


def run_script(script: Path, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """`script` run by this interpreter (timeout 300 s), its output captured as text."""
    return subprocess.run([sys.executable, str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def original_runs(tmp_path_factory, jobs: list[tuple[str, int]]) -> dict[tuple[str, int], subprocess.CompletedProcess]:
    """{(fixture stem, run index): its run}: `fixtures/<stem>.py` unpatched on `shard_dir`'s
    shards, in `run_env`; run index i is the i-th independent run of that fixture. Each
    job runs once per test run, whichever worker asks first."""
    shards = shard_dir(tmp_path_factory)
    folder = shared_dir(tmp_path_factory)
    workdir = folder / "cwd"
    workdir.mkdir(exist_ok=True)
    env = run_env(shards)

    def one(job, blocking):
        stem, index = job
        result = folder / f"{stem}.{index}.json"
        try:
            with _Lock(folder / f"{stem}.{index}.lock", blocking):
                if not result.exists():
                    done = run_script(FIXTURES / f"{stem}.py", env, workdir)
                    partial = result.with_suffix(".part")
                    partial.write_text(json.dumps([done.returncode, done.stdout, done.stderr]))
                    partial.rename(result)
                returncode, stdout, stderr = json.loads(result.read_text())
        except BlockingIOError:  # the other worker is training it
            return job, None
        return job, subprocess.CompletedProcess([sys.executable, str(FIXTURES / f"{stem}.py")], returncode, stdout, stderr)

    with ThreadPoolExecutor(max_workers=workers()) as pool:
        found = dict(pool.map(lambda job: one(job, False), jobs))
        waiting = [job for job, run in found.items() if run is None]
        found.update(pool.map(lambda job: one(job, True), waiting))
    return found
