"""What a patch costs in time, against one libcst parse and codegen of the same source.

    python bench/patch_speed.py SCRIPT... [--repeat 3] [--no-default] [--byte-breakdown] [--phases] [--json]

For every script, in one process and side by side (alternating, the best of
`--repeat` rounds of each after one untimed warm-up round that loads the tool's
imports and caches): the seconds of `cst.parse_module(code).code` (one parse and one
codegen of the code the tool patches: the file, or a wrapper's payload); the seconds
of the patch as the command runs it with `--no-check` (read, parse, survey,
transforms, runtime, write, counted code bytes) and of the command's default (the
same, then the written file compiled under the target Python and its import smoked,
which runs subprocesses; `--no-default` leaves it out); their ratios to the parse and
codegen, each said to be within 3x or not. For a record counted as minified, the
"pyminify" column is the seconds of one whole-module `pyminify` of the patched code and
its compression, in this process: what counting it costs once, as the record's own
size function does. The patch counts the input and the patched code in one worker
process, unit by unit (patcher/minify_worker.py), which starts on the input while the
script is surveyed and patched, and minifies of the patched code only the units the
patch changed; what of it outlasts the patch is what the patch waits for. `--byte-breakdown` times the opt-in per-feature byte breakdown
instead. `--phases` adds where the patch's time goes (profiled, so the phases add up
to more than the plain patch). Nothing is written beside the inputs: outputs go to a
temporary directory.
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
    ("counted bytes (wait)", "patcher/patch_file.py", "_counted_bytes"),
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


def minifier_seconds(path: Path) -> float | None:
    """Seconds of one whole-module pyminify and compression of the patched code of `path`
    in this process, or None when the script is not counted as minified."""
    from patcher import minify_worker
    from patcher.code_size import counting_of
    from patcher.patch import patch_source
    from patcher.read.source import keep_style

    script = read_script(path)
    module = script.module if script.module is not None else cst.parse_module(script.source)
    counting = counting_of(module, script.wrapped)
    if counting.how != "minified":
        return None
    patched = keep_style(script, patch_source(script.source, module=module).source)
    started = time.perf_counter()
    minify_worker.wrapper_bytes(minify_worker.minify(patched.encode("utf-8"), list(counting.minify_flags)), counting.compressor)
    return time.perf_counter() - started


def measure(path: Path, repeat: int, options: FileOptions, with_check: bool, with_phases: bool) -> dict:
    """One script's row: {"file", "kb", "parse_codegen_s", "patch_s", "ratio", "minifier_s"}
    and, with `with_check`, {"default_s", "default_ratio"}; seconds are the best of
    `repeat` rounds; "minifier_s" is None for a script not counted as minified."""
    code = read_script(path).source
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        checked = replace(options, check=True)
        parse_codegen(code), timed_patch(path, out, options)  # warm-up: imports, template caches
        if with_check:
            timed_patch(path, out, checked)
        base, patched, default, minifier = [], [], [], []
        for _ in range(repeat):
            base.append(parse_codegen(code))
            patched.append(timed_patch(path, out, options))
            if with_check:
                default.append(timed_patch(path, out, checked))
            minifier.append(minifier_seconds(path))
        row = {"file": str(path), "kb": round(len(code.encode("utf-8")) / 1000, 1), "parse_codegen_s": round(min(base), 3), "patch_s": round(min(patched), 3)}
        row["ratio"] = round(min(patched) / min(base), 2)
        row["minifier_s"] = None if minifier[0] is None else round(min(minifier), 3)
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
    parser.add_argument("--no-default", action="store_true", help="leave out the command's default (with its check: compile on the target Python, import smoke)")
    parser.add_argument("--check", action="store_true", help=argparse.SUPPRESS)  # the default is timed anyway
    parser.add_argument("--byte-breakdown", action="store_true", help="time the patch with the per-feature byte breakdown")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    options = FileOptions(check=False, byte_breakdown=args.byte_breakdown)
    with_check = not args.no_default
    rows = [measure(Path(p), max(1, args.repeat), options, with_check, args.phases) for p in args.paths]
    for row in rows:
        row["within_3x"] = row["ratio"] <= 3.0
        if with_check:
            row["default_within_3x"] = row["default_ratio"] <= 3.0
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len(_name(r["file"])) for r in rows)
    extra = f" {'default':>8} {'ratio':>6} {'<=3x':>4}" if with_check else ""
    print(f"{'script':{width}} {'KB':>6} {'parse+cg':>8} {'no-check':>8} {'ratio':>6} {'<=3x':>4}{extra} {'pyminify':>8}")
    for r in rows:
        extra = f" {r['default_s']:8.2f} {r['default_ratio']:6.2f} {_yes(r['default_within_3x']):>4}" if with_check else ""
        floor = "-" if r["minifier_s"] is None else f"{r['minifier_s']:.2f}"
        print(f"{_name(r['file']):{width}} {r['kb']:6.1f} {r['parse_codegen_s']:8.2f} {r['patch_s']:8.2f} {r['ratio']:6.2f} {_yes(r['within_3x']):>4}{extra} {floor:>8}")
        if "phases" in r:
            print(" " * width + "  profiled: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items()))
    breakdown = ", with --byte-breakdown" if args.byte_breakdown else ""
    print(f"seconds, best of {max(1, args.repeat)}; ratio: to one libcst parse+codegen of the same code, measured alternately in this run; no-check: the command with --no-check{breakdown}")
    if with_check:
        print("default: the command as it runs by default, its check included (a compile under the target Python and an import smoke in subprocesses)")
    print("pyminify: one whole-module pyminify and compression of the patched code (minified counting only): what counting it once costs without units; the patch counts input and output unit by unit in a worker beside it")
    return 0


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _name(path: str) -> str:
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name


if __name__ == "__main__":
    sys.exit(main())
