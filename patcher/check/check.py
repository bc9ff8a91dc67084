"""Pre-submission checks: compile under a real target Python, import smoke, self-containedness.

`check_file(path)` answers three questions about a training script (plain, or the
payload inside a compressed exec wrapper, see `patcher.read.source`):

1. **Does it compile on the target Python?** `compile_source` (patcher/check/compile_check.py) runs a real interpreter
   (found by `find_python`, patcher/check/interpreters.py, Python 3.10 by default) on the code. The payload of a
   wrapped script is compiled as well as the wrapper, because the wrapper compiles on
   3.10 even when its payload does not (DESIGN.md, "What existing checkers miss").
   A Python 3.12-only f-string (PEP 701) is named, with its line and column and a fix.
   With no such interpreter installed, a grammar check under the running Python stands
   in, and says so.
2. **Does it import?** `import_smoke` (patcher/check/import_smoke.py) loads the code in a child process under a module
   name other than `__main__`, registered in `sys.modules` before it runs (the dataclass
   trap), with missing GPU-only packages (`flash_attn_interface`, `triton`, ...) replaced by
   stubs that are reported. Of a script that trains at top level (modded-nanogpt) every
   definition runs, from the whole file, and each statement that does work is skipped and
   named, so importing it never starts training; such a run is "partial", never "ok".
3. **Are all its names defined?** `undefined_names` (patcher/check/undefined.py): pyflakes,
   statically, over every scope of the file, function bodies and skipped training code included.
4. **Is it one file?** `self_contained_warnings` (patcher/check/self_contained.py): warnings for imports of modules that sit beside the script and
   for code files read through a path built from `__file__`.

Nothing here executes the script in this process; all code search uses libcst.
"""

from __future__ import annotations

import os
import platform
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping

import libcst as cst

from patcher.check.compile_check import EMPTY, CompileResult, compile_source
from patcher.check.import_smoke import ImportResult, import_smoke, kill_running, runnable_part
from patcher.check.interpreters import DEFAULT_TARGET, find_python
from patcher.check.self_contained import self_contained_findings, self_contained_warnings
from patcher.check.undefined import UndefinedName, undefined_names
from patcher.read.source import Script, code_bytes, read_script
from patcher.transforms.py310_fstrings import requote

__all__ = [
    "CompileResult",
    "ImportResult",
    "CheckResult",
    "find_python",
    "compile_source",
    "import_smoke",
    "check_file",
    "runnable_part",
    "undefined_names",
    "self_contained_warnings",
]

_BOM = "\ufeff"
WARNED_TOO = "(the original too)"


# --------------------------------------------------------------------------- results


