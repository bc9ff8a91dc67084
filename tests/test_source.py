"""Tests for patcher.read.source: reading plain and compressed-wrapper scripts, re-rendering them.

Wrappers are built here from small payloads in the styles seen in competition records
(one long piece, 100-wide pieces on separate lines, 100-wide pieces on one line).
"""

from __future__ import annotations

import ast
import base64
import bz2
import gzip
import hashlib
import io
import lzma
import os
import stat
import tempfile
import tokenize
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import patcher.read.source as source_mod
from patcher.read.source import SourceError, code_bytes, read_script, render, write_atomic

PAYLOAD = 'import os\n\ndef main():\n    print("hello", os.getpid())\n\nif __name__ == "__main__":\n    main()\n'
PATCHED = PAYLOAD + "\n# patched: prefetch\nX = [i * i for i in range(10)]\n"
ENCODERS = {
    "b85decode": base64.b85encode,
    "b64decode": base64.b64encode,
    "a85decode": base64.a85encode,
    "b32decode": base64.b32encode,
}
RAW_KW = ',format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]'
RAW_COMPRESS = {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2, "preset": 9}]}


def compress(codec: str, data: bytes, ckw: dict | None = None) -> bytes:
    """Compress as a record author would; ckw are extra lzma/zlib compress settings."""
    ckw = ckw or {}
    if codec == "lzma":
        return lzma.compress(data, **ckw)
    if codec == "zlib":
        c = zlib.compressobj(6, zlib.DEFLATED, ckw.get("wbits", zlib.MAX_WBITS))
        return c.compress(data) + c.flush()
    if codec == "bz2":
        return bz2.compress(data)
    return gzip.compress(data)


def escape(chunk: str, quote: str) -> str:
    """Ascii85 text can contain quotes and backslashes; escape them for a non-raw literal."""
    return chunk.replace("\\", "\\\\").replace(quote, "\\" + quote)


@dataclass
class Built:
    text: str
    head: str  # everything before the encoded literal
    tail: str  # everything after it


def build(
    payload: str = PAYLOAD,
    *,
    codec: str = "lzma",
    encoding: str = "b85decode",
    imports: str | None = None,
    mod: str | None = None,
    b64: str | None = None,
    kwargs: str = "",
    ckw: dict | None = None,
    width: int | None = None,
    joiner: str = "",
    prefix: str = "",
    quote: str = '"',
    size_line: bool = False,
    decode: bool = False,
    blob: bytes | None = None,
    nl: str = "\n",
    trailing_nl: bool = True,
) -> Built:
    """A wrapper script around `payload` (or around `blob`, already compressed)."""
    alias = {"lzma": "L", "zlib": "Z", "bz2": "C", "gzip": "G"}[codec]
    if imports is None:
        imports = f"import {codec} as {alias},base64 as B"
        mod = mod or alias
        b64 = b64 or "B"
    if blob is None:
        blob = compress(codec, payload.encode("utf-8"), ckw)
    encoded = ENCODERS[encoding](blob).decode("ascii")
    chunks = [encoded] if width is None else [encoded[i : i + width] for i in range(0, len(encoded), width)]
    esc = (lambda c: c) if "r" in prefix.lower() else (lambda c: escape(c, quote))
    literal = joiner.join(f"{prefix}{quote}{esc(c)}{quote}" for c in chunks)
    head_lines = [imports] + (["__wrapper_size__=0"] if size_line else [])
    head = nl.join(head_lines) + nl + f"exec({mod}.decompress({b64}.{encoding}("
    tail = f"){kwargs})" + (".decode()" if decode else "") + ")" + (nl if trailing_nl else "")
    text = head + literal + tail
    if size_line:
        # As in the real record: measured with a placeholder, then the number put in.
        n = code_bytes(text)
        head = head.replace("__wrapper_size__=0", f"__wrapper_size__={n}")
        text = head + literal + tail
    return Built(text, head, tail)


def write(tmp_path: Path, text: str, name: str = "train_gpt.py") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8"))
    return p


