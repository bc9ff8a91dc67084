"""`patch-prefetch IN -o OUT` and its subcommands: arguments, reports, exit codes.

The work is elsewhere (patch, check, verify, bench). The conventions are ruff's and
black's: `--diff` alone prints the diff on stdout and writes nothing; `--json` puts one
JSON document on stdout (the diff inside it); `-` is stdin as INPUT and stdout as `-o`;
several INPUTs go to `--out-dir`; `-q`; `--color`; `--version`.
Exit codes of the main job (`EXIT_HELP` is what `--help` prints):
0 written (or already patched: said so), 2 bad input or usage, 3 nothing to patch
(nothing written), 4 written but the check of the output failed, 5 no input file (an
empty directory, a path pattern that matches nothing).
`patch-prefetch check FILE…`: 0 every check passed, 1 one failed, 2 bad input (every
file is checked and reported all the same).
`patch-prefetch unwrap FILE [-o OUT]`: 0 written, 2 bad input, 3 not wrapped (nothing written).
`patch-prefetch verify ORIGINAL PATCHED`: 0 identical, 1 a batch differs or the patched
loader raises (the line names rank, phase, batch and field), 2 cannot verify (one line:
why, e.g. "needs sentencepiece"; a harness failure is never 1), 3 nothing to verify
(PATCHED holds no runtime of this tool), 4 the batches are identical but a thread or
process of a replaced loader is still alive after the rebuild (a `LEAK:` line each:
what it is, the bytes it holds, where it was started).
`patch-prefetch ab ORIGINAL PATCHED` (A/B step time, alternated runs): 0 comparison made
(whatever the verdict), 2 bad input or usage, or a run failed (one line: which run, why).
`patch-prefetch DIR --out-dir OUT` (tree mode): 0 no file failed, 1 some failed, 2 usage.
Every command: 130 interrupted (Ctrl-C), 141 stdout closed (quietly).
"""

from __future__ import annotations

import os
import signal
import sys

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOTHING, EXIT_CHECK_FAILED, EXIT_NO_FILES = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 130, 141
EXIT_LEAKED = 4  # verify: the batches are identical, but a replaced loader's thread or process is still alive
INTERRUPTED_LINE = "patch-prefetch: interrupted"


def _started_as_command() -> bool:
    """Whether this process is the `patch-prefetch` command (its console script, or
    `python -m patcher.cli`), not a program that imports the package."""
    launcher = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return __name__ == "__main__" or launcher.startswith("patch-prefetch")


def _end_at_ctrl_c(said: bool) -> None:
    """From now on Ctrl-C ends the command at once: one line on stderr (unless `said`
    already) and exit 130. For the interpreter's exit (joining threads, flushing), where a
    KeyboardInterrupt can no longer be caught by the command and Python would print a
    traceback of its shutdown."""

    def leave(signum, frame) -> None:
        try:
            sys.stdout.flush()
        except BaseException:  # a closed pipe, or a write this signal interrupted
            pass
        if not said:
            os.write(2, (INTERRUPTED_LINE + "\n").encode())
        os._exit(EXIT_INTERRUPTED)

    # Interrupted already: further SIGINTs (`timeout` forwards a second) are ignored, as
    # while the report was printed. A Python handler would not do: the interpreter's
    # finalization puts SIG_DFL back in its place, and a SIGINT then kills the process.
    signal.signal(signal.SIGINT, signal.SIG_IGN if said else leave)


# The command's imports take about half a second (libcst, the transforms): a Ctrl-C then
# must give the line and the exit code of a Ctrl-C anywhere else, not an import's traceback.
try:
    import argparse
    import glob
    import json
    import tempfile
    import textwrap
    from dataclasses import replace
    from pathlib import Path

    from patcher.transforms.features import DEFAULT_FEATURES, DIAGNOSTICS, FEATURES
    from patcher.patch import features_from
    from patcher.patch_file import ALREADY_PATCHED, CHECK_FAILED, NOTHING_TO_PATCH, WRITTEN, FileOptions, UsageError, cap_note, patch_file
    from patcher.colour import CHOICES as COLOUR_CHOICES, GREEN, RED, YELLOW, paint, use_colour
    from patcher.progress import running_clock, wanted
    from patcher.read.source import SourceError, is_symlink_loop, output_problem, read_script, write_atomic
    from patcher.review import coloured_review, patch_diff
    from patcher.tree import NoFiles, caused_by_ctrl_c
    from patcher.suggest import SuggestingParser, close_to
except KeyboardInterrupt:
    if not _started_as_command():
        raise
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot cut the line short
    print(INTERRUPTED_LINE, file=sys.stderr)
    raise SystemExit(EXIT_INTERRUPTED) from None

EXIT_HELP = """exit codes:
  0    written (or already patched, and said so); with --diff and no -o: the diff printed
  1    tree mode: some file failed (its row says why)
  2    bad input or usage: one line naming the file and line; nothing written
  3    nothing to patch: nothing written
  4    written, but the check of the output failed (or the artifact is over the cap)
  5    no input file: an empty directory, a --glob or path pattern that matches nothing
  130  interrupted (Ctrl-C; tree mode says which files were written and which were not)
  141  stdout closed (| head): quietly"""
