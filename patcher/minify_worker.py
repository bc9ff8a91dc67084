"""A process of its own that counts minified code bytes (run as a script).

    python patcher/minify_worker.py COMPRESSOR PYMINIFY_FLAG... < SOURCE
    python patcher/minify_worker.py --serve < REQUESTS

One-shot: reads the source (UTF-8 bytes) on stdin and writes one JSON object (a line)
on stdout: ``{"bytes": N}``, N being the size of ``pyminify FLAGS -`` ->
``lzma.compress`` (or ``brotli.compress(quality=11)``) -> base85 exec wrapper, exactly
as the command line ``pyminify FLAGS -`` minifies stdin (its own argument parser and
its fallback to the source when minifying does not pay), or ``{"error": LINE}`` when
the minifier fails (LINE: the last line of its traceback). COMPRESSOR: "lzma" |
"brotli".

``--serve``: reads requests, one JSON line each, ``{"source": TEXT, "compressor":
COMPRESSOR, "flags": [PYMINIFY_FLAG, ...]}``, and answers each in order with its count
line, as the one-shot mode does, until stdin closes. It can be started before the caller knows
what it will ask: it imports the minifier meanwhile. A request ``{"guess": TEXT,
"default_flags": [...]}`` gets no answer: the worker minifies the units of TEXT with the
flags it guesses (`speculate`) while no other request waits. The count line also
says how the source was minified: ``"units": [minified, reused]`` (see
`minify_by_units`) or ``"whole": REASON``. The units minified for one request are
kept for the next, so the patched code of a script, sent after the script, costs the
minifier only what the patch changed.

It is a plain script with no import of this package, so that it starts in a few tens
of milliseconds; patcher/code_size.py starts it so that the minifier (about a second
for a 150 KB record) runs beside the patch or the check instead of after them.
"""

from __future__ import annotations

import ast
import base64
import builtins
import functools
import io
import json
import lzma
import os
import queue
import sys
import threading
import tokenize
import traceback
import warnings

# The wrapper a minifying record builds around its compressed code (its own bytes count).
WRAPPER = {
    "lzma": (b'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("', b'")))\n'),
    "brotli": (b'import brotli as B,base64 as A\nexec(B.decompress(A.b85decode("', b'")))\n'),
}

# python-minifier releases whose passes `minify_by_units` was checked against (a pass
# that reads the whole module would break it, so other releases minify whole).
UNIT_RELEASES = ("3.4.0",)
# Flags without which python-minifier makes whole-module choices: local names renamed
# to avoid the module's globals, string literals hoisted to module-level names.
UNIT_FLAGS_NEEDED = ("--no-rename-locals", "--no-hoist-literals")
UNIT_FLAGS_REFUSED = ("--rename-globals",)
# Names whose use as a builtin taints python-minifier's view of the whole module.
_TAINTING_NAMES = frozenset({"exec", "eval", "locals", "globals", "vars"})
_COMPOUND = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith, ast.Match) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def minify(source: bytes, flags: list[str]) -> bytes:
    """`pyminify FLAGS -` of `source`: what that command writes on stdout."""
    from python_minifier.__main__ import MinificationNotBeneficialError, do_minify

    try:
        return do_minify(source, "stdin", _options(tuple(flags)))
    except MinificationNotBeneficialError:
        return source


@functools.lru_cache(maxsize=None)
def _options(flags: tuple):
    """The command's own parse of `pyminify FLAGS -` (read only by `do_minify`), made once
    per set of flags rather than once per unit."""
    from python_minifier.__main__ import parse_args

    argv, sys.argv = sys.argv, ["pyminify", *flags, "-"]
    try:
        return parse_args()
    finally:
        sys.argv = argv


def _best_effort(source: bytes, flags: list[str]) -> bytes:
    """`minify`, without the command's fallback to the source when minifying does not pay
    (a unit is judged by the whole module's size, not its own)."""
    before = os.environ.get("PYMINIFY_FORCE_BEST_EFFORT")
    os.environ["PYMINIFY_FORCE_BEST_EFFORT"] = "1"
    try:
        return minify(source, flags)
    finally:
        if before is None:
            del os.environ["PYMINIFY_FORCE_BEST_EFFORT"]
        else:
            os.environ["PYMINIFY_FORCE_BEST_EFFORT"] = before


