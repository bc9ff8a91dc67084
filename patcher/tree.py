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
relative to the inputs' closest common directory under OUT.

An output is written (renamed into place whole) only once its check is done, so a file
on disk under OUT is one whose row says how its check went. Ctrl-C stops the workers and
says which files were written (and how each one's check went), which were in hand
(nothing of them written; a worker's half-done output is removed) and which were not
started; with `--json` the same goes into the JSON document. Further SIGINTs (`timeout`
forwards the terminal's Ctrl-C as a second one) are ignored until the report is out.
A symlink loop that a directory walk meets is a row of its own, "skipped", with the
reason; a symlink loop named as INPUT is bad input.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from patcher.check.import_smoke import use_forked_smoke
from patcher.patch_file import ALREADY_PATCHED, CHECK_FAILED, NOTHING_TO_PATCH, VERDICTS, WRITTEN, FileOptions, Staging, UsageError, patch_file
from patcher.colour import GREEN, RED, paint
from patcher.progress import file_bar, wanted
from patcher.read.source import SourceError, is_symlink_loop
from patcher.review import coloured_review, patch_diff

# The single-file command's exit code for each status (a row keeps it).
EXIT_CODES = {WRITTEN: 0, ALREADY_PATCHED: 0, NOTHING_TO_PATCH: 3, CHECK_FAILED: 4}
EXIT_BAD_INPUT = 2
FAILED_STATUSES = ("bad input", "check failed", "crash", "timed out")
# The status of a file patched for its diff alone (no --out-dir): nothing written.
PATCHED_NOT_WRITTEN = "patched (diff)"
# A symlink loop met by a directory walk: not read, not a failure.
SKIPPED = "skipped"
SYMLINK_LOOP = "is a symlink loop; not read"
# Ctrl-C: a file in hand (nothing of it written), a file never begun.
INTERRUPTED, NOT_STARTED = "interrupted", "not started"
# Where a file in hand was when Ctrl-C stopped its worker (a worker's `Staging` messages).
STOPPED = {
    "patching": "stopped while being patched",
    "checking": "stopped during its check",
    "staged": "stopped before its checked output was renamed into place",
}
EXIT_INTERRUPTED = 130  # the command's exit code after Ctrl-C (patcher.cli)
DEFAULT_FILE_TIMEOUT_S = 600.0


@dataclass
class Row:
    """One file of the tree: what the single-file command reported for it.

    file: path relative to the input directory. status: written | already patched |
    nothing to patch | bad input | check failed | crash | timed out | skipped (a symlink
    loop) | interrupted | not started (Ctrl-C). written: whether the output is on disk
    (renamed into place, after its check when there is one). applied: features applied.
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
    written: bool = False
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
    """Ctrl-C during a tree run. rows: the Rows of the files finished before it (`written`
    says whether each output is on disk). in_hand: Rows (status "interrupted") of the
    files being patched when it came: their workers were killed, nothing of theirs is
    written, and `error` says where each was (`STOPPED`). not_started: relative paths
    never begun."""

    def __init__(self, rows: list, in_hand: list, not_started: list[str]):
        super().__init__("interrupted")
        self.rows, self.in_hand, self.not_started = rows, in_hand, not_started


def caused_by_ctrl_c(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt is in `error`'s chain (`__context__`, `__cause__`): a
    library's `finally` that raises while a Ctrl-C unwinds it (libcst's position
    metadata raises KeyError there) turns the Ctrl-C into that exception."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def find_scripts(root: Path, pattern: str, out_dir: Path | None, loops: list[Path] | None = None) -> list[Path]:
    """Files under `root` whose name matches `pattern`, sorted, none under `out_dir` (None:
    no output directory). loops: gets the matching entries that are symlink loops (not
    files: they cannot be read), sorted."""
    # realpath, not Path.resolve: on Python < 3.13 resolve raises RuntimeError on a loop
    out = os.path.realpath(out_dir) if out_dir is not None else None
    found = []
    for path in sorted(root.rglob(pattern)):
        resolved = os.path.realpath(path)
        if out is not None and (resolved == out or resolved.startswith(out.rstrip(os.sep) + os.sep)):
            continue
        if path.is_file():
            found.append(path)
        elif loops is not None and is_symlink_loop(path):
            loops.append(path)
    return found


def collect(inputs: list[Path], pattern: str, out_dir: Path | None, loops: list[Path] | None = None) -> tuple[Path, list[Path]]:
    """The scripts of a tree run and the directory their relative paths start from.

    inputs: directories (their files matching `pattern`, as `find_scripts`) and files
    (taken as given, whatever their name). Returns (base, scripts): base is the closest
    directory holding every input (a directory input counts as itself), scripts are
    in input order, each once. loops: gets the symlink loops the directories hold
    (`find_scripts`). Raises NoFiles for a directory with no match.
    """
    scripts: list[Path] = []
    for path in inputs:
        if path.is_dir():
            met = [] if loops is not None else None
            found = find_scripts(path, pattern, out_dir, met)
            if not found and not met:
                raise NoFiles(f"{path}: no file under it matches --glob {pattern!r}; nothing written")
            scripts.extend(found)
            if loops is not None:
                loops.extend(met)
        else:
            scripts.append(path)
    unique = list({Path(os.path.abspath(p)): None for p in scripts})
    anchors = [os.path.abspath(p) if p.is_dir() else os.path.dirname(os.path.abspath(p)) for p in inputs]
    return Path(os.path.commonpath(anchors)), unique


# In a worker process: (the pid of the tree run that started it, a function that sends
# its `Staging` messages to that run). None elsewhere.
_CHANNEL: tuple | None = None


def staging_path(target: str | Path, owner: int) -> Path:
    """The temporary file that a worker of the tree run `owner` (its pid) writes `target`
    to before renaming it into place: beside the file `target` leads to (a rename does
    not cross file systems), hidden, named after both."""
    target = Path(os.path.realpath(target))
    return target.with_name(f".{target.name}.{owner}.patch-prefetch.tmp")


def patch_one(source: str, target: str | None, relative: str, options: FileOptions, diff: bool = False) -> Row:
    """Patch `source` -> `target` (None: nowhere, for the diff alone) as the single-file
    command would (`patch_file`), with the review diff when `diff`; never raises. In a
    worker, the output goes through `staging_path` and the worker's run hears of it."""
    staging = None
    try:
        if target is not None and _CHANNEL is not None:
            owner, tell = _CHANNEL
            staging = Staging(staging_path(target, owner), tell)
        elif target is not None:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
        done = patch_file(Path(source), Path(target) if target is not None else None, options, staging)
    except (SourceError, UsageError) as error:
        return Row(relative, "bad input", EXIT_BAD_INPUT, error=str(error))
    except Exception as error:  # a bug in the tool: reported for this file, the rest go on
        if caused_by_ctrl_c(error):
            raise KeyboardInterrupt from None
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
        written=bool(report["written"]),
        applied=list(report["applied"]),
        skipped=[f"{s['feature']}: {s['reason']}" for s in report["skipped"]],
        bytes_before=report["code_bytes"]["before"],
        bytes_after=report["code_bytes"]["after"] if report["written"] else None,
        check=None if check is None else VERDICTS[check.verdict],
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

    Returns one Row per file, in path order (then one per symlink loop met, "skipped"). options: how each file is patched (the
    single-file command's options). file_timeout: seconds one file may take in its worker; past it the
    worker is killed (status "timed out"). A worker that dies gives its file the status
    "crash" with the signal or exit code; the other files are patched all the same.
    progress: show files done of total, the file in hand and the elapsed time on stderr.
    """
    loops: list[Path] = []
    scripts = find_scripts(root, pattern, out_dir, loops)
    return patch_files(root, scripts, out_dir, jobs, options, file_timeout, progress, loops=loops)


def patch_files(
    base: Path,
    scripts: list[Path],
    out_dir: Path,
    jobs: int | None = None,
    options: FileOptions = FileOptions(byte_breakdown=False),
    file_timeout: float = DEFAULT_FILE_TIMEOUT_S,
    progress: bool = False,
    diff: bool = False,
    loops: list[Path] = (),
) -> list[Row]:
    """Patch `scripts` (paths under `base`) into the same relative paths under `out_dir`
    (None: nothing written, with `diff`).

    Returns one Row per script, in the order given, then one per path of `loops` (symlink
    loops a directory walk met: "skipped", not read); arguments as `patch_tree`; diff: each
    Row carries its review diff. Raises TreeInterrupted on Ctrl-C (the workers are
    killed first, and what a killed worker had staged is removed); from the first Ctrl-C
    on, SIGINT is ignored (see `_CtrlC`).
    """
    base = Path(os.path.abspath(base))
    relative = [Path(os.path.abspath(p)).relative_to(base) for p in scripts]
    tasks = [(str(p), str(out_dir / r) if out_dir is not None else None, str(r), options, diff) for p, r in zip(scripts, relative)]
    skipped = [Row(str(Path(os.path.abspath(p)).relative_to(base)), SKIPPED, None, error=SYMLINK_LOOP) for p in loops]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))
    # Largest files first, so that no long one is left running alone at the end.
    pending = sorted(tasks, key=lambda task: -_size(task[0]))
    preload = options.check and options.run_import
    try:
        with _CtrlC() as ctrl_c, file_bar(len(tasks), progress) as bar:
            done = _Pool(jobs, file_timeout, preload, bar).run(pending, ctrl_c)
    except TreeInterrupted as stop:
        stop.rows.extend(skipped)
        raise
    return [done[task[2]] for task in tasks] + skipped


def _size(path: str) -> int:
    """Bytes of the file at `path`; 0 for one that cannot be read (its row will say why)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class _CtrlC:
    """SIGINT during a tree run, taken as a request to stop rather than as an exception
    raised wherever the main thread happens to be.

    The first SIGINT makes `fd` readable (the pool's wait wakes up) and `count` 1; the
    pool then stops its workers and raises TreeInterrupted. Later ones only count:
    `timeout` forwards the terminal's Ctrl-C as a second SIGINT, and nothing may cut
    short the stopping of the workers, the removal of what they staged, or the report.
    After a SIGINT, SIGINT stays ignored (the command only reports and exits); without
    one, the previous handler is put back. Outside the main thread, or where SIGINT is
    ignored already, nothing is installed (`fd` is None) and SIGINT does what it did.
    """

    def __init__(self):
        self.count = 0
        self.fd: int | None = None
        self._write: int | None = None
        self._previous = None

    def __enter__(self) -> "_CtrlC":
        # SIGINT ignored already (a job started in the background by a shell): left so
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.fd, self._write = os.pipe()
            os.set_blocking(self._write, False)
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.count += 1
        try:
            os.write(self._write, b"\0")
        except OSError:  # the pipe is full: it is readable already
            pass

    def __exit__(self, *exc) -> bool:
        if self.fd is not None:
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(signal.SIGINT, signal.SIG_IGN if self.count else previous)
            os.close(self.fd)
            os.close(self._write)
        return False


def _worker(conn, preload: bool, owner: int) -> None:
    """Worker process of the tree run `owner` (its pid): patch the files sent on `conn`,
    one Row back for each, until None; before a Row, the file's `Staging` messages
    (("checking", None), ("staged", verdict)) as tuples."""
    global _CHANNEL
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _CHANNEL = (owner, lambda event, value: conn.send((event, value)))
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


@dataclass
class _Job:
    """A file in a worker's hands. phase: "patching", then "checking" (its check began),
    then "staged" (its checked output is whole in its staging file, about to be renamed
    into place). verdict: the check's, from the "staged" message (None: not checked)."""

    process: object
    conn: object
    task: tuple
    started: float
    phase: str = "patching"
    verdict: str | None = None


class _Pool:
    """Worker processes that each patch one file at a time.

    Unlike a ProcessPoolExecutor, a worker that dies or overruns its time only costs
    its own file: it is reaped (or killed) and replaced, and the row says why. A worker
    killed while its output was staged leaves it staged: the pool removes it, or, when the
    rename had happened, says the file is written.
    """

    def __init__(self, jobs: int, file_timeout: float, preload: bool = True, bar=None):
        self.jobs = jobs
        self.bar = bar  # a progress bar (tqdm), or None
        self.preload = preload
        self.file_timeout = file_timeout
        self.context = multiprocessing.get_context("fork" if hasattr(os, "fork") else "spawn")
        self.owner = os.getpid()  # names the staging files of this run's workers
        self.busy: dict = {}  # conn -> _Job
        self.idle: list = []  # (process, conn)

    def run(self, pending: list[tuple], ctrl_c: _CtrlC | None = None) -> dict[str, Row]:
        """Rows by relative path for every task in `pending`. Raises TreeInterrupted on
        KeyboardInterrupt, or once `ctrl_c` has counted a SIGINT."""
        done: dict[str, Row] = {}
        pending = list(pending)
        try:
            while (pending or self.busy) and not (ctrl_c is not None and ctrl_c.count):
                while pending and len(self.busy) < self.jobs:
                    self._start(pending[0])
                    pending.pop(0)
                before = len(done)
                self._collect(done, ctrl_c)
                if self.bar is not None:
                    self.bar.update(len(done) - before)
                    self.bar.set_postfix_str(", ".join(job.task[2] for job in self.busy.values()))
            if pending or self.busy:
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            in_hand = self._stop_busy(done)
            stopped = {row.file for row in in_hand}
            not_started = [task[2] for task in pending if task[2] not in done and task[2] not in stopped]
            raise TreeInterrupted(list(done.values()), in_hand, not_started) from None
        finally:
            self._stop_all()
        return done

    def _start(self, task: tuple) -> None:
        if self.idle:
            process, conn = self.idle.pop()
        else:
            conn, child_conn = self.context.Pipe()
            process = self.context.Process(target=_worker, args=(child_conn, self.preload, self.owner), daemon=True)
            process.start()
            child_conn.close()
        self.busy[conn] = _Job(process, conn, task, time.monotonic())
        conn.send(task)

    def _collect(self, done: dict, ctrl_c: _CtrlC | None = None) -> None:
        """Wait for a message, a death, the next deadline or a Ctrl-C; record what happened."""
        now = time.monotonic()
        first_deadline = min(job.started + self.file_timeout for job in self.busy.values())
        sentinels = {job.process.sentinel: conn for conn, job in self.busy.items()}
        timeout = max(0.0, first_deadline - now)
        if self.bar is not None:
            timeout = min(timeout, 1.0)  # wake up to move the bar's clock
        woken = [ctrl_c.fd] if ctrl_c is not None and ctrl_c.fd is not None else []
        ready = wait(list(self.busy) + list(sentinels) + woken, timeout=timeout)
        for item in ready:
            conn = item if item in self.busy else sentinels.get(item)
            if conn is None or conn not in self.busy:
                continue
            job = self.busy[conn]
            message, closed = None, False
            if conn.poll():
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    closed = True
            if isinstance(message, Row):
                done[job.task[2]] = message  # before the job is forgotten: a file is never in neither
                del self.busy[conn]
                self.idle.append((job.process, conn))
                continue
            if message is not None:
                job.phase, job.verdict = message
                continue
            if not closed and job.process.is_alive():
                continue  # not a result yet
            job.process.join()
            done[job.task[2]] = self._lost(job, "crash", _death(job.process.exitcode))
            del self.busy[conn]
            conn.close()
        now = time.monotonic()
        for conn, job in list(self.busy.items()):
            if now - job.started >= self.file_timeout:
                _kill(job.process)
                done[job.task[2]] = self._lost(job, "timed out", f"took longer than {self.file_timeout:g} s (--file-timeout); its worker was killed")
                del self.busy[conn]
                conn.close()

    def _lost(self, job: _Job, status: str, why: str) -> Row:
        """The row of a file whose worker is gone (dead or killed) before its Row came:
        its Row if it was sent after all, else `status` with `why` and whether its output
        made it into place."""
        row = self._drain(job)
        if row is not None:
            return row
        if self._settle(job):
            return Row(job.task[2], status, None, written=True, check=job.verdict, error=f"{why} after its output was written (check: {job.verdict or 'not run'})")
        return Row(job.task[2], status, None, error=f"{why}; nothing written")

    @staticmethod
    def _drain(job: _Job) -> Row | None:
        """Read what a gone worker had sent on its file: its Row, if any (a message cut
        off by its death is dropped); progress messages update `job`."""
        row = None
        try:
            while job.conn.poll():
                message = job.conn.recv()
                if isinstance(message, Row):
                    row = message
                else:
                    job.phase, job.verdict = message
        except (EOFError, OSError):
            pass
        return row

    def _settle(self, job: _Job) -> bool:
        """Whether the output of `job`, whose worker is gone, is in place. Its staging file
        still there: the rename never happened; the file is removed. Gone after the
        "staged" message: renamed into place."""
        target = job.task[1]
        if target is None:
            return False
        try:
            os.unlink(staging_path(target, self.owner))
        except FileNotFoundError:
            return job.phase == "staged"
        except OSError:
            pass
        return False

    def _stop_busy(self, done: dict) -> list[Row]:
        """Kill the busy workers (Ctrl-C). Files whose outcome is known go to `done` (a Row
        that came, or an output renamed into place before the kill); returns the Rows,
        status "interrupted", of the others (nothing of them written)."""
        in_hand = []
        for conn, job in list(self.busy.items()):
            _kill(job.process)
            file = job.task[2]
            row = self._drain(job)
            if row is not None or file in done:
                done.setdefault(file, row)
            elif self._settle(job):
                status = CHECK_FAILED if job.verdict == "FAILED" else WRITTEN
                done[file] = Row(file, status, None, written=True, check=job.verdict, error=f"Ctrl-C came after its output was written, before its report (check: {job.verdict or 'not run'})")
            else:
                in_hand.append(Row(file, INTERRUPTED, None, error=f"{STOPPED[job.phase]}; nothing written (Ctrl-C)"))
            del self.busy[conn]
            conn.close()
        return in_hand

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
        for job in self.busy.values():
            _kill(job.process)
            self._settle(job)
        self.idle, self.busy = [], {}


def _kill(process) -> None:
    """SIGKILL a worker, and what it started (a check's compile, an import smoke), then
    reap it. The worker is stopped first: it starts nothing more, and its children are
    still its own (a dead worker's children would be re-parented, out of reach) while
    they are killed."""
    from patcher.check.smoke_child import kill_descendants

    if process.exitcode is None:
        try:
            os.kill(process.pid, signal.SIGSTOP)
        except OSError:
            pass
        kill_descendants(process.pid)
        try:
            process.kill()
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
        return f"worker killed by {name} (signal {-exitcode}) while patching this file"
    return f"worker exited with code {exitcode} while patching this file"


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
            print(f"{'':{width}}    {'reason' if r.status == SKIPPED else 'error'}: {r.error}", file=stream)
    failed = sum(r.failed for r in rows)
    counts = {s: sum(r.status == s for r in rows) for s in dict.fromkeys(r.status for r in rows)}
    print(f"{len(rows)} files: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + (f"; {failed} failed" if failed else ""), file=stream)


def run(args, options: FileOptions) -> int:
    """The tree mode of the command line: `args.inputs` (directories and files) into
    `args.out_dir`. Returns the exit code; raises NoFiles (nothing matched) and, on
    Ctrl-C, TreeInterrupted after saying on stderr what was written and what was not."""
    out_dir = Path(args.out_dir) if args.out_dir is not None else None
    diff = getattr(args, "diff", False)
    loops: list[Path] = []
    base, scripts = collect([Path(p) for p in args.inputs], args.glob, out_dir, loops)
    progress = wanted(args.json) and not getattr(args, "quiet", False)

    def document(rows: list[Row]) -> dict:
        files = [{k: v for k, v in dict(asdict(r), failed=r.failed).items() if k != "diff" or diff} for r in rows]
        return {"root": str(base), "inputs": [str(p) for p in args.inputs], "out_dir": None if out_dir is None else str(out_dir), "files": files}

    try:
        rows = patch_files(base, scripts, out_dir, args.jobs, options, getattr(args, "file_timeout", DEFAULT_FILE_TIMEOUT_S), progress=progress, diff=diff, loops=loops)
    except TreeInterrupted as stop:
        print(interrupted_summary(stop, out_dir), file=sys.stderr)
        if args.json:  # stdout stays one JSON document: every file, each as far as it got
            rows = stop.rows + stop.in_hand + [Row(f, NOT_STARTED, None) for f in stop.not_started]
            print(json.dumps(dict(document(rows), interrupted=True, exit_code=EXIT_INTERRUPTED)), flush=True)
        raise
    if args.json:
        print(json.dumps(document(rows)))
        return 1 if any(r.failed for r in rows) else 0
    if diff:  # the diffs on stdout (`| patch -p0`, `| less`), the summary beside them on stderr
        for r in rows:
            if r.diff:
                sys.stdout.write("".join(coloured_review(r.diff.splitlines(True))) if getattr(args, "diff_colour", False) else r.diff)
    if not getattr(args, "quiet", False):
        print_table(rows, sys.stderr if diff else sys.stdout, colour=getattr(args, "colour", False))
    return 1 if any(r.failed for r in rows) else 0



def interrupted_summary(stop: TreeInterrupted, out_dir: Path | None, shown: int = 10) -> str:
    """What a Ctrl-C left behind, in a few lines: files written under `out_dir` (each
    checked before it was, and how that check went), files finished without an output
    (and why), files in hand (nothing written; where each one was stopped), files not
    started; each list names its first `shown` files."""
    written = [r for r in stop.rows if r.written]
    unwritten = [f"{r.file} ({r.status})" for r in stop.rows if not r.written]

    def names(files: list[str]) -> str:
        more = f" and {len(files) - shown} more" if len(files) > shown else ""
        return ", ".join(files[:shown]) + more

    total = len(stop.rows) + len(stop.in_hand) + len(stop.not_started)
    lines = [f"interrupted after {len(stop.rows)} of {total} files"]
    if written:
        lines.append(f"  written under {out_dir}: {len(written)}: {names([r.file for r in written])}")
        for verdict, label in (("ok", "check ok"), ("partial", "check partial"), ("FAILED", "check FAILED"), (None, "not checked")):
            group = [r.file for r in written if r.check == verdict]
            if group:
                lines.append(f"    {label}: {len(group)}: {names(group)}")
    if unwritten:
        lines.append(f"  finished, nothing written: {len(unwritten)}: {names(unwritten)}")
    for phase, said in STOPPED.items():
        group = [r.file for r in stop.in_hand if r.error.startswith(said + ";")]
        if group:
            lines.append(f"  {said}, nothing written: {len(group)}: {names(group)}")
    if stop.not_started:
        lines.append(f"  not started: {len(stop.not_started)}: {names(stop.not_started)}")
    return "\n".join(lines)
