"""Lines of our fixtures that also appear verbatim in real record scripts.

    python bench/fixture_overlap.py REPO_DIR [REPO_DIR ...] [--min-length 40] [--show]

Our fixtures are miniatures written for this project, modelled on the shapes of the
parameter-golf and modded-nanogpt records, never copies of their code. This prints, per
fixture, how many of its lines of at least `--min-length` characters (stripped) occur
verbatim in any `*.py` under the given checkouts (for example a clone of
openai/parameter-golf), and with `--show` which ones. A few lines may be the interface
shape itself (a `next_batch(...)` call site the survey matches, a common import);
anything more is a sign of copied code. Exit 1 when a fixture has more than `--max`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def long_lines(text: str, min_length: int) -> list[str]:
    """The stripped lines of `text` at least `min_length` characters long."""
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) >= min_length]


def real_lines(repos: list[Path], min_length: int) -> set[str]:
    """Every long stripped line of every `*.py` file under `repos`."""
    seen: set[str] = set()
    for repo in repos:
        for path in repo.rglob("*.py"):
            try:
                seen.update(long_lines(path.read_text(errors="replace"), min_length))
            except OSError:
                continue
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repos", nargs="+", type=Path, help="checkouts of record repositories")
    parser.add_argument("--min-length", type=int, default=40, help="shortest line compared, in characters (default 40)")
    parser.add_argument("--max", type=int, default=10, help="identical lines allowed per fixture (default 10)")
    parser.add_argument("--show", action="store_true", help="print the identical lines")
    args = parser.parse_args(argv)
    real = real_lines(args.repos, args.min_length)
    worst = 0
    for path in sorted((ROOT / "fixtures").rglob("*.py")):
        mine = long_lines(path.read_text(), args.min_length)
        shared = [line for line in mine if line in real]
        worst = max(worst, len(shared))
        print(f"{path.relative_to(ROOT)}: {len(shared)} of {len(mine)} lines identical")
        if args.show:
            for line in shared:
                print(f"    {line[:120]}")
    return 1 if worst > args.max else 0


if __name__ == "__main__":
    sys.exit(main())