STDIN = "-"
DEVNULL = os.devnull
EXIT_BY_STATUS = {WRITTEN: EXIT_OK, ALREADY_PATCHED: EXIT_OK, NOTHING_TO_PATCH: EXIT_NOTHING, CHECK_FAILED: EXIT_CHECK_FAILED}
IMPORT_SMOKE_HELP = (
    "the import smoke runs the script's definitions (imports, class bodies, decorators, default "
    "arguments; the whole top level when it has an `if __name__ == \"__main__\":` guard, which is "
    "not entered) in a child Python process with your environment, in a scratch working directory; "
    "its process group is killed after --timeout seconds"
)
SUBCOMMANDS = ("check", "verify", "bench", "unwrap", "ab")


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="patch-prefetch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_wrapped(
            "Rewrite a parameter-golf / modded-nanogpt train_gpt.py so that training batches are "
            "built ahead in a forked producer process or a background thread (pinned memory), copied H2D on a dedicated CUDA "
            "stream, switchable at run time (TRAIN_PREFETCH, TRAIN_COPY_STREAM), "
            "with a fusion-friendly MLP square. The data fed to the model stays bit-identical. "
            f"Default features: {', '.join(DEFAULT_FEATURES)}; the diagnostics ({', '.join(DIAGNOSTICS)}) "
            "only with --with FEATURE or --diagnostics. The report gives the code bytes the patch adds, "
            "counted as the record counts them (the wrapper file, pyminify+lzma+base85, or raw bytes), "
            "and, with a submission.json beside the script, the artifact size against the 16,000,000-byte cap."
        ),
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="training script (plain, or an lzma/zlib/bz2/gzip + base64 exec wrapper); '-' reads it from stdin; a directory or several INPUTs: tree mode, with --out-dir. A pattern the shell left unexpanded ('records/*/train_gpt.py') is expanded here")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", help=f"where to write the patched script ('-' = stdout, {DEVNULL} = nowhere); default with INPUT '-': stdout")
    out.add_argument("--in-place", action="store_true", help="overwrite the input, keeping INPUT.orig")
    parser.add_argument("--diff", action="store_true", help="print a unified diff of the unwrapped original vs the patched source (a wrapped record: its payloads, line by line; the injected runtime of a minified script shown formatted). Alone (no -o): the diff on stdout, nothing written, the report on stderr; with -o -: the diff on stderr. Tree mode (a directory or several INPUTs): every file's diff on stdout and the summary on stderr, nothing written without --out-dir")
    parser.add_argument("--json", action="store_true", help="print one JSON document with the report (and the diff, under 'diff', with --diff) on stdout; with -o -, stdout is the script and the JSON goes to stderr")
    parser.add_argument("-q", "--quiet", action="store_true", help="no report and no progress: errors only (the diff and --json still print)")
    parser.add_argument("--color", dest="color", choices=COLOUR_CHOICES, default="auto", help="colour the diff and the summary: auto (a terminal, unless NO_COLOR is set), always, never")
    parser.add_argument("--only", action="append", metavar="FEATURE", choices=FEATURES, help=f"apply only these ({', '.join(FEATURES)})")
    parser.add_argument("--skip", action="append", metavar="FEATURE", choices=FEATURES, help="do not apply this feature")
    parser.add_argument("--with", dest="extra", action="append", metavar="FEATURE", choices=FEATURES, help=f"also apply this feature; the diagnostics ({', '.join(DIAGNOSTICS)}) only add code until a toggle is set, so a default patch leaves them out")
    parser.add_argument("--diagnostics", action="store_true", help=f"also apply every diagnostic feature ({', '.join(DIAGNOSTICS)})")
    parser.add_argument("--producer-toggles", action="store_true", help="also add the producer tuning toggle TRAIN_PREFETCH_QUEUE (prefetch depth, default 2); a default patch leaves it out, since it costs code bytes")
    parser.add_argument("--no-rewrap", action="store_true", help="write a wrapped input's patched payload as plain source")
    parser.add_argument("--no-check", action="store_true", help="do not check the output (compile on the target Python, import smoke)")
    parser.add_argument("--no-import", action="store_true", help="check by compiling only: no import smoke (nothing of the script runs)")
    parser.add_argument("--timeout", type=_seconds, default=60.0, help="import smoke timeout in seconds (default 60)")
    parser.add_argument("--byte-breakdown", action="store_true", help="also report what each applied feature costs in code bytes, what its --skip saves (one more patch, and counted as minified one more pyminify run, per feature; single files only)")
    parser.add_argument("--no-byte-breakdown", action="store_true", help="code bytes before and after only (the default)")
    parser.add_argument("--python", default=None, help="target Python for the check: a version or an interpreter path; one that is not installed is an error (exit 2). Default 3.10, or, where none is installed, a grammar check under the running Python (reported as partial)")
    tree = parser.add_argument_group("tree mode (a directory, or several INPUTs)")
    tree.add_argument("--out-dir", help="write each patched script to its path relative to the INPUTs' common directory, here")
    tree.add_argument("--glob", default="train*.py", help="file names to patch under a directory INPUT (default train*.py); files named as INPUT are patched whatever their name")
    tree.add_argument("--jobs", type=int, default=None, help="parallel processes (default: number of CPUs)")
    tree.add_argument("--file-timeout", type=_seconds, default=600.0, help="seconds one file may take, check included; past it the file's worker is killed and its row says so (default 600)")
    parser.epilog = _wrapped(
        "The output is checked unless --no-check: compiled under the target Python, then imported: "
        + IMPORT_SMOKE_HELP + ". --no-import compiles only. "
        "Subcommands: patch-prefetch check FILE... | verify ORIGINAL PATCHED | bench SCRIPT | unwrap FILE [-o OUT] "
        "| ab ORIGINAL PATCHED (step time on your GPU, alternated runs) (each has --help)."
    ) + "\n\n" + EXIT_HELP
    return parser


def _wrapped(text: str) -> str:
    """`text` filled to 79 columns (the help keeps line breaks as written: the exit codes' table)."""
    return textwrap.fill(text, 79, break_on_hyphens=False)


def _version() -> str:
    from patcher.render.render import tool_version

    return tool_version()


