"""A process of its own that counts one source's minified code bytes (run as a script).

    python patcher/minify_worker.py COMPRESSOR [--compile FILENAME] PYMINIFY_FLAG... < SOURCE

Reads the source (UTF-8 bytes) on stdin and writes one JSON object (a line) on stdout:
``{"bytes": N}``, N being the size of ``pyminify FLAGS -`` -> ``lzma.compress`` (or
``brotli.compress(quality=11)``) -> base85 exec wrapper, exactly as the command line
``pyminify FLAGS -`` minifies stdin (its own argument parser and its fallback to the
source when minifying does not pay), or ``{"error": LINE}`` when the minifier fails
(LINE: the last line of its traceback). COMPRESSOR: "lzma" | "brotli". With
``--compile FILENAME`` a line ``{"compile": VERDICT}`` comes first, as soon as it is known:
VERDICT is null when the source compiles under this Python (`compile(source, FILENAME,
"exec")`, a leading BOM dropped), else ``[line, message]`` of the SyntaxError.

It is a plain script with no import of this package, so that it starts in a few tens
of milliseconds; patcher/code_size.py starts it so that the minifier (about a second
for a 150 KB record) runs beside the patch or the check instead of after them.
"""

from __future__ import annotations

import base64
import json
import lzma
import sys
import traceback

# The wrapper a minifying record builds around its compressed code (its own bytes count).
WRAPPER = {
    "lzma": (b'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("', b'")))\n'),
    "brotli": (b'import brotli as B,base64 as A\nexec(B.decompress(A.b85decode("', b'")))\n'),
}


def minify(source: bytes, flags: list[str]) -> bytes:
    """`pyminify FLAGS -` of `source`: what that command writes on stdout."""
    from python_minifier.__main__ import MinificationNotBeneficialError, do_minify, parse_args

    argv, sys.argv = sys.argv, ["pyminify", *flags, "-"]
    try:
        options = parse_args()
    finally:
        sys.argv = argv
    try:
        return do_minify(source, "stdin", options)
    except MinificationNotBeneficialError:
        return source


def wrapper_bytes(minified: bytes, compressor: str) -> int:
    """Bytes of the base85 exec wrapper around `minified` compressed with `compressor`."""
    if compressor == "brotli":
        import brotli

        compressed = brotli.compress(minified, quality=11)
    else:
        compressed = lzma.compress(minified)
    prefix, suffix = WRAPPER[compressor]
    return len(prefix) + len(base64.b85encode(compressed)) + len(suffix)


def main(argv: list[str]) -> dict:
    compressor, rest = argv[0], argv[1:]
    filename = None
    if rest[:1] == ["--compile"]:
        filename, rest = rest[1], rest[2:]
    source = sys.stdin.buffer.read()
    reply: dict = {}
    if filename is not None:  # its own line, first: the caller needs it before the count
        try:
            compile(source.decode("utf-8").removeprefix("\ufeff"), filename, "exec")
            verdict = None
        except SyntaxError as error:
            verdict = [error.lineno, error.msg]
        sys.stdout.write(json.dumps({"compile": verdict}) + "\n")
        sys.stdout.flush()
    try:
        reply["bytes"] = wrapper_bytes(minify(source, rest), compressor)
    except Exception as error:  # the minifier's own failure, reported as its command line would
        reply["error"] = traceback.format_exception_only(type(error), error)[-1].strip() or "no message"
    return reply


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main(sys.argv[1:])) + "\n")
