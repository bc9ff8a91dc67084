"""Tree mode: `patch-prefetch records/ --out-dir patched/` patches every matching script.

Every file under the input directory whose name matches `--glob` (default `train*.py`)
is patched in its own process (`--jobs`, default the number of CPUs) exactly as
`patch-prefetch FILE -o OUT --json` would, into the same relative path under
`--out-dir`. A failure in one file (bad input, a failed check, a crash) is a row in the
summary, not the end of the run. Exit code: 0 when no file failed (written, already
patched or nothing to patch), 1 when one or more failed, 2 for bad usage.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from patcher.check import use_forked_smoke

STATUS_BY_CODE = {0: "written", 2: "bad input", 3: "nothing to patch", 4: "check failed"}
FAILED_STATUSES = ("bad input", "check failed", "crash")


@dataclass
class Row:
    """One file of the tree: what the single-file command reported for it.

    file: path relative to the input directory. status: written | already patched |
    nothing to patch | bad input | check failed | crash. applied: features applied.
    skipped: "feature: reason" lines. bytes_before / bytes_after: code bytes of the
    input and of what was written (None when nothing was), counted as `counted_as`
    (wrapper | minified | raw, see patcher.code_size). artifact: {"cap", "before",
    "after", "over"} in bytes where a submission.json gives the record's artifact size,
    else None. check: ok | FAILED | None (not run). error: the one-line error for bad
    input, a crash, or an artifact over the cap.
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

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES


def find_scripts(root: Path, pattern: str, out_dir: Path) -> list[Path]:
    """Files under `root` whose name matches `pattern`, sorted, none under `out_dir`."""
    out = out_dir.resolve()
    found = []
    for path in sorted(root.rglob(pattern)):
        resolved = path.resolve()
        if path.is_file() and out != resolved and out not in resolved.parents:
            found.append(path)
    return found


def patch_one(source: str, target: str, relative: str, options: list[str]) -> Row:
    """Run the single-file command on `source` -> `target`; never raises."""
    from patcher.cli import main

    Path(target).parent.mkdir(parents=True, exist_ok=True)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([source, "-o", target, "--json", *options])
    except Exception as error:  # a bug in the tool: reported for this file, the rest go on
        return Row(relative, "crash", None, error=f"{type(error).__name__}: {error}")
    report = _last_json(out.getvalue())
    if report is None:
        lines = err.getvalue().strip().splitlines()
        message = lines[-1].removeprefix("patch-prefetch: error: ") if lines else None
        return Row(relative, STATUS_BY_CODE.get(code, "crash"), code, error=message)
    status = "already patched" if report.get("already_patched") else STATUS_BY_CODE.get(code, "crash")
    check = report.get("check")
    artifact = report.get("artifact")
    error_lines = err.getvalue().strip().splitlines()
    over = error_lines[-1].removeprefix("patch-prefetch: error: ") if artifact and artifact["over"] and error_lines else None
    return Row(
        relative,
        status,
        code,
        applied=list(report.get("applied", [])),
        skipped=[f"{s['feature']}: {s['reason']}" for s in report.get("skipped", [])],
        bytes_before=report["code_bytes"]["before"],
        bytes_after=report["code_bytes"]["after"] if report.get("written") else None,
        check=None if check is None else ("ok" if check.get("ok") else "FAILED"),
        error=over,
        seconds=report.get("seconds"),
        counted_as=report["code_bytes"].get("counted_as"),
        artifact=artifact,
    )


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def patch_tree(root: Path, out_dir: Path, pattern: str = "train*.py", jobs: int | None = None, options: list[str] | None = None) -> list[Row]:
    """Patch every matching script under `root` into `out_dir` (same relative paths).

    Returns one Row per file, in path order. options: extra single-file arguments
    (`--only`, `--skip`, `--no-check`, `--python`, `--no-rewrap`).
    """
    scripts = find_scripts(root, pattern, out_dir)
    tasks = [(str(p), str(out_dir / p.relative_to(root)), str(p.relative_to(root)), list(options or [])) for p in scripts]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))
    # Worker processes import torch once and fork each file's import smoke from there.
    with ProcessPoolExecutor(max_workers=jobs, initializer=use_forked_smoke) as pool:
        # Largest files first, so that no long one is left running alone at the end.
        by_size = sorted(tasks, key=lambda task: -os.path.getsize(task[0]))
        futures = {task[2]: pool.submit(patch_one, *task) for task in by_size}
        rows = []
        for task in tasks:
            try:
                rows.append(futures[task[2]].result())
            except Exception as error:  # the worker process died
                rows.append(Row(task[2], "crash", None, error=f"{type(error).__name__}: {error}"))
        return rows


def print_table(rows: list[Row], stream) -> None:
    """The summary: one line per file, then skip reasons and errors indented below it."""
    width = max([len(r.file) for r in rows] + [4])
    print(f"{'file':{width}}  {'status':16} {'applied':44} {'counted bytes':>26}  {'artifact (cap 16000000)':>24}  check", file=stream)
    for r in rows:
        size = "" if r.bytes_before is None else (f"{r.bytes_before}->{r.bytes_after}" if r.bytes_after is not None else str(r.bytes_before))
        size += f" {r.counted_as}" if r.counted_as else ""
        art = "-" if r.artifact is None else f"{r.artifact['after']}" + (f" OVER +{r.artifact['over']}" if r.artifact["over"] else "")
        print(f"{r.file:{width}}  {r.status:16} {','.join(r.applied) or '-':44} {size:>26}  {art:>24}  {r.check or '-'}", file=stream)
        for reason in r.skipped:
            if reason.startswith("py310_fstrings: no "):
                continue  # nothing to requote is not news
            print(f"{'':{width}}    skipped {reason}", file=stream)
        if r.error:
            print(f"{'':{width}}    error: {r.error}", file=stream)
    failed = sum(r.failed for r in rows)
    counts = {s: sum(r.status == s for r in rows) for s in dict.fromkeys(r.status for r in rows)}
    print(f"{len(rows)} files: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + (f"; {failed} failed" if failed else ""), file=stream)


def run(args, options: list[str]) -> int:
    """The tree mode of the command line (`args.input` is a directory)."""
    root, out_dir = Path(args.input), Path(args.out_dir)
    rows = patch_tree(root, out_dir, args.glob, args.jobs, options)
    if args.json:
        print(json.dumps({"root": str(root), "out_dir": str(out_dir), "files": [dict(asdict(r), failed=r.failed) for r in rows]}))
    else:
        print_table(rows, sys.stdout)
    return 1 if any(r.failed for r in rows) else 0
