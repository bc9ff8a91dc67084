"""The code-byte figures of the README and docs come from one generated table.

docs/code-bytes.md holds the table `bench/bytes_table.py` generates from the fixtures
(regenerated here and compared), and the real scripts' rows that the README and the
other pages quote (checked to agree).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bytes_table  # noqa: E402

DOCS = ROOT / "docs"


def _added(text: str) -> set[str]:
    """The `+N,NNN` byte figures (4 digits or more) in `text`."""
    return set(re.findall(r"\+\d{1,3},\d{3}\b", text))


def test_the_fixture_table_is_what_the_generator_makes_now():
    assert bytes_table.in_doc(bytes_table.DOC.read_text()) == bytes_table.table(), "stale: run python bench/bytes_table.py --write"


def test_the_figures_quoted_elsewhere_are_the_tables():
    tables = _added(bytes_table.DOC.read_text())
    readme = (ROOT / "README.md").read_text()
    [row] = [line for line in readme.splitlines() if line.startswith("| code bytes added")]
    quoted = {
        "README.md": _added(row),
        "parameter-golf.md": _added((DOCS / "parameter-golf.md").read_text()),
        "runtime.md": set(re.findall(r"(\+\d{1,3},\d{3}) [^(\n]*?today", (DOCS / "runtime.md").read_text())),
    }
    assert quoted["README.md"] and quoted["parameter-golf.md"] and len(quoted["runtime.md"]) == 2
    for page, figures in quoted.items():
        assert figures <= tables, f"{page} quotes {sorted(figures - tables)}, not in docs/code-bytes.md"