def units_of(text: str, tree: ast.Module) -> list[tuple[str, type | None]]:
    """The module's top-level statements cut into units: `(source text, kind)` for each
    compound statement (decorators included; kind: its `ast` class) and for each run of
    consecutive simple statements (one slice of whole lines from the run's first line to
    its last; kind None)."""
    lines = io.StringIO(text, newline="").readlines()  # the lines `ast` numbers: \n, \r\n, \r only
    found: list[tuple[str, type | None]] = []
    run_start = run_end = None
    for statement in tree.body:
        start = min([statement.lineno] + [d.lineno for d in getattr(statement, "decorator_list", ())])
        if isinstance(statement, _COMPOUND):
            if run_start is not None:
                found.append(("".join(lines[run_start - 1 : run_end]), None))
                run_start = None
            found.append(("".join(lines[start - 1 : statement.end_lineno]), type(statement)))
        else:
            run_start = start if run_start is None else run_start
            run_end = statement.end_lineno
    if run_start is not None:
        found.append(("".join(lines[run_start - 1 : run_end]), None))
    return found


def whole_module_reason(source: bytes, tree: ast.Module, flags: list[str]) -> str | None:
    """Why python-minifier's output for this module may not be the join of its units'
    outputs (then it is minified whole), or None.

    python-minifier (see UNIT_RELEASES) reads the whole module in these places, each
    checked here: local renaming and literal hoisting (the flags); a module "tainted"
    by `from x import *`, `import timeit` or a builtin exec/eval/locals/globals/vars,
    which keeps every `raise E()`'s brackets (so it matters only with such a raise); a
    `__doc__` anywhere, which keeps every literal statement; a module-level name that
    shadows a builtin, which changes how other units' uses of it resolve; a module-level
    `global` statement, which its dead-branch pass reads; a source encoding other than
    UTF-8.
    """
    import python_minifier

    if getattr(python_minifier, "__version__", None) not in UNIT_RELEASES and _release() not in UNIT_RELEASES:
        return f"python-minifier {_release()} (units checked against {', '.join(UNIT_RELEASES)})"
    missing = [f for f in UNIT_FLAGS_NEEDED if f not in flags] + [f for f in UNIT_FLAGS_REFUSED if f in flags]
    if missing:
        return f"flags: {' '.join(missing)}"
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
    except SyntaxError:
        return "encoding"
    if encoding not in ("utf-8", "utf-8-sig"):
        return f"encoding {encoding}"
    facts = _module_facts(tree)
    if facts["module_global"]:
        return "a module-level global statement"  # read by the dead-branch pass on the module
    if facts["doc"]:
        return "uses __doc__"
    shadowing = facts["names"] & set(dir(builtins))
    if shadowing:
        return f"module-level names shadow builtins: {', '.join(sorted(shadowing))}"
    if facts["tainting"] and facts["bracketed_raise"]:
        # only `raise E()` reads the taint: python-minifier drops its brackets unless tainted
        return f"{facts['tainting']} and raises an exception with brackets ({facts['bracketed_raise']})"
    return None


def _module_facts(tree: ast.Module) -> dict:
    """What `whole_module_reason` reads, in one walk: "names" bound in the module's scope
    (by its own statements, comprehension targets included to err on the safe side, and
    by `global` statements anywhere), "module_global" (a `global` statement in the
    module's scope), "doc" (a `__doc__` anywhere), "tainting" (what would taint it, or
    None), "bracketed_raise" (the line of a `raise E()`, or None)."""
    names: set[str] = set()
    facts = {"names": names, "module_global": False, "doc": False, "tainting": None, "bracketed_raise": None}
    stack: list[tuple[ast.AST, bool]] = [(node, True) for node in tree.body]
    while stack:
        node, module_scope = stack.pop()
        if isinstance(node, ast.Name):
            if node.id == "__doc__":
                facts["doc"] = True
            elif node.id in _TAINTING_NAMES:
                facts["tainting"] = facts["tainting"] or f"uses {node.id}"
            if module_scope and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr == "__doc__":
            facts["doc"] = True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(a.name == "*" for a in node.names) or any(name.split(".")[0] == "timeit" for name in modules):
                facts["tainting"] = facts["tainting"] or "a star or timeit import"
            if module_scope:
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Raise) and any(_no_arg_call(e) for e in (node.exc, node.cause)):
            facts["bracketed_raise"] = facts["bracketed_raise"] or f"line {node.lineno}"
        elif isinstance(node, ast.Global):
            names.update(node.names)
            facts["module_global"] = facts["module_global"] or module_scope
        elif module_scope and isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif module_scope and isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif module_scope and isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            if module_scope and not isinstance(node, ast.Lambda):
                names.add(node.name)
            # decorators, defaults and bases run in the enclosing scope; the rest in the new one
            outer = list(getattr(node, "decorator_list", ()))
            if isinstance(node, ast.ClassDef):
                outer += node.bases + [k.value for k in node.keywords]
            else:
                outer += node.args.defaults + [d for d in node.args.kw_defaults if d is not None]
            stack.extend((child, module_scope) for child in outer)
            stack.extend((child, False) for child in ast.iter_child_nodes(node))
            continue
        stack.extend((child, module_scope) for child in ast.iter_child_nodes(node))
    return facts


