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

import base64
import json
import lzma
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk

ARTIFACT_CAP = 16_000_000

# The wrapper a minifying record builds around its compressed code (its own bytes count).
_MINIFIED_WRAPPER = {
    "lzma": (b'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("', b'")))\n'),
    "brotli": (b'import brotli as B,base64 as A\nexec(B.decompress(A.b85decode("', b'")))\n'),
}
# The flags of the records' own code-size function, when a script names none we can read.
DEFAULT_MINIFY_FLAGS = ("--no-rename-locals", "--no-hoist-literals", "--remove-literal-statements")
# Keys of submission.json whose values are whole-artifact sizes in bytes.
_ARTIFACT_KEYS = ("artifact_bytes", "artifact_bytes_max", "artifact_size_bytes", "bytes_total", "total_bytes")


class CountError(Exception):
    """The minifier could not process the source (one line)."""


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


def counting_of(module: cst.Module, wrapped: bool) -> Counting:
    """How the record whose code is `module` counts its code size.

    A wrapped file counts as "wrapper". A module with a function that names
    "pyminify" (the record's own code-size function) counts as "minified", with the
    `--` flags of the command list in that function and the compressor it calls
    (`brotli.compress` under any import alias, else lzma). Anything else is "raw".
    """
    if wrapped:
        return Counting("wrapper")
    brotli_names = {a.asname.name.value if a.asname else "brotli" for n in walk(module) if isinstance(n, cst.Import) for a in n.names if cst.Module([]).code_for_node(a.name) == "brotli"}
    for function in (n for n in walk(module) if isinstance(n, cst.FunctionDef)):
        nodes = list(walk(function))
        if not any(isinstance(n, cst.SimpleString) and n.evaluated_value == "pyminify" for n in nodes):
            continue
        flags = ()
        for node in nodes:
            if isinstance(node, cst.List):
                found = tuple(e.value.evaluated_value for e in node.elements if isinstance(e.value, cst.SimpleString) and e.value.evaluated_value.startswith("--"))
                if found:
                    flags = found
                    break
        brotli = any(m.matches(n, m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("compress")))) and n.func.value.value in brotli_names for n in nodes)
        return Counting("minified", flags or DEFAULT_MINIFY_FLAGS, "brotli" if brotli else "lzma")
    return Counting("raw")


def minified_wrapper_bytes(source: str, flags: tuple = DEFAULT_MINIFY_FLAGS, compressor: str = "lzma") -> int:
    """Size in bytes of ``pyminify FLAGS`` -> ``lzma.compress`` (or ``brotli.compress(quality=11)``)
    -> base85 exec wrapper of `source`, as the records' own code-size function computes
    it. Raises CountError (one line)."""
    command = [sys.executable, "-m", "python_minifier", *flags, "-"]
    done = subprocess.run(command, input=source.encode("utf-8"), capture_output=True)
    if done.returncode != 0:
        last = (done.stderr.decode("utf-8", "replace").strip().splitlines() or ["no message"])[-1]
        raise CountError(f"pyminify failed: {last}")
    if compressor == "brotli":
        import brotli

        compressed = brotli.compress(done.stdout, quality=11)
    else:
        compressed = lzma.compress(done.stdout)
    prefix, suffix = _MINIFIED_WRAPPER[compressor]
    return len(prefix) + len(base64.b85encode(compressed)) + len(suffix)


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


def count_patch(script, result, enabled: set[str], counting: Counting, breakdown: bool = True) -> dict:
    """Counted code bytes before and after a patch, and what each applied feature adds.

    Takes the `Script` read from disk, its `PatchResult`, the enabled features and the
    script's `Counting`. A wrapped script is counted re-wrapped (what the record
    submits), whatever `--no-rewrap` wrote. Features are charged in the order of
    `FEATURES`, `env_toggles` last: `by_feature[f]` is the count of the patch with the
    features up to `f` minus the count up to the one before, so a runtime piece shared by
    two features is charged to the first and the parts add up to the total (with
    `breakdown` False, `by_feature` is {}: one patch per feature less). Returns
    {"before", "after", "counted_as", "by_feature"} in bytes. Raises CountError when the
    minifier fails.
    """
    from patcher.patch import patch_source
    from patcher.read.source import SourceError, keep_style, render
    from patcher.transforms.features import FEATURES

    def counted(source: str) -> int:
        source = keep_style(script, source)  # as written: the input's line endings and BOM
        file_text = render(script, source, rewrap=True) if counting.how == "wrapper" else source
        return counting.count(file_text, source)

    after = None
    if counting.how == "wrapper" and result.changed:
        try:
            after = counted(result.source)
        except SourceError:  # no wrapper can hold the patched payload (`--no-rewrap` only): count the code
            counting = Counting("raw")
    before = counting.count(script.raw, script.source)
    if not result.changed:
        return {"before": before, "after": before, "counted_as": counting.how, "by_feature": {}}
    after = counted(result.source) if after is None else after
    if not breakdown:
        return {"before": before, "after": after, "counted_as": counting.how, "by_feature": {}}
    order = sorted(result.applied, key=lambda f: (f == "env_toggles", FEATURES.index(f)))
    by_feature, previous, so_far = {}, before, set(enabled) - set(result.applied)
    for feature in order:
        so_far.add(feature)
        if feature == order[-1]:
            now = after
        else:
            now = counted(patch_source(script.source, so_far, module=result.survey.module, surveyed=result.survey, producer_toggles=result.producer_toggles).source)
        by_feature[feature], previous = now - previous, now
    return {"before": before, "after": after, "counted_as": counting.how, "by_feature": by_feature}
