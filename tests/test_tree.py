"""Tree mode: `patch-prefetch DIR --out-dir OUT` over a records-like tree."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from patcher.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture
def records(tmp_path):
    """A small records/ tree: two good scripts, a broken one, an empty one, a helper."""
    root = tmp_path / "records"
    (root / "2026-01-01_Readable").mkdir(parents=True)
    shutil.copy(FIXTURES / "tokenstream_readable.py", root / "2026-01-01_Readable" / "train_gpt.py")
    (root / "track" / "2026-01-02_Minified").mkdir(parents=True)
    shutil.copy(FIXTURES / "shuffled_minified.py", root / "track" / "2026-01-02_Minified" / "train_gpt.py")
    (root / "2026-01-03_Broken").mkdir()
    (root / "2026-01-03_Broken" / "train_gpt.py").write_text("def main(:\n    pass\n")
    (root / "2026-01-04_Empty").mkdir()
    (root / "2026-01-04_Empty" / "train_gpt.py").write_text("")
    (root / "2026-01-01_Readable" / "helper.py").write_text("x = 1\n")  # not train*.py
    return root


def run_tree(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_tree_patches_every_match_mirrors_layout_and_reports_failures(records, tmp_path, capsys):
    out_dir = tmp_path / "patched"
    code, stdout, _ = run_tree([records, "--out-dir", out_dir, "--json", "--no-check", "--jobs", "2"], capsys)
    assert code == EXIT_FAILED  # two files failed; the others were still patched
    rows = {r["file"]: r for r in json.loads(stdout)["files"]}
    assert set(rows) == {
        "2026-01-01_Readable/train_gpt.py",
        "track/2026-01-02_Minified/train_gpt.py",
        "2026-01-03_Broken/train_gpt.py",
        "2026-01-04_Empty/train_gpt.py",
    }
    assert rows["2026-01-01_Readable/train_gpt.py"]["status"] == "written"
    assert rows["track/2026-01-02_Minified/train_gpt.py"]["status"] == "written"
    broken = rows["2026-01-03_Broken/train_gpt.py"]
    assert broken["status"] == "bad input" and broken["failed"] and "train_gpt.py:1: syntax error" in broken["error"]
    assert rows["2026-01-04_Empty/train_gpt.py"]["status"] == "bad input"
    assert (out_dir / "2026-01-01_Readable" / "train_gpt.py").is_file()
    assert (out_dir / "track" / "2026-01-02_Minified" / "train_gpt.py").is_file()
    assert not (out_dir / "2026-01-03_Broken" / "train_gpt.py").exists()  # nothing written for bad input
    assert not (out_dir / "2026-01-01_Readable" / "helper.py").exists()
    # The same report as the single-file command gives for that file.
    single = tmp_path / "single.py"
    assert main([str(records / "track" / "2026-01-02_Minified" / "train_gpt.py"), "-o", str(single), "--json", "--no-check"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    row = rows["track/2026-01-02_Minified/train_gpt.py"]
    assert row["applied"] == report["applied"]
    assert row["bytes_after"] == report["code_bytes"]["after"]
    assert (out_dir / "track" / "2026-01-02_Minified" / "train_gpt.py").read_bytes() == single.read_bytes()


def test_tree_table_and_check_verdict(tmp_path, capsys):
    root = tmp_path / "records"
    (root / "a").mkdir(parents=True)
    shutil.copy(FIXTURES / "tokenstream_readable.py", root / "a" / "train_gpt.py")
    (root / "b").mkdir()
    # Patches fine, then fails the import smoke: raises at import, after its definitions.
    failing = (FIXTURES / "tokenstream_readable.py").read_text() + "\nraise RuntimeError('needs a GPU at import')\n"
    (root / "b" / "train_gpt.py").write_text(failing)
    code, stdout, _ = run_tree([root, "--out-dir", tmp_path / "out", "--jobs", "1"], capsys)
    assert code == EXIT_FAILED
    lines = stdout.splitlines()
    row_a = next(l for l in lines if l.startswith("a/train_gpt.py"))
    row_b = next(l for l in lines if l.startswith("b/train_gpt.py"))
    assert "written" in row_a and row_a.endswith("ok") and "train_prefetch" in row_a
    assert "check failed" in row_b and row_b.endswith("FAILED")
    assert lines[-1] == "2 files: 1 written, 1 check failed; 1 failed"


def test_tree_with_nothing_failing_exits_0(tmp_path, capsys):
    root = tmp_path / "r"
    (root / "x").mkdir(parents=True)
    shutil.copy(FIXTURES / "no_loader.py", root / "x" / "train_gpt.py")
    shutil.copy(FIXTURES / "curriculum.py", root / "train_gpt.py")
    code, stdout, _ = run_tree([root, "--out-dir", tmp_path / "o", "--no-check", "--json"], capsys)
    assert code == EXIT_OK
    statuses = sorted(r["status"] for r in json.loads(stdout)["files"])
    assert statuses == ["nothing to patch", "written"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "give --out-dir"),
        (["--out-dir", "SAME"], "is the input directory"),
        (["--out-dir", "o", "-o", "x.py"], "not -o"),
    ],
)
def test_tree_usage_errors_write_nothing(records, tmp_path, capsys, extra, message):
    extra = [str(records) if a == "SAME" else (str(tmp_path / a) if a in ("o", "x.py") else a) for a in extra]
    before = sorted(p for p in records.rglob("*"))
    code, _, err = run_tree([records, *extra], capsys)
    assert code == EXIT_BAD_INPUT
    assert message in err and len(err.strip().splitlines()) == 1
    assert sorted(p for p in records.rglob("*")) == before
    assert not (tmp_path / "o").exists()
