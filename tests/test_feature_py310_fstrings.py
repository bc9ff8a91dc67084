"""py310_fstrings: PEP 701 f-strings requoted so a real Python 3.10 compiles them."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
from patch_tables import assert_noop, assert_patch, notes_of

from patcher.cli import EXIT_BAD_INPUT, main
from patcher.patch import features_from, patch_source
from patcher.transforms.py310_fstrings import requote

ONLY = features_from(["py310_fstrings"], None)


def compiles_with(python: str, source: str) -> bool:
    done = subprocess.run([python, "-c", "import sys; compile(sys.stdin.read(), 'x', 'exec')"], input=source, text=True, capture_output=True)
    return done.returncode == 0


def ast_dump_312(python312: str, source: str) -> str:
    done = subprocess.run([python312, "-c", "import ast, sys; print(ast.dump(ast.parse(sys.stdin.read())))"], input=source, text=True, capture_output=True, check=True)
    return done.stdout


REWRITES = [
    pytest.param('log(f"  {cat}: {", ".join(sorted(c))}")\n', "log(f\"  {cat}: {', '.join(sorted(c))}\")\n", id="join-separator"),
    pytest.param('x = f"{getattr(m, "layers", [])} n"\n', "x = f\"{getattr(m, 'layers', [])} n\"\n", id="getattr-name"),
    pytest.param('x = f"{"a" if ok else "b"}"\n', "x = f\"{'a' if ok else 'b'}\"\n", id="conditional"),
    pytest.param("x = f'{d['k']}'\n", "x = f'{d[\"k\"]}'\n", id="single-quoted-outer"),
    pytest.param('x = f"say {f"{n}"}!"\n', "x = f\"say {f'{n}'}!\"\n", id="nested-f-string"),
    pytest.param('x = f"{a:{"w"}}"\n', "x = f\"{a:{'w'}}\"\n", id="field-in-a-format-spec"),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    result = assert_patch(before, after, only="py310_fstrings")
    assert notes_of(result, "py310_fstrings") == [(True, "nested same-quote f-string (PEP 701) requoted for Python 3.10", 1)]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites_compile_on_real_310_with_the_same_ast(before, after, python310, python312):
    assert not compiles_with(python310, before)
    assert compiles_with(python310, after)
    assert ast_dump_312(python312, before) == ast_dump_312(python312, after)


NONE = "no Python 3.12-only f-string"
CANNOT = "cannot rewrite for Python 3.10: "

# Unfixable rows: the transform leaves the script alone and reports the site as unfixable
# (the command then writes nothing: test_unfixable_forms_are_reported_with_line_and_nothing_written).
NOOPS = [
    pytest.param('x = f"{d[\'k\']}"\n', NONE, None, False, id="already-310-style"),
    pytest.param('x = f"""{d["k"]}"""\n', NONE, None, False, id="triple-quoted-outer-is-fine-on-310"),
    pytest.param('x = "{}".format(d["k"])\n', NONE, None, False, id="not-an-f-string"),
    pytest.param('x = f"{a!r:>{width}}"\n', NONE, None, False, id="nested-format-spec"),
    pytest.param('import os\n\nx = f"{"\\n".join(xs)}"\n', CANNOT + "backslash inside a replacement field (PEP 701, Python 3.12+)", 3, True, id="unfixable-backslash-in-field"),
    pytest.param('x = f"{a # note\n}"\n', CANNOT + "comment inside a replacement field (PEP 701, Python 3.12+)", 1, True, id="unfixable-comment-in-field"),
    pytest.param(
        'x = f"{a +\n b}"\n',
        CANNOT + "line break inside a replacement field of a single-quoted f-string (PEP 701, Python 3.12+)",
        1,
        True,
        id="unfixable-line-break-in-a-single-quoted-field",
    ),
    pytest.param(
        'x = f"{d["it\'s"]}"\n',
        CANNOT + "a string inside a replacement field would need an escape in the other quote (no Python 3.10 spelling)",
        1,
        True,
        id="unfixable-inner-text-holds-other-quote",
    ),
    pytest.param(
        'x = f"{\'"\' + "a"}"\n',
        CANNOT + "a string inside a replacement field holds the f-string's own quote (no Python 3.10 spelling)",
        1,
        True,
        id="unfixable-other-quoted-string-holds-the-own-quote",
    ),
    pytest.param(
        'x = f"{f"{x}\'"}"\n',
        CANNOT + "a nested f-string holds the other quote character (no Python 3.10 spelling)",
        1,
        True,
        id="unfixable-nested-f-string-holds-other-quote",
    ),
]


@pytest.mark.parametrize("source, reason, line, unfixable", NOOPS)
def test_noop(source, reason, line, unfixable):
    assert_noop(source, reason, line, only="py310_fstrings", unfixable=unfixable)


@pytest.mark.parametrize(
    "source, form",
    [
        pytest.param('x = f"{"\\n".join(xs)}"\n', "backslash", id="backslash-in-field"),
        pytest.param('x = f"{a # note\n}"\n', "comment", id="comment-in-field"),
        pytest.param('x = f"{d["it\'s"]}"\n', "other quote", id="inner-text-holds-other-quote"),
    ],
)
def test_unfixable_forms_are_reported_with_line_and_nothing_written(tmp_path, capsys, source, form):
    script = tmp_path / "train_gpt.py"
    script.write_text("import os\n\n" + source)
    out = tmp_path / "out.py"
    assert main([str(script), "-o", str(out), "--only", "py310_fstrings"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{script}:3" in err and form in err
    assert not out.exists()


def test_only_py310_fstrings_leaves_the_loader_alone():
    source = Path(__file__).resolve().parent.parent.joinpath("fixtures", "tokenstream_readable.py").read_text()
    source += '\nlabel = f"{", ".join(["a", "b"])}"\n'
    result = patch_source(source, ONLY)
    assert result.applied == ["py310_fstrings"]
    # The whole output, exactly: the fixture (a full training script kept in fixtures/, too
    # long to write out here) with that one f-string requoted and nothing else changed.
    assert result.source == source.replace('f"{", ".join(["a", "b"])}"', "f\"{', '.join(['a', 'b'])}\"")
    compile(result.source, "x", "exec")
    ast.parse(result.source, feature_version=(3, 10))


def test_requote_gives_the_whole_source_requoted():
    # `_make_train_loader` marks a patched script: patch_source leaves such a script
    # alone, requote (check imports it, verify loads it) requotes it all the same.
    before = 'import os\n\ndef _make_train_loader():\n    pass\n\nlabel = f"{", ".join(names)} in {os.sep}"\nx = f"{d["k"]}" if ok else "-"\n'
    after = "import os\n\ndef _make_train_loader():\n    pass\n\nlabel = f\"{', '.join(names)} in {os.sep}\"\nx = f\"{d['k']}\" if ok else \"-\"\n"
    assert requote(before) == after
    assert requote(after) == after


@pytest.mark.parametrize(
    "source",
    [
        pytest.param('x = f"{"\\n".join(xs)}"\n', id="backslash-in-field"),
        pytest.param('x = f"{d["it\'s"]}"\n', id="inner-text-holds-other-quote"),
        pytest.param("def f(:\n", id="not-python"),
    ],
)
def test_requote_is_none_when_it_cannot(source):
    assert requote(source) is None
