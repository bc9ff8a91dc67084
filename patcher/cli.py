"""`patch-prefetch IN -o OUT`: arguments, reports and exit codes; the work is elsewhere.

Exit codes: 0 written (or already patched: said so), 2 bad input or usage,
3 nothing to patch (nothing written).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from pathlib import Path

from patcher.patch import features_from, patch_source
from patcher.source import SourceError, code_bytes, read_script, render, write_atomic
from patcher.transforms.base import FEATURES

EXIT_OK, EXIT_BAD_INPUT, EXIT_NOTHING = 0, 2, 3


class UsageError(Exception):
    """Bad arguments: one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patch-prefetch",
        description=(
            "Rewrite a parameter-golf / modded-nanogpt train_gpt.py so that training batches are "
            "built ahead on a background thread (pinned memory), copied H2D on a dedicated CUDA "
            "stream, switchable at run time (TRAIN_PREFETCH, TRAIN_PREFETCH_QUEUE, TRAIN_COPY_STREAM), "
            "with a fusion-friendly MLP square. The data fed to the model stays bit-identical."
        ),
    )
    parser.add_argument("input", help="training script (plain, or an lzma/zlib/bz2/gzip + base64 exec wrapper)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", help="where to write the patched script ('-' = stdout)")
    out.add_argument("--in-place", action="store_true", help="overwrite the input, keeping INPUT.orig")
    parser.add_argument("--diff", action="store_true", help="print a unified diff of the unwrapped original vs the patched source")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the report")
    parser.add_argument("--only", action="append", metavar="FEATURE", choices=FEATURES, help=f"apply only these ({', '.join(FEATURES)})")
    parser.add_argument("--skip", action="append", metavar="FEATURE", choices=FEATURES, help="do not apply this feature")
    parser.add_argument("--no-rewrap", action="store_true", help="write a wrapped input's patched payload as plain source")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `patch-prefetch` command. Returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return EXIT_BAD_INPUT if exit.code else EXIT_OK
    try:
        return _run(args)
    except (SourceError, UsageError) as error:
        print(f"patch-prefetch: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _run(args) -> int:
    started = time.perf_counter()
    in_path = Path(args.input)
    out_path = _output_path(args, in_path)
    script = read_script(in_path)
    try:
        enabled = features_from(args.only, args.skip)
    except ValueError as error:
        raise UsageError(str(error)) from None
    result = patch_source(script.source, enabled)
    for note in result.skipped:
        if note.feature == "py310_fstrings" and note.reason.startswith("cannot rewrite"):
            where = " payload" if script.wrapped else ""
            raise SourceError(in_path, f"{note.reason}; nothing written", note.line) if not where else SourceError(
                in_path, f"payload line {note.line}: {note.reason}; nothing written"
            )
    wrote = False
    text = script.raw
    if result.changed:
        _compile_like_input(script, result.source)
        text = render(script, result.source, rewrap=not args.no_rewrap)
    elif result.already_patched and args.no_rewrap:
        text = script.source
    if result.changed or result.already_patched:
        wrote = _write(text, out_path, args)
    report = {
        "input": str(in_path),
        "output": None if out_path is None else ("-" if out_path == "-" else str(out_path)),
        "written": wrote,
        "already_patched": result.already_patched,
        "applied": result.applied,
        "skipped": [n.as_dict() for n in result.skipped],
        "notes": [dict(n.as_dict(), applied=n.applied) for n in result.notes],
        "code_bytes": {"before": code_bytes(script.raw), "after": code_bytes(text) if wrote else code_bytes(script.raw)},
        "wrapped": script.wrapped,
        "seconds": round(time.perf_counter() - started, 3),
    }
    stream = sys.stderr if out_path == "-" else sys.stdout
    if args.diff:
        stream.writelines(difflib.unified_diff(script.source.splitlines(True), result.source.splitlines(True), f"{in_path} (original)", f"{in_path} (patched)"))
    if args.json:
        print(json.dumps(report), file=stream)
    else:
        _print_report(report, result, stream)
    if result.already_patched:
        return EXIT_OK
    return EXIT_OK if result.changed else EXIT_NOTHING


def _output_path(args, in_path: Path):
    if args.in_place:
        return in_path
    if args.output is None:
        raise UsageError("no output given: use -o OUT, -o - for stdout, or --in-place")
    if args.output == "-":
        return "-"
    out = Path(args.output)
    try:
        same = out.resolve() == in_path.resolve()
    except OSError:
        same = False
    if same:
        raise UsageError(f"{out}: output path is the input path; use --in-place to overwrite it (a .orig backup is kept)")
    return out


def _compile_like_input(script, patched: str) -> None:
    """Compile the patched source with the running Python when the input compiled with it."""
    try:
        compile(script.source, str(script.path), "exec")
    except SyntaxError:
        return  # the input needs a newer Python; the output is no worse (see `check`)
    try:
        compile(patched, str(script.path), "exec")
    except SyntaxError as error:  # a bug in a transform, not the user's input
        raise RuntimeError(f"patched source does not compile: line {error.lineno}: {error.msg}") from error


def _write(text: str, out_path, args) -> bool:
    if out_path == "-":
        sys.stdout.write(text)
        return True
    try:
        write_atomic(out_path, text, backup_suffix=".orig" if args.in_place else None)
    except OSError as error:
        raise SourceError(out_path, f"cannot write output: {error.strerror or error}") from None
    return True


def _print_report(report: dict, result, stream) -> None:
    out = report["output"]
    if result.already_patched:
        print(f"{report['input']}: already patched; nothing changed" + (f" (copied to {out})" if out not in (None, report["input"]) else ""), file=stream)
    elif not result.changed:
        print(f"{report['input']}: nothing to patch; nothing written", file=stream)
    else:
        print(f"{report['input']} -> {out}  ({'wrapped' if report['wrapped'] else 'plain'}, {report['seconds']} s)", file=stream)
    for note in result.notes:
        mark = "applied" if note.applied else "skipped"
        where = f" (line {note.line})" if note.line else ""
        print(f"  {mark:8} {note.feature:15} {note.reason}{where}", file=stream)
    cb = report["code_bytes"]
    print(f"  code bytes: {cb['before']} -> {cb['after']} ({cb['after'] - cb['before']:+d})", file=stream)


if __name__ == "__main__":
    sys.exit(main())
