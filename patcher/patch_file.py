"""One script on disk: read, patch, write, count and check it; what the command does for one file.

`patch_file` is shared by the single-file command (patcher/cli.py), which prints its
result, and tree mode (patcher/tree.py), which makes a row of it. It raises
`SourceError` (bad input, unwritable output: one line naming the file) and
`UsageError`; everything else it reports in the `FileResult`.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import libcst as cst

from patcher.code_size import ARTIFACT_CAP, Budget, CountError, Counting, CountSession, MinifyWorker, PendingCount, early_worker, count_patch, counting_of, read_artifact_bytes
from patcher.transforms.features import DEFAULT_FEATURES
from patcher.patch import PatchResult, patch_source
from patcher.families import registry
from patcher.survey.survey import index_of
from patcher.read.source import Script, SourceError, keep_style, output_problem, read_script, render, write_atomic

WRITTEN, ALREADY_PATCHED, NOTHING_TO_PATCH, CHECK_FAILED = "written", "already patched", "nothing to patch", "check failed"
# A check's verdict as reports show it.
VERDICTS = {"ok": "ok", "partial": "partial", "failed": "FAILED"}


class UsageError(Exception):
    """Bad command-line usage (exit code 2), such as a missing output path."""


@dataclass(frozen=True)
class FileOptions:
    """How to patch one file.

    enabled: feature names. rewrap: re-wrap a wrapped input's payload. check: check
    what was written (compile on `python`, import smoke unless not `run_import`, within
    `timeout` seconds). byte_breakdown: count what each feature adds (one more patch
    per applied feature, so off by default; counted anyway when the artifact is over
    the cap, for the error line). in_place: the
    output is the input (a `.orig` backup is kept). producer_toggles: also add
    `TRAIN_PREFETCH_QUEUE`.
    """

    enabled: frozenset[str] = frozenset(DEFAULT_FEATURES)
    rewrap: bool = True
    check: bool = True
    run_import: bool = True
    python: str = "3.10"
    timeout: float = 60.0
    byte_breakdown: bool = False
    in_place: bool = False
    producer_toggles: bool = False


@dataclass
class FileResult:
    """What `patch_file` did to one file.

    status: "written" | "already patched" | "nothing to patch" | "check failed".
    report: the JSON report of the command (input, output, written, applied, skipped,
    notes, code_bytes, wrapped, artifact, seconds, check). patch: the `PatchResult`.
    check: the `CheckResult` of what was written, None when not checked. budget: the
    artifact budget from a submission.json beside the input, None without one.
    original / patched: the unwrapped source before and after (for a diff).
    over_cap: the one-line error when the patched artifact is over the cap, else None.
    """

    status: str
    report: dict
    patch: PatchResult
    original: str
    patched: str
    check: object | None = None
    budget: Budget | None = None
    over_cap: str | None = field(default=None)


@dataclass(frozen=True)
class Staging:
    """How an output reaches its path, for a caller that may kill this process meanwhile
    and must then know whether the output was written (tree mode's workers).

    temp: the temporary file the output is written to before it is renamed into place
    (beside the output; the output's directory is created if needed). tell: called
    with ("checking", None) when the check of the output starts, and with ("staged",
    verdict) once `temp` holds the whole output, just before the rename (verdict: "ok",
    "partial", "FAILED", or None when not checked). Whoever kills this process before
    the rename finds `temp` still there (and removes it); after it, `temp` is gone.
    """

    temp: Path
    tell: Callable[[str, str | None], None]


def patch_file(in_path: Path, out_path: Path | str | None, options: FileOptions, staging: Staging | None = None) -> FileResult:
    """Patch the script at `in_path` into `out_path` ("-": stdout; None: nowhere, as for
    a diff alone, and then nothing is checked). Returns a `FileResult`.

    The output is checked before it is written, and written (renamed into place whole)
    only once everything else is done: a Ctrl-C or an error before that leaves nothing
    of it on disk, and `report["written"]` is True exactly when it was written.
    staging: where the output waits for its rename, and whom to tell (`Staging`).

    Raises SourceError for bad input or an output that cannot be written (nothing is
    written then) and for a site the tool cannot rewrite for the target Python.
    """
    started = time.perf_counter()
    in_path = Path(in_path)
    if options.check and options.run_import and out_path is not None:
        from patcher.check import import_smoke

        import_smoke.prewarm()  # the check's import child starts (and imports torch) while the script is patched
        try:
            return _patch_file(in_path, out_path, options, started, staging)
        finally:
            import_smoke.discard_warm()  # not taken: nothing written, or nothing imported
    return _patch_file(in_path, out_path, options, started, staging)


def _patch_file(in_path: Path, out_path, options: FileOptions, started: float, staging: Staging | None = None) -> FileResult:
    launched: list[MinifyWorker | None] = []  # `early_worker`'s answer, given while the script is parsed
    try:
        with _gc_paused():
            script = read_script(in_path, on_text=lambda text: launched.append(early_worker(text)))
            if options.in_place and (problem := output_problem(in_path)) is not None:
                raise SourceError(in_path, f"cannot patch in place: {problem}; nothing written")
            # One parse (the reader's) and one survey, shared by the count and every transform.
            module = script.module if script.module is not None else cst.parse_module(script.source)
            index = index_of(module)
            counting = counting_of(module, script.wrapped, index)
    except BaseException:
        if launched and launched[0] is not None:
            launched[0].abandon()
        raise
    worker = launched[0] if launched else None
    if worker is not None and counting.how != "minified":
        worker.abandon()
    # One worker counts the input while the script is surveyed and patched, then the
    # patched code, reusing what it minified of the input.
    with counting.session(worker) as session:
        return _patch_parsed(in_path, out_path, options, started, script, module, index, counting, session, staging)


def _patch_parsed(in_path: Path, out_path, options: FileOptions, started: float, script: Script, module: cst.Module, index, counting: Counting, session: CountSession, staging: Staging | None = None) -> FileResult:
    minified = counting.how == "minified"
    before = session.start(script.raw, script.source) if minified else None
    with _gc_paused():
        verdicts = registry.judge(module, index)
        result = patch_source(script.source, set(options.enabled), module=module, verdicts=verdicts, producer_toggles=options.producer_toggles)
    for note in result.skipped:
        if note.unfixable:
            if script.wrapped:
                raise SourceError(in_path, f"payload line {note.line}: {note.reason}; nothing written")
            raise SourceError(in_path, f"{note.reason}; nothing written", note.line)
    text = script.raw
    patched = keep_style(script, result.source)  # the input's line endings and BOM
    # The patched code's count runs in a worker beside what remains (compile, write, check).
    after = session.start(patched, patched) if minified and result.changed else None
    if result.changed:
        _compile_like_input(script, patched)
        text = render(script, patched, rewrap=options.rewrap)
    elif result.already_patched and not options.rewrap:
        text = script.source
    # Written last, once checked and counted: an output on disk is one whose check is done.
    writes = out_path is not None and (result.changed or (result.already_patched and not options.in_place))
    report = {
        "input": str(in_path),
        "output": None if out_path is None else ("-" if out_path == "-" else str(out_path)),
        "written": False,
        "already_patched": result.already_patched,
        "applied": result.applied,
        "skipped": [n.as_dict() for n in result.skipped],
        "notes": [dict(n.as_dict(), applied=n.applied) for n in result.notes],
        "code_bytes": None,
        "switches": list(result.switches),
        "expect": expectations(result.verdicts, set(result.applied)) if result.changed and result.verdicts is not None else [],
        "wrapped": script.wrapped,
    }
    check = None
    if writes and options.check and _forks_smoke():
        # the import smoke forks this process (tree mode): no thread of ours may be running then
        for pending in (before, after):
            if pending is not None:
                _done(pending)
        session.close()
    if writes and options.check:  # the minifier's worker, if any, runs meanwhile
        if staging is not None:
            staging.tell("checking", None)
        check_started = time.perf_counter()
        check = _check_written(text, _written_script(script, result, text, patched), out_path, in_path, options, script)
        started += time.perf_counter() - check_started
    report["code_bytes"] = _counted_bytes(script, result, set(options.enabled), counting, before, options, after, session)
    budget = _budget(in_path, report["code_bytes"])
    savings: dict[str, int] = {}
    if budget is not None and budget.over and result.changed and budget.before <= budget.cap:
        # over the cap by the patch: what each --skip saves is what the user needs to choose, so count it
        savings = _skip_savings(script, result, set(options.enabled), counting, before, options, session, report["code_bytes"])
    report["cap_checked"] = budget is not None
    report["cap_note"] = None if budget is not None else cap_note(in_path, report["code_bytes"], capped=capped_competition(in_path, result.verdicts))
    if budget is not None:
        report["artifact"] = budget.as_dict()
        if budget.over:
            report["artifact"].update(skip_saves=savings, fits_with_skip=_cheapest_fit(budget, savings))
    report["seconds"] = round(time.perf_counter() - started, 3)  # the check's own time is not the patch's
    if check is not None:
        report["check"] = check.as_dict()
    over = budget is not None and budget.over
    if over or (check is not None and not check.ok):
        status = CHECK_FAILED
    elif result.already_patched:
        status = ALREADY_PATCHED
    else:
        status = WRITTEN if result.changed else NOTHING_TO_PATCH
    if writes:
        report["written"] = _write(text, out_path, options.in_place, staging, None if check is None else VERDICTS[check.verdict])
    # said once the output is on disk (or not), so that the line can say which
    over_cap = f"{in_path}: {_over_cap_line(budget, report['code_bytes'], savings, _where_written(report, out_path))}" if over else None
    return FileResult(status, report, result, script.source, patched, check, budget, over_cap)


@contextmanager
def _gc_paused():
    """Python's cyclic garbage collector off for the block. Parsing, surveying and
    patching build and drop hundreds of thousands of libcst nodes, which hold no reference
    cycles (refcounting frees them), and the collections they set off cost about a fifth
    of the patch. It is back on before anything runs the user's code (the check's import
    smoke may fork this process)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _forks_smoke() -> bool:
    """Whether the check's import smoke forks this process (tree mode on Linux)."""
    from patcher.check import import_smoke

    return import_smoke._FORKED_SMOKE


def _done(pending: PendingCount) -> None:
    """Wait for `pending`'s worker (its error, if any, is raised later by `result()`)."""
    try:
        pending.result()
    except CountError:
        pass


def _written_script(script: Script, result, text: str, patched: str) -> Script:
    """The written file as a Script: `text` on disk, its code (`patched`), its wrapper
    if any, and the patched tree (`result.module` prints to exactly `result.source`)."""
    if text == script.raw:
        return script
    module = result.module if patched == result.source else None
    if script.wrapped and text != patched:
        return Script(script.path, text, patched, script.wrapper, module)  # re-wrapped; render checked the round trip
    return Script(script.path, text, text, module=module if text == patched else None)


def _check_written(text: str, written: Script, out_path, in_path: Path, options: FileOptions, original: Script):
    """Run `check` on what is to be written (`written`, whose text is `text`, named as
    `out_path`: the check reads nothing from there; a temporary copy for stdout); when
    it fails, on `original` (the input as read) too."""
    from patcher.check.check import check_file, compare_with_original

    # the output is meant to stand where the input stands: imported with the input's `__file__`
    kwargs = dict(target=options.python, timeout=options.timeout, run_import=options.run_import, as_path=in_path.resolve())
    if out_path != "-":
        checked = check_file(out_path, script=replace(written, path=Path(out_path)), **kwargs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / in_path.name
            copy.write_text(text)
            checked = check_file(copy, script=replace(written, path=copy), **kwargs)
    # A failure: check the input the same way, so the report says who introduced it.
    return compare_with_original(checked, original, **kwargs)


def _compile_like_input(script, patched: str) -> None:
    """Compile the patched source with the running Python; when it does not compile,
    compile the input too: a transform's bug if the input compiles, else the input needs
    a newer Python and the output is no worse (see `check`). Raises RuntimeError for the
    bug. (The input is compiled only then: one compile in the common case.)"""
    bom = "\ufeff"
    try:
        compile(patched.removeprefix(bom), str(script.path), "exec")
        return
    except SyntaxError as error:
        failure = error
    try:
        compile(script.source.removeprefix(bom), str(script.path), "exec")
    except SyntaxError:
        return
    raise RuntimeError(f"patched source does not compile: line {failure.lineno}: {failure.msg}") from failure


def _write(text: str, out_path, in_place: bool, staging: Staging | None = None, verdict: str | None = None) -> bool:
    """Write `text` to `out_path` ("-": stdout), renamed into place whole (`write_atomic`),
    through `staging.temp` when given. Returns True; raises SourceError (nothing written)."""
    if out_path == "-":
        sys.stdout.write(text)
        return True
    temp = on_staged = None
    if staging is not None:
        temp, on_staged = staging.temp, lambda: staging.tell("staged", verdict)
    try:
        if staging is not None:
            Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out_path, text, backup_suffix=".orig" if in_place else None, temp=temp, on_staged=on_staged)
    except FileExistsError:
        backup = f"{out_path}.orig"
        raise SourceError(out_path, f"backup {backup} already exists; not overwritten (move it away to patch in place again); nothing written") from None
    except OSError as error:
        raise SourceError(out_path, f"cannot write output: {error.strerror or error}") from None
    return True


def _counted_bytes(script: Script, result, enabled: set[str], counting: Counting, before: PendingCount | None, options: FileOptions, after: PendingCount | None = None, session: CountSession | None = None) -> dict:
    """The report's `code_bytes`: counted as the record counts them (see patcher.code_size);
    `before` / `after`: the counts of the input and of the patched code, already under way, or None;
    `session`: the worker that counts them, for any further count."""
    try:
        return count_patch(script, result, enabled, counting, options.byte_breakdown, before, rewrap=options.rewrap, after=after, session=session)
    except CountError as error:
        raise SourceError(script.path, f"cannot count code bytes: {error}; nothing written") from None


def _budget(in_path: Path, counted: dict) -> Budget | None:
    """The artifact budget from a submission.json beside the input, or None."""
    reported = read_artifact_bytes(in_path)
    if reported is None:
        return None
    return Budget(ARTIFACT_CAP, reported, reported + counted["after"] - counted["before"])


def expectations(verdicts, applied: set[str]) -> list[str]:
    """The report's "expect" lines (`patcher.expect.expectations`)."""
    from patcher.expect import expectations as lines

    return lines(verdicts, applied)


def capped_competition(in_path: Path, verdicts) -> bool:
    """Whether the script is parameter-golf's, the competition whose code bytes count
    against an artifact cap: a submission.json beside it, a folder of its record tracks
    (`track_10min_16mb`, `track_non_record_16mb`) above it, or a loader of one of its
    families (`Family.competition`; modded-nanogpt's and nanochat's are not)."""
    from patcher.families.registry import UNITS as FAMILY_UNITS

    if (in_path.parent / "submission.json").is_file() or any(part.startswith("track_") and part.endswith("_16mb") for part in in_path.parts):
        return True
    competition = {f.name: f.competition for f in FAMILY_UNITS}
    used = set(verdicts.families.values()) | {v.family for v in verdicts.iterators}
    return any(competition.get(name) == "parameter-golf" for name in used)


def cap_note(in_path: Path, counted: dict, stdin: bool = False, capped: bool = True) -> str | None:
    """The report's line for a parameter-golf script whose artifact size is unknown (no
    submission.json beside it, or none that gives a size): the cap was not checked, and
    what the patch adds to the code bytes (`counted`: the report's `code_bytes`). None
    when the patch adds none, or for a script of a competition without a cap (`capped`
    False: see `capped_competition`). stdin: the script came on stdin (`in_path` is a
    scratch copy)."""
    if counted["after"] <= counted["before"] or not capped:
        return None
    if stdin:
        why = "the script came on stdin, with no submission.json to give the model artifact's size"
    elif in_path.name != "train_gpt.py" and (in_path.parent / "train_gpt.py").is_file():
        why = f"{in_path.name} is a companion of the train_gpt.py beside it, the file the record submits"
    elif (in_path.parent / "submission.json").is_file():
        why = "its submission.json gives no artifact size"
    else:
        why = f"no submission.json beside {in_path.name} to give the model artifact's size"
    return (
        f"cap not checked ({why}): a parameter-golf record's counted code plus its model artifact must stay under "
        f"{ARTIFACT_CAP:,} bytes, and the patch adds {counted['after'] - counted['before']:+d} bytes of code "
        f"({counted['before']} -> {counted['after']}, {counted['counted']})"
    )


def _skip_savings(script: Script, result: PatchResult, enabled: set[str], counting: Counting, before: PendingCount | None, options: FileOptions, session: CountSession, counted: dict) -> dict[str, int]:
    """Counted bytes that `--skip FEATURE` saves, for each applied feature: the
    `--byte-breakdown` costs (`count_patch`'s `by_feature`, the one definition of a
    feature's cost), taken from `counted` (the report's `code_bytes`) when the breakdown
    ran, counted now otherwise. Raises SourceError when a count fails."""
    if counted["by_feature"] or not result.applied:
        return dict(counted["by_feature"])
    return _counted_bytes(script, result, enabled, counting, before, replace(options, byte_breakdown=True), None, session)["by_feature"]


def _cheapest_fit(budget: Budget, savings: dict[str, int]) -> str | None:
    """The feature whose `--skip` brings the artifact under the cap while giving up the
    fewest bytes of the patch, or None when no single one does."""
    fits = [(saved, feature) for feature, saved in savings.items() if budget.after - saved <= budget.cap]
    return min(fits)[1] if fits else None


def _where_written(report: dict, out_path) -> str:
    """Whether and where the output was written, in the words of the over-the-cap line."""
    if not report["written"]:
        return "nothing written"
    return "written to stdout all the same" if out_path == "-" else f"written to {out_path} all the same"


def _over_cap_line(budget: Budget, counted: dict, savings: dict[str, int], written: str) -> str:
    """One line: by how much the artifact is over the cap, what each feature adds (what
    its `--skip` saves, from `savings`), whether the output was `written`, and which
    `--skip` fits, if any."""
    costs = ", ".join(f"{name} {added:+d}" for name, added in savings.items())
    costs = f"; what each feature adds, as its --skip would save it: {costs}" if costs else ""
    already = f", already {budget.before - budget.cap} over before the patch" if budget.before > budget.cap else ""
    line = f"artifact {budget.after} bytes is {budget.over} over the {budget.cap}-byte cap (largest reported {budget.before}{already}; the patch adds {counted['after'] - counted['before']:+d}{costs})"
    line += f"; {written}"
    fit = _cheapest_fit(budget, savings)
    if budget.before > budget.cap:
        advice = "no --skip brings it under: the artifact is over the cap without the patch"
    elif fit is not None:
        advice = f"--skip {fit} ({-savings[fit]:+d} bytes) brings it under, {budget.cap - (budget.after - savings[fit])} bytes to spare"
    elif savings:
        most = max(savings, key=savings.get)
        advice = f"no single --skip brings it under (the most, --skip {most}, saves {savings[most]} bytes): choose features with --only"
    else:
        advice = ""
    return f"{line}; {advice}" if advice else line
