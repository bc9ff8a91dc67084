"""`patch-prefetch-verify-beside FILE…`: the pre-commit hook that verifies every patched
script committed beside its original.

pre-commit passes the staged files that match the hook's `files` pattern; verify needs
two (ORIGINAL PATCHED), so this entry pairs each file with the one beside it, by the
two names the tool's own commands leave:

- `NAME_patched.py` beside `NAME.py`: `patch-prefetch NAME.py -o NAME_patched.py`;
- `NAME.py` beside `NAME.py.orig`: `patch-prefetch NAME.py --in-place`, which keeps the
  original as `NAME.py.orig`.

Either file of a pair being staged is enough; a file with no partner on disk is left
alone (nothing printed). Each pair runs `patch-prefetch verify ORIGINAL PATCHED` in a
process of its own, after a line naming it; its verdict is verify's own.
Exit code: 0 every pair identical (or no pair), else the first of 1 (a batch differs),
2 (cannot verify), 3 (nothing to verify: the patched file holds no runtime of the
tool), 4 (identical batches, but a replaced loader's thread or process left running)
that some pair gave, in that order; 130 interrupted (the pairs not yet run are not).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from patcher.suggest import SuggestingParser

PATCHED_SUFFIX, ORIG_SUFFIX = "_patched.py", ".orig"
EXIT_OK, EXIT_INTERRUPTED = 0, 130
# Worst first: a difference outweighs a pair that could not be verified, which outweighs
# a patched file that holds no runtime of the tool, which outweighs a leaked worker.
SEVERITY = (1, 2, 3, 4)


def pairs_beside(files: list[str]) -> list[tuple[str, str]]:
    """(original, patched) for every file of `files` whose partner exists on disk, in the
    order the files came, each pair once. Paths are kept as given (relative to the
    current directory, as pre-commit passes them)."""
    found: list[tuple[str, str]] = []

    def add(original: str, patched: str) -> None:
        if os.path.isfile(original) and os.path.isfile(patched) and (original, patched) not in found:
            found.append((original, patched))

    for name in files:
        if name.endswith(".py" + ORIG_SUFFIX):
            add(name, name[: -len(ORIG_SUFFIX)])
        elif name.endswith(PATCHED_SUFFIX):
            add(name[: -len(PATCHED_SUFFIX)] + ".py", name)
        elif name.endswith(".py"):
            add(name + ORIG_SUFFIX, name)
            add(name, name[: -len(".py")] + PATCHED_SUFFIX)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="patch-prefetch-verify-beside",
        description="Run `patch-prefetch verify ORIGINAL PATCHED` for every FILE that sits beside its partner: NAME_patched.py beside NAME.py, or NAME.py beside NAME.py.orig (what --in-place keeps). For a pre-commit hook.",
        epilog="Exit codes: 0 every pair identical (or no pair among FILEs), 1 a batch differs, 2 cannot verify, 3 nothing to verify (a patched file holds no runtime of patch-prefetch), 4 identical but a replaced loader's worker left running; the worst that a pair gave, in that order. 130 interrupted.",
    )
    parser.add_argument("files", nargs="*", metavar="FILE", help="staged files; those with no partner beside them are skipped")
    # verify's own options, passed on to every pair (set them with the hook's `args:`).
    parser.add_argument("--batches", help="verify --batches: batches per rank after the rebuild")
    parser.add_argument("--world-size", help="verify --world-size: ranks to simulate")
    parser.add_argument("--seed", help="verify --seed: seed of the synthetic shards")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `patch-prefetch-verify-beside`. Returns the exit code (see the module)."""
    args = build_parser().parse_args(argv)
    options = [item for flag, value in (("--batches", args.batches), ("--world-size", args.world_size), ("--seed", args.seed)) if value is not None for item in (flag, value)]
    codes: list[int] = []
    for original, patched in pairs_beside(args.files):
        print(f"patch-prefetch verify {original} {patched}", flush=True)
        try:
            # A process per pair: each verify imports both scripts, which must not meet
            # the previous pair's modules.
            code = subprocess.run([sys.executable, "-m", "patcher.cli", "verify", *options, original, patched]).returncode
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        if code == EXIT_INTERRUPTED:
            return EXIT_INTERRUPTED
        codes.append(code)
    return next((code for code in SEVERITY if code in codes), max(codes, default=EXIT_OK))


if __name__ == "__main__":
    raise SystemExit(main())