def _no_arg_call(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args and not node.keywords


@functools.lru_cache(maxsize=None)
def _release() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("python-minifier")
    except PackageNotFoundError:
        return "unknown"


# (source, flags) -> `plan`'s answer, for the last few sources (a guess, then its count).
_PLANS: dict = {}


def plan(source: bytes, flags: list[str], tree: ast.Module | None = None) -> tuple[list, str | None]:
    """(`units_of` the source, None), or ([], why it is minified whole): parsed (unless
    `tree`, its `ast`, is given) and checked once for a source asked twice with the same
    flags (guessed, then counted)."""
    key = (source, tuple(flags))
    if key not in _PLANS:
        try:
            tree = tree if tree is not None else ast.parse(source)
        except (SyntaxError, ValueError):
            _PLANS[key] = ([], "does not parse here")
        else:
            reason = whole_module_reason(source, tree, flags)
            _PLANS[key] = ([], reason) if reason is not None else (units_of(source.decode("utf-8").removeprefix("\ufeff"), tree), None)
        while len(_PLANS) > 4:
            del _PLANS[next(iter(_PLANS))]
    return _PLANS[key]


def minify_by_units(source: bytes, flags: list[str], memo: dict) -> tuple[bytes, dict]:
    """`minify(source, flags)`, made by minifying each unit of the module (`units_of`)
    alone and joining the outputs with newlines. Returns (the minified bytes, how:
    ``{"units": [minified, reused]}``, or ``{"whole": reason}`` when it minified the
    whole module instead).

    Why it is the same output: with locals not renamed and literals not hoisted,
    python-minifier's passes work statement by statement, apart from the module-wide
    facts `whole_module_reason` checks; and its printer puts each top-level compound
    statement on lines of its own and joins a run of simple statements the same way
    wherever the run stands. A pass that turns a compound unit into something else
    (`if True:` inlined, `if False:` dropped) would change how its neighbours join:
    such a module is minified whole. The shebang and the command's fallback to the
    source when minifying does not pay are applied to the whole, as `pyminify` does.

    memo: {unit text: its minified text, or None where it cannot stand alone}, kept by
    the caller across calls, so that a unit already minified is reused.
    """
    units, reason = plan(source, flags)
    if reason is not None:
        return minify(source, flags), {"whole": reason}  # the minifier's own error, if it does not parse
    text = source.decode("utf-8")
    outputs, minified, reused = [], 0, 0
    for unit, kind in units:
        if unit in memo:
            reused += 1
        else:
            minified += 1
            memo[unit] = _minify_unit(unit, kind, flags)
        if memo[unit] is None:
            return minify(source, flags), {"whole": "a unit minifies to another kind of statement"}
        if memo[unit]:
            outputs.append(memo[unit])
    joined = "\n".join(outputs)
    if text.startswith("#!"):
        joined = text.split("\n", 1)[0].rstrip("\r") + "\n" + joined
    result = joined.encode("utf-8")
    if len(result) > len(source) and not os.environ.get("PYMINIFY_FORCE_BEST_EFFORT"):
        result = source  # as `pyminify` does when minifying does not pay
    return result, {"units": [minified, reused]}


def _minify_unit(unit: str, kind: type | None, flags: list[str]) -> str | None:
    """The minified text of one unit of `kind` (see `units_of`; no trailing newline, ""
    when nothing is left of a simple run), or None when a compound statement does not
    come out as one statement of its kind. Of python-minifier's passes only those on
    `if` (dead branches, `__debug__`) remove or inline a statement of a suite, so only
    an `if` is parsed back to see."""
    out = _best_effort(unit.encode("utf-8"), flags).decode("utf-8").rstrip("\n")
    if kind is not None and not out:
        return None
    if kind is ast.If:
        body = ast.parse(out).body
        if len(body) != 1 or type(body[0]) is not ast.If:
            return None
    return out


def wrapper_bytes(minified: bytes, compressor: str) -> int:
    """Bytes of the base85 exec wrapper around `minified` compressed with `compressor`."""
    if compressor == "brotli":
        import brotli

        compressed = brotli.compress(minified, quality=11)
    else:
        compressed = lzma.compress(minified)
    prefix, suffix = WRAPPER[compressor]
    return len(prefix) + len(base64.b85encode(compressed)) + len(suffix)


def count(source: bytes, compressor: str, flags: list[str]) -> dict:
    """The one-shot count line for `source`: {"bytes": N}, or {"error": LINE} when the
    minifier fails."""
    try:
        return {"bytes": wrapper_bytes(minify(source, flags), compressor)}
    except Exception as error:  # the minifier's own failure, reported as its command line would
        return {"error": _error_line(error)}


def _error_line(error: Exception) -> str:
    """The last line of `error`'s traceback, as the minifier's command line prints it."""
    return traceback.format_exception_only(type(error), error)[-1].strip() or "no message"


def _say(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def serve() -> None:
    """Answer the requests on stdin in order (see the module docstring), one memo per set
    of flags. The minifier is imported first, while the caller is still reading its script;
    a guess request is worked on only while no other request waits. Each count is
    compressed on a thread of its own (lzma and brotli release the GIL) while the next
    request is minified; the answers still go out in the order asked."""
    import python_minifier.__main__  # noqa: F401

    if hasattr(os, "nice"):
        # Counts are wanted last; the patch and the check's import child (torch) go first.
        os.nice(10)
    requests: queue.Queue = queue.Queue()
    threading.Thread(target=_read_requests, args=(requests,), daemon=True).start()
    answers: queue.Queue = queue.Queue()  # dicts, or threads whose `.reply` is the dict
    answering = threading.Thread(target=_answer_in_order, args=(answers,))
    answering.start()
    memos: dict = {}
    while (request := requests.get()) is not None:
        if "guess" in request:
            speculate(request["guess"].encode("utf-8"), request["default_flags"], memos, requests)
            continue
        source = request["source"].encode("utf-8")
        flags = request["flags"]
        try:
            minified, how = minify_by_units(source, flags, memos.setdefault(tuple(flags), {}))
        except Exception as error:  # the minifier's own failure, reported as its command line would
            answers.put({"error": _error_line(error)})
            continue
        compressing = threading.Thread(target=_compress, args=(minified, request["compressor"], how))
        compressing.start()
        answers.put(compressing)
    answers.put(None)
    answering.join()


def _compress(minified: bytes, compressor: str, how: dict) -> None:
    """The count line of `minified`, left on this thread as `.reply`."""
    try:
        reply = {"bytes": wrapper_bytes(minified, compressor), **how}
    except Exception as error:  # e.g. brotli not installed: said as the one-shot mode says it
        reply = {"error": _error_line(error)}
    threading.current_thread().reply = reply


def _answer_in_order(answers: queue.Queue) -> None:
    while (answer := answers.get()) is not None:
        if isinstance(answer, threading.Thread):
            answer.join()
            answer = answer.reply
        _say(answer)


def _read_requests(requests: queue.Queue) -> None:
    try:
        for line in sys.stdin:
            requests.put(json.loads(line))
    finally:  # a line it cannot read ends the worker (its caller says so) rather than leaving it waiting
        requests.put(None)


def speculate(source: bytes, default_flags: list[str], memos: dict, requests: queue.Queue) -> int:
    """Minify the units of a script before its count is asked, with the flags its own
    size function seems to name (`guess_flags`), until a request arrives. Returns the
    units minified.

    The caller knows the flags only once it has parsed the script with libcst (seconds
    for a large record); the guess lets the minifier start at once. It is never trusted:
    units are kept per set of flags, so a count asked with other flags does not use them,
    and a wrong guess costs at most the unit being minified when the request arrives.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return 0
    named, flags = guess_flags(tree)
    if not named:
        return 0
    flags = flags or default_flags
    units, reason = plan(source, flags, tree)
    if reason is not None:
        return 0
    memo, done = memos.setdefault(tuple(flags), {}), 0
    for unit, kind in units:
        if not requests.empty():
            break
        if unit not in memo:
            memo[unit], done = _minify_unit(unit, kind, flags), done + 1
    return done


def guess_flags(tree: ast.Module) -> tuple[bool, list[str] | None]:
    """(whether a function holds the string "pyminify", the `--` strings of the first list
    in the outermost such function, or None): what patcher.code_size.counting_of reads
    with libcst from the parsed script, read here from `ast` as a guess (`speculate`)."""
    for function in _outermost_functions(tree):
        nodes = list(_preorder(function))
        if any(isinstance(n, ast.Constant) and n.value == "pyminify" for n in nodes):
            for node in nodes:
                if isinstance(node, ast.List):
                    found = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value.startswith("--")]
                    if found:
                        return True, found
            return True, None
    return False, None


def _outermost_functions(tree: ast.Module):
    """The functions not inside another function, in source order."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _preorder(node: ast.AST):
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(list(ast.iter_child_nodes(current))))


def main(argv: list[str]) -> None:
    # Warnings on the script's code (invalid escape sequences, ...) are not the count's;
    # a large script can have thousands.
    warnings.simplefilter("ignore")
    if argv[:1] == ["--serve"]:
        serve()
        return
    compressor, flags = argv[0], argv[1:]
    _say(count(sys.stdin.buffer.read(), compressor, flags))


if __name__ == "__main__":
    main(sys.argv[1:])
