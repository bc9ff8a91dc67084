"""The minifier's worker minifies a module unit by unit (top-level compound statements,
runs of simple statements) and reuses the units it has seen; the bytes must be exactly
what `pyminify` gives for the whole module, or the worker must minify it whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "patcher"))
import minify_worker  # noqa: E402  (a plain script, imported as the worker runs it)

from patcher.code_size import Counting  # noqa: E402

# The flags of the records that count minified (2026-04-27), and the package's default.
RECORD_FLAGS = ["--no-rename-locals", "--no-hoist-literals", "--remove-literal-statements", "--remove-asserts", "--prefer-single-line"]
PLAIN_FLAGS = ["--no-rename-locals", "--no-hoist-literals", "--remove-literal-statements"]

HEAD = '''"""A training script."""
from __future__ import annotations
import os
import sys
import torch
'''
BODY = '''
class Hyperparameters:
    """Settings."""
    seed: int = int(os.environ.get("SEED", 1337))
    lr = 0.02

@torch.no_grad()
# a comment between the decorator and the def
def evaluate(model, x):
    assert x is not None
    if x.numel() == 0:
        raise ValueError()
    return model(x)

x = 1; y = 2
z = (x +
     y)
try:
    import brotli
except ImportError:
    brotli = None

for i in range(2):
    pass

if __name__ == "__main__":
    print(Hyperparameters.lr, x, y, z)
'''


def units(source: str, flags=RECORD_FLAGS, memo=None) -> tuple[bytes, dict]:
    return minify_worker.minify_by_units(source.encode("utf-8"), list(flags), {} if memo is None else memo)


def whole(source: str, flags=RECORD_FLAGS) -> bytes:
    return minify_worker.minify(source.encode("utf-8"), list(flags))


@pytest.mark.parametrize("flags", [RECORD_FLAGS, PLAIN_FLAGS])
@pytest.mark.parametrize(
    "source",
    [
        HEAD + BODY,
        "#!/usr/bin/env python\n" + HEAD + BODY,  # the shebang is kept, on the whole
        "\ufeff" + HEAD + BODY,
        (HEAD + BODY).replace("\n", "\r\n"),
        HEAD + "x = 1\f\ny = 2\n" + BODY,  # a form feed is not a line break for `ast`
        HEAD + "def f():\n    return vars()\n" + BODY.replace("raise ValueError()", "raise ValueError('x')"),  # vars, but no raise E()
    ],
)
def test_units_give_the_whole_modules_bytes(source, flags):
    got, how = units(source, flags)
    assert got == whole(source, flags)
    assert "units" in how and how["units"][1] == 0 and how["units"][0] > 5


@pytest.mark.parametrize(
    "source, reason",
    [
        (HEAD + "class ValueError(Exception):\n    pass\n" + BODY, "shadow builtins: ValueError"),  # raise ValueError() keeps its brackets
        (HEAD + "def f():\n    return globals()\n" + BODY, "uses globals and raises"),  # tainted: brackets kept everywhere
        (HEAD + "from math import *\n" + BODY, "a star or timeit import and raises"),
        (HEAD + "def f():\n    return f.__doc__\n" + BODY, "uses __doc__"),  # docstrings kept everywhere
        (HEAD + "if True:\n    w = 3\n" + BODY, "another kind of statement"),  # inlined: joins its neighbours
        (HEAD + "if False:\n    w = 3\n" + BODY, "another kind of statement"),  # dropped
        (HEAD + "global q\n" + BODY, "module-level global"),
    ],
)
def test_a_module_read_whole_by_the_minifier_is_minified_whole(source, reason):
    got, how = units(source)
    assert got == whole(source)
    assert reason in how["whole"]


def test_flags_that_read_the_whole_module_minify_it_whole():
    source = HEAD + BODY
    for flags, missing in ((["--no-hoist-literals"], "--no-rename-locals"), (["--no-rename-locals"], "--no-hoist-literals"), (PLAIN_FLAGS + ["--rename-globals"], "--rename-globals")):
        got, how = units(source, flags)
        assert got == whole(source, flags) and missing in how["whole"]


def test_a_release_not_checked_minifies_whole(monkeypatch):
    monkeypatch.setattr(minify_worker, "UNIT_RELEASES", ("0.0.0",))
    monkeypatch.setattr(minify_worker, "_PLANS", {})  # no plan made under the real release
    got, how = units(HEAD + BODY)
    assert got == whole(HEAD + BODY) and "python-minifier" in how["whole"]


def test_the_source_is_kept_when_minifying_does_not_pay_as_pyminify_does(monkeypatch):
    import python_minifier.__main__ as command

    real = command.minify
    monkeypatch.setattr(command, "minify", lambda source, **options: real(source, **options) + "\n#" + "-" * 5000)  # longer than its input
    source = HEAD + BODY
    assert whole(source) == source.encode()
    assert units(source)[0] == source.encode()
    monkeypatch.setenv("PYMINIFY_FORCE_BEST_EFFORT", "1")  # the command's switch: the minified code, however long
    assert whole(source) != source.encode() and units(source)[0] != source.encode()


def test_the_units_seen_before_are_reused_and_only_the_changed_ones_minified():
    memo: dict = {}
    original = HEAD + BODY
    patched = original.replace("lr = 0.02", "lr = 0.03") + "\ndef _runtime():\n    return 1\n"
    first, how_first = units(original, memo=memo)
    second, how_second = units(patched, memo=memo)
    assert second == whole(patched) and first == whole(original)
    assert how_second["units"][0] == 2  # the changed class and the new function
    assert how_second["units"][1] == sum(how_first["units"]) - 1


SNIPPETS = [
    "import os\n",
    "import sys as system\n",
    "from math import sqrt\n",
    '"""a docstring"""\n',
    "assert 1 + 1 == 2\n",
    "x = 1; y = [1, 2, 3]\n",
    "def f(a, /, b=2, *c, d, **e):\n    '''doc'''\n    return None\n",
    "class A(object):\n    pass\n",
    "@property\ndef g():\n    raise RuntimeError()\n",
    "if x:\n    pass\nelse:\n    y = 2\n",
    "while 0:\n    pass\n",
    "try:\n    import numpy\nexcept ImportError:\n    raise\n",
    "with open('f') as h:\n    h.read()\n",
    "for k in range(3):\n    continue\n",
    "z: int = 3\n",
    "print(f'{x!r:>10}')\n",
    "v = vars()\n",
    "if True:\n    w = 4\n",
    "def h():\n    global G\n    G = 1\n",
    "class ValueError(Exception):\n    pass\n",
    "raise KeyError()\n",
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(SNIPPETS), min_size=1, max_size=8), st.sampled_from([RECORD_FLAGS, PLAIN_FLAGS]))
def test_any_sequence_of_statements_gives_the_whole_modules_bytes(pieces, flags):
    source = "".join(pieces)
    assert units(source, flags)[0] == whole(source, flags)


def test_the_session_counts_the_input_then_the_patched_code_reusing_its_units():
    counting = Counting("minified", tuple(RECORD_FLAGS), "lzma")
    original = HEAD + BODY
    patched = original.replace("lr = 0.02", "lr = 0.03")
    with counting.session() as session:
        before = session.start(original, original)
        after = session.start(patched, patched)
        assert before.result() == minify_worker.wrapper_bytes(whole(original), "lzma")
        assert after.result() == minify_worker.wrapper_bytes(whole(patched), "lzma")
    assert before.how["units"][1] == 0 and after.how["units"][0] == 1


SIZE_FUNCTION = '''
def _code_size(code):
    import brotli
    flags = ["--no-rename-locals", "--no-hoist-literals", "--remove-literal-statements"]
    out = subprocess.run(["pyminify", *flags, "-"], input=code, capture_output=True).stdout
    return len(brotli.compress(out))
'''


def test_a_guess_minifies_the_units_ahead_with_the_flags_the_size_function_names():
    import queue

    source = (HEAD + BODY + SIZE_FUNCTION).encode()
    assert minify_worker.guess_flags(__import__("ast").parse(source)) == (True, PLAIN_FLAGS)
    memos: dict = {}
    done = minify_worker.speculate(source, ["--ignored"], memos, queue.Queue())
    assert done > 5 and list(memos) == [tuple(PLAIN_FLAGS)]
    got, how = minify_worker.minify_by_units(source, PLAIN_FLAGS, memos[tuple(PLAIN_FLAGS)])
    assert got == minify_worker.minify(source, PLAIN_FLAGS) and how["units"] == [0, done]
    # asked with other flags, the count minifies its own units
    assert minify_worker.minify_by_units(source, RECORD_FLAGS, memos.setdefault(tuple(RECORD_FLAGS), {}))[1]["units"][1] == 0


def test_a_guess_stops_when_a_request_waits_and_needs_a_size_function():
    import queue

    waiting: queue.Queue = queue.Queue()
    waiting.put({"source": "x = 1\n"})
    assert minify_worker.speculate((HEAD + BODY + SIZE_FUNCTION).encode(), PLAIN_FLAGS, {}, waiting) == 0
    memos: dict = {}
    assert minify_worker.speculate((HEAD + BODY).encode(), PLAIN_FLAGS, memos, queue.Queue()) == 0 and not memos