def decode_rendered(out: str, built: Built, encoding: str, codec: str, kw: dict, joiner: str | None):
    """Independently decode a rendered wrapper (tokenize + literal_eval), returning
    (payload, pieces). Checks the text between pieces is exactly `joiner`."""
    assert out.endswith(built.tail)
    middle = out[len(built.head) : len(out) - len(built.tail)]
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(middle).readline) if t.type == tokenize.STRING]
    lines = middle.splitlines(keepends=True)

    def offset(row: int, col: int) -> int:
        return sum(len(x) for x in lines[: row - 1]) + col

    spans = [(offset(*t.start), offset(*t.end)) for t in tokens]
    assert spans[0][0] == 0 and spans[-1][1] == len(middle)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert middle[end:start] == joiner
    pieces = [ast.literal_eval(t.string) for t in tokens]
    text = b"".join(pieces) if isinstance(pieces[0], bytes) else "".join(pieces)
    blob = getattr(base64, encoding)(text)
    data = {"lzma": lzma, "zlib": zlib, "bz2": bz2, "gzip": gzip}[codec].decompress(blob, **kw)
    return data.decode("utf-8"), pieces


def assert_one_line_error(exc: SourceError, path: Path):
    msg = str(exc)
    assert "\n" not in msg and "\r" not in msg
    assert msg.startswith(str(path))
    return msg


# --------------------------------------------------------------------------- plain files


def test_plain_file_comes_back_as_plain(tmp_path):
    p = write(tmp_path, PAYLOAD)
    s = read_script(p)
    assert not s.wrapped and s.wrapper is None
    assert s.raw == PAYLOAD and s.source == PAYLOAD
    assert render(s, PATCHED) == PATCHED


def test_plain_file_line_endings_are_not_normalised(tmp_path):
    crlf = PAYLOAD.replace("\n", "\r\n")
    s = read_script(write(tmp_path, crlf))
    assert s.raw == crlf and s.source == crlf


def test_plain_file_with_unrelated_exec_open_is_not_an_indirection(tmp_path):
    text = 'import os\nexec(open("config.py").read())\nx = 1\n'
    s = read_script(write(tmp_path, text))
    assert not s.wrapped and s.source == text


def test_python312_syntax_is_accepted(tmp_path):
    text = 'type Vec = list[float]\ndef first[T](xs: list[T]) -> T:\n    return xs[0]\nd = {"a": 1}\ns = f"{d["a"]}"\n'
    assert read_script(write(tmp_path, text)).source == text


def test_code_bytes_counts_utf8_bytes():
    assert code_bytes("abc") == 3
    assert code_bytes("é") == 2
    assert code_bytes("日本\n") == 7


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", ["lzma", "zlib", "bz2", "gzip"])
@pytest.mark.parametrize("encoding", ["b85decode", "b64decode", "a85decode", "b32decode"])
def test_codec_encoding_round_trip(tmp_path, codec, encoding):
    built = build(codec=codec, encoding=encoding, width=60, joiner="\n")
    s = read_script(write(tmp_path, built.text))
    assert s.wrapped
    assert s.source == PAYLOAD
    assert (s.wrapper.codec, s.wrapper.encoding) == (codec, encoding)
    assert s.wrapper.decompress_kwargs == {}

    out = render(s, PATCHED)
    assert out.startswith(built.head) and out.endswith(built.tail)
    payload, _ = decode_rendered(out, built, encoding, codec, {}, "\n")
    assert payload == PATCHED
    again = read_script(write(tmp_path, out, "again.py"))
    assert again.source == PATCHED and again.wrapper == s.wrapper
    assert hash(again.wrapper) == hash(s.wrapper)


