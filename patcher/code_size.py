"""Counted code bytes and the artifact budget, the way each record counts them.

parameter-golf charges code bytes plus the compressed model against a cap of
16,000,000 bytes (`ARTIFACT_CAP`). Records count their code in one of three ways
(DESIGN.md, "What a submission can afford"):

- ``wrapper``: a compressed exec wrapper counts the file itself, as written.
- ``minified``: a script that computes its own code size (records from 2026-04-10
  on define a function that runs ``pyminify --no-rename-locals --no-hoist-literals
  --remove-literal-statements``, then ``lzma.compress`` or, from 2026-04-13 on,
  ``brotli.compress``, then a base85 ``exec`` wrapper) is counted that way, with the
  flags and the compressor the script's own function uses, through python-minifier
  (the library behind ``pyminify``).
- ``raw``: anything else counts its UTF-8 bytes.

`submission.json` beside a script gives the artifact sizes the record reported
(per-seed ``artifact_bytes``, ``bytes_total``, ...); `read_artifact_bytes` takes the
largest, so that the budget check holds for every seed.
"""

from __future__ import annotations

import collections
import json
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import visit, walk
from patcher.survey.index import ScriptIndex

ARTIFACT_CAP = 16_000_000

# The worker that minifies and compresses (a script: it imports nothing of this package).
_WORKER = Path(__file__).with_name("minify_worker.py")
# The flags of the records' own code-size function, when a script names none we can read.
DEFAULT_MINIFY_FLAGS = ("--no-rename-locals", "--no-hoist-literals", "--remove-literal-statements")
# How long a count waits for the worker's next answer (seconds) before it gives up on it:
# counted from the worker's last answer, or from the request when it had nothing to do.
# Measured on 2 cores: the largest record (161 KB) is answered in 1.0-1.4 s from a cold
# start (interpreter, minifier import, every unit minified) and in 0.2-1.3 s when warm;
# the largest fixture (15 KB) in under 0.5 s. 120 s is over 80 times that: enough for a
# machine ten times slower under a load that takes most of its cores, short enough that
# a worker that will never answer does not hold the command for long.
ANSWER_BOUND_S = 120.0
# How often a waiting count looks at the worker (seconds): whether it is stopped.
_LOOK_EVERY_S = 0.5
# How long the worker may take to end once it has closed its output or been killed (seconds).
_END_BOUND_S = 5.0
# Keys of submission.json whose values are whole-artifact sizes in bytes.
_ARTIFACT_KEYS = ("artifact_bytes", "artifact_bytes_max", "artifact_size_bytes", "bytes_total", "total_bytes")


class CountError(Exception):
    """The minifier could not process the source, or its worker ended or stopped answering
    before it counted it (one line)."""


@dataclass(frozen=True)
class Counting:
    """How a script's code is counted.

    how: "wrapper" | "minified" | "raw". minify_flags: the pyminify flags (a tuple of
    str) for "minified", else (). compressor: "lzma" | "brotli", for "minified".
    """

    how: str
    minify_flags: tuple = ()
    compressor: str = "lzma"

    def count(self, file_text: str, source: str) -> int:
        """Counted bytes of a script whose file is `file_text` and whose code is `source`
        (the payload of a wrapper, else the file). Raises CountError when the minifier fails."""
        if self.how == "wrapper":
            return len(file_text.encode("utf-8"))
        if self.how == "minified":
            return minified_wrapper_bytes(source, self.minify_flags, self.compressor)
        return len(source.encode("utf-8"))

    def label(self) -> str:
        """What is counted and how, in the words of the report (text and JSON alike):
        "counted as wrapper: ...", "counted as minified: ..." or "raw: ..."."""
        if self.how == "wrapper":
            return "counted as wrapper: the bytes of the wrapped file"
        if self.how == "minified":
            return f"counted as minified: pyminify {' '.join(self.minify_flags)}, {self.compressor}, base85 exec wrapper"
        return "raw: the UTF-8 bytes of the code"

    def start(self, file_text: str, source: str) -> "PendingCount":
        """`count(file_text, source)` under way: for "minified" in a worker process
        (patcher/minify_worker.py: minifier and compressor), so the caller goes on
        meanwhile, else done now."""
        session = self.session()
        try:
            return session.start(file_text, source)
        finally:
            session.close(wait=False)

    def session(self, worker: "MinifyWorker | None" = None) -> "CountSession":
        """A `CountSession` that counts this way: several counts, one worker process
        (`worker`, when one was launched early; its own otherwise)."""
        return CountSession(self, worker if self.how == "minified" else None)


