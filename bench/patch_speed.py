"""What a patch costs in time, against one libcst parse and codegen of the same source.

    python bench/patch_speed.py SCRIPT... [--repeat 3] [--check] [--byte-breakdown] [--phases] [--json]

For every script, in one process and side by side (alternating, the best of
`--repeat` rounds of each after one untimed warm-up round that loads the tool's
imports and caches): the seconds of `cst.parse_module(code).code` (one parse and one
codegen of the code the tool patches: the file, or a wrapper's payload), the seconds
of the default patch as the command runs it with `--no-check` (read, parse, survey,
transforms, runtime, write, counted code bytes), and their ratio. `--check` also times
the command's default (the written file compiled under the target Python and its
import smoked, which runs subprocesses); `--byte-breakdown` times the opt-in
per-feature byte breakdown instead of the default. `--phases` adds where the patch's
time goes (profiled, so the phases add up to more than the plain patch).
Nothing is written beside the inputs: outputs go to a temporary directory.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import libcst as cst  # noqa: E402

from patcher.patch_file import FileOptions, patch_file  # noqa: E402
from patcher.read.source import read_script  # noqa: E402

# Functions whose cumulative profiled time `--phases` reports: (label, file suffix, function name).
PHASES = (
    ("read+parse", "read/source.py", "read_script"),
    ("survey", "survey/survey.py", "survey"),
    ("transforms+runtime", "patcher/patch.py", "patch_source"),
    ("codegen", "libcst/_nodes/module.py", "code"),
    ("counted bytes", "patcher/patch_file.py", "_counted_bytes"),
    ("rewrap", "read/source.py", "render"),
    ("check", "patcher/patch_file.py", "_check_written"),
)


def parse_codegen(code: str) -> float:
    """Seconds of one `cst.parse_module(code).code`."""
    started = time.perf_counter()
    cst.parse_module(code).code
    return time.perf_counter() - started


def timed_patch(path: Path, out: Path, options: FileOptions) -> float:
    """Seconds of one `patch_file(path, out, options)` (what the command does for one file)."""
    started = time.perf_counter()
    patch_file(path, out, options)
    return time.perf_counter() - started


def phases(path: Path, out: Path, options: FileOptions) -> dict:
    """{phase label: profiled cumulative seconds} of one patch (see PHASES)."""
    profile = cProfile.Profile()
    profile.runcall(patch_file, path, out, options)
    stats = pstats.Stats(profile).stats
    found = {}
    for label, suffix, name in PHASES:
        found[label] = round(sum(v[3] for (file, _, function), v in stats.items() if function == name and file.endswith(suffix)), 3)
    return found


def measure(path: Path, repeat: int, options: FileOptions, with_check: bool, with_phases: bool) -> dict:
    """One script's row: {"file", "kb", "parse_codegen_s", "patch_s", "ratio"} and, with
    `with_check`, {"default_s", "default_ratio"}; seconds are the best of `repeat` rounds."""
    code = read_script(path).source
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        checked = replace(options, check=True)
        parse_codegen(code), timed_patch(path, out, options)  # warm-up: imports, template caches
        if with_check:
            timed_patch(path, out, checked)
        base, patched, default = [], [], []
        for _ in range(repeat):
            base.append(parse_codegen(code))
            patched.append(timed_patch(path, out, options))
            if with_check:
                default.append(timed_patch(path, out, checked))
        row = {"file": str(path), "kb": round(len(code.encode("utf-8")) / 1000, 1), "parse_codegen_s": round(min(base), 3), "patch_s": round(min(patched), 3)}
        row["ratio"] = round(min(patched) / min(base), 2)
        if with_check:
            row["default_s"] = round(min(default), 3)
            row["default_ratio"] = round(min(default) / min(base), 2)
        if with_phases:
            row["phases"] = phases(path, out, options)
    return row



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="also time the default with its check (compile on the target Python, import smoke)")
    parser.add_argument("--byte-breakdown", action="store_true", help="time the patch with the per-feature byte breakdown")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    options = FileOptions(check=False, byte_breakdown=args.byte_breakdown)
    rows = [measure(Path(p), max(1, args.repeat), options, args.check, args.phases) for p in args.paths]
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len(_name(r["file"])) for r in rows)
    extra = f" {'default':>8} {'ratio':>6}" if args.check else ""
    print(f"{'script':{width}} {'KB':>6} {'parse+cg':>8} {'patch':>8} {'ratio':>6}{extra}   (seconds; patch with --no-check{', with --byte-breakdown' if args.byte_breakdown else ''})")
    for r in rows:
        extra = f" {r['default_s']:8.2f} {r['default_ratio']:6.2f}" if args.check else ""
        print(f"{_name(r['file']):{width}} {r['kb']:6.1f} {r['parse_codegen_s']:8.2f} {r['patch_s']:8.2f} {r['ratio']:6.2f}{extra}")
        if "phases" in r:
            print(" " * width + "  profiled: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    return 0


def _name(path: str) -> str:
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


if __name__ == "__main__":
    sys.exit(main())