def test_format_raw_filters_resolved_and_kept_verbatim(tmp_path):
    built = build(kwargs=RAW_KW, ckw=RAW_COMPRESS)
    s = read_script(write(tmp_path, built.text))
    assert s.wrapper.decompress_kwargs == {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2}]}
    out = render(s, PATCHED)
    assert out.endswith('"),format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]))\n')
    payload, pieces = decode_rendered(
        out, built, "b85decode", "lzma", {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2}]}, None
    )
    assert payload == PATCHED and len(pieces) == 1  # one-piece original stays one piece


def test_lzma_render_keeps_the_smaller_of_preset_9_and_extreme(tmp_path):
    big = PAYLOAD * 40 + "".join(f"v{i} = {i * 7919 % 1000}\n" for i in range(300))
    s = read_script(write(tmp_path, build(kwargs=RAW_KW, ckw=RAW_COMPRESS).text))
    out = render(s, big)
    blob = base64.b85decode(out.split('"')[1])
    sizes = [
        len(lzma.compress(big.encode(), format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": p}]))
        for p in (9, 9 | lzma.PRESET_EXTREME)
    ]
    assert len(blob) == min(sizes)


@pytest.mark.parametrize(
    "payload, extreme_wins",
    [
        ("import os\n" + "".join(f"print({i!r}, os.getpid())\n" for i in range(100)), False),
        ("".join(f"# comment line {i}\nvalue_{i} = \"{i * i}\"\n" for i in range(120)), True),
    ],
)
def test_unchanged_source_rerender_is_identical_unless_extreme_is_smaller(tmp_path, payload, extreme_wins):
    # Records compress with preset 9; re-rendering unchanged code must not churn the file
    # unless 9|EXTREME really is smaller.
    built = build(payload, kwargs=RAW_KW, ckw=RAW_COMPRESS, width=100, joiner="\n")
    s = read_script(write(tmp_path, built.text))
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
    extreme = lzma.compress(payload.encode(), format=lzma.FORMAT_RAW, filters=filters)
    preset9 = compress("lzma", payload.encode(), RAW_COMPRESS)
    assert (len(extreme) < len(preset9)) == extreme_wins  # precondition of the case
    out = render(s, payload)
    if extreme_wins:
        assert code_bytes(out) < code_bytes(built.text)
        middle = out[len(built.head) : len(out) - len(built.tail)]
        assert base64.b85decode(middle.replace('"', "").replace("\n", "")) == extreme
    else:
        assert out == built.text


def test_xz_container_and_check_are_kept(tmp_path):
    built = build(ckw={"format": lzma.FORMAT_XZ, "check": lzma.CHECK_CRC32})
    s = read_script(write(tmp_path, built.text))
    out = render(s, PATCHED)
    blob = base64.b85decode(out.split('"')[1])
    assert blob.startswith(b"\xfd7zXZ\x00")
    assert blob[7] & 0x0F == lzma.CHECK_CRC32
    assert lzma.decompress(blob).decode() == PATCHED


def test_lzma_alone_container_is_kept(tmp_path):
    built = build(ckw={"format": lzma.FORMAT_ALONE})
    s = read_script(write(tmp_path, built.text))
    blob = base64.b85decode(render(s, PATCHED).split('"')[1])
    assert not blob.startswith(b"\xfd7zXZ")
    assert lzma.decompress(blob, format=lzma.FORMAT_ALONE).decode() == PATCHED


@pytest.mark.parametrize(
    "kwargs, wbits, expected",
    [
        (",wbits=-Z.MAX_WBITS", -15, {"wbits": -15}),
        (",16+Z.MAX_WBITS", 31, {"wbits": 31}),
        (",wbits=-9", -9, {"wbits": -9}),
    ],
)
def test_zlib_wbits_expressions(tmp_path, kwargs, wbits, expected):
    built = build(codec="zlib", kwargs=kwargs, ckw={"wbits": wbits})
    s = read_script(write(tmp_path, built.text))
    assert s.wrapper.decompress_kwargs == expected
    out = render(s, PATCHED)
    payload, _ = decode_rendered(out, built, "b85decode", "zlib", expected, None)
    assert payload == PATCHED


@pytest.mark.parametrize("prefix", ["b", "B", "Rb"])
def test_bytes_literal_prefix_kept_on_every_piece(tmp_path, prefix):
    built = build(prefix=prefix, width=40, joiner="\n")
    s = read_script(write(tmp_path, built.text))
    assert s.wrapper.is_bytes_literal and s.source == PAYLOAD
    out = render(s, PATCHED)
    middle = out[len(built.head) : len(out) - len(built.tail)]
    lines = middle.split("\n")
    assert len(lines) > 2 and all(line.startswith(prefix + '"') and line.endswith('"') for line in lines)
    assert read_script(write(tmp_path, out, "b.py")).source == PATCHED


def test_single_quotes_and_raw_prefix_kept(tmp_path):
    built = build(prefix="r", quote="'", width=50, joiner=" ")
    s = read_script(write(tmp_path, built.text))
    out = render(s, PATCHED)
    middle = out[len(built.head) : len(out) - len(built.tail)]
    assert middle.startswith("r'") and "' r'" in middle and '"' not in middle
    assert read_script(write(tmp_path, out, "q.py")).source == PATCHED


def test_ascii85_quotes_and_backslashes_are_escaped(tmp_path):
    # Ascii85 output uses '"', "'" and '\\'; find a payload whose encoding has all three.
    payload = next(
        p
        for p in (f"x = {i}\n" * (i % 7 + 1) + f"y = '{i}'\n" for i in range(2000))
        if all(c in base64.a85encode(compress("lzma", p.encode())).decode() for c in "\"\\'")
    )
    built = build(payload, encoding="a85decode", width=30, joiner="\n")
    s = read_script(write(tmp_path, built.text))
    assert s.source == payload
    out = render(s, payload + "z = 1\n")
    middle = out[len(built.head) : len(out) - len(built.tail)]
    assert '\\"' in middle or "\\\\" in middle  # the new pieces needed escapes too
    assert read_script(write(tmp_path, out, "a.py")).source == payload + "z = 1\n"


@pytest.mark.parametrize("joiner", ["\n", ""])
def test_piece_width_and_joiner_preserved(tmp_path, joiner):
    built = build(kwargs=RAW_KW, ckw=RAW_COMPRESS, width=100, joiner=joiner)
    s = read_script(write(tmp_path, built.text))
    assert s.wrapper.piece_width == 100 and s.wrapper.joiner == joiner
    big = PATCHED + "".join(f"v{i} = {i * 31337 % 977}\n" for i in range(400))
    out = render(s, big)
    # Everything outside the literal is byte-identical.
    assert out.startswith(built.head) and out.endswith(built.tail)
    payload, pieces = decode_rendered(
        out, built, "b85decode", "lzma", {"format": lzma.FORMAT_RAW, "filters": [{"id": lzma.FILTER_LZMA2}]}, joiner
    )
    assert payload == big
    assert len(pieces) > 3 and all(len(p) == 100 for p in pieces[:-1]) and 0 < len(pieces[-1]) <= 100
    if joiner == "\n":
        assert out.count("\n") == len(pieces) + 1  # import line, one line per piece
    else:
        assert out.count("\n") == built.text.count("\n") == 2  # one-line style stays one line


def test_one_line_style_without_trailing_newline(tmp_path):
    built = build(width=100, joiner="", trailing_nl=False)
    s = read_script(write(tmp_path, built.text))
    out = render(s, PATCHED)
    assert not out.endswith("\n") and out.endswith('")))')
    assert out.count("\n") == 1
    assert read_script(write(tmp_path, out, "o.py")).source == PATCHED


def test_crlf_wrapper_keeps_crlf(tmp_path):
    built = build(width=40, joiner="\r\n", nl="\r\n")
    s = read_script(write(tmp_path, built.text))
    out = render(s, PATCHED)
    assert "\n" not in out.replace("\r\n", "")
    assert out.count("\r\n") > 3
    assert read_script(write(tmp_path, out, "crlf.py")).source == PATCHED


def test_bom_is_kept(tmp_path):
    built = build()
    s = read_script(write(tmp_path, "\ufeff" + built.text))
    assert s.wrapped and s.source == PAYLOAD
    out = render(s, PATCHED)
    assert out.startswith("\ufeff" + built.head)


@pytest.mark.parametrize(
    "imports, mod, b64",
    [
        ("import lzma as L,base64 as B", "L", "B"),
        ("import lzma, base64", "lzma", "base64"),
        ("import lzma\nimport base64", "lzma", "base64"),
        ("import base64 as b, lzma as z", "z", "b"),
    ],
)
def test_alias_forms(tmp_path, imports, mod, b64):
    kwargs = f",format={mod}.FORMAT_RAW,filters=[{{'id': {mod}.FILTER_LZMA2}}]"
    built = build(imports=imports, mod=mod, b64=b64, kwargs=kwargs, ckw=RAW_COMPRESS)
    s = read_script(write(tmp_path, built.text))
    assert s.source == PAYLOAD
    assert s.wrapper.decompress_kwargs["format"] == lzma.FORMAT_RAW
    out = render(s, PATCHED)
    assert out.startswith(built.head) and out.endswith(built.tail)
    assert read_script(write(tmp_path, out, "x.py")).source == PATCHED


def test_from_import_form(tmp_path):
    blob = lzma.compress(PAYLOAD.encode())
    text = (
        "from lzma import decompress\nfrom base64 import b85decode as d\n"
        f'exec(decompress(d("{base64.b85encode(blob).decode()}")))\n'
    )
    s = read_script(write(tmp_path, text))
    assert (s.wrapper.codec, s.wrapper.encoding, s.source) == ("lzma", "b85decode", PAYLOAD)
    assert read_script(write(tmp_path, render(s, PATCHED), "y.py")).source == PATCHED


def test_decode_call_on_payload(tmp_path):
    built = build(codec="zlib", decode=True)
    s = read_script(write(tmp_path, built.text))
    assert s.wrapper.text_decode and s.source == PAYLOAD
    out = render(s, PATCHED)
    assert out.endswith(")).decode())\n")
    assert read_script(write(tmp_path, out, "d.py")).source == PATCHED


def test_wrapper_size_updated(tmp_path):
    built = build(kwargs=RAW_KW, ckw=RAW_COMPRESS, width=100, joiner="\n", size_line=True)
    s = read_script(write(tmp_path, built.text))
    n_old = int(built.head.split("__wrapper_size__=")[1].split("\n")[0])
    delta = code_bytes(built.text) - n_old
    assert s.wrapper.wrapper_size_delta == delta and delta == len(str(n_old)) - 1
    big = PATCHED + "".join(f"w{i} = {i * 7 % 13}\n" for i in range(500))
    out = render(s, big)
    n_new = int(out.split("__wrapper_size__=")[1].split("\n")[0])
    assert n_new != n_old
    assert code_bytes(out) - n_new == delta
    # Only the number and the literal changed.
    head = built.head.replace(f"__wrapper_size__={n_old}", f"__wrapper_size__={n_new}")
    assert out.startswith(head) and out.endswith(built.tail)
    assert read_script(write(tmp_path, out, "s.py")).source == big


def test_wrapper_size_fixed_point_across_digit_change(tmp_path):
    # Start with a 3-digit size and grow the file past 1000 bytes: N gains a digit.
    built = build("x = 1\n", size_line=True)
    n_old = int(built.head.split("__wrapper_size__=")[1].split("\n")[0])
    assert n_old < 1000
    s = read_script(write(tmp_path, built.text))
    delta = s.wrapper.wrapper_size_delta
    big = "".join(f"h{i} = '{hashlib.sha256(str(i).encode()).hexdigest()}'\n" for i in range(30))
    out = render(s, big)
    n_new = int(out.split("__wrapper_size__=")[1].split("\n")[0])
    assert n_new >= 1000 and code_bytes(out) - n_new == delta


def test_rewrap_false_gives_plain_source(tmp_path):
    s = read_script(write(tmp_path, build(kwargs=RAW_KW, ckw=RAW_COMPRESS).text))
    assert render(s, PATCHED, rewrap=False) == PATCHED
    assert render(s, PATCHED, rewrap=True) != PATCHED


def test_render_raises_runtime_error_when_round_trip_fails(tmp_path, monkeypatch):
    s = read_script(write(tmp_path, build().text))
    real = source_mod.encode_payload
    monkeypatch.setattr(source_mod, "encode_payload", lambda w, src: real(w, src + "# tampered\n"))
    with pytest.raises(RuntimeError):
        render(s, PATCHED)


# --------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    p = tmp_path / "nope.py"
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "no such file" in assert_one_line_error(ei.value, p)
    assert ei.value.line is None and str(ei.value) == f"{p}: no such file"


def test_directory(tmp_path):
    with pytest.raises(SourceError) as ei:
        read_script(tmp_path)
    assert "directory" in assert_one_line_error(ei.value, tmp_path)


def test_unreadable(tmp_path, monkeypatch):
    p = write(tmp_path, PAYLOAD)

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    # chmod 000 does not stop root, so simulate the refusal.
    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "permission" in assert_one_line_error(ei.value, p)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file(tmp_path, text):
    p = write(tmp_path, text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "empty file" in assert_one_line_error(ei.value, p)


@pytest.mark.parametrize("data", [b"x = 1\n\x00\x01\x02", b"x = '\xff\xfe'\n"])
def test_binary_file(tmp_path, data):
    p = tmp_path / "bin.py"
    p.write_bytes(data)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "not a Python source file (binary)" in assert_one_line_error(ei.value, p)


@pytest.mark.parametrize(
    "text, line",
    [
        ("import os\nx = 1\ny = 1 +\nz = 2\n", 3),  # parser error
        ("a = 1\n  b = 2\n", 2),  # unexpected indent
        ("a = 1\nb = 2\nc = 'oops\nd = 4\n", 3),  # tokenizer error
        ("a = 1\nb = 2)\n", 2),  # tokenizer error
    ],
)
def test_syntax_error_in_plain_file_reports_line(tmp_path, text, line):
    p = write(tmp_path, text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    msg = assert_one_line_error(ei.value, p)
    assert ei.value.line == line and ei.value.col is not None
    assert msg.startswith(f"{p}:{line}: syntax error")


def test_syntax_error_inside_payload_names_payload_line(tmp_path):
    bad = "x = 1\ny = 2\nz = 'unterminated\n"
    p = write(tmp_path, build(bad, width=50, joiner="\n").text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    msg = assert_one_line_error(ei.value, p)
    assert "payload line 3" in msg
    assert ei.value.line == 2  # the exec statement's line in the wrapper


def test_corrupt_base64(tmp_path):
    built = build()
    text = built.head + '"abc\\"def"' + built.tail  # '"' is not a Base85 character
    p = write(tmp_path, text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    msg = assert_one_line_error(ei.value, p)
    assert "b85decode" in msg and "corrupt" in msg and ei.value.line == 2


def test_corrupt_b64_padding(tmp_path):
    built = build(encoding="b64decode")
    p = write(tmp_path, built.head + '"QUJDQ"' + built.tail)  # 5 characters: bad padding
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "b64decode" in assert_one_line_error(ei.value, p)


@pytest.mark.parametrize("codec", ["lzma", "zlib", "bz2", "gzip"])
def test_corrupt_compressed_data(tmp_path, codec):
    good = compress(codec, PAYLOAD.encode())
    bad = good[:8] + bytes(b ^ 0x5A for b in good[8:])
    p = write(tmp_path, build(codec=codec, blob=bad).text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    msg = assert_one_line_error(ei.value, p)
    assert "decompress" in msg and codec in msg and ei.value.line == 2


def test_truncated_compressed_data(tmp_path):
    good = compress("lzma", (PAYLOAD * 20).encode())
    p = write(tmp_path, build(blob=good[: len(good) // 2]).text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "decompress" in assert_one_line_error(ei.value, p)


def test_payload_not_utf8(tmp_path):
    p = write(tmp_path, build(blob=lzma.compress(b"x = '\xff'\n")).text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "not UTF-8" in assert_one_line_error(ei.value, p)


def test_indirection_names_the_decode_file(tmp_path):
    p = write(tmp_path, 'exec(open(__file__.replace("train_gpt.py","train_gpt_decode.py")).read())\n')
    with pytest.raises(SourceError) as ei:
        read_script(p)
    msg = assert_one_line_error(ei.value, p)
    assert "train_gpt_decode.py" in msg and "patch" in msg
    assert str(tmp_path / "train_gpt_decode.py") in msg


def test_indirection_with_plain_name(tmp_path):
    p = write(tmp_path, "import os\nexec(open('real_code.py').read())\n")
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "real_code.py" in assert_one_line_error(ei.value, p)


def test_path_read_text_indirection(tmp_path):
    p = write(tmp_path, "from pathlib import Path\nexec(Path(__file__).with_name('code.py').read_text())\n")
    with pytest.raises(SourceError) as ei:
        read_script(p)
    msg = assert_one_line_error(ei.value, p)
    assert "patch that file" in msg and str(tmp_path / "code.py") in msg


def test_two_wrappers_are_refused(tmp_path):
    built = build()
    p = write(tmp_path, built.text + built.text.split("\n", 1)[1])
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "more than one" in assert_one_line_error(ei.value, p) and ei.value.line == 3


def test_unsupported_codec(tmp_path):
    p = write(tmp_path, 'import brotli, base64\nexec(brotli.decompress(base64.b85decode("abc")))\n')
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "brotli" in assert_one_line_error(ei.value, p)


def test_keyword_values_are_never_evaluated(tmp_path, capsys):
    built = build(kwargs=',format=print("PWNED") or L.FORMAT_XZ')
    p = write(tmp_path, built.text)
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert "resolve" in assert_one_line_error(ei.value, p)
    assert "PWNED" not in capsys.readouterr().out


def test_constant_outside_allowlist_is_refused(tmp_path):
    p = write(tmp_path, build(kwargs=",memlimit=L.__name__").text)
    with pytest.raises(SourceError):
        read_script(p)


def test_wrapper_mixed_with_other_code_is_refused(tmp_path):
    p = write(tmp_path, build().text + "print('after')\n")
    with pytest.raises(SourceError) as ei:
        read_script(p)
    assert ei.value.line == 3 and "mixed" in assert_one_line_error(ei.value, p)


def test_source_error_format():
    assert str(SourceError("a.py", "bad\nthing", line=7, col=2)) == "a.py:7: bad thing"
    e = SourceError(Path("b.py"), "worse")
    assert str(e) == "b.py: worse" and (e.path, e.line, e.col, e.message) == ("b.py", None, None, "worse")


# --------------------------------------------------------------------------- write_atomic


def test_write_atomic_new_file_no_temp_left(tmp_path):
    p = tmp_path / "out.py"
    write_atomic(p, "a = 1\r\nb = 'é'\n")
    assert p.read_bytes() == "a = 1\r\nb = 'é'\n".encode()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.py"]


def test_write_atomic_backup_and_mode(tmp_path):
    p = tmp_path / "train_gpt.py"
    p.write_text("old\n")
    p.chmod(0o751)
    write_atomic(p, "new\n", backup_suffix=".orig")
    assert p.read_text() == "new\n"
    assert (tmp_path / "train_gpt.py.orig").read_text() == "old\n"
    assert stat.S_IMODE(p.stat().st_mode) == 0o751
    assert sorted(x.name for x in tmp_path.iterdir()) == ["train_gpt.py", "train_gpt.py.orig"]


def test_write_atomic_no_backup_without_suffix_or_target(tmp_path):
    p = tmp_path / "t.py"
    write_atomic(p, "x\n", backup_suffix=".bak")  # nothing to back up yet
    write_atomic(p, "y\n")
    assert p.read_text() == "y\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.py"]


def test_write_atomic_failure_leaves_target_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "t.py"
    p.write_text("keep\n")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_atomic(p, "new\n")
    assert p.read_text() == "keep\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["t.py"]


# --------------------------------------------------------------------------- property


STYLES = st.sampled_from(
    [
        dict(codec="lzma", encoding="b85decode", kwargs=RAW_KW, ckw=RAW_COMPRESS, width=100, joiner="\n", size_line=True),
        dict(codec="lzma", encoding="b85decode", width=100, joiner=""),
        dict(codec="lzma", encoding="b85decode", kwargs=RAW_KW, ckw=RAW_COMPRESS),
        dict(codec="zlib", encoding="a85decode", width=37, joiner="\n", prefix="b"),
        dict(codec="bz2", encoding="b64decode", width=64, joiner=" ", quote="'"),
        dict(codec="gzip", encoding="b32decode", width=80, joiner="\n", decode=True),
    ]
)
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=400)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(style=STYLES, text=TEXT)
def test_property_read_render_recovers_payload(style, text):
    payload = f"x = {text!r}\n"
    with tempfile.TemporaryDirectory() as d:
        s = read_script(write(Path(d), build(**style).text))
        out = render(s, payload)
        p = write(Path(d), out, "re.py")
        again = read_script(p)
        assert again.source == payload
        w, w2 = s.wrapper, again.wrapper
        assert (w2.codec, w2.encoding, w2.decompress_kwargs, w2.quote, w2.prefix) == (
            w.codec, w.encoding, w.decompress_kwargs, w.quote, w.prefix
        )
        # A short payload may fit one piece; otherwise the piece width is kept.
        assert w2.piece_width in (None, w.piece_width)
        if s.wrapper.has_wrapper_size:
            assert code_bytes(out) - int(again.wrapper.size_node.value) == s.wrapper.wrapper_size_delta


@pytest.mark.parametrize("name", ["tokenstream_readable.py", "wrapped_lzma_raw.py", "wrapped_lzma_oneline.py"])
def test_read_script_hands_over_the_parsed_code_it_patches(name):
    # The main job patches script.module instead of parsing the code again: it must be
    # the code to patch (the payload of a wrapper), not the wrapper file.
    script = read_script(Path(__file__).resolve().parent.parent / "fixtures" / name)
    assert script.module is not None
    assert script.module.code == script.source


def test_read_script_with_a_bom_leaves_parsing_to_the_patcher(tmp_path):
    path = tmp_path / "bom.py"
    path.write_text("\ufeffx = 1\n", encoding="utf-8")
    assert read_script(path).module is None


def test_long_one_line_payload_reads_and_renders(tmp_path):
    # ~470 pieces of 100 characters on one line nest ~470 levels of implicit
    # concatenation; reading, rendering and reading back must not hit the recursion limit.
    payload = PAYLOAD + "NOISE = " + repr(os.urandom(36_000).hex()) + "\n"
    built = build(payload, width=100)
    assert built.text.count('""') > 400
    script = read_script(write(tmp_path, built.text))
    assert script.source == payload
    out = render(script, payload + "# patched\n")
    assert read_script(write(tmp_path, out, "again.py")).source == payload + "# patched\n"


def test_rewrap_of_a_payload_with_many_pieces_reads_back(tmp_path):
    # A one-line wrapper of 100-character pieces: a grown payload of ~600 pieces nests
    # its ConcatenatedString deeper than the default recursion limit allows libcst to visit.
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "wrapped_lzma_oneline.py"
    script = read_script(fixture)
    noise = "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(1500))
    grown = script.source + f"\nPADDING = {noise!r}\n"
    out = tmp_path / "train_gpt.py"
    out.write_text(render(script, grown))
    assert out.read_text().count('""') > 400
    assert read_script(out).source == grown
