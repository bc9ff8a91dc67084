"""Long fuzz run: mutated training scripts and wrappers through patch, check and verify.

    python bench/fuzz.py [--inputs 10000] [--seed 0] [--check-every 1] [--verify-every 20] [--json OUT]

Seeds are the bundled fixtures (plain and wrapped) plus wrappers built here from them
(lzma raw / xz, zlib, bz2, gzip; base85, base64; one piece or many); half of the inputs
start from a slice of up to 120 lines of a fixture (cheap to patch, often broken).
Each input is one seed with one to three mutations: a token deleted, inserted or swapped (tokens from
`tokenize`), a truncation, byte flips in a wrapper's encoded literal or in its
compressed payload, a payload mutated and re-packed, deep nesting spliced in, CRLF
line endings, a BOM, a decompression bomb. Every command runs in a child forked from
this process (patcher already imported), so a signal or a crash is seen as one:

- patch: `patch-prefetch IN -o OUT --no-check` (exit 0, 2 or 3 allowed);
- check: `patch-prefetch check IN --no-import` on every `--check-every`-th input (0, 1 or 2);
- verify: `patch-prefetch verify IN IN` on every `--verify-every`-th input (0, 1 or 2).

Counted as failures: a traceback on stderr, a death by signal, an exit code outside
the allowed set, a run over `--child-timeout`, an input file changed, and an output
file (or a temporary file) left behind by a non-zero patch exit. Prints the figures
and, with `--json`, writes them to a file. Exit 0 when there was no failure.
"""

from __future__ import annotations

import argparse
import base64
import bz2
import gzip
import io
import json
import lzma
import os
import random
import resource
import signal
import sys
import tempfile
import time
import tokenize
import zlib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patcher.cli import main as cli_main  # noqa: E402
from patcher.read.source import MAX_SOURCE_BYTES, read_script  # noqa: E402

ALLOWED = {"patch": {0, 2, 3}, "check": {0, 1, 2}, "verify": {0, 1, 2}}
INSERT_POOL = ["(", ")", "[", "]", "{", "}", ":", ",", ".", "=", "+", "*", "**", "lambda", "def", "class", "if", "else",
               "return", "yield", "not", "None", "0", "1.5", "'s'", 'f"{x}"', "\n", "\t", "    ", "\\\n", "#", "@",
               "next_batch", "self", "import", "async", "await", "\\", '"""', "'", "\r", "\ufeff", "é", "\x0c"]


# --------------------------------------------------------------------------- seeds


def _wrap(code: str, codec: str, encoding: str, width: int | None, raw: bool = False) -> str:
    data = code.encode()
    kw = ""
    if codec == "lzma":
        blob = lzma.compress(data, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}]) if raw else lzma.compress(data)
        kw = ',format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]' if raw else ""
        head = "import lzma as L,base64 as B"
    elif codec == "zlib":
        blob, head = zlib.compress(data, 9), "import zlib as L,base64 as B"
    elif codec == "bz2":
        blob, head = bz2.compress(data), "import bz2 as L,base64 as B"
    else:
        blob, head = gzip.compress(data, mtime=0), "import gzip as L,base64 as B"
    enc = {"b85decode": base64.b85encode, "b64decode": base64.b64encode}[encoding](blob).decode()
    if width:
        literal = "\n".join(f'"{enc[i:i + width]}"' for i in range(0, len(enc), width))
    else:
        literal = f'"{enc}"'
    return f"{head}\n__wrapper_size__=0\nexec(L.decompress(B.{encoding}({literal}){kw}))\n"


