"""What a patch costs a submission: counted code bytes per script, as each record counts them.

    python bench/code_bytes.py SCRIPT_OR_DIR... [--only FEATURE ...] [--with FEATURE ...] [--jobs N] [--json]

For every script (a directory: every `train*.py` under it) prints how its code is
counted (wrapper | minified | raw, see patcher/code_size.py), the counted bytes before
and after the default patch (or the features given), the bytes added, the ratio
after/before, what each applied feature costs (what its `--skip` saves, and the shared
rest), and, where a `submission.json` beside
the script gives artifact sizes, the largest artifact after the patch and the room
left under the 16,000,000-byte cap (negative: over). Scripts the patch does not change
are listed with their reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher.code_size import ARTIFACT_CAP, count_patch, counting_of, read_artifact_bytes  # noqa: E402
from patcher.patch import features_from, patch_source  # noqa: E402
from patcher.read.source import SourceError, read_script  # noqa: E402


def measure(path: str, only: list[str] | None, extra: list[str] | None) -> dict:
    """One script's row: {"file", "counted_as", "before", "after", "added", "by_feature", "artifact_after", "room"} (bytes), or {"file", "error"}."""
    try:
        script = read_script(path)
    except SourceError as error:
        return {"file": path, "error": str(error)}
    enabled = features_from(only, None, extra)
    result = patch_source(script.source, enabled, module=script.module)
    if not result.changed:
        return {"file": path, "error": "nothing to patch: " + "; ".join(n.reason for n in result.skipped if n.feature == "train_prefetch")}
    counted = count_patch(script, result, enabled, counting_of(result.survey.module, script.wrapped))
    added = counted["after"] - counted["before"]
    artifact = read_artifact_bytes(path)
    row = {"file": path, **counted, "added": added, "lines_added": result.source.count("\n") - script.source.count("\n")}
    if artifact is not None:
        row["artifact_after"] = artifact + added
        row["room"] = ARTIFACT_CAP - artifact - added
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--only", action="append")
    parser.add_argument("--with", dest="extra", action="append")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    files = []
    for name in args.paths:
        path = Path(name)
        files += sorted(str(p) for p in path.rglob("train*.py")) if path.is_dir() else [str(path)]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        rows = list(pool.map(measure, files, [args.only] * len(files), [args.extra] * len(files)))
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len(Path(r["file"]).parent.name) for r in rows)
    print(f"{'record':{width}}  {'counted':8} {'before':>8} {'after':>8} {'added':>6} {'ratio':>7} {'lines':>5} {'room':>8}  added per feature")
    for r in rows:
        name = Path(r["file"]).parent.name
        if "error" in r:
            print(f"{name:{width}}  {r['error']}")
            continue
        room = str(r["room"]) if "room" in r else "-"
        parts = " ".join(f"{k}:{v:+d}" for k, v in [*r["by_feature"].items(), *([("shared", r["shared"])] if r.get("shared") else [])])
        print(f"{name:{width}}  {r['counted_as']:8} {r['before']:8d} {r['after']:8d} {r['added']:+6d} {r['after'] / r['before']:7.4f} {r['lines_added']:5d} {room:>8}  {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
