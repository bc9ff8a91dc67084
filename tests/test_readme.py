"""The README's first screen says what the code does: its switch table is the features' own."""
from __future__ import annotations

from pathlib import Path

import patcher.transforms.features as features

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _switch_rows() -> list[tuple[str, str, str]]:
    section = README.split("## Switches", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("| ").split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return [(name.strip("`"), default.strip("`"), doc.strip()) for name, default, doc in rows]


def test_the_switch_table_lists_every_toggle_with_its_default_and_doc():
    expected = [(t.name, str(t.default), t.doc) for t in sorted(features.TOGGLE_UNITS.values(), key=lambda t: t.position)]
    assert _switch_rows() == expected


def test_the_first_screen_gives_the_two_make_commands_first():
    first_block = README.split("```", 2)[1]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]


def _links(page: Path) -> list[Path]:
    """The local files a markdown page links to, resolved beside the page."""
    text = page.read_text()
    targets = [part.split(")", 1)[0] for part in text.split("](")[1:]]
    return [(page.parent / t.split("#")[0]).resolve() for t in targets if t and not t.startswith(("http://", "https://", "#"))]


def test_the_readme_stays_a_first_screen_and_links_the_rest_in_docs():
    root = Path(__file__).resolve().parent.parent
    assert len(README.splitlines()) <= 130, "longer explanations belong in docs/"
    docs = sorted((root / "docs").glob("*.md"))
    linked = set(_links(root / "README.md"))
    assert {d.resolve() for d in docs} <= linked, "a page in docs/ that the README does not link"
    for page in [root / "README.md", *docs]:
        missing = [str(p) for p in _links(page) if not p.exists()]
        assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_quick_start_patches_checks_verifies_compares_switches_off_and_undoes():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line.split("#")[0].split() for line in section.split("```")[1].strip().splitlines()]
    words = [c[c.index("patch-prefetch") + 1] if "patch-prefetch" in c else c[0] for c in commands if c]
    assert words[-5:] == ["train_gpt.py", "check", "verify", "ab", "TRAIN_PREFETCH=0"]
    assert "-o" in commands[-5]
    assert "\nUndo:" in section and "--in-place" in section and ".orig" in section


def test_what_to_expect_says_where_each_figure_was_measured_and_what_a_gpu_has_not_measured():
    section = README.split("## What to expect", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert rows and all(len(row) == 3 and row[2].strip() for row in rows), "a figure without its where"
    assert "Not measured on a GPU yet:" in " ".join(section.split())
