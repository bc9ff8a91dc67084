"""round_overlap when the round collected in the background fails: the patched trainer
ends as the original does. The round being trained finishes and is saved, then the
collection's own exception (same object: class, message, args, the collection's
traceback) is raised where the original would have raised it, when the failed round's
data is needed; no thread or process is left behind.

Runs the miniature round-loop trainer (fixtures/round_loop.py), original and patched,
as real processes through a small driver whose `except ValueError:` stands for the
script's own handler.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from patcher.patch import features_from, patch_source

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "round_loop.py"

# Loads a trainer file as a module, trains 4 rounds of 3 iterations with round 2's
# collection raising ValueError; the script's own handler reports what it caught (and
# the threads and child processes alive then) as one JSON line, then re-raises. Where
# round 2 is collected in the background, round 1's training waits at its first
# iteration until that collection has ended (failed), so the failure always comes
# while round 1 still has iterations to train.
DRIVER = textwrap.dedent(
    """\
    import importlib.util, json, multiprocessing, sys, threading
    spec = importlib.util.spec_from_file_location("trainer", sys.argv[1])
    trainer = importlib.util.module_from_spec(spec)
    sys.modules["trainer"] = trainer
    spec.loader.exec_module(trainer)
    record = trainer.record
    def record_and_let_the_round_in_flight_end(*call):
        record(*call)
        if call[:2] == ("train_itr", 3):  # round 1 trains: round 2, if collected beside it, fails now
            for t in threading.enumerate():
                if t.name.startswith("round_overlap_collect"):
                    t.join(10)
    trainer.record = record_and_let_the_round_in_flight_end
    try:
        trainer.run(sys.argv[2], rounds=4, fail_at_round=2)
    except ValueError as exc:
        print(json.dumps({
            "caught": [type(exc).__name__, list(exc.args), str(exc)],
            "trained": [c[1] for c in trainer.CALLS if c[0] == "train_itr"],
            "saved": [c[1:] for c in trainer.CALLS if c[0] == "round_done"],
            "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
            "children": [p.pid for p in multiprocessing.active_children()],
        }), flush=True)
        raise
    """
)


def _run(tmp_path: Path, trainer: Path, name: str, overlap: str | None = None) -> dict:
    """Run the driver on `trainer` in a fresh folder; returns its exit code, report, last
    stderr line, stderr and the files left in the folder ({name: text})."""
    out = tmp_path / name
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ROUND_OVERLAP"}
    if overlap is not None:
        env["ROUND_OVERLAP"] = overlap
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(trainer), str(out)], capture_output=True, text=True, env=env, timeout=60)
    lines = proc.stdout.splitlines()
    return {
        "code": proc.returncode,
        "report": json.loads(lines[-1]) if lines else None,
        "last": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "",
        "stderr": proc.stderr,
        "files": {p.name: p.read_text() for p in sorted(out.iterdir())},
    }


def _setup(tmp_path: Path) -> Path:
    (tmp_path / "driver.py").write_text(DRIVER)
    result = patch_source(FIXTURE.read_text(), features_from(None, None, ["round_overlap"]))
    assert "round_overlap" in result.applied
    patched = tmp_path / "round_loop_patched.py"
    patched.write_text(result.source)
    return patched


def test_failed_background_round_ends_as_the_original(tmp_path):
    patched = _setup(tmp_path)
    original = _run(tmp_path, FIXTURE, "original")
    on = _run(tmp_path, patched, "on")
    off = _run(tmp_path, patched, "off", overlap="0")
    # the original: rounds 0 and 1 train and are saved, round 2's collection raises
    assert original["code"] == 1 and original["last"] == "ValueError: generation of round 2 failed"
    assert original["report"]["caught"] == ["ValueError", ["generation of round 2 failed"], "generation of round 2 failed"]
    assert original["report"]["trained"] == [0, 1, 2, 3, 4, 5]
    # patched: the script's own `except ValueError` catches the collection's exception itself
    assert on["report"] is not None, on["stderr"]
    assert on["code"] == original["code"] and on["last"] == original["last"]
    assert on["report"]["caught"] == original["report"]["caught"]
    # round 1 (trained while round 2 failed) trains to its end and is saved
    assert on["report"]["trained"] == original["report"]["trained"]
    assert [s[0] for s in on["report"]["saved"]] == [s[0] for s in original["report"]["saved"]] == [0, 3]
    # the network file holds the last saved round, the target file its published copy, nothing staged is left
    for run in (original, on):
        assert sorted(run["files"]) == ["nnet.txt", "nnet_targ.txt"]
        assert float(run["files"]["nnet.txt"]) == run["report"]["saved"][-1][1]
        assert run["files"]["nnet_targ.txt"] == run["files"]["nnet.txt"]
    # the collection's traceback comes with it; no collection thread or child outlives the failure
    assert "in get_update_data" in on["stderr"] and "RoundCollectionError" not in on["stderr"]
    assert on["report"]["threads"] == [] and on["report"]["children"] == []
    # switched off, the patched trainer fails exactly as the original: same calls, same values, same files
    assert (off["code"], off["report"], off["last"], off["files"]) == (original["code"], original["report"], original["last"], original["files"])
