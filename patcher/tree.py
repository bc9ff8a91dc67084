"""Tree mode: `patch-prefetch records/ --out-dir patched/` patches every matching script.

Every file under the input directory whose name matches `--glob` (default `train*.py`)
is patched in its own process (`--jobs`, default the number of CPUs) exactly as
`patch-prefetch FILE -o OUT` would (`patcher.patch_file.patch_file`), into the same relative path under
`--out-dir`. A failure in one file (bad input, a failed check, a crash) is a row in the
summary, not the end of the run. A worker process that dies (a signal, an exit) or
passes `--file-timeout` is killed and replaced; that file's row says what happened and
the other files go on. Exit code: 0 when no file failed (written, already patched or
nothing to patch), 1 when one or more failed, 2 for bad usage, 5 when no file matched
(an empty directory, a `--glob` that matches nothing under it).

With `--diff` each file's review diff (`patcher.review.patch_diff`) is printed on
stdout, in input order, and the summary goes to stderr; without `--out-dir` nothing is
written (black's and ruff's `--diff`: `patch-prefetch records/ --diff | less`).

Several inputs (`patch-prefetch a/train_gpt.py b/ --out-dir OUT`): each directory gives
its matching files, each file is taken as given, and every output goes to its path
relative to the inputs' closest common directory under OUT. Ctrl-C stops the workers
and says which files were written, which were in hand (nothing of them written: outputs
are renamed into place whole) and which were not started.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from patcher.check.import_smoke import use_forked_smoke
from patcher.patch_file import ALREADY_PATCHED, CHECK_FAILED, NOTHING_TO_PATCH, WRITTEN, FileOptions, UsageError, patch_file
from patcher.colour import GREEN, RED, paint
from patcher.progress import coloured_diff, file_bar, wanted
from patcher.read.source import SourceError
from patcher.review import patch_diff

# The single-file command's exit code for each status (a row keeps it).
EXIT_CODES = {WRITTEN: 0, ALREADY_PATCHED: 0, NOTHING_TO_PATCH: 3, CHECK_FAILED: 4}
EXIT_BAD_INPUT = 2
FAILED_STATUSES = ("bad input", "check failed", "crash", "timed out")
# The status of a file patched for its diff alone (no --out-dir): nothing written.
PATCHED_NOT_WRITTEN = "patched (diff)"
DEFAULT_FILE_TIMEOUT_S = 600.0


@dataclass
class Row:
    """One file of the tree: what the single-file command reported for it.

    file: path relative to the input directory. status: written | already patched |
    nothing to patch | bad input | check failed | crash | timed out. applied: features applied.
    skipped: "feature: reason" lines. bytes_before / bytes_after: code bytes of the
    input and of what was written (None when nothing was), counted as `counted_as`
    (wrapper | minified | raw, see patcher.code_size). artifact: {"cap", "before",
    "after", "over"} in bytes where a submission.json gives the record's artifact size,
    else None. check: ok | partial | FAILED | None (not run). error: the one-line error for bad
    input, a crash, or an artifact over the cap. diff: the review diff (with `--diff`), else None.
    """

    file: str
    status: str
    exit_code: int | None
    applied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int | None = None
    bytes_after: int | None = None
    check: str | None = None
    error: str | None = None
    seconds: float | None = None
    counted_as: str | None = None
    artifact: dict | None = None
    diff: str | None = None

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES


class NoFiles(Exception):
    """No input file to patch: an empty directory, a `--glob` that matches nothing
    under a directory, or a path pattern that matches nothing (exit code 5)."""


class TreeInterrupted(KeyboardInterrupt):
    """Ctrl-C during a tree run. rows: the Rows of the files finished before it (their
    outputs are written, or their row says why not). in_hand: relative paths being
    patched when it came (their workers were killed; nothing of theirs is written, since
    an output is renamed into place whole). not_started: relative paths never begun."""

    def __init__(self, rows: list, in_hand: list[str], not_started: list[str]):
        super().__init__("interrupted")
        self.rows, self.in_hand, self.not_started = rows, in_hand, not_started


def find_scripts(root: Path, pattern: str, out_dir: Path | None) -> list[Path]:
    """Files under `root` whose name matches `pattern`, sorted, none under `out_dir` (None: no output directory)."""
    out = out_dir.resolve() if out_dir is not None else None
    found = []
    for path in sorted(root.rglob(pattern)):
        resolved = path.resolve()
        if path.is_file() and (out is None or (out != resolved and out not in resolved.parents)):
            found.append(path)
    return found


def collect(inputs: list[Path], pattern: str, out_dir: Path | None) -> tuple[Path, list[Path]]:
    """The scripts of a tree run and the directory their relative paths start from.

    inputs: directories (their files matching `pattern`, as `find_scripts`) and files
    (taken as given, whatever their name). Returns (base, scripts): base is the closest
    directory holding every input (a directory input counts as itself), scripts are
    in input order, each once. Raises NoFiles for a directory with no match.
    """
    scripts: list[Path] = []
    for path in inputs:
        if path.is_dir():
            found = find_scripts(path, pattern, out_dir)
            if not found:
                raise NoFiles(f"{path}: no file under it matches --glob {pattern!r}; nothing written")
            scripts.extend(found)
        else:
            scripts.append(path)
    unique = list({Path(os.path.abspath(p)): None for p in scripts})
    anchors = [os.path.abspath(p) if p.is_dir() else os.path.dirname(os.path.abspath(p)) for p in inputs]
    return Path(os.path.commonpath(anchors)), unique


def patch_one(source: str, target: str | None, relative: str, options: FileOptions, diff: bool = False) -> Row:
    """Patch `source` -> `target` (None: nowhere, for the diff alone) as the single-file
    command would (`patch_file`), with the review diff when `diff`; never raises."""
    if target is not None:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
    try:
        done = patch_file(Path(source), Path(target) if target is not None else None, options)
    except (SourceError, UsageError) as error:
        return Row(relative, "bad input", EXIT_BAD_INPUT, error=str(error))
    except Exception as error:  # a bug in the tool: reported for this file, the rest go on
        return Row(relative, "crash", None, error=f"{type(error).__name__}: {error}")
    report, check = done.report, done.check
    status = ALREADY_PATCHED if done.patch.already_patched else done.status
    shown = None
    if diff:
        shown = "".join(patch_diff(done, relative))
        status = PATCHED_NOT_WRITTEN if status == WRITTEN and not report["written"] else status
    return Row(
        relative,
        status,
        EXIT_CODES[done.status],
        applied=list(report["applied"]),
        skipped=[f"{s['feature']}: {s['reason']}" for s in report["skipped"]],
        bytes_before=report["code_bytes"]["before"],
        bytes_after=report["code_bytes"]["after"] if report["written"] else None,
        check=None if check is None else {"ok": "ok", "partial": "partial", "failed": "FAILED"}[check.verdict],
        error=done.over_cap,
        seconds=report["seconds"],
        counted_as=report["code_bytes"].get("counted_as"),
        artifact=report.get("artifact"),
        diff=shown,
    )


def patch_tree(
    root: Path,
    out_dir: Path,
    pattern: str = "train*.py",
    jobs: int | None = None,
    options: FileOptions = FileOptions(byte_breakdown=False),
    file_timeout: float = DEFAULT_FILE_TIMEOUT_S,
    progress: bool = False,
) -> list[Row]:
    """Patch every matching script under `root` into `out_dir` (same relative paths).

    Returns one Row per file, in path order. options: how each file is patched (the
    single-file command's options). file_timeout: seconds one file may take in its worker; past it the
    worker is killed (status "timed out"). A worker that dies gives its file the status
    "crash" with the signal or exit code; the other files are patched all the same.
    progress: show files done of total, the file in hand and the elapsed time on stderr.
    """
    return patch_files(root, find_scripts(root, pattern, out_dir), out_dir, jobs, options, file_timeout, progress)


def patch_files(
    base: Path,
    scripts: list[Path],
    out_dir: Path,
    jobs: int | None = None,
    options: FileOptions = FileOptions(byte_breakdown=False),
    file_timeout: float = DEFAULT_FILE_TIMEOUT_S,
    progress: bool = False,
    diff: bool = False,
) -> list[Row]:
    """Patch `scripts` (paths under `base`) into the same relative paths under `out_dir`
    (None: nothing written, with `diff`).

    Returns one Row per script, in the order given; arguments as `patch_tree`; diff: each
    Row carries its review diff. Raises TreeInterrupted on Ctrl-C (the workers are
    killed first).
    """
    base = Path(os.path.abspath(base))
    relative = [Path(os.path.abspath(p)).relative_to(base) for p in scripts]
    tasks = [(str(p), str(out_dir / r) if out_dir is not None else None, str(r), options, diff) for p, r in zip(scripts, relative)]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))
    # Largest files first, so that no long one is left running alone at the end.
    pending = sorted(tasks, key=lambda task: -os.path.getsize(task[0]))
    preload = options.check and options.run_import
    with file_bar(len(tasks), progress) as bar:
        done = _Pool(jobs, file_timeout, preload, bar).run(pending)
    return [done[task[2]] for task in tasks]


def _worker(conn, preload: bool) -> None:
    """Worker process: patch the files sent on `conn`, one Row back for each, until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if preload:
        use_forked_smoke()  # import torch once; each file's import smoke is forked from here
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        conn.send(patch_one(*task))


class _Pool:
    """Worker processes that each patch one file at a time.

    Unlike a ProcessPoolExecutor, a worker that dies or overruns its time only costs
    its own file: it is reaped (or killed) and replaced, and the row says why.
    """

    def __init__(self, jobs: int, file_timeout: float, preload: bool = True, bar=None):
        self.jobs = jobs
        self.bar = bar  # a progress bar (tqdm), or None
        self.preload = preload
        self.file_timeout = file_timeout
        self.context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
        self.busy: dict = {}  # conn -> (process, task, started)
        self.idle: list = []  # (process, conn)

    def run(self, pending: list[tuple]) -> dict[str, Row]:
        """Rows by relative path for every task in `pending`."""
        done: dict[str, Row] = {}
        pending = list(pending)
        try:
            while pending or self.busy:
                while pending and len(self.busy) < self.jobs:
                    self._start(pending.pop(0))
                before = len(done)
                self._collect(done)
                if self.bar is not None:
                    self.bar.update(len(done) - before)
                    self.bar.set_postfix_str(", ".join(task[2] for _, task, _ in self.busy.values()))
        except KeyboardInterrupt:
            in_hand = [task[2] for _, task, _ in self.busy.values()]
            self._stop_all()
            raise TreeInterrupted(list(done.values()), in_hand, [task[2] for task in pending]) from None
        finally:
            self._stop_all()
        return done

    def _start(self, task: tuple) -> None:
        if self.idle:
            process, conn = self.idle.pop()
        else:
            conn, child_conn = self.context.Pipe()
            process = self.context.Process(target=_worker, args=(child_conn, self.preload), daemon=True)
            process.start()
            child_conn.close()
        conn.send(task)
        self.busy[conn] = (process, task, time.monotonic())

    def _collect(self, done: dict) -> None:
        """Wait for a result, a death or the next deadline; record what happened."""
        now = time.monotonic()
        first_deadline = min(started + self.file_timeout for _, _, started in self.busy.values())
        sentinels = {process.sentinel: conn for conn, (process, _, _) in self.busy.items()}
        timeout = max(0.0, first_deadline - now)
        if self.bar is not None:
            timeout = min(timeout, 1.0)  # wake up to move the bar's clock
        ready = wait(list(self.busy) + list(sentinels), timeout=timeout)
        for item in ready:
            conn = item if item in self.busy else sentinels.get(item)
            if conn is None or conn not in self.busy:
                continue
            process, task, _ = self.busy[conn]
            row, closed = None, False
            if conn.poll():
                try:
                    row = conn.recv()
                except (EOFError, OSError):
                    closed = True
            if row is not None:
                del self.busy[conn]
                done[task[2]] = row
                self.idle.append((process, conn))
                continue
            if not closed and process.is_alive():
                continue  # not a result yet
            del self.busy[conn]
            process.join()
            done[task[2]] = Row(task[2], "crash", None, error=_death(process.exitcode))
            conn.close()
        now = time.monotonic()
        for conn, (process, task, started) in list(self.busy.items()):
            if now - started >= self.file_timeout:
                del self.busy[conn]
                _kill(process)
                conn.close()
                done[task[2]] = Row(task[2], "timed out", None, error=f"took longer than {self.file_timeout:g} s (--file-timeout); its worker was killed, nothing written")

    def _stop_all(self) -> None:
        for process, conn in self.idle:
            try:
                conn.send(None)
            except OSError:
                pass
        for process, conn in self.idle:
            process.join(timeout=5)
            if process.is_alive():
                _kill(process)
        for process, _, _ in self.busy.values():
            _kill(process)
        self.idle, self.busy = [], {}


def _kill(process) -> None:
    """SIGKILL a worker, and the import smoke it may have started, then reap it."""
    from patcher.check.smoke_child import kill_descendants

    try:
        process.kill()
        kill_descendants(process.pid)
    except OSError:
        pass
    process.join()


def _death(exitcode: int | None) -> str:
    """One line on how a worker ended, e.g. "worker killed by SIGSEGV (signal 11)"."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "a signal"
        return f"worker killed by {name} (signal {-exitcode}) while patching this file; nothing written"
    return f"worker exited with code {exitcode} while patching this file; nothing written"


def print_table(rows: list[Row], stream, colour: bool = False) -> None:
    """The summary: one line per file, then skip reasons and errors indented below it.
    colour: statuses in colour (failed red, written green)."""
    width = max([len(r.file) for r in rows] + [4])
    print(f"{'file':{width}}  {'status':16} {'applied':44} {'code bytes':>26}  {'artifact (cap 16000000)':>24}  check", file=stream)
    for r in rows:
        size = "" if r.bytes_before is None else (f"{r.bytes_before}->{r.bytes_after}" if r.bytes_after is not None else str(r.bytes_before))
        size += f" {r.counted_as}" if r.counted_as else ""
        art = "-" if r.artifact is None else f"{r.artifact['after']}" + (f" OVER +{r.artifact['over']}" if r.artifact["over"] else "")
        status = paint(f"{r.status:16}", RED if r.failed else GREEN if r.status == WRITTEN else None, colour)
        print(f"{r.file:{width}}  {status} {','.join(r.applied) or '-':44} {size:>26}  {art:>24}  {r.check or '-'}", file=stream)
        for reason in r.skipped:
            if reason.startswith("py310_fstrings: no "):
                continue  # nothing to requote is not news
            print(f"{'':{width}}    skipped {reason}", file=stream)
        if r.error:
            print(f"{'':{width}}    error: {r.error}", file=stream)
    failed = sum(r.failed for r in rows)
    counts = {s: sum(r.status == s for r in rows) for s in dict.fromkeys(r.status for r in rows)}
    print(f"{len(rows)} files: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + (f"; {failed} failed" if failed else ""), file=stream)


def run(args, options: FileOptions) -> int:
    """The tree mode of the command line: `args.inputs` (directories and files) into
    `args.out_dir`. Returns the exit code; raises NoFiles (nothing matched) and, on
    Ctrl-C, TreeInterrupted after saying on stderr what was written and what was not."""
    out_dir = Path(args.out_dir) if args.out_dir is not None else None
    diff = getattr(args, "diff", False)
    base, scripts = collect([Path(p) for p in args.inputs], args.glob, out_dir)
    progress = wanted(args.json) and not getattr(args, "quiet", False)
    try:
        rows = patch_files(base, scripts, out_dir, args.jobs, options, getattr(args, "file_timeout", DEFAULT_FILE_TIMEOUT_S), progress=progress, diff=diff)
    except TreeInterrupted as stop:
        print(interrupted_summary(stop, out_dir), file=sys.stderr)
        raise
    if args.json:
        files = [{k: v for k, v in dict(asdict(r), failed=r.failed).items() if k != "diff" or diff} for r in rows]
        print(json.dumps({"root": str(base), "inputs": [str(p) for p in args.inputs], "out_dir": None if out_dir is None else str(out_dir), "files": files}))
        return 1 if any(r.failed for r in rows) else 0
    if diff:  # the diffs on stdout (`| patch -p0`, `| less`), the summary beside them on stderr
        for r in rows:
            if r.diff:
                sys.stdout.write("".join(coloured_diff(r.diff.splitlines(True))) if getattr(args, "diff_colour", False) else r.diff)
    if not getattr(args, "quiet", False):
        print_table(rows, sys.stderr if diff else sys.stdout, colour=getattr(args, "colour", False))
    return 1 if any(r.failed for r in rows) else 0



def interrupted_summary(stop: TreeInterrupted, out_dir: Path | None, shown: int = 10) -> str:
    """What a Ctrl-C left behind, in a few lines: files written (under `out_dir`),
    files finished without an output (and why), files in hand (not written), files
    not started; each list names its first `shown` files."""
    written = [r.file for r in stop.rows if r.bytes_after is not None and r.status in (WRITTEN, CHECK_FAILED, ALREADY_PATCHED)]
    unwritten = [f"{r.file} ({r.status})" for r in stop.rows if r.file not in written]

    def names(files: list[str]) -> str:
        more = f" and {len(files) - shown} more" if len(files) > shown else ""
        return ", ".join(files[:shown]) + more

    total = len(stop.rows) + len(stop.in_hand) + len(stop.not_started)
    lines = [f"interrupted after {len(stop.rows)} of {total} files"]
    if written:
        lines.append(f"  written under {out_dir}: {len(written)}: {names(written)}")
    if unwritten:
        lines.append(f"  finished, nothing written: {len(unwritten)}: {names(unwritten)}")
    if stop.in_hand:
        lines.append(f"  stopped while being patched, nothing written: {len(stop.in_hand)}: {names(stop.in_hand)}")
    if stop.not_started:
        lines.append(f"  not started: {len(stop.not_started)}: {names(stop.not_started)}")
    return "\n".join(lines)
