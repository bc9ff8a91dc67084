"""bench/gpu_loaders.py on this CPU: both stages `--dry-run` on the fixtures, patched here
with the real CLI, and planted faults (a patched side whose targets are off by one) that
must give exit 1 and a first difference. Each run is a subprocess: the stage installs
`cuda_on_host` and writes its own data, as it does on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_loaders.py"
KEYS = {"stage", "device", "dry_run", "sizes", "load_ms", "host_ms", "ratio", "batches_compared", "exact", "first_difference", "notes"}
STATS = {"mean", "median", "p90", "max"}


def _patch(fixture: str, out: Path) -> Path:
    cli = Path(sys.executable).with_name("patch-prefetch")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "patcher.cli"]
    done = subprocess.run([*command, str(ROOT / "fixtures" / fixture), "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _stage(stage: str, original: Path, patched: Path, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    done = subprocess.run([sys.executable, str(SCRIPT), stage, str(original), str(patched), "--json", str(out), "--dry-run", *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    return done, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpu-loaders")
    return {"tmp": tmp, "generator": _patch("generator_shards.py", tmp / "generator_shards.py"), "module": _patch("bestfit_packing.py", tmp / "bestfit_packing.py")}


def _assert_exact(done, report, stage):
    assert done.returncode == 0, done.stdout + done.stderr
    assert KEYS <= set(report)
    assert report["stage"] == stage and report["dry_run"] is True and report["device"] == "cpu (cuda_on_host)"
    assert report["exact"] is True and report["first_difference"] is None
    assert report["batches_compared"] > 0
    assert report["load_ms"] == 0.0 and any("no GPU load" in note for note in report["notes"])


def test_generator_dry_run_exact(patched):
    done, report = _stage("generator", ROOT / "fixtures" / "generator_shards.py", patched["generator"], patched["tmp"] / "generator.json")
    _assert_exact(done, report, "generator")
    assert report["batches_compared"] == report["sizes"]["micro_steps"]
    assert len(report["sizes"]["stages_run"]) >= 3  # two stage changes sent
    assert STATS <= set(report["host_ms"]["original"]) and STATS <= set(report["host_ms"]["patched"])
    assert isinstance(report["ratio"], float)


def test_module_dry_run_exact(patched):
    pytest.importorskip("pyarrow")
    done, report = _stage("module", ROOT / "fixtures" / "bestfit_packing.py", patched["module"], patched["tmp"] / "module.json", "--steps", "6")
    _assert_exact(done, report, "module")
    assert set(report["host_ms"]) == {"device_index", "device_str"}
    for case in ("device_index", "device_str"):
        assert STATS <= set(report["host_ms"][case]["patched"])
        assert report["producer"][case]["ran"], report["producer"]
        assert report["producer_start_ms"][case] > 0
    assert report["batches_compared"] == 2 * (6 + report["sizes"]["warmup_batches"])


def test_generator_planted_fault(patched):
    text = patched["generator"].read_text()
    line = next(line for line in text.splitlines() if "_pinned_h2d(targets, " in line)
    faulty = patched["tmp"] / "generator_fault.py"
    faulty.write_text(text.replace(line, line.replace("_pinned_h2d(targets, ", "_pinned_h2d(targets + 1, ")))
    done, report = _stage("generator", ROOT / "fixtures" / "generator_shards.py", faulty, patched["tmp"] / "generator_fault.json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert report["exact"] is False
    assert report["first_difference"]["batch"] == 0 and report["first_difference"]["field"] == 1
    assert "values differ" in report["first_difference"]["why"]


def test_module_planted_fault(patched):
    pytest.importorskip("pyarrow")
    text = patched["module"].read_text()
    line = next(line for line in text.splitlines() if ".copy_(rows[:, 1:])" in line)  # the targets' copy, in the producer's function
    faulty = patched["tmp"] / "module_fault" / "bestfit_packing.py"
    faulty.parent.mkdir()
    faulty.write_text(text.replace(line, line.replace("rows[:, 1:]", "rows[:, 1:] + 1")))
    done, report = _stage("module", ROOT / "fixtures" / "bestfit_packing.py", faulty, patched["tmp"] / "module_fault.json", "--steps", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert report["exact"] is False
    assert report["first_difference"]["case"] == "device_index" and report["first_difference"]["batch"] == 0
    assert report["first_difference"]["field"] == 1


def test_cannot_run_is_exit_2(patched):
    original = ROOT / "fixtures" / "generator_shards.py"
    done, report = _stage("generator", original, original, patched["tmp"] / "same.json")
    assert done.returncode == 2 and report is None
    assert done.stderr.strip().count("\n") == 0 and "cannot run" in done.stderr


def test_generator_patched_side_raising_is_a_difference(patched):
    text = patched["generator"].read_text()
    line = next(line for line in text.splitlines() if "new_args = yield (" in line)
    indent = line[: len(line) - len(line.lstrip())]
    faulty = patched["tmp"] / "generator_raises.py"
    faulty.write_text(text.replace(line, f"{indent}raise RuntimeError('planted')\n{line}"))
    done, report = _stage("generator", ROOT / "fixtures" / "generator_shards.py", faulty, patched["tmp"] / "generator_raises.json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert report["first_difference"]["batch"] == 0 and "raised RuntimeError: planted" in report["first_difference"]["why"]