def seeds() -> list[tuple[str, str]]:
    """(name, text) of every seed."""
    out = []
    for path in sorted((ROOT / "fixtures").glob("*.py")):
        if path.name == "make_wrapped.py":
            continue
        text = path.read_text()
        out.append((path.name, text))
        try:
            script = read_script(path)
        except Exception:
            continue
        if script.wrapped:
            continue
        out.append((f"{path.stem}.lzma-raw-b85", _wrap(text, "lzma", "b85decode", 100, raw=True)))
        out.append((f"{path.stem}.xz-b85-1", _wrap(text, "lzma", "b85decode", None)))
        out.append((f"{path.stem}.zlib-b64", _wrap(text, "zlib", "b64decode", 76)))
        out.append((f"{path.stem}.bz2-b85", _wrap(text, "bz2", "b85decode", 200)))
        out.append((f"{path.stem}.gzip-b64", _wrap(text, "gzip", "b64decode", None)))
    return out


# --------------------------------------------------------------------------- mutations


def _tokens(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the tokens of `text` (as far as it tokenizes)."""
    # Lines as tokenize reads them (only \n, \r\n and \r end a line, not \x0c or U+2028).
    lines = io.StringIO(text, newline="").readlines()
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    spans = []
    try:
        for tok in tokenize.generate_tokens(iter(lines).__next__):
            if tok.type in (tokenize.ENDMARKER, tokenize.DEDENT) or tok.start == tok.end:
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            if r0 - 1 < len(starts) and r1 - 1 < len(starts):
                spans.append((starts[r0 - 1] + c0, starts[r1 - 1] + c1))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    return spans


def _token_mutation(text: str, rng: random.Random) -> str:
    spans = _tokens(text)
    if not spans:
        return text[: rng.randrange(len(text) + 1)]
    kind = rng.choice(["delete", "insert", "swap"])
    a, b = spans[rng.randrange(len(spans))]
    if kind == "delete":
        return text[:a] + text[b:]
    if kind == "insert":
        at = rng.choice((a, b))
        return text[:at] + rng.choice(INSERT_POOL) + " " * rng.randrange(2) + text[at:]
    c, d = spans[rng.randrange(len(spans))]
    if (a, b) > (c, d):
        a, b, c, d = c, d, a, b
    if b > c:
        return text
    return text[:a] + text[c:d] + text[b:c] + text[a:b] + text[d:]


def _deep(rng: random.Random) -> str:
    n = rng.choice([50, 99, 150, 199, 250, 1000, 5000, 20000])
    shape = rng.choice(["paren", "bracket", "call", "unary", "sum", "lambda", "indent"])
    if shape == "paren":
        return "x = " + "(" * n + "1" + ")" * n + "\n"
    if shape == "bracket":
        return "x = " + "[" * n + "]" * n + "\n"
    if shape == "call":
        return "x = " + "f(" * n + ")" * n + "\n"
    if shape == "unary":
        return "x = " + "-" * n + "1\n"
    if shape == "sum":
        return "x = " + "+".join(["1"] * n) + "\n"
    if shape == "lambda":
        return "x = " + "lambda: " * n + "1\n"
    return "".join("    " * i + "if x:\n" for i in range(min(n, 300))) + "    " * min(n, 300) + "pass\n"


def _splice_line(text: str, insert: str, rng: random.Random) -> str:
    lines = text.splitlines(True)
    at = rng.randrange(len(lines) + 1)
    return "".join(lines[:at]) + insert + "".join(lines[at:])


def _wrapped_parts(text: str):
    """(Script) when `text` reads as a wrapper, else None."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    try:
        script = read_script(f.name)
    except Exception:
        return None
    finally:
        os.unlink(f.name)
    return script if script.wrapped else None


def mutate(text: str, rng: random.Random) -> tuple[str, list[str]]:
    """One to three mutations of `text`; returns (text, names of the mutations)."""
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.choice(["token", "token", "token", "truncate", "deep", "flip", "payload", "payload", "crlf", "bom", "bomb"])
        if kind in ("flip", "payload", "bomb"):
            script = _wrapped_parts(text)
            if script is None:
                kind = "token"
        if kind == "token":
            text = _token_mutation(text, rng)
        elif kind == "truncate":
            text = text[: rng.randrange(len(text) + 1)]
        elif kind == "deep":
            text = _splice_line(text, _deep(rng), rng)
        elif kind == "crlf":
            text = text.replace("\r\n", "\n").replace("\n", "\r\n")
        elif kind == "bom":
            text = "\ufeff" + text.lstrip("\ufeff")
        elif kind == "flip":  # characters of the encoded literal (base85/64 alphabet or not)
            spans = [s for s in _tokens(text) if s[0] < len(text) and text[s[0]] in "\"'bB" and s[1] - s[0] > 20]
            if spans:
                a, b = rng.choice(spans)
                chars = list(text)
                for _ in range(rng.randrange(1, 4)):
                    i = rng.randrange(a + 1, b - 1)
                    chars[i] = chr(rng.randrange(33, 127)) if chars[i] not in "\"'\n\\" else chars[i]
                text = "".join(chars)
        elif kind in ("payload", "bomb"):
            w = script.wrapper
            codec = w.codec
            payload = (" " * (MAX_SOURCE_BYTES + rng.randrange(1, 4096))) if kind == "bomb" else _token_mutation(script.source, rng)
            data = payload.encode("utf-8", "surrogatepass")
            blob = {
                "lzma": lambda: lzma.compress(data, **w.compress_kwargs[0]),
                "zlib": lambda: zlib.compress(data, 9) if w.compress_kwargs[0]["wbits"] > 0 else data,
                "bz2": lambda: bz2.compress(data),
                "gzip": lambda: gzip.compress(data, mtime=0),
            }[codec]()
            if rng.random() < 0.3:  # flip bytes in the compressed payload
                blob = bytearray(blob)
                for _ in range(rng.randrange(1, 4)):
                    if blob:
                        blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
                blob = bytes(blob)
                kind = "payload-byteflip"
            enc = {"b85decode": base64.b85encode, "b64decode": base64.b64encode, "a85decode": base64.a85encode, "b32decode": base64.b32encode}[w.encoding](blob).decode()
            literal_text = "".join(f'"{enc[i:i + 100]}"\n' for i in range(0, len(enc), 100)) or '""'
            prefix, _, rest = text.partition(f"{w.encoding}(")
            if not rest:
                continue
            depth, end = 1, None
            for i, ch in enumerate(rest):  # find the closing parenthesis of the encode call
                if ch == "(":
                    depth += 1
                elif ch == ")":
                    depth -= 1
                    if depth == 0:
                        end = i
                        break
            if end is None:
                continue
            text = prefix + f"{w.encoding}(" + literal_text + rest[end:]
        done.append(kind)
    return text, done


# --------------------------------------------------------------------------- running


def run_child(argv: list[str], workdir: Path, timeout: float) -> dict:
    """Run `patch-prefetch argv` in a forked child; exit code or signal, stderr, peak RSS."""
    err_path = workdir / "stderr.txt"
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(fd, 2)
            os.setpgid(0, 0)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            try:
                code = cli_main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 98
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 97
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 96)
    deadline = time.monotonic() + timeout
    status = rusage = None
    while True:
        got, status, rusage = os.wait4(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            _, status, rusage = os.wait4(pid, 0)
            return {"hung": True, "code": None, "signal": None, "stderr": "", "rss_kb": rusage.ru_maxrss}
        time.sleep(0.005)
    stderr = err_path.read_text(errors="replace") if err_path.exists() else ""
    return {
        "hung": False,
        "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "stderr": stderr,
        "rss_kb": rusage.ru_maxrss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=1)
    parser.add_argument("--verify-every", type=int, default=20)
    parser.add_argument("--child-timeout", type=float, default=300.0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--failures", help="keep failing inputs in this directory")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    pool = seeds()
    started = time.monotonic()
    exits = {name: Counter() for name in ALLOWED}
    figures = Counter()
    peak_kb = 0
    fail_dir = Path(args.failures) if args.failures else None
    if fail_dir:
        fail_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pp-fuzz-") as tmp:
        work = Path(tmp)
        for n in range(args.inputs):
            name, seed_text = rng.choice(pool)
            if rng.random() < 0.5:  # a slice of a fixture, sometimes wrapped
                lines = seed_text.splitlines(True)
                a = rng.randrange(len(lines))
                seed_text = "".join(lines[a : a + rng.randrange(1, 120)])
                name = f"{name}[{a}:]"
                if rng.random() < 0.3 and seed_text.strip():
                    seed_text = _wrap(seed_text, "lzma", "b85decode", rng.choice([None, 50, 100]))
            text, kinds = mutate(seed_text, rng)
            for kind in kinds:
                figures[f"mutation {kind}"] += 1
            case = work / f"case{n % 2}"
            case.mkdir(exist_ok=True)
            for leftover in case.iterdir():
                leftover.unlink()
            src = case / "train_gpt.py"
            data = text.encode("utf-8", "surrogatepass")
            src.write_bytes(data)
            out = case / "out.py"
            commands = [("patch", [str(src), "-o", str(out), "--no-check"])]
            if args.check_every and n % args.check_every == 0:
                commands.append(("check", ["check", str(src), "--no-import"]))
            if args.verify_every and n % args.verify_every == 0:
                commands.append(("verify", ["verify", str(src), str(src), "--batches", "4"]))
            for command, cargv in commands:
                if out.exists():
                    out.unlink()
                result = run_child(cargv, work, args.child_timeout)
                peak_kb = max(peak_kb, result["rss_kb"])
                figures["runs"] += 1
                problem = None
                if result["hung"]:
                    problem = "hung"
                elif result["signal"] is not None:
                    problem = f"signal {result['signal']}"
                elif "Traceback" in result["stderr"]:
                    problem = "traceback"
                elif result["code"] not in ALLOWED[command]:
                    problem = f"exit {result['code']}"
                exits[command]["hung" if result["hung"] else (f"signal {result['signal']}" if result["signal"] else result["code"])] += 1
                if src.read_bytes() != data:
                    problem = problem or "input modified"
                    figures["inputs modified"] += 1
                    src.write_bytes(data)
                if command == "patch" and result["code"] not in (0, None):
                    extra = [p.name for p in case.iterdir() if p.name != "train_gpt.py"]
                    if extra:
                        problem = problem or f"wrote {extra} with exit {result['code']}"
                        figures["non-zero exit wrote"] += 1
                if command == "patch" and result["code"] == 0 and any(p.name.endswith(".tmp") for p in case.iterdir()):
                    problem = problem or "temporary file left"
                if problem:
                    kind = problem.split()[0]
                    figures[f"failure {kind}"] += 1
                    figures["failures"] += 1
                    if fail_dir:
                        (fail_dir / f"{n:06d}-{command}-{kind}.py").write_bytes(data)
                        (fail_dir / f"{n:06d}-{command}-{kind}.txt").write_text(f"{cargv}\n{name} {kinds}\n{problem}\n{result['stderr'][-4000:]}")
            figures["inputs"] += 1
            if (n + 1) % 250 == 0:
                print(f"{n + 1} inputs, {figures['failures']} failures, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(_report(figures, exits, peak_kb, started, pool), indent=2) + "\n")
    report = _report(figures, exits, peak_kb, started, pool)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if not figures["failures"] else 1


def _report(figures, exits, peak_kb, started, pool) -> dict:
    return {
        "inputs": figures["inputs"],
        "runs": figures["runs"],
        "exits": {command: {str(k): v for k, v in sorted(c.items(), key=str)} for command, c in exits.items()},
        "tracebacks": figures["failure traceback"],
        "signals": figures["failure signal"],
        "hung": figures["failure hung"],
        "bad exit codes": figures["failure exit"],
        "inputs modified": figures["inputs modified"],
        "non-zero exit wrote": figures["non-zero exit wrote"],
        "failures": figures["failures"],
        "peak child rss MiB": round(peak_kb / 1024, 1),
        "mutations": {k.removeprefix("mutation "): v for k, v in figures.items() if k.startswith("mutation ")},
        "wall s": round(time.monotonic() - started, 1),
        "seeds": len(pool),
    }


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.exit(main())
