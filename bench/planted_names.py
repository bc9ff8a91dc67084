"""Does `check` catch a misspelt name wherever it stands? Plants one and counts.

    python bench/planted_names.py SCRIPT_OR_DIR... [--json]

For every script (a directory: every `train*.py` under it; a wrapped script's payload)
plants an undefined name twice, with libcst: once as a new last top-level statement
(below the training code of a script that trains at top level, which the import smoke
skips), once as the first statement of the body of the script's last top-level
function (which no import runs). Each planted copy is checked statically
(`patcher.check.undefined.undefined_names`, pyflakes over every scope) and must report
exactly the planted name beside what the unplanted script already reports. Prints one
row per script and the counts caught / planted; exit 1 when one is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import libcst as cst

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patcher.check.undefined import undefined_names  # noqa: E402
from patcher.read.source import SourceError, read_script  # noqa: E402

TOP_LEVEL_NAME = "planted_undefined_top_level"
FUNCTION_NAME = "planted_undefined_in_function"


def plant_top_level(module: cst.Module) -> str:
    """`module`'s code with `print(TOP_LEVEL_NAME)` as its last top-level statement."""
    line = cst.parse_statement(f"print({TOP_LEVEL_NAME})\n")
    return module.with_changes(body=[*module.body, line]).code


def plant_in_function(module: cst.Module) -> str | None:
    """`module`'s code with `print(FUNCTION_NAME)` first in the body of its last
    top-level function; None when it has none."""
    functions = [i for i, s in enumerate(module.body) if isinstance(s, cst.FunctionDef)]
    if not functions:
        return None
    index = functions[-1]
    fn = module.body[index]
    planted = cst.parse_statement(f"print({FUNCTION_NAME})\n")
    if isinstance(fn.body, cst.IndentedBlock):
        body = fn.body.with_changes(body=[planted, *fn.body.body])
    else:  # a one-line suite `def f(): return x`
        body = fn.body.with_changes(body=[cst.Expr(cst.parse_expression(f"print({FUNCTION_NAME})")), *fn.body.body])
    return module.with_changes(body=[*module.body[:index], fn.with_changes(body=body), *module.body[index + 1:]]).code


def measure(path: str) -> dict:
    """{"file", "already": [names], "top_level": bool | None, "in_function": bool | None} or {"file", "error"}."""
    try:
        script = read_script(path)
    except SourceError as error:
        return {"file": path, "error": str(error)}
    module = script.module if script.module is not None else cst.parse_module(script.source)
    before = undefined_names(script.source, path)
    if before is None:
        return {"file": path, "error": "the running Python cannot parse it"}
    already = {u.name for u in before}
    row = {"file": path, "already": sorted(already)}
    for key, name, planted in (("top_level", TOP_LEVEL_NAME, plant_top_level(module)), ("in_function", FUNCTION_NAME, plant_in_function(module))):
        if planted is None:
            row[key] = None
            continue
        found = undefined_names(planted, path) or []
        row[key] = {u.name for u in found} - already == {name}
    return row


def scripts(inputs: list[str]) -> list[str]:
    out = []
    for item in inputs:
        path = Path(item)
        out.extend(sorted(str(p) for p in path.rglob("train*.py")) if path.is_dir() else [str(path)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = [measure(p) for p in scripts(args.inputs)]
    planted = [r[k] for r in rows if "error" not in r for k in ("top_level", "in_function") if r[k] is not None]
    caught = sum(planted)
    if args.json:
        print(json.dumps({"rows": rows, "planted": len(planted), "caught": caught}))
    else:
        for r in rows:
            if "error" in r:
                print(f"{r['file']}: not checked: {r['error']}")
                continue
            marks = ", ".join(f"{k}: {'caught' if r[k] else 'MISSED'}" for k in ("top_level", "in_function") if r[k] is not None)
            already = f"; already undefined: {', '.join(r['already'])}" if r["already"] else ""
            print(f"{r['file']}: {marks}{already}")
        print(f"caught {caught} of {len(planted)} planted names in {sum('error' not in r for r in rows)} scripts")
    return 0 if caught == len(planted) else 1


if __name__ == "__main__":
    sys.exit(main())