class PendingCount:
    """A count started by `CountSession.start`; `result()` waits for it and returns the bytes.

    counting: the `Counting` it counts with. For "minified" the count runs in the
    session's worker process (`worker`); a command that fails before it asks for the
    result does not wait for the minifier at exit. `how`, once the result is in: how the
    worker minified ({"units": [minified, reused]} or {"whole": reason}; {} when not minified).
    """

    def __init__(self, counting: Counting, worker: "MinifyWorker | None" = None):
        self.counting = counting
        self.how: dict = {}
        self._worker = worker
        self._value: int | None = None
        self._error: Exception | None = None
        self._done = threading.Event()

    def _finish(self, value: int | None = None, error: Exception | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def result(self) -> int:
        """The counted bytes. Raises CountError when the minifier failed, when its worker
        ended before answering, or when it gave no answer for `ANSWER_BOUND_S` seconds
        (the worker is then killed; a stopped worker is said on stderr meanwhile)."""
        if self._worker is not None and not self._worker._wait(self._done.wait):
            self._worker._give_up()
        self._done.wait()  # set by now: answered, or failed by `_give_up`
        if self._error is not None:
            raise self._error
        return self._value


class MinifyWorker:
    """One process of patcher/minify_worker.py in `--serve` mode, answering counts in the
    order asked, fed by a writer thread and read by a reader thread (daemons both).

    It keeps what it minified of each source, so that the patched code, counted after
    the input, costs the minifier only the units the patch changed
    (`minify_worker.minify_by_units`). It can be launched before the caller knows how
    the script counts (`early_worker`): the process imports the minifier meanwhile.
    """

    def __init__(self):
        command = [sys.executable, str(_WORKER), "--serve"]
        # Its stderr goes to a file, not a pipe: a pipe nobody reads while it works fills
        # at 64 KB (warnings on the script's code, one per line) and blocks it for good.
        self._stderr = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._requests: queue.Queue = queue.Queue()
        self._waiting: collections.deque = collections.deque()
        self._lock = threading.Lock()  # `_waiting`, `_ended` and `_since`, between callers and the reader
        self._ended: str | None = None  # why the process answers no more, once it does not
        self._since = time.monotonic()  # its last answer, or the request it got when it had nothing to do
        self._said_stopped = False
        self._threads = [
            threading.Thread(target=self._write, name="count-minified-in", daemon=True),
            threading.Thread(target=self._read, name="count-minified-out", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def count(self, counting: Counting, source: str) -> PendingCount:
        """The minified count of `source` with `counting`'s flags and compressor, under way.
        Asked of a worker that has ended, it fails at once (`result` raises CountError)."""
        pending = PendingCount(counting, self)
        with self._lock:
            if self._ended is not None:
                pending._finish(error=CountError(self._ended))
                return pending
            if not self._waiting:
                self._since = time.monotonic()
            self._waiting.append(pending)
        request = {"source": source, "compressor": counting.compressor, "flags": list(counting.minify_flags)}
        self._requests.put(json.dumps(request) + "\n")
        return pending

    def guess(self, source: str) -> None:
        """Let the process minify the units of `source` before any count is asked, with the
        flags it guesses (`minify_worker.speculate`), while nothing else waits."""
        self._requests.put(json.dumps({"guess": source, "default_flags": list(DEFAULT_MINIFY_FLAGS)}) + "\n")

    def close(self, wait: bool = True) -> None:
        """No more counts: the process ends when it has answered those asked. With `wait`,
        return only once it has and the threads have ended: its answers are waited for
        as `PendingCount.result` waits (given up after `ANSWER_BOUND_S` seconds without
        one, the counts owed then failing), its end for `_END_BOUND_S` seconds (then it is
        killed: nothing is lost, it owes nothing)."""
        self._requests.put(None)
        if not wait:
            return
        with self._lock:
            last = self._waiting[-1] if self._waiting else None  # answered in order: the last is answered last
        if last is not None and not self._wait(last._done.wait):
            self._give_up()
        if not self._threads_ended(_END_BOUND_S):
            self._proc.kill()
            self._threads_ended(_END_BOUND_S)

    def abandon(self) -> None:
        """End the process now, its counts unanswered (a command that failed, or a script
        that turned out not to be counted minified, does not wait for the minifier). Its
        threads end with it (a tree-mode worker may fork next, which wants none running)."""
        self._end(f"the minifier's worker (pid {self._proc.pid}) was ended: its counts were no longer wanted")
        self._requests.put(None)
        self._proc.kill()
        self._threads_ended(_END_BOUND_S)

    def _threads_ended(self, seconds: float) -> bool:
        """Whether both threads end within `seconds` (each within it, in turn)."""
        for thread in self._threads:
            thread.join(seconds)
        return not any(thread.is_alive() for thread in self._threads)

    def _wait(self, done) -> bool:
        """Call `done(seconds)` (a wait that returns whether what it waits for happened)
        until it returns True, or until the worker has given no answer for
        `ANSWER_BOUND_S` seconds: False then. Says once on stderr that the worker is
        stopped (SIGSTOP), when it is: it answers nothing until it is continued."""
        while not done(_LOOK_EVERY_S):
            if not self._said_stopped and _stopped(self._proc.pid):
                self._said_stopped = True
                print(f"patch-prefetch: the minifier's worker (pid {self._proc.pid}) is stopped; waiting up to {ANSWER_BOUND_S:g} s for its count of the code bytes (kill -CONT {self._proc.pid} lets it go on)", file=sys.stderr, flush=True)
            if time.monotonic() - self._since > ANSWER_BOUND_S:
                return False
        return True

    def _give_up(self) -> None:
        """Kill the process: it gave no answer for `ANSWER_BOUND_S` seconds. The counts it
        owes, and any asked later, fail with one line saying so."""
        how = "it is stopped" if _stopped(self._proc.pid) else "it runs but does not answer"
        self._end(f"no answer from the minifier's worker (pid {self._proc.pid}) in {ANSWER_BOUND_S:g} s ({how}; a 160 KB script takes it about 2 s); ended it")
        self._proc.kill()

    def _end(self, why: str) -> None:
        """No more answers: each count still waiting, and any asked later, fails with `why`
        (the first reason given stands)."""
        with self._lock:
            if self._ended is None:
                self._ended = why
            waiting, self._waiting = self._waiting, collections.deque()
        for pending in waiting:
            pending._finish(error=CountError(self._ended))

    def _write(self) -> None:
        stdin = self._proc.stdin
        try:
            while (request := self._requests.get()) is not None:
                stdin.write(request.encode("utf-8"))
                stdin.flush()
        except OSError:
            pass  # the process died; the reader reports it
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    def _read(self) -> None:
        try:
            for line in self._proc.stdout:
                try:
                    reply = json.loads(line)
                except ValueError:
                    continue  # not the worker's: something the minifier printed
                with self._lock:  # taken and finished at once: a count given up finds none half-answered
                    if not self._waiting or not isinstance(reply, dict):
                        continue  # not an answer of ours (a JSON line the minifier printed)
                    pending = self._waiting.popleft()
                    self._since = time.monotonic()
                    if "error" in reply:
                        pending._finish(error=CountError(f"pyminify failed: {reply['error']}"))
                    else:
                        pending.how = {k: v for k, v in reply.items() if k in ("units", "whole")}
                        pending._finish(reply["bytes"])
        finally:  # at the end of its output, or a reply this reader could not take
            try:
                self._end(self._ending())
            finally:
                self._stderr.close()

    def _ending(self) -> str:
        """How the process ended, once its output has: one line for the counts it did not answer."""
        who = f"the minifier's worker (pid {self._proc.pid})"
        try:
            code = self._proc.wait(_END_BOUND_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return f"{who} closed its output without ending; killed it"
        if code < 0:
            name = _signal_name(-code)
            why = " (out of memory, or killed by another process)" if -code == signal.SIGKILL else ""
            return f"{who} was killed by {name}{why} before it answered"
        if code:
            return f"pyminify failed: {who} exited with code {code}: {_last_line(self._stderr)}"
        return f"{who} ended before it answered"


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (by SIGSTOP, Ctrl-Z or a debugger). Linux: reads
    /proc; False elsewhere or when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _last_line(file) -> str:
    """The last non-empty line of `file` (the worker's stderr), read from its last 4 KB."""
    try:
        size = file.seek(0, 2)
        file.seek(max(0, size - 4096))
        lines = file.read().decode("utf-8", "replace").strip().splitlines()
    except (OSError, ValueError):
        lines = []
    return lines[-1] if lines else "no message"


def early_worker(text: str) -> MinifyWorker | None:
    """A `MinifyWorker` launched now, for a script whose text `text` names "pyminify" (so it
    may count as minified; `counting_of` decides, on the parsed code), else None.

    Launched before the script is parsed, the worker imports the minifier and starts on
    the script's units with the flags it guesses from the text (`MinifyWorker.guess`);
    the count asked once `counting_of` has decided reuses them if the guess was right."""
    if "pyminify" not in text:
        return None
    worker = MinifyWorker()
    worker.guess(text)
    return worker


class CountSession:
    """Counts of several versions of one script with one `Counting`, in the order started.

    For "minified" they go to one `MinifyWorker` (given, e.g. launched early, or
    launched on the first count), so that each count reuses what the ones before it
    minified; other ways of counting are done at once. Used as a context manager, the
    session waits for its worker on success and abandons it on an exception.
    """

    def __init__(self, counting: Counting, worker: MinifyWorker | None = None):
        self.counting = counting
        self._worker = worker

    def start(self, file_text: str, source: str) -> PendingCount:
        """The count of a script whose file is `file_text` and whose code is `source`, under
        way (see `Counting.start`)."""
        if self.counting.how != "minified":
            pending = PendingCount(self.counting)
            pending._finish(self.counting.count(file_text, source))
            return pending
        if self._worker is None:
            self._worker = MinifyWorker()
        return self._worker.count(self.counting, source)

    def close(self, wait: bool = True) -> None:
        """See `MinifyWorker.close`. A count started after launches a new worker."""
        if self._worker is not None:
            self._worker.close(wait)
            self._worker = None

    def abandon(self) -> None:
        """See `MinifyWorker.abandon`."""
        if self._worker is not None:
            self._worker.abandon()

    def __enter__(self) -> "CountSession":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()


def counting_of(module: cst.Module, wrapped: bool, index: ScriptIndex | None = None) -> Counting:
    """How the record whose code is `module` counts its code size.

    A wrapped file counts as "wrapper". A module with a function that names
    "pyminify" (the record's own code-size function) counts as "minified", with the
    `--` flags of the command list in that function and the compressor it calls
    (`brotli.compress` under any import alias, else lzma). Anything else is "raw".
    index: the survey's `ScriptIndex` of `module` (`Survey.collector`), so that the
    module is not walked again; without it one pass is made here.
    """
    if wrapped:
        return Counting("wrapper")
    if index is None:
        index = ScriptIndex()
        visit(module, index)
    # A literal without a backslash reads "pyminify" only if its text holds it.
    function = next((f for s, f in index.strings if f is not None and ("pyminify" in s.value or "\\" in s.value) and s.evaluated_value == "pyminify"), None)
    if function is None:
        return Counting("raw")
    brotli_names = {a.asname.name.value if a.asname else "brotli" for n in index.imports for a in n.names if cst.Module([]).code_for_node(a.name) == "brotli"}
    nodes = list(walk(function))
    flags = ()
    for node in nodes:
        if isinstance(node, cst.List):
            found = tuple(e.value.evaluated_value for e in node.elements if isinstance(e.value, cst.SimpleString) and e.value.evaluated_value.startswith("--"))
            if found:
                flags = found
                break
    brotli = any(m.matches(n, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("compress")))) and n.func.value.value in brotli_names for n in nodes)
    return Counting("minified", flags or DEFAULT_MINIFY_FLAGS, "brotli" if brotli else "lzma")


def minified_wrapper_bytes(source: str, flags: tuple = DEFAULT_MINIFY_FLAGS, compressor: str = "lzma") -> int:
    """Size in bytes of ``pyminify FLAGS`` -> ``lzma.compress`` (or ``brotli.compress(quality=11)``)
    -> base85 exec wrapper of `source`, as the records' own code-size function computes
    it (in a worker process, patcher/minify_worker.py). Raises CountError (one line)."""
    with Counting("minified", tuple(flags), compressor).session() as session:
        return session.start(source, source).result()


def read_artifact_bytes(script_path: str | Path) -> int | None:
    """The largest artifact size (bytes) in the `submission.json` beside `script_path`.

    Takes every value under a key of `_ARTIFACT_KEYS` at any depth (per-seed sizes or a
    total). Returns None when there is no such file, it is not JSON, it gives no size,
    or the script is a companion of the record's `train_gpt.py` (a readable copy such
    as `train_gpt_human.py` beside the wrapped file the record submits).
    """
    script_path = Path(script_path)
    if script_path.name != "train_gpt.py" and (script_path.parent / "train_gpt.py").is_file():
        return None
    path = script_path.parent / "submission.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found: list[int] = []

    def visit(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _ARTIFACT_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool):
                    found.append(int(value))
                else:
                    visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(data)
    return max(found) if found else None


@dataclass
class Budget:
    """The artifact budget of one patched record.

    cap: bytes allowed (16,000,000). before: the largest reported artifact size (bytes);
    after: before plus the counted code bytes the patch adds; over: bytes past the
    cap (0 when it fits).
    """

    cap: int
    before: int
    after: int

    @property
    def over(self) -> int:
        return max(0, self.after - self.cap)

    def as_dict(self) -> dict:
        return {"cap": self.cap, "before": self.before, "after": self.after, "over": self.over}


def count_patch(script, result, enabled: set[str], counting: Counting, breakdown: bool = True, before: PendingCount | None = None, rewrap: bool = True, after: PendingCount | None = None, session: CountSession | None = None) -> dict:
    """Counted code bytes before and after a patch, and what each applied feature adds.

    Takes the `Script` read from disk, its `PatchResult`, the enabled features and the
    script's `Counting`; `before`, when given, is the count of the input already under
    way (`session.start(script.raw, script.source)`, started before the patch so that
    the minifier runs while the script is patched); `after`, likewise, the count of the
    patched code as written (`keep_style(script, result.source)`), started early by the
    caller so that it runs beside the check; `session`, the `CountSession` they run in,
    which counts the rest too (a new one when None or of another way of counting). A wrapped script is counted
    re-wrapped (what the record submits); with `rewrap` False (`--no-rewrap`, which
    writes the payload as plain source) its code is counted raw, before and after. With
    `breakdown`, each applied feature's cost (`by_feature[f]`): what `--skip f` saves,
    the count of the whole patch minus the count of the patch without `f` (the one
    definition, used by `--byte-breakdown` and by the over-the-cap line alike);
    `by_feature_raw[f]`, the same in raw UTF-8 bytes of the code, which says why a
    counted cost is negative (compression, or a runtime cut smaller with the feature);
    `shared`, the total minus the features' own costs: runtime that two features use
    and only skipping both removes (negative where a skip removes more than its own,
    `env_toggles` taking every feature's switches). One more patch and count per
    applied feature (counted as minified, the worker minifies only the units each of
    those changes). Without it `by_feature` and `by_feature_raw` are {} and `shared` 0.
    Returns {"before", "after", "counted_as", "counted", "by_feature",
    "by_feature_raw", "shared"}: bytes, `counted_as` "wrapper" | "minified" | "raw" and
    `counted` its `Counting.label()`. Raises CountError when the minifier fails.
    """
    if counting.how == "wrapper" and not rewrap:
        counting = Counting("raw")
    if session is not None and session.counting == counting:
        return _count_patch(script, result, enabled, counting, breakdown, before, after, session)
    with counting.session() as session:
        return _count_patch(script, result, enabled, counting, breakdown, before, after, session)


def _count_patch(script, result, enabled: set[str], counting: Counting, breakdown: bool, before, after, session: CountSession) -> dict:
    from patcher.patch import patch_source
    from patcher.read.source import SourceError, keep_style, render
    from patcher.transforms.features import FEATURES

    def start(source: str) -> PendingCount:
        source = keep_style(script, source)  # as written: the input's line endings and BOM
        file_text = render(script, source, rewrap=True) if counting.how == "wrapper" else source
        return session.start(file_text, source)

    if after is not None and after.counting != counting:
        after = None
    if counting.how == "wrapper" and result.changed and after is None:
        try:
            after = start(result.source)
        except SourceError:  # no wrapper can hold the patched payload (`--no-rewrap` only): count the code
            counting = Counting("raw")
            session = counting.session()
    if before is None or before.counting != counting:
        before = session.start(script.raw, script.source)
    if not result.changed:
        return {"before": before.result(), "after": before.result(), "counted_as": counting.how, "counted": counting.label(), "by_feature": {}, "by_feature_raw": {}, "shared": 0}
    after = start(result.source) if after is None else after
    steps = []
    if breakdown:
        order = sorted(result.applied, key=lambda f: (f == "env_toggles", FEATURES.index(f)))
        for feature in order:  # each count is queued before the next patch is made
            without = patch_source(script.source, set(enabled) - {feature}, module=result.survey.module, verdicts=result.verdicts, producer_toggles=result.producer_toggles).source
            steps.append((feature, start(without), without))
    whole = after.result()
    raw = len(keep_style(script, result.source).encode())
    by_feature = {feature: whole - pending.result() for feature, pending, _ in steps}
    by_feature_raw = {feature: raw - len(keep_style(script, without).encode()) for feature, _, without in steps}
    shared = whole - before.result() - sum(by_feature.values()) if steps else 0
    return {"before": before.result(), "after": whole, "counted_as": counting.how, "counted": counting.label(), "by_feature": by_feature, "by_feature_raw": by_feature_raw, "shared": shared}


def cost_lines(counted: dict) -> list[str]:
    """The `--byte-breakdown` lines of a report's `code_bytes` (`count_patch`): one per
    feature, `name +N` (what `--skip name` saves), with the reason where a feature that
    adds code costs a negative count, then the shared remainder, if any, so that the
    lines add up to the total."""
    lines = []
    for name, added in counted["by_feature"].items():
        raw = counted.get("by_feature_raw", {}).get(name)
        why = ""
        if added < 0 and raw is not None:
            why = (f"  (it adds {raw:+d} raw bytes; {counted['counted']} compresses the patch with it smaller)" if raw >= 0
                   else f"  (the injected runtime, cut to the options chosen, is smaller with it: {raw:+d} raw bytes)")
        lines.append(f"{name:15} {added:+d}{why}")
    if counted.get("shared"):
        what = "runtime two features use: only skipping both removes it" if counted["shared"] > 0 else "counted in two features' costs above: skipping either removes it"
        lines.append(f"{'shared':15} {counted['shared']:+d}  ({what})")
    return lines
