"""bench/gpu_proof.py --dry-run: every stage on the CPU at tiny sizes, on the fixtures.

What the GPU run depends on is checked here, where it costs no GPU time: the wheel set
installs for the GPU machine's Python, each stage runs and records itself, a failed
stage does not stop the others, and a deadline skips what would overrun.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROOF = ROOT / "bench" / "gpu_proof.py"
sys.path.insert(0, str(ROOT / "bench"))

import gpu_proof  # noqa: E402
from gpu_prepare import prepare  # noqa: E402


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The fixtures patched, and the GPU machine's wheels downloaded, once."""
    inputs = tmp_path_factory.mktemp("inputs")
    prepare(inputs, fixtures=True, wheels=True)
    return inputs


def _proof(*args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROOF), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_dry_run_runs_every_stage(prepared, tmp_path):
    out = tmp_path / "out"
    done = _proof("--dry-run", "--inputs", str(prepared), "--out", str(out))
    results = json.loads((out / "results.json").read_text())
    rows = results["stages"]
    assert list(rows) == [stage.key for stage in gpu_proof.STAGES]
    assert {key: row["status"] for key, row in rows.items()} == {key: "ok" for key in rows}, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    # Each stage recorded its figures, exit and time; each box says where its seconds come from.
    for key, row in rows.items():
        assert row["rc"] in (0, gpu_proof.SKIPPED_RC) and row["seconds"] >= 0 and row["figures"]["headline"]
        assert results["budgets"][key]["basis"]
    assert set(rows["0_probe"]["figures"]["installed"]) >= {"libcst", "pyflakes", "python_minifier"}
    assert rows["7_generator"]["figures"]["exact"] is True
    assert rows["8_module"]["figures"]["exact"] is True
    registered = rows["3_registered_slot"]["figures"]
    assert registered["exact"] == {"batches": 12, "differ": 0, "registered": True}
    assert registered["failure_isolated"]["second_registration"] is False and registered["failure_isolated"]["launch_after_failure_on_its_thread"] == "clean"
    # The end-to-end stages: the miniatures run original then patched to their last step,
    # the producer never fell back, and the comparison carries its resolution and basis.
    for key in ("1_nanochat_e2e", "5_modded_e2e"):
        report = rows[key]["figures"]["report"]
        assert [(r["side"], r["rc"], r["fell_back"], r["steady"]["n"] >= 2) for r in report["runs"]] == [("original", 0, False, True), ("patched", 0, False, True)], key
        comparison = report["comparison"]
        assert comparison["basis"].startswith("within one run each") and comparison["resolution_pct"] > 0, key
        assert "faster" not in comparison["verdict"] and "slower" not in comparison["verdict"], key
    ab = rows["4_ab_root"]["figures"]["ab"]
    # One run each on the CPU, in order, both measured, the producer never fell back.
    assert ab["runs_each"] == 1 and [(r["side"], r["step_ms"] is not None) for r in ab["runs"]] == [("a", True), ("b", True)]
    assert ab["fallbacks"] == 0
    assert "one run a side" in rows["4_ab_root"]["figures"]["resolution"]
    assert results["inputs"]["patcher"]["sha256"]
    # What comes back from the GPU machine: few, small files.
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= gpu_proof.MAX_OUT_FILES


def test_a_failed_stage_does_not_stop_the_next(prepared, tmp_path):
    inputs = tmp_path / "inputs"
    shutil.copytree(prepared, inputs)
    (inputs / "modded_patched.py").unlink()
    out = tmp_path / "out"
    done = _proof("--dry-run", "--inputs", str(inputs), "--out", str(out), "--only", "7", "--only", "9")
    rows = json.loads((out / "results.json").read_text())["stages"]
    assert rows["7_generator"]["status"] == "failed"
    assert rows["9_premise"]["status"] == "ok"
    assert done.returncode == 1
    assert "input modded patched missing" in done.stdout


def test_the_deadline_skips_what_would_overrun(prepared, tmp_path):
    out = tmp_path / "out"
    done = _proof("--dry-run", "--inputs", str(prepared), "--out", str(out), "--deadline", "0.5", "--only", "0", "--only", "9")
    rows = json.loads((out / "results.json").read_text())["stages"]
    # Stage 0 starts with 0.5 s left and is cut off at the deadline; stage 9 finds none left.
    assert rows["0_probe"]["status"] == "timed out"
    assert rows["9_premise"]["status"] == "skipped" and "left before the deadline" in rows["9_premise"]["why"]
    assert done.returncode == 1


def test_the_device_command_fits():
    assert len(gpu_proof.DEVICE_COMMAND) <= gpu_proof.DEVICE_COMMAND_LIMIT
    assert "--inputs .gpu_inputs" in gpu_proof.DEVICE_COMMAND


def test_no_manifest_is_a_one_line_error(tmp_path):
    done = _proof("--inputs", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "no manifest.json" in done.stderr


def test_the_boxes_before_the_modded_stage_fit_the_deadline():
    # The stages up to the modded-nanogpt run get their whole box, and it its minimum,
    # inside the 540 s a device command is given; every box has its basis written down.
    keys = [stage.key for stage in gpu_proof.STAGES]
    modded = keys.index("5_modded_e2e")
    assert sum(stage.budget_s for stage in gpu_proof.STAGES[:modded]) + gpu_proof.STAGES[modded].min_s <= 540
    assert set(gpu_proof.BUDGET_BASIS) == set(keys)


def test_the_registered_slot_stage_fails_where_the_slots_are_not_registered(tmp_path, monkeypatch):
    # The planted fault: a runtime that never registers its slots (every hand-out then
    # copies into pinned memory first, the path of a failed registration).
    from patcher.templates import prefetch_lean

    monkeypatch.setattr(prefetch_lean, "_register", lambda slots, device: prefetch_lean._registered.__setitem__(id(slots), (slots, False)))
    with pytest.raises(gpu_proof.StageFailed, match="the slots' memory is not registered"):
        gpu_proof.stage_registered_slot(tmp_path, tmp_path, dry_run=True)