def build_unwrap_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="patch-prefetch unwrap",
        description="Write a compressed exec wrapper's payload (a wrapped record's train_gpt.py) as plain source: the code the record runs, for reading, diffing or patching by hand.",
        epilog="Exit codes: 0 written, 2 bad input (one line; nothing written), 3 not wrapped (nothing written).",
    )
    parser.add_argument("file", help="a wrapped training script ('-' = stdin)")
    parser.add_argument("-o", "--output", default="-", help="where to write the payload (default '-': stdout)")
    return parser


def build_check_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="patch-prefetch check", description="Pre-submission check: compile under a real target Python (payload of a wrapper included), import smoke with missing GPU-only modules stubbed, self-containedness, code bytes.", epilog="Note: " + IMPORT_SMOKE_HELP + ". --no-import compiles only.")
    parser.add_argument("files", nargs="+", help="training scripts (plain or wrapped); each is checked and reported, a bad one included")
    parser.add_argument("--python", default=None, help="target version or interpreter path; one that is not installed is an error (exit 2). Default 3.10, or, where none is installed, a grammar check under the running Python (reported as partial)")
    parser.add_argument("--timeout", type=_seconds, default=60.0, help="import smoke timeout in seconds (default 60)")
    parser.add_argument("--no-import", action="store_true", help="compile only: no import smoke (nothing of the script runs)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout: the file's object; several files: {\"files\": [one object each], \"exit_code\": N}")
    parser.epilog += " Exit codes: 0 every file passed (ok or partial), 1 one failed, 2 bad input (the other files are still checked)."
    return parser