@dataclass
class CheckResult:
    """Everything `check_file` found about one script.

    file: the path as given. compile: the code (the payload for a wrapped script).
    wrapper_compile: the wrapper file itself, None for a plain script. imports: the
    import smoke test, None when not run. undefined: every use of an undefined name
    (pyflakes), None when the code could not be parsed for it. code_bytes: size of the
    file as written, in bytes (what counts toward the artifact cap). warnings: one line
    each, marked "(the original too)" where the script it was patched from has it too
    (`compare_with_original`). original: for a patched script that failed, the same
    check of the script it was patched from, else None. warning_keys: what each of
    `warnings` is about, without its line (`self_contained_findings`).
    """

    file: str
    compile: CompileResult
    wrapper_compile: CompileResult | None
    imports: ImportResult | None
    code_bytes: int
    warnings: list[str] = field(default_factory=list)
    undefined: list[UndefinedName] | None = field(default_factory=list)
    original: "CheckResult | None" = None
    warning_keys: list[tuple[str, str]] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """Nothing failed: compiles (payload and wrapper), imports where run, no undefined name.
        True for a partial check too (see `verdict`)."""
        wrapper_ok = self.wrapper_compile is None or self.wrapper_compile.ok
        import_ok = self.imports is None or self.imports.ok
        return self.compile.ok and wrapper_ok and import_ok and not self.undefined

    @property
    def skipped(self) -> list[str]:
        """What the check did not cover although it was asked to, one phrase each."""
        out = []
        if self.compile.ok and not self.compile.python:
            out.append("no real target interpreter: grammar check under the running Python only")
        if self.imports is not None and self.imports.partial:
            out.append(f"import smoke ran {self.imports.ran} of {self.imports.total} top-level statements")
        if self.undefined is None:
            out.append("undefined names not checked: the running Python cannot parse the code")
        return out

    @property
    def verdict(self) -> str:
        """"failed" (something failed), "partial" (nothing failed, but `skipped` is not
        empty: never reported as ok), or "ok"."""
        if not self.ok:
            return "failed"
        return "partial" if self.skipped else "ok"

    @property
    def summary(self) -> str:
        """The verdict in words: "ok", "partial: import smoke ran 40 of 52 top-level
        statements", "FAILED"; a failure says whether the original fails the same way."""
        if self.verdict == "partial":
            return "partial: " + "; ".join(self.skipped)
        if self.verdict == "ok":
            return "ok"
        if self.original is None:
            return "FAILED"
        return "FAILED (the original fails too)" if not self.original.ok else "FAILED (introduced by the patch: the original passes)"

    def as_dict(self) -> dict:
        """JSON-ready dict: file, ok, verdict, skipped, compile, wrapper_compile, import,
        undefined, code_bytes, warnings, original_ok (None unless compared)."""
        return {
            "file": self.file,
            "ok": self.ok,
            "verdict": self.verdict,
            "skipped": self.skipped,
            "undefined": None if self.undefined is None else [u.as_dict() for u in self.undefined],
            "original_ok": None if self.original is None else self.original.ok,
            "compile": self.compile.as_dict(),
            "wrapper_compile": self.wrapper_compile.as_dict() if self.wrapper_compile else None,
            "import": self.imports.as_dict() if self.imports else None,
            "code_bytes": self.code_bytes,
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- check_file


def check_file(
    path: str | os.PathLike,
    target: str = DEFAULT_TARGET,
    timeout: float = 60.0,
    run_import: bool = True,
    script: Script | None = None,
    as_path: str | os.PathLike | None = None,
) -> CheckResult:
    """Check one training script: compile on `target`, import smoke, one-file warnings.

    path: a plain or wrapped script (`patcher.read.source.read_script`). target: as for
    `find_python`. timeout: seconds for the import smoke test. run_import: False skips
    it (`imports` is None). For a wrapped script the payload is compiled (`compile`,
    payload lines) and the wrapper file too (`wrapper_compile`). The import runs only
    when the running Python can compile the code; otherwise `imports.ok` is False and
    its error says why. Raises `SourceError` for a file `read_script` rejects (missing,
    empty, binary, unparsable, corrupt wrapper, exec(open(other).read()) only).
    script: the file as already read (`patcher.read.source.Script`, e.g. what the main job
    just wrote and round-tripped), so that it is not read and unwrapped again; its
    `module`, when set, is used instead of parsing `source` again. as_path: where the
    script is meant to stand (the input of a patch); the import smoke runs it with that
    `__file__`. Default: `path` itself.
    """
    script = read_script(path) if script is None else script
    known = {script.source: script.module} if script.module is not None else EMPTY
    name = str(path)
    # The compiles on the target Python and the import smoke are subprocesses that wait
    # on nothing of each other: they run on threads beside the in-process analyses below,
    # except where the import smoke forks this process (tree mode), which must have no
    # other thread running then.
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="check") as pool:
        run = pool.submit if not _forked_smoke() else _now
        try:
            compiled = run(compile_source, script.source, name, target, known)
            wrapper = run(compile_source, script.raw, name, target) if script.wrapped else None
            imports = run(_import_if_compiles, script.source, name, timeout, known, path if as_path is None else as_path) if run_import else None
            found = self_contained_findings(script.source, script.path, script.wrapped, known)
            undefined = undefined_names(script.source, name)
            compiled, wrapper, imports = (None if job is None else job.result() for job in (compiled, wrapper, imports))
        except BaseException:
            # Ctrl-C here: the pool's exit waits for its threads, and the import smoke's
            # thread waits on its child until the timeout; end the child so it returns now.
            kill_running()
            raise
    compiled.where = "payload" if script.wrapped else "file"
    if wrapper is not None:
        wrapper.where = "file"
    return CheckResult(
        file=name,
        compile=compiled,
        wrapper_compile=wrapper,
        imports=imports,
        code_bytes=code_bytes(script.raw),
        warnings=[text for _, text in found],
        undefined=undefined,
        warning_keys=[key for key, _ in found],
    )


def _forked_smoke() -> bool:
    from patcher.check import import_smoke

    return import_smoke._FORKED_SMOKE


def _now(function, *args) -> Future:
    """`function(*args)` run here, as a finished Future (what `pool.submit` gives later)."""
    done: Future = Future()
    try:
        done.set_result(function(*args))
    except BaseException as error:
        done.set_exception(error)
    return done


def compare_with_original(result: CheckResult, original: Script, **check_options) -> CheckResult:
    """When the patched script's check `result` failed, check `original` (the script it
    was patched from, as read) the same way and keep that as `result.original`, so the
    report says whether the patch introduced the failure. Either way, each warning of
    `result` that `original` has too (the same import or file, at whatever line) ends in
    WARNED_TOO: the patch did not bring it. Returns `result`."""
    if not result.ok:
        result.original = check_file(original.path, script=original, **check_options)
    if result.warnings and len(result.warning_keys) == len(result.warnings):
        if result.original is not None:
            before = set(result.original.warning_keys)
        else:
            known = {original.source: original.module} if original.module is not None else EMPTY
            before = {key for key, _ in self_contained_findings(original.source, original.path, original.wrapped, known)}
        result.warnings = [
            f"{text} {WARNED_TOO}" if key in before and not text.endswith(WARNED_TOO) else text
            for key, text in zip(result.warning_keys, result.warnings)
        ]
    return result


def _import_if_compiles(source: str, filename: str, timeout: float, known: Mapping[str, cst.Module], as_path) -> ImportResult:
    """import_smoke, unless the running Python cannot compile `source` (then say so)."""
    code = source[1:] if source.startswith(_BOM) else source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(code, filename, "exec", dont_inherit=True)
    except SyntaxError as e:
        requoted = requote(code)
        if requoted is not None:
            # Same AST with PEP 701 f-strings requoted: import that, and say so.
            result = import_smoke(requoted, filename, timeout, as_path=as_path)
            result.note = f"imported with its Python 3.12-only f-strings requoted (same AST); the running Python {platform.python_version()} cannot compile them"
            return result
        why = (
            f"not imported: the running Python {platform.python_version()} cannot compile it either "
            f"({e.msg}, line {e.lineno})"
        )
        return ImportResult(False, error=why, line=e.lineno)
    except (ValueError, MemoryError, RecursionError) as e:
        return ImportResult(False, error=f"not imported: cannot compile ({type(e).__name__}: {e})")
    return import_smoke(source, filename, timeout, known, as_path)
