"""bench/fixture_overlap.py: fixture lines found verbatim in other checkouts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("fixture_overlap", ROOT / "bench" / "fixture_overlap.py")
fixture_overlap = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fixture_overlap)


def test_long_lines_strips_and_filters_by_length():
    text = "    short\n" + "    " + "x" * 12 + "  \n\tlonger line here\n"
    assert fixture_overlap.long_lines(text, 12) == ["x" * 12, "longer line here"]


def test_a_checkout_holding_copied_fixture_lines_fails(tmp_path, capsys):
    fixture = ROOT / "fixtures" / "no_loader.py"
    copied = fixture_overlap.long_lines(fixture.read_text(), 20)[:5]
    assert len(copied) == 5
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train_gpt.py").write_text("\n".join("  " + line for line in copied) + "\n")
    assert fixture_overlap.main([str(tmp_path), "--min-length", "20", "--max", "4", "--show"]) == 1
    out = capsys.readouterr().out
    assert "fixtures/no_loader.py: 5 of" in out
    assert copied[0][:120] in out
    assert fixture_overlap.main([str(tmp_path), "--min-length", "20", "--max", "5"]) == 0


def test_an_unrelated_checkout_passes(tmp_path, capsys):
    (tmp_path / "a.py").write_text("print('nothing in common with any fixture, surely')\n")
    assert fixture_overlap.main([str(tmp_path), "--max", "0"]) == 0
    assert " 0 of " in capsys.readouterr().out