def build_verify_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="patch-prefetch verify", description="Prove the patched script's training loader hands out the original's batches, bit for bit, for every rank, across the warm-up rebuild, on synthetic shards.", epilog="Exit codes: 0 identical, 1 a batch differs, 2 cannot verify, 3 nothing to verify (PATCHED holds no runtime of patch-prefetch), 4 identical batches but a thread or process of a replaced loader still alive after the rebuild (LEAK lines: what, what it holds, where it was started).")
    parser.add_argument("original")
    parser.add_argument("patched")
    parser.add_argument("--batches", type=int, default=None, help="batches per rank after the rebuild (default 96 for a loader class, 64 items for a data generator)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to simulate (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic shards")
    parser.add_argument("--shard-tokens", type=int, help="tokens per synthetic train shard for a loader class (default: 4 shards holding about 2/3 of what the run reads); small shards make a ShuffledSequenceLoader reshuffle within the run")
    parser.add_argument("--send", action="append", default=[], metavar="EXPR", help="a value to pass to a data generator's .send() mid-run, as a Python expression over the script's module-level names (repeatable; the values the script's own .send() calls pass are used when they can be evaluated outside training)")
    parser.add_argument("--run-ahead", type=_micro_steps, default=None, metavar="K", help="micro-steps the host runs ahead of the GPU on the CUDA path driven with host memory: an asynchronous H2D copy from pinned memory reads its source K micro-steps after the call, unless an event, a synchronize or a use of its result makes it run earlier (default 2: the least that shows an unfenced double buffer; raise it for deeper rings)")
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte", help="tokenizer a data-loader module (nanochat's dataloader.py) is driven with: byte, a byte-level stand-in (default); bpe, a rustbpe BPE of vocab 512 trained on the synthetic corpus and wrapped in tiktoken, as nanochat builds its own (needs pip install rustbpe tiktoken)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def build_ab_parser() -> argparse.ArgumentParser:
    from patcher import ab

    parser = SuggestingParser(
        prog="patch-prefetch ab",
        usage="%(prog)s [options] ORIGINAL PATCHED [-- SCRIPT_ARG ...]",
        description=(
            "A/B step time, on your GPU: run ORIGINAL (A) and PATCHED (B) alternately, each run its own process, "
            "each stopped (its process group killed) once it has logged step --steps, so no run pays for the final "
            "evaluation or quantisation; read the mean step time of each run from the script's own log lines "
            "(parameter-golf, its 2026-04 records, modded-nanogpt, nanochat base_train, or `step:N train_loss:X` lines "
            "timed on arrival), and give the B/A ratio with a 95 % confidence interval, a p-value (Welch) and a verdict. "
            "Every run gets ITERATIONS=S, TRAIN_LOG_EVERY=K (--log-every, 20: a log line is a sync in parameter-golf, so never every step), "
            "VAL_LOSS_EVERY=0 (what parameter-golf reads; --env wins), both sides one compile cache, "
            "and nanochat's --num-iterations=S where the script defines that flag. Lines starting with 'prefetch:' "
            "are quoted, and a producer that fell back ('runs without prefetch') is counted."
        ),
        epilog="Exit codes: 0 comparison made (whatever the verdict), 2 bad input or usage, or a run failed (one line: which run, its exit code, the end of its stderr), 130 interrupted (the running script's process group is killed first).",
    )
    parser.add_argument("original", help="script A (its path; relative to the current directory, not --cwd)")
    parser.add_argument("patched", help="script B, e.g. the output of patch-prefetch ORIGINAL -o PATCHED; what follows -- is passed to both scripts")
    parser.set_defaults(script_args=[])  # what follows `--`: split off before parsing (_main)
    parser.add_argument("--runs", type=int, default=None, help=f"runs of each script, alternated A B A B (default {ab.DEFAULT_RUNS}; with --until the most, default {ab.DEFAULT_UNTIL_RUNS})")
    parser.add_argument("--log-every", type=int, default=ab.DEFAULT_LOG_EVERY, metavar="K", help=f"steps between two log lines of a run, each a sync in parameter-golf (default {ab.DEFAULT_LOG_EVERY})")
    parser.add_argument("--until", type=float, default=None, metavar="X", help="keep alternating runs until the ratio's 95 %% interval is narrower than ±X %% (or --budget has passed)")
    parser.add_argument("--budget", type=_seconds, default=None, metavar="SECONDS", help="stop starting new pairs of runs after this many seconds")
    parser.add_argument("--steps", type=int, default=ab.DEFAULT_STEPS, help=f"stop each run once it has logged this step (default {ab.DEFAULT_STEPS})")
    parser.add_argument("--skip", type=int, default=None, help="steps left out at the start of each run (compilation, warm-up; default 20 %% of --steps, at least 1)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="K", help="run under torchrun --standalone --nproc_per_node K (default: plain python, one process)")
    parser.add_argument("--python", dest="run_python", default=None, metavar="PATH", help="the interpreter that runs both scripts: your training environment's, with its CUDA torch (default: the one running patch-prefetch)")
    parser.add_argument("--cwd", default=None, help="working directory of the runs (default: the current one)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="set for both scripts (repeatable); wins over the step settings")
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE", help="set for script B only (repeatable), e.g. TRAIN_PREFETCH=0")
    parser.add_argument("--label-a", default="original", help="name of side A in the report (default original)")
    parser.add_argument("--label-b", default="patched", help="name of side B in the report (default patched)")
    parser.add_argument("--timeout", type=_seconds, default=ab.DEFAULT_TIMEOUT_S, help=f"seconds one run may take before it is killed and counted as failed (default {ab.DEFAULT_TIMEOUT_S:.0f})")
    parser.add_argument("--tokens-per-step", type=int, default=None, help="tokens a step, to turn a 2026-04 record's tok/s into ms (default: TRAIN_BATCH_TOKENS of the run's environment)")
    parser.add_argument("--step-regex", default=None, metavar="REGEX", help="the step line of a script in no known format: its first group is the step number (lines timed on arrival; a group named ms: cumulative training ms)")
    parser.add_argument("--json", action="store_true", help="print one JSON document with everything (runs, per-run ms, ratio, ci, p, verdict, fallbacks, format, commands)")
    return parser


def _seconds(text: str) -> float:
    """argparse type: a positive number of seconds."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {text!r}")
    return value


def _micro_steps(text: str) -> int:
    """argparse type: a count of micro-steps, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"not a number of micro-steps (0 or more): {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `patch-prefetch` command. Returns the exit code.

    Ctrl-C gives one line on stderr and 130; a closed stdout (`| head`) ends the
    command quietly with 141, whatever it had done by then (a file already written
    stays written).
    """
    said = False
    try:
        try:
            return _main(argv)
        except Exception as error:
            if caused_by_ctrl_c(error):
                raise KeyboardInterrupt from None
            raise
    except KeyboardInterrupt:
        said = True
        print(INTERRUPTED_LINE, file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        if argv is None and _started_as_command():
            _end_at_ctrl_c(said)  # what is left is the interpreter's exit


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so that Python's flush at exit does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    meant = _mistyped_subcommand(argv[0]) if argv and command is None else None
    if meant is not None:
        return _usage_failed(UsageError(f"{argv[0]}: no such file, nor a subcommand; did you mean {meant}?"), "--json" in argv)
    if command == "bench":
        return bench_main(argv[1:])
    parser = {"check": build_check_parser, "verify": build_verify_parser, "unwrap": build_unwrap_parser, "ab": build_ab_parser}.get(command, build_parser)()
    script_args = None
    if command == "ab" and "--" in argv:  # `ab A B [options] -- ARGS`: ARGS go to both scripts
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    try:
        args = parser.parse_args(argv[1:] if command else argv)
    except SystemExit as exit:
        return EXIT_BAD_INPUT if exit.code else EXIT_OK
    if script_args is not None:
        args.script_args = script_args
    run = {"check": _run_check, "verify": _run_verify, "unwrap": _run_unwrap, "ab": _run_ab}.get(command, _run)
    try:
        if hasattr(args, "python"):
            args.python = _target_python(args)
        return run(args)
    except (SourceError, UsageError, NoFiles) as error:
        return _usage_failed(error, getattr(args, "json", False))


def _usage_failed(error: Exception, as_json: bool) -> int:
    """Say `error` (bad input or usage, or no input file) in one line on stderr, and with
    `as_json` as the JSON document `{"error", "exit_code"}` on stdout. Returns the exit code."""
    code = EXIT_NO_FILES if isinstance(error, NoFiles) else EXIT_BAD_INPUT
    print(f"patch-prefetch: error: {error}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": str(error), "exit_code": code}))  # stdout stays one JSON document
    return code


def _mistyped_subcommand(word: str) -> str | None:
    """The subcommand that `word`, the first argument, was meant to be, or None. Only for a
    bare word (no path separator, dot or pattern) that names no file: `verfy` is a
    mistyped `verify`, while `check.py`, a missing script, is left to be reported as one."""
    if word.startswith("-") or any(c in word for c in "./" + os.sep) or glob.has_magic(word) or os.path.lexists(word):
        return None
    return close_to(word, SUBCOMMANDS)


def bench_main(argv: list[str] | None = None) -> int:
    """`patch-prefetch bench`: a data-loader module (nanochat) to `module_bench`, any other
    script to `bench`. Exit 0, or 2 with one line when it cannot run."""
    from patcher.proof import bench
    from patcher.proof.bench import run_bench
    from patcher.proof.timing import DEFAULT_OP, DEFAULT_OP_NUMEL, MAIN_THREAD_MODES, OP_KINDS, BenchError
    from patcher.proof.module_bench import module_loader, print_module_report, run_module_bench

    parser = SuggestingParser(prog="patch-prefetch bench", description=bench.__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--compute-ms", type=float, default=20.0, help="simulated step time in ms (default 20)")
    parser.add_argument("--main-thread", choices=list(MAIN_THREAD_MODES), default="gil-busy", help="simulated step: idle (sleeps), gil-busy (5 ms of Python, then sleeps) or op-bound (small torch ops for the whole step)")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per synthetic shard (default 100 M, the real size)")
    parser.add_argument("--queue-depth", type=int, default=2, help="prefetch depth (TRAIN_PREFETCH_QUEUE)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch CPU threads (default 1, what torchrun sets for 8 processes per node; 0: as torch starts, one per core)")
    parser.add_argument("--shards", type=int, default=3, help="synthetic train shards (default 3; rank 0 of 8 reads every 8th in the ShuffledSequenceLoader family)")
    parser.add_argument("--data-dir", help="keep the synthetic shards here and reuse them on later runs")
    parser.add_argument("--pageable-h2d", action="store_true", help="charge the original's next_batch the host copy its pageable H2D makes on a GPU (the patched hand-out's copy is the pinning copy it makes there)")
    parser.add_argument("--op", choices=list(OP_KINDS), default=DEFAULT_OP, help=f"op-bound: the op of the step's loop (default {DEFAULT_OP}: a new output tensor per op, as a CUDA op allocates; add-out writes into one output)")
    parser.add_argument("--op-numel", type=int, default=DEFAULT_OP_NUMEL, help=f"op-bound: float32 elements of the op's tensors (default {DEFAULT_OP_NUMEL}: no host data, as a CUDA op's output has none)")
    parser.add_argument("--ops-per-step", type=int, help="op-bound: a fixed op count a step instead of one calibrated to --compute-ms")
    parser.add_argument("--alternate-every", type=int, default=1, help="steps a side runs before the other side's turn (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit:
        return 2 if exit.code else 0
    try:
        with running_clock(f"bench {args.script}: {args.steps} steps", wanted(args.json)):
            if module_loader(read_script(args.script).source) is not None:  # a data-loader module (nanochat)
                report = run_module_bench(args.script, args.steps, args.compute_ms, args.main_thread)
                print(json.dumps(report)) if args.json else print_module_report(report, sys.stdout)
                return 0
            report = run_bench(args.script, args.steps, args.compute_ms, args.main_thread, args.shard_tokens, shards=args.shards, queue_depth=args.queue_depth, data_dir=args.data_dir, torch_threads=args.torch_threads or None, pageable_h2d=args.pageable_h2d,
                op=args.op, op_numel=args.op_numel, ops_per_step=args.ops_per_step, alternate_every=args.alternate_every)
    except (BenchError, SourceError) as error:
        print(f"patch-prefetch bench: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        bench.print_table(report, sys.stdout)
    return 0


def _target_python(args) -> str:
    """The check's target: `--python` as given, once it is known to be installed (a
    version or path that is not: UsageError, exit 2, since a check under another Python
    would prove nothing about it); without `--python`, the default 3.10."""
    from patcher.check.interpreters import DEFAULT_TARGET, find_python

    if args.python is None:
        return DEFAULT_TARGET
    if getattr(args, "no_check", False):
        return args.python
    path, _version = find_python(args.python)
    if path is None:
        raise UsageError(f"--python {args.python}: no such interpreter on PATH or under pyenv root; install it or name an interpreter path (a check under another Python would prove nothing about {args.python})")
    return args.python


def _run(args) -> int:
    args.inputs = _expand(args.inputs)
    if len(args.inputs) > 1 or args.out_dir is not None or Path(args.inputs[0]).is_dir():
        return _run_tree(args)
    name = args.inputs[0]
    if name == STDIN:
        if args.in_place:
            raise UsageError("--in-place needs a file, not stdin")
        with tempfile.TemporaryDirectory(prefix="patch-prefetch-") as tmp:
            in_path = Path(tmp) / "stdin.py"
            in_path.write_bytes(sys.stdin.buffer.read())
            try:
                return _run_file(args, in_path, "<stdin>")
            except SourceError as error:  # name stdin, not the scratch copy
                raise SourceError("<stdin>", error.message, error.line, error.col) from None
    try:  # the input is named before anything about the output
        os.stat(name)
    except FileNotFoundError:
        raise SourceError(name, "no such file") from None
    except OSError:
        pass  # said by the read, with the reason
    return _run_file(args, Path(name), name)


def _expand(inputs: list[str]) -> list[str]:
    """INPUTs with the patterns the shell left unexpanded (quoted, or no match there)
    expanded, sorted, `**` included. A pattern that matches nothing: NoFiles (exit 5). A
    path that exists is taken as given, even with `*` in its name."""
    expanded: list[str] = []
    for name in inputs:
        if name == STDIN or os.path.lexists(name) or not glob.has_magic(name):
            expanded.append(name)
            continue
        found = sorted(glob.glob(name, recursive=True))
        if not found:
            raise NoFiles(f"{name}: no file matches this pattern; nothing written")
        expanded.extend(found)
    if STDIN in expanded and len(expanded) > 1:
        raise UsageError("'-' (stdin) is one script: it cannot be patched with other INPUTs")
    return expanded


def _run_file(args, in_path: Path, shown: str) -> int:
    """One script: patch `in_path` (named `shown` in the report), print what was asked."""
    out_path = _output_path(args, in_path)
    # Where the report goes: stdout, unless stdout carries the script, or the diff alone.
    to_stdout = out_path == "-"
    report_stream = sys.stderr if to_stdout or (args.diff and not args.json) else sys.stdout
    diff_stream = sys.stderr if to_stdout else sys.stdout
    clock = wanted(args.json) and not args.quiet and not to_stdout
    with running_clock(f"patching {shown}", clock):
        done = patch_file(in_path, out_path, _file_options(args))
    done.report["input"] = shown
    if shown == "<stdin>" and done.report.get("cap_note"):
        done.report["cap_note"] = cap_note(in_path, done.report["code_bytes"], stdin=True)
    if out_path is None:
        done.report["output"] = None
    diff = None
    if args.diff:
        diff = patch_diff(done, shown)
    if args.json:
        if diff is not None:
            done.report["diff"] = "".join(diff)
        print(json.dumps(done.report), file=report_stream)
    elif diff is not None:
        diff_stream.writelines(coloured_review(diff) if use_colour(args.color, diff_stream) else diff)
    if not args.json and not args.quiet:
        colour = use_colour(args.color, report_stream)
        _print_report(done.report, done.patch, report_stream, colour)
        if done.check is not None:
            exit_note = "" if done.check.ok else " (exit 4)"
            verdict = paint(done.check.summary, GREEN if done.check.ok else RED, colour)
            print(f"  check: {verdict}{exit_note}", file=report_stream)
            _print_check(done.check, report_stream, indent="    ")
    if done.over_cap is not None:
        print(f"patch-prefetch: error: {done.over_cap}", file=sys.stderr)
    return EXIT_BY_STATUS[done.status]


def _file_options(args) -> FileOptions:
    """The `FileOptions` of the parsed command line; raises UsageError for an unknown feature."""
    try:
        enabled = features_from(args.only, args.skip, args.extra, args.diagnostics)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return FileOptions(
        enabled=frozenset(enabled),
        rewrap=not args.no_rewrap,
        check=not args.no_check,
        run_import=not args.no_import,
        python=args.python,
        timeout=args.timeout,
        byte_breakdown=args.byte_breakdown and not args.no_byte_breakdown,
        in_place=args.in_place,
        producer_toggles=args.producer_toggles,
    )


def _run_tree(args) -> int:
    from patcher import tree

    several = len(args.inputs) > 1
    if STDIN in args.inputs:
        raise UsageError("'-' (stdin) is one script: tree mode takes files and directories")
    if args.out_dir is None and not args.diff:
        what = "several INPUTs" if several else f"{args.inputs[0]}: is a directory;"
        raise UsageError(f"{what} give --out-dir for tree mode (or --diff to see the patches without writing them)")
    if args.output is not None or args.in_place:
        raise UsageError("tree mode (a directory or several INPUTs) takes --out-dir, not -o or --in-place")
    if args.out_dir is not None and os.path.lexists(args.out_dir) and not os.path.isdir(args.out_dir):
        what = "a symlink loop" if is_symlink_loop(args.out_dir) else "not a directory"
        raise SourceError(args.out_dir, f"--out-dir is {what}; nothing written")
    for name in args.inputs if args.out_dir is not None else ():
        if Path(name).is_dir() and _same_path(name, args.out_dir):
            raise UsageError(f"{args.out_dir}: --out-dir is the input directory; nothing overwritten")
    options = replace(_file_options(args), byte_breakdown=False)
    args.colour = use_colour(args.color, sys.stderr if args.diff else sys.stdout)
    args.diff_colour = use_colour(args.color, sys.stdout)
    return tree.run(args, options)


def _run_check(args) -> int:
    """Check every file, a bad one included: its error is its report (exit 2 over 1)."""
    from patcher.check.check import check_file

    code, documents = EXIT_OK, []
    for name in args.files:
        try:
            result = check_file(name, target=args.python, timeout=args.timeout, run_import=not args.no_import)
        except SourceError as error:
            code = EXIT_BAD_INPUT
            # Said once where it is read: the report's row on stdout; the error line on
            # stderr too where that is somewhere else (a file, a pipe), or stdout is JSON.
            if args.json or not _same_destination(sys.stdout, sys.stderr):
                print(f"patch-prefetch: error: {error}", file=sys.stderr)
            documents.append({"file": name, "ok": False, "error": str(error)})
            if not args.json:
                where = f":{error.line}" if error.line is not None else ""
                print(f"{name}{where}: bad input (exit 2): {error.message}")
            continue
        if not result.ok and code == EXIT_OK:
            code = EXIT_FAILED
        documents.append(dict(result.as_dict(), file=name))
        if not args.json:
            print(f"{name}: {result.summary}")
            _print_check(result, sys.stdout, indent="  ")
    if args.json:
        print(json.dumps(documents[0] if len(documents) == 1 else {"files": documents, "exit_code": code}))
    return code


def _same_destination(a, b) -> bool:
    """Whether streams `a` and `b` end in the same place (one terminal, pipe or file, as
    with `2>&1`). False when that cannot be told (a stream without a descriptor)."""
    if a is b:
        return True
    try:
        first, second = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _run_unwrap(args) -> int:
    """`patch-prefetch unwrap FILE [-o OUT]`: the payload of a wrapped script, as plain source."""
    if args.file == STDIN:
        with tempfile.TemporaryDirectory(prefix="patch-prefetch-") as tmp:
            copy = Path(tmp) / "stdin.py"
            copy.write_bytes(sys.stdin.buffer.read())
            try:
                script = read_script(copy)
            except SourceError as error:
                raise SourceError("<stdin>", error.message, error.line, error.col) from None
    else:
        script = read_script(args.file)
    shown = "<stdin>" if args.file == STDIN else args.file
    if not script.wrapped:
        print(f"patch-prefetch unwrap: {shown}: not a compressed exec wrapper; nothing written", file=sys.stderr)
        return EXIT_NOTHING
    if args.output == "-":
        sys.stdout.write(script.source)
        return EXIT_OK
    out = Path(args.output)
    if args.file != STDIN and _same_path(out, args.file):
        raise UsageError(f"{out}: output path is the input path; nothing written")
    problem = output_problem(out)
    if problem is not None:
        raise SourceError(out, f"cannot write output: {problem}; nothing written")
    try:
        write_atomic(out, script.source)
    except OSError as error:
        raise SourceError(out, f"cannot write output: {error.strerror or error}") from None
    print(f"{shown}: payload ({script.wrapper.codec}) -> {out}", file=sys.stderr)
    return EXIT_OK


SKIPPED_SHOWN = 5  # skipped statements listed by line; the rest are counted


def _print_check(result, stream, indent: str) -> None:
    from patcher.check.stubs import summarise as summarise_stubs

    c = result.compile
    python = c.python or "no real interpreter (grammar check only)"
    where = " payload" if c.where == "payload" else ""
    status = "ok" if c.ok else f"FAILED{where} line {c.line}:{c.col}: {c.error}"
    print(f"{indent}compile ({python}): {status}", file=stream)
    pad = indent
    if result.wrapper_compile is not None:
        w = result.wrapper_compile
        print(f"{pad}wrapper compile: {'ok' if w.ok else 'FAILED line ' + str(w.line) + ': ' + str(w.error)}", file=stream)
    imp = result.imports
    if imp is not None:
        status = f"FAILED: {imp.error}" if not imp.ok else (f"partial: {imp.ran} of {imp.total} top-level statements" if imp.partial else "ok")
        extra = f"; stubbed: {', '.join(summarise_stubs(imp.stubbed))}" if imp.stubbed else ""
        where = f", as if at {imp.as_path}" if imp.as_path else ""
        print(f"{pad}import smoke (ran the script's definitions in a child process{where}): {status}{extra}", file=stream)
        if imp.note:
            print(f"{pad}  ({imp.note})", file=stream)
        if imp.partial:
            shown = imp.skipped[:SKIPPED_SHOWN]
            more = f" and {len(imp.skipped) - len(shown)} more" if len(imp.skipped) > len(shown) else ""
            print(f"{pad}  skipped (they do work: training, I/O, process groups): {'; '.join(shown)}{more}", file=stream)
    else:
        print(f"{pad}import smoke: not run (compiled only; nothing of the script ran)", file=stream)
    if result.undefined is None:
        print(f"{pad}undefined names: not checked (the running Python cannot parse the code)", file=stream)
    elif result.undefined:
        print(f"{pad}undefined names (pyflakes): FAILED: {'; '.join(str(u) for u in result.undefined)}", file=stream)
    else:
        print(f"{pad}undefined names (pyflakes, every scope): none", file=stream)
    if result.original is not None:
        print(f"{pad}the original, checked the same way: {'FAILED too' if not result.original.ok else 'passes'}", file=stream)
    for warning in result.warnings:
        print(f"{pad}warning: {warning}", file=stream)
    print(f"{pad}code bytes: {result.code_bytes}", file=stream)


def _run_verify(args) -> int:
    from patcher.proof.verify import CannotVerify, NothingToVerify, verify

    try:
        batches = "default batches" if args.batches is None else f"{args.batches} batches"
        with running_clock(f"verify {args.patched}: {batches} x {args.world_size} ranks", wanted(args.json)):
            result = verify(args.original, args.patched, batches=args.batches, world_size=args.world_size, seed=args.seed, sends=args.send, shard_tokens=args.shard_tokens, run_ahead=args.run_ahead, tokenizer=args.tokenizer)
    except NothingToVerify as error:
        return _verify_error(args, f"nothing to verify: {error}", EXIT_NOTHING)
    except CannotVerify as error:
        return _verify_error(args, f"cannot verify: {error}", EXIT_BAD_INPUT)
    except (SourceError, KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as error:  # the harness's own failure is never "the batches differ"
        if caused_by_ctrl_c(error):
            raise
        where = _innermost_frame(error)
        return _verify_error(args, f"cannot verify: the harness failed{where}: {type(error).__name__}: {' '.join(str(error).split())[:300]}", EXIT_BAD_INPUT)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        for note in result.notes:
            print(f"  {note}")
        if result.identical:
            val = f" and {result.val_batches_compared} validation batches" if result.val_batches_compared else ""
            unproven = "" if result.prefetched else "; a hand-edited script (no runtime of patch-prefetch), driven through its own loader" if result.edited else "; not run ahead: the training generator's own H2D copies are staged (pinned_staging)" if result.staged else "; nothing was prefetched (train_prefetch was skipped): the training loader is the original's"
            over = "".join(f", {what}" for what in result.exercised) + (f"; tokenizer: {result.tokenizer}" if result.tokenizer else "")
            if result.skipped:
                print(f"partial: {result.batches_compared} batches{val} identical over {result.world_size} ranks{over}; not exercised: {'; '.join(result.skipped)} ({result.seconds:.1f} s){unproven}")
            else:
                print(f"identical: {result.batches_compared} batches{val} over {result.world_size} ranks{over} ({result.seconds:.1f} s){unproven}")
        else:
            d = result.difference
            field = "" if d.field is None else f", field {d.field}"
            how = f" ({d.configuration})" if d.configuration else ""
            print(f"DIFFER: rank {d.rank}, {d.phase} batch {d.batch}{field}: {d.what}{how}" + (f"; tokenizer: {result.tokenizer}" if result.tokenizer else ""))
        for leak in result.leaks:
            print(f"LEAK: {leak}")
    if not result.identical:
        return EXIT_FAILED
    return EXIT_LEAKED if result.leaks else EXIT_OK


def _run_ab(args) -> int:
    """`patch-prefetch ab ORIGINAL PATCHED`: alternated runs, the step-time comparison."""
    from patcher import ab

    def progress(result, total: int) -> None:
        if not args.json:
            ms = "-" if result.step_ms is None else f"{result.step_ms:.3f} ms/step"
            note = " (producer fell back)" if result.fell_back else ""
            print(f"ab: run {result.index}/{total} {result.label}: {ms}{note}", file=sys.stderr, flush=True)

    try:
        report = ab.run_ab(
            args.original, args.patched, runs=args.runs if args.runs is not None else (ab.DEFAULT_UNTIL_RUNS if args.until is not None else ab.DEFAULT_RUNS), steps=args.steps, skip=args.skip, nproc_per_node=args.nproc_per_node,
            cwd=args.cwd, env=ab.parse_assignments(args.env, "--env"), env_b=ab.parse_assignments(args.env_b, "--env-b"),
            label_a=args.label_a, label_b=args.label_b, timeout_s=args.timeout, tokens_per_step=args.tokens_per_step,
            step_regex=args.step_regex, script_args=args.script_args, python=args.run_python, on_run=progress,
            log_every=args.log_every, until_pct=args.until, budget_s=args.budget,
        )
    except ab.AbError as error:
        print(f"patch-prefetch ab: error: {error}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(error), "exit_code": EXIT_BAD_INPUT}))
        return EXIT_BAD_INPUT
    print(json.dumps(report) if args.json else ab.format_report(report))
    return EXIT_OK


def _verify_error(args, line: str, code: int) -> int:
    """Say why verify gave no verdict: one line on stderr, and with --json the document
    `{"error", "exit_code"}` on stdout. Returns `code`."""
    print(f"patch-prefetch verify: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps({"error": line, "exit_code": code}))
    return code


def _innermost_frame(error: BaseException) -> str:
    """" at FILE:LINE" of the innermost frame of `error`'s traceback, or ""."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""


def _output_path(args, in_path: Path):
    """Where the patched script goes: a Path, "-" (stdout), or None (nowhere: `--diff`
    alone, or `-o /dev/null`). Raises UsageError / SourceError for an output refused."""
    if args.in_place:
        return in_path
    if args.output is None:
        if args.diff:
            return None  # ruff's and black's --diff: show, write nothing
        if args.inputs == [STDIN]:
            return "-"  # black's `-`: stdin to stdout
        raise UsageError("no output given: use -o OUT, -o - for stdout, --diff to see the patch without writing it, or --in-place")
    if args.output == "-":
        return "-"
    if os.path.abspath(args.output) == DEVNULL:
        return None
    out = Path(args.output)
    if _same_path(out, in_path):
        raise UsageError(f"{out}: output path is the input path; use --in-place to overwrite it (a .orig backup is kept)")
    problem = output_problem(out)
    if problem is not None:
        raise SourceError(out, f"cannot write output: {problem}; nothing written")
    return out


def _same_path(a, b) -> bool:
    """Whether paths `a` and `b` lead to the same place. Never raises: a symlink loop is
    compared as far as it resolves (Path.resolve raises RuntimeError on one before Python
    3.13), and reading it is refused later with its own error."""
    return os.path.realpath(a) == os.path.realpath(b)


def _said_once(notes) -> list[tuple[object, list[int]]]:
    """`notes` with each (feature, applied or skipped, reason) once, in first-seen order,
    with the lines of every site it was given for: a loader built twice (a warm-up
    rebuild) gets its reason once, not once a site, word for word."""
    grouped: dict[tuple, tuple[object, list[int]]] = {}
    for note in notes:
        _, lines = grouped.setdefault((note.feature, note.applied, note.reason), (note, []))
        if note.line and note.line not in lines:
            lines.append(note.line)
    return list(grouped.values())


def _print_report(report: dict, result, stream, colour: bool = False) -> None:
    out = report["output"]
    if result.already_patched:
        print(f"{report['input']}: already patched; nothing changed" + (f" (copied to {out})" if out not in (None, report["input"]) else ""), file=stream)
    elif not result.changed:
        print(f"{report['input']}: nothing to patch; nothing written", file=stream)
    elif out is None:
        print(f"{report['input']}: patched, nothing written (--diff without -o)  ({'wrapped' if report['wrapped'] else 'plain'}, {report['seconds']} s)", file=stream)
    else:
        print(f"{report['input']} -> {out}  ({'wrapped' if report['wrapped'] else 'plain'}, {report['seconds']} s)", file=stream)
    for note, lines in _said_once(result.notes):
        mark = paint(f"{'applied' if note.applied else 'skipped':8}", GREEN if note.applied else YELLOW, colour)
        where = f" (line {lines[0]})" if len(lines) == 1 else f" (lines {', '.join(map(str, lines))})" if lines else ""
        print(f"  {mark} {note.feature:15} {note.reason}{where}", file=stream)
    from patcher.code_size import cost_lines

    for line in report.get("expect", []):
        print(f"  {'expect':8} {line}", file=stream)
    if report.get("switches"):
        print(f"  switches added (environment variables the patched script reads; the README's table says what each does): {', '.join(report['switches'])}", file=stream)
    cb = report["code_bytes"]
    print(f"  code bytes, {cb['counted']}: {cb['before']} -> {cb['after']} ({cb['after'] - cb['before']:+d})", file=stream)
    for line in cost_lines(cb):
        print(f"    {line}", file=stream)
    art = report.get("artifact")
    if art is not None:
        state = f"{art['over']} over the cap" if art["over"] else f"{art['cap'] - art['after']} under the cap"
        print(f"  artifact (submission.json, largest): {art['before']} -> {art['after']} of {art['cap']} ({state})", file=stream)
    if report.get("cap_note"):
        print(f"  {paint(report['cap_note'], YELLOW, colour)}", file=stream)


if __name__ == "__main__":
    sys.exit(main())
