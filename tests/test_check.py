"""Tests for patcher.check.check: compile under a real target Python, import smoke, one-file warnings.

Tests that need a real interpreter of a given version skip (saying which) when none is
installed; the grammar-check fallback is tested by making `find_python` find nothing.
"""

from __future__ import annotations

import base64
import json
import lzma
import os
import platform
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

import patcher.check.compile_check as compile_check
import patcher.check.import_smoke as import_smoke_mod
import patcher.check.interpreters as interpreters
import patcher.check.self_contained as self_contained
from patcher.check.check import CheckResult, check_file, compile_source, find_python, import_smoke
from patcher.read.source import SourceError

# Line 3 holds a nested same-quote f-string: fine on 3.12, a SyntaxError on 3.10 / 3.11.
PEP701 = 'import os\nd = {"k": 1}\nmsg = f"value {d["k"]}"\n'
PEP701_LINE, PEP701_COL = 3, 7  # the f-string starts at column 7 of line 3

needs_310 = pytest.mark.usefixtures("python310")  # tests/conftest.py: skipped when none is installed
needs_312 = pytest.mark.usefixtures("python312")


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _line_of(source: str, needle: str) -> int:
    """1-based line of the first line containing `needle`."""
    return next(i for i, line in enumerate(source.splitlines(), 1) if needle in line)


def _no_python(monkeypatch) -> None:
    monkeypatch.setattr(compile_check, "find_python", lambda target="3.10": (None, ""))


# --------------------------------------------------------------------------- find_python


@needs_310
def test_find_python_finds_310_through_pyenv_without_path(monkeypatch):
    """With no python3.10 on PATH the pyenv versions folder still supplies one."""
    root = interpreters._pyenv_root()
    if not list((Path(root) / "versions").glob("3.10*/bin/python3.10")):
        pytest.skip(f"no Python 3.10 under pyenv root {root}")
    monkeypatch.setenv("PATH", "/nonexistent")
    path, version = find_python("3.10")
    assert path is not None and os.path.realpath(path).startswith(os.path.realpath(root))
    assert version.startswith("3.10.")
    assert "shims" not in path  # the real executable, not a pyenv shim


@needs_310
def test_find_python_reports_the_version_it_ran():
    path, version = find_python("3.10")
    out = subprocess.run([path, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True)
    assert out.stdout.strip() == version


def test_find_python_accepts_an_explicit_path():
    path, version = find_python(sys.executable)
    assert path == sys.executable
    assert version == platform.python_version()


@pytest.mark.parametrize("target", ["9.99", "/no/such/python", "not-a-python-xyz"])
def test_find_python_gives_none_for_what_does_not_exist(target):
    assert find_python(target) == (None, "")


# --------------------------------------------------------------------------- compile_source


@needs_310
def test_compile_on_real_310_names_the_pep701_fstring_and_its_position(python310):
    result = compile_source(PEP701, "t.py", "3.10")
    assert result.real and not result.ok
    assert result.python.startswith("3.10.") and python310 in result.python
    assert (result.line, result.col) == (PEP701_LINE, PEP701_COL)
    assert "PEP 701" in result.error and "3.12" in result.error
    assert "py310_fstrings" in result.error


@needs_310
@pytest.mark.parametrize(
    "line, kind",
    [
        ("y = f\"{'\\n'.join(xs)}\"\n", "backslash"),
        ('y = f"""{len(xs) # count\n}"""\n', "comment"),
    ],
    ids=["backslash", "comment"],
)
def test_compile_on_real_310_names_other_pep701_forms(line, kind):
    result = compile_source("xs = []\n" + line, "t.py", "3.10")
    assert not result.ok and result.line == 2
    assert f"{kind} inside an f-string replacement field" in result.error
    assert "py310_fstrings" not in result.error  # the rewrite cannot fix these


@needs_310
def test_compile_on_real_310_plain_error_has_no_fstring_hint():
    result = compile_source("x = 1\ndef f(:\n    pass\n", "t.py", "3.10")
    assert not result.ok and result.line == 2
    assert "PEP 701" not in result.error


@needs_312
def test_compile_on_312_accepts_the_pep701_fstring():
    result = compile_source(PEP701, "t.py", "3.12")
    assert result.real and result.ok and result.error is None
    assert result.python.startswith("3.12.")


def test_fallback_without_interpreter_still_flags_pep701(monkeypatch):
    _no_python(monkeypatch)
    result = compile_source(PEP701, "t.py", "3.10")
    assert not result.real and result.python is None
    assert not result.ok
    assert (result.line, result.col) == (PEP701_LINE, PEP701_COL)
    assert "PEP 701" in result.error
    assert "no real Python 3.10 ran" in result.error


def test_fallback_scan_catches_pep701_when_the_running_parser_accepts_it(monkeypatch):
    """On a 3.12+ running Python ast.parse(feature_version=(3, 10)) passes PEP 701 f-strings."""
    _no_python(monkeypatch)
    monkeypatch.setattr(compile_check, "ast", types.SimpleNamespace(parse=lambda *args, **kwargs: None))
    result = compile_source(PEP701, "t.py", "3.10")
    assert not result.ok and not result.real
    assert (result.line, result.col) == (PEP701_LINE, PEP701_COL)
    assert "nested same-quote f-string" in result.error


def test_fallback_passes_a_clean_file_and_says_no_real_python_ran(monkeypatch):
    _no_python(monkeypatch)
    result = compile_source("import os\nprint(f\"{os.sep!r} {'x'}\")\n", "t.py", "3.10")
    assert result.ok and not result.real and result.python is None
    assert "no real Python 3.10 ran; grammar check only" in result.error


def test_fallback_uses_the_target_grammar(monkeypatch):
    """A 3.11-only construct fails the 3.10 grammar check even on a newer running Python."""
    if sys.version_info < (3, 11):
        pytest.skip("needs a running Python >= 3.11 to parse except*")
    _no_python(monkeypatch)
    code = "try:\n    pass\nexcept* ValueError:\n    pass\n"
    assert not compile_source(code, "t.py", "3.10").ok
    assert compile_source(code, "t.py", "3.11").ok


# --------------------------------------------------------------------------- import_smoke

DATACLASS_MODULE = _src(
    """
    from __future__ import annotations
    from dataclasses import dataclass

    @dataclass
    class Hyperparameters:
        steps: int = 10
        lr: float = 0.1
    """
)

NAIVE_LOADER = _src(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("naive_mod", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not registered in sys.modules first
    """
)


def test_dataclass_trap_naive_loader_fails_import_smoke_passes(tmp_path):
    path = tmp_path / "naive_mod.py"
    path.write_text(DATACLASS_MODULE)
    naive = subprocess.run([sys.executable, "-c", NAIVE_LOADER, str(path)], capture_output=True, text=True)
    assert naive.returncode != 0
    assert "AttributeError" in naive.stderr

    result = import_smoke(DATACLASS_MODULE, "naive_mod.py")
    assert result.ok, result.error
    assert not result.partial and result.ran == result.total


def test_guarded_script_is_not_run_as_main(tmp_path):
    marker = tmp_path / "main_ran"
    code = f'import os\ndef main():\n    open({str(marker)!r}, "w").close()\nif __name__ == "__main__":\n    main()\n'
    result = import_smoke(code, "train_gpt.py")
    assert result.ok, result.error
    assert not marker.exists()
    assert not result.partial and result.ran == result.total == 3  # a guarded script is imported whole


STUB_SCRIPT = _src(
    """
    import numpy as np
    from flash_attn_interface import flash_attn_func
    import some_missing_pkg.sub
    import triton_like_missing as tlm

    @tlm.jit
    def kernel(x):
        return x

    class Op(some_missing_pkg.sub.Function):
        pass

    OP = Op()
    BLOCK = tlm.next_power_of_2(64) * 2
    ATTN = flash_attn_func
    assert callable(kernel) and kernel(3) == 3  # a stub decorator keeps the function
    """
)


def test_missing_gpu_packages_are_stubbed_and_reported():
    result = import_smoke(STUB_SCRIPT, "train_gpt.py")
    assert result.ok, result.error
    for name in ("flash_attn_interface", "some_missing_pkg", "some_missing_pkg.sub", "triton_like_missing"):
        assert name in result.stubbed
    assert "numpy" not in result.stubbed


def test_only_the_scripts_own_imports_are_stubbed(tmp_path, monkeypatch):
    """A library's optional import of a missing module still fails inside that library."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "optional_user.py").write_text(
        "try:\n    import missing_optional_dep\n    HAVE = True\nexcept ImportError:\n    HAVE = False\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(lib))
    code = "import optional_user\nassert optional_user.HAVE is False, 'stubbed inside a library'\n"
    result = import_smoke(code, "train_gpt.py")
    assert result.ok, result.error
    assert result.stubbed == []


def test_error_reports_type_message_and_script_line():
    code = _src(
        """
        import os

        def load_config():
            raise ValueError("bad")

        CONFIG = load_config()

        if __name__ == "__main__":
            pass
        """
    )
    result = import_smoke(code, "train_gpt.py")
    assert not result.ok
    assert "ValueError: bad" in result.error
    raise_line = _line_of(code, "raise ValueError")
    assert f"line {raise_line} in load_config" in result.error
    assert result.line == raise_line


def test_script_printing_to_stdout_does_not_confuse_the_result():
    code = 'import sys\nprint("{not json")\nsys.stdout = open("/dev/null", "w")\nprint("x")\nif __name__ == "__main__": pass\n'
    result = import_smoke(code, "train_gpt.py")
    assert result.ok, result.error


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("forked", [False, True], ids=["fresh-interpreter", "forked-from-warm-process"])
def test_timeout_kills_the_import_and_its_children(tmp_path, monkeypatch, forked):
    import patcher.check.import_smoke

    monkeypatch.setattr(patcher.check.import_smoke, "_FORKED_SMOKE", forked)
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("SMOKE_PID_FILE", str(pid_file))
    code = _src(
        """
        import os, subprocess, time
        child = subprocess.Popen(["sleep", "600"])
        open(os.environ["SMOKE_PID_FILE"], "w").write(str(child.pid))

        def wait_forever():
            while True:
                time.sleep(1)

        wait_forever()

        if __name__ == "__main__":
            pass
        """
    )
    start = time.monotonic()
    result = import_smoke(code, "train_gpt.py", timeout=3)
    elapsed = time.monotonic() - start
    assert not result.ok
    assert "timed out after 3 s" in result.error
    assert elapsed < 3 + 5
    if Path("/proc").is_dir() and pid_file.exists():
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 3
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the script's own child process outlived the timeout"


def test_forked_smoke_reports_like_a_fresh_interpreter(monkeypatch):
    # Tree mode forks the import smoke from a worker that has torch imported; the
    # result (ok, error with its line, stubbed modules) must be the same.
    import patcher.check.import_smoke

    code = "import flash_attn_interface\nimport torch\nX = 1\nraise ValueError('boom')\nif __name__ == '__main__':\n    pass\n"
    results = []
    for forked in (False, True):
        monkeypatch.setattr(patcher.check.import_smoke, "_FORKED_SMOKE", forked)
        r = import_smoke(code, "train_gpt.py", timeout=60)
        results.append((r.ok, r.error, r.line, r.stubbed))
    assert results[0] == results[1]
    assert results[0][0] is False and "ValueError: boom" in results[0][1] and results[0][2] == 4
    assert results[0][3] == ["flash_attn_interface"]


# A miniature modded-nanogpt: definitions, then training at top level, no __main__ guard.
TOP_LEVEL_HEAD = _src(
    '''
    """Miniature top-level training script."""
    from __future__ import annotations
    import functools
    import os
    from dataclasses import dataclass
    from typing import TYPE_CHECKING

    import torch
    import torch.distributed as dist
    try:
        from flash_attn_interface import flash_attn_func
    except ImportError:
        flash_attn_func = None
    if TYPE_CHECKING:
        from collections.abc import Iterator

    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    MARKER = os.environ.get("SMOKE_MARKER", "marker.txt")
    RANK = int(os.environ.get("RANK", "0"))

    @dataclass
    class Hyperparameters:
        steps: int = int(os.environ.get("STEPS", 3))
        lr: float = 0.02

    class Model(torch.nn.Module):
        def forward(self, x):
            return x * 2

    @functools.lru_cache
    def schedule(step: int) -> float:
        return 1.0 - step / 10

    def start_training():
        with open(MARKER, "w") as f:
            f.write("training started")
    '''
)

FIRST_EXECUTABLE = {
    "dist_init": 'dist.init_process_group(backend="gloo")',
    "call": "start_training()",
    "for_loop": "for step in range(3):\n    start_training()",
    "with_block": "with open(MARKER, 'w') as f:\n    f.write('started')",
    "if_block": "if RANK == 0:\n    start_training()",
    "assign_from_call": "model = Model()",
    "assert": "assert RANK == 0",
    "cuda_in_default": "def pick(n=torch.cuda.device_count()):\n    return n",
}


# Definitions after the training code: they run too, and a later one may need a name
# only the training code binds (then it is skipped as well, and named).
TOP_LEVEL_TAIL = _src(
    """
    def later_helper(x):
        return schedule(x) * 2

    LATER_CONSTANT = len("abc")

    class LaterModel(Model):
        ran = open(os.environ["SMOKE_LATER"], "w").close()  # proves the definitions after the training code ran

    def uses_the_model(lr=model):
        return lr
    """
)


@pytest.mark.parametrize("name", list(FIRST_EXECUTABLE), ids=list(FIRST_EXECUTABLE))
def test_top_level_training_script_runs_every_definition_and_skips_the_work(name, tmp_path, monkeypatch):
    marker, later = tmp_path / "marker.txt", tmp_path / "later.txt"
    monkeypatch.setenv("SMOKE_MARKER", str(marker))
    monkeypatch.setenv("SMOKE_LATER", str(later))
    work = FIRST_EXECUTABLE[name] + "\nmodel = Model()\nstart_training()\nfor step in range(3):\n    start_training()\n"
    code = TOP_LEVEL_HEAD + "\n" + work + "\n" + TOP_LEVEL_TAIL
    first_work = len(TOP_LEVEL_HEAD.splitlines()) + 2
    assert code.splitlines()[first_work - 1] == FIRST_EXECUTABLE[name].splitlines()[0]

    result = import_smoke(code, "train_gpt.py")
    assert result.ok, result.error
    assert not marker.exists(), "importing started training"
    assert later.exists(), "the definitions after the training code did not run"
    assert result.partial
    # Skipped: the first executable, model = Model(), the call, the loop, and the
    # function whose default needs `model`; nothing else.
    skipped_lines = [int(s.split(":")[0].removeprefix("line ")) for s in result.skipped]
    assert skipped_lines[0] == first_work
    assert any("uses_the_model" in s and "needs model" in s for s in result.skipped), result.skipped
    assert not any("later_helper" in s or "LaterModel" in s or "LATER_CONSTANT" in s for s in result.skipped)
    assert len(result.skipped) == 5 and result.ran == result.total - 5
    assert "flash_attn_interface" in result.stubbed


def test_an_error_in_a_definition_after_the_training_code_is_found_at_its_line():
    code = "import os\n\nstart = os.getpid()\nprint('training')\n\ndef f():\n    return 1\n\nX = undefined_at_import\n"
    result = import_smoke(code, "train_gpt.py")
    assert not result.ok
    assert "NameError" in result.error and result.line == 9
    assert result.skipped == ["line 3: start = os.getpid()", "line 4: print('training')"]


def test_top_level_skips_keep_line_numbers_for_errors():
    code = "import os\n\ndef f():\n    raise KeyError('RANK')\n\nf()\nX = f  # cheap\nY = {}['a']\n"
    # f() (line 6) does work and is skipped; the subscript of a literal at line 8 is
    # cheap and runs, and its KeyError names line 8 of the script, not of a shortened copy.
    result = import_smoke(code, "train_gpt.py")
    assert not result.ok and result.line == 8 and result.skipped == ["line 6: f()"]


def test_launcher_environment_reads_are_work():
    code = "import os\nrank = int(os.environ['RANK'])\nworld = rank + 1\ndef f(r=world):\n    return r\n"
    result = import_smoke(code, "train_gpt.py")
    assert result.ok, result.error
    assert [s.split(":")[0] for s in result.skipped] == ["line 2", "line 3", "line 4"]
    assert result.ran == 1 and result.total == 4


# --------------------------------------------------------------------------- check_file


def _wrap(payload: str) -> str:
    """An lzma + base85 exec wrapper in the records' style."""
    blob = lzma.compress(payload.encode(), format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}])
    encoded = base64.b85encode(blob).decode()
    return (
        "import lzma as L,base64 as B\n"
        f'exec(L.decompress(B.b85decode("{encoded}"),format=L.FORMAT_RAW,filters=[{{"id":L.FILTER_LZMA2}}]))\n'
    )


@needs_310
def test_wrapped_script_wrapper_compiles_but_payload_fails_on_310(tmp_path, python310):
    """py_compile on the file passes on 3.10; the payload inside does not."""
    path = tmp_path / "train_gpt.py"
    path.write_text(_wrap(PEP701))
    py_compile = subprocess.run([python310, "-m", "py_compile", str(path)], capture_output=True)
    assert py_compile.returncode == 0  # what existing checkers see

    result = check_file(path, "3.10", run_import=False)
    assert result.wrapper_compile is not None
    assert result.wrapper_compile.ok and result.wrapper_compile.where == "file"
    assert not result.compile.ok and result.compile.where == "payload"
    assert result.compile.line == PEP701_LINE  # a payload line, not the wrapper's line 2
    assert "PEP 701" in result.compile.error
    assert not result.ok
    assert result.code_bytes == path.stat().st_size


def test_wrapped_script_import_smoke_runs_the_payload(tmp_path):
    payload = "import os\nfrom flash_attn_interface import flash_attn_func\nVALUE = 1\nif __name__ == '__main__':\n    pass\n"
    path = tmp_path / "train_gpt.py"
    path.write_text(_wrap(payload))
    result = check_file(path, "3.10")
    assert result.imports is not None and result.imports.ok, result.imports.error
    assert result.imports.stubbed == ["flash_attn_interface"]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the running Python compiles PEP 701 f-strings")
def test_pep701_payload_is_imported_requoted_and_says_so(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text(PEP701)
    result = check_file(path, "3.10")
    assert result.imports.ok, result.imports.error
    assert "requoted" in result.imports.note


def test_import_is_not_attempted_when_nothing_makes_it_compile(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text('import os\n\nx = f"{"\\n".join(["a"])}"\n')
    result = check_file(path, "3.10")
    assert not result.imports.ok
    assert "cannot compile" in result.imports.error and result.imports.line == 3


SELF_CONTAINED = _src(
    """
    import glob
    import os
    import helper
    from pathlib import Path

    import numpy

    files = sorted(glob.glob("./data/*.bin"))
    shards = os.path.join(os.path.dirname(__file__), "data", "fineweb_train_*.bin")
    code = open(__file__).read()
    here = os.path.dirname(os.path.abspath(__file__))

    def main():
        exec(open(__file__.replace("train_gpt.py", "train_gpt_decode.py")).read())
        kernel_src = (Path(__file__).parent / "kernels.cu").read_text()
        extra = os.path.join(here, "extra_module.py")

    if __name__ == "__main__":
        main()
    """
)


def test_self_contained_warnings_name_file_and_line(tmp_path):
    (tmp_path / "helper.py").write_text("X = 1\n")
    path = tmp_path / "train_gpt.py"
    path.write_text(SELF_CONTAINED)
    result = check_file(path, "3.10", run_import=False)
    text = "\n".join(result.warnings)
    expected = {
        "helper": _line_of(SELF_CONTAINED, "import helper"),
        "train_gpt_decode.py": _line_of(SELF_CONTAINED, "train_gpt_decode.py"),
        "kernels.cu": _line_of(SELF_CONTAINED, "kernels.cu"),
        "extra_module.py": _line_of(SELF_CONTAINED, "extra_module.py"),
    }
    assert len(result.warnings) == len(expected), text
    for name, line in expected.items():
        assert any(name in w and f"line {line} " in w for w in result.warnings), (name, text)
    assert "numpy" not in text and ".bin" not in text and "glob" not in text


def test_no_warning_without_sibling_module(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text("import helper\nimport glob\nfiles = glob.glob('./data/*.bin')\n")
    assert check_file(path, "3.10", run_import=False).warnings == []


def test_wrapped_warnings_use_payload_lines(tmp_path):
    (tmp_path / "helper.py").write_text("X = 1\n")
    path = tmp_path / "train_gpt.py"
    path.write_text(_wrap("import os\n\n\nimport helper\n"))
    result = check_file(path, "3.10", run_import=False)
    assert len(result.warnings) == 1 and "payload line 4 imports helper" in result.warnings[0]


def test_as_dict_has_the_documented_keys(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text("import os\nif __name__ == '__main__':\n    pass\n")
    result = check_file(path, "3.10")
    assert isinstance(result, CheckResult) and result.ok
    data = result.as_dict()
    json.dumps(data)
    assert {"file", "compile", "import", "code_bytes", "warnings"} <= set(data)
    assert {"python", "ok", "error", "line"} <= set(data["compile"])
    assert {"ok", "partial", "total", "ran", "skipped", "stubbed", "error"} <= set(data["import"])
    assert {"verdict", "skipped", "undefined", "original_ok"} <= set(data)
    assert data["verdict"] == "ok" and data["undefined"] == [] and data["original_ok"] is None
    assert data["file"] == str(path) and data["code_bytes"] == path.stat().st_size
    assert check_file(path, "3.10", run_import=False).as_dict()["import"] is None


@pytest.mark.parametrize("content", [None, "", "   \n"], ids=["missing", "empty", "blank"])
def test_check_file_raises_source_error_on_bad_input(tmp_path, content):
    path = tmp_path / "train_gpt.py"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SourceError):
        check_file(path)


def test_check_of_a_150kb_script_passes(tmp_path):
    """About the size of the largest records, importing torch (how long it takes is a
    benchmark's question, not a test's: a loaded machine would fail a timed test)."""
    body = "".join(
        f"def helper_{i}(x, scale={i}):\n    '''Helper {i}.'''\n    y = x * scale + {i}\n    return y\n\n\n"
        for i in range(1800)
    )
    code = "import os\nimport torch\n\n\n" + body + "if __name__ == '__main__':\n    pass\n"
    path = tmp_path / "train_gpt.py"
    path.write_text(code)
    assert path.stat().st_size > 140_000
    result = check_file(path, "3.10")
    assert result.ok and result.verdict == "ok", result.as_dict()
    assert result.imports.ran == result.imports.total == 1803 and result.undefined == []


def test_definitions_keep_a_run_name_built_from_a_uuid():
    # modded-nanogpt: `run_id = f"... {str(uuid.uuid4())[0:5]}"` at the top, then
    # `run_id: str = run_id` as a dataclass default; dropping the first breaks the class.
    from patcher.check.import_smoke import definitions_only

    source = (
        "import uuid\nfrom dataclasses import dataclass\n"
        "run_id = f\"Baseline - {str(uuid.uuid4())[0:5]}\"\n"
        "@dataclass\nclass Hyperparameters:\n    run_id: str = run_id\n"
        "args = Hyperparameters()\nprint(args)\n"
    )
    kept = definitions_only(source)
    assert "run_id = f\"Baseline" in kept
    assert "args = Hyperparameters()" not in kept
    namespace: dict = {}
    exec(compile(kept, "script.py", "exec"), namespace)
    assert namespace["Hyperparameters"]().run_id.startswith("Baseline - ")


def test_check_uses_the_tree_it_is_handed_instead_of_parsing_again(tmp_path, monkeypatch):
    import libcst

    import patcher.check.check as check_mod
    from patcher.read.source import Script

    code = "import os\nimport helper\n\ndef main():\n    pass\n"
    (tmp_path / "helper.py").write_text("")
    path = tmp_path / "train_gpt.py"
    path.write_text(code)
    script = Script(path, code, code, module=libcst.parse_module(code))

    def no_parse(source):
        raise AssertionError("parsed again")

    monkeypatch.setattr(compile_check, "_parse_text", no_parse)
    result = check_mod.check_file(path, run_import=False, script=script)
    assert any("imports helper" in w for w in result.warnings)


@pytest.mark.parametrize("name", ["tokenstream_readable", "shuffled_minified", "generator_toplevel", "batch_switch", "document_packing"])
def test_the_patched_tree_gives_what_parsing_the_output_gives(name, tmp_path):
    # check reuses PatchResult.module instead of parsing the written code again: the
    # tree prints to exactly that code, and every analysis check makes of it agrees.
    import libcst

    from patcher.patch import patch_source
    from patcher.read.source import read_script

    script = read_script(Path(__file__).resolve().parent.parent / "fixtures" / f"{name}.py")
    result = patch_source(script.source, module=script.module)
    assert result.changed and result.module.code == result.source
    (tmp_path / "helper.py").write_text("")
    source = result.source + "import helper\n"  # something for the self-containedness check to find
    tree = libcst.parse_module(result.source)
    tree = tree.with_changes(body=[*result.module.body, *libcst.parse_module("import helper\n").body])
    assert tree.code == source

    def analyses(known):
        return (import_smoke_mod.definitions_only(source, known), compile_check._pep701_sites(source, known), self_contained.self_contained_warnings(source, tmp_path / "train_gpt.py", known=known))

    fresh = analyses(compile_check.EMPTY)
    assert analyses({source: tree}) == fresh
    assert any("imports helper" in w for w in fresh[2])


# --------------------------------------------------------------------------- verdicts earned

UNDEFINED_IN_FUNCTION = "import os\n\ndef train():\n    return os.sep + misspelt_name\n\nif __name__ == '__main__':\n    train()\n"


def test_an_undefined_name_in_a_function_body_fails_the_check(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text(UNDEFINED_IN_FUNCTION)
    result = check_file(path, "3.10")
    assert result.imports.ok  # importing runs no function body: only the static check sees it
    assert [(u.name, u.line, u.col) for u in result.undefined] == [("misspelt_name", 4, 21)]
    assert not result.ok and result.verdict == "failed" and result.summary == "FAILED"


def test_an_undefined_name_in_skipped_training_code_fails_the_check(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text("import os\nrank = int(os.environ['RANK'])\nfor step in range(3):\n    print(step, lossx)\n")
    result = check_file(path, "3.10")
    assert result.imports.ok and result.imports.partial
    assert [u.name for u in result.undefined] == ["lossx"] and result.verdict == "failed"


def test_a_top_level_script_is_partial_never_ok(tmp_path):
    path = tmp_path / "train_gpt.py"
    path.write_text("import os\n\ndef f():\n    return 1\n\nrank = int(os.environ['RANK'])\nprint(rank)\n")
    result = check_file(path, "3.10")
    assert result.ok and result.verdict == "partial"
    assert result.summary == "partial: import smoke ran 2 of 4 top-level statements"
    assert result.as_dict()["skipped"] == ["import smoke ran 2 of 4 top-level statements"]


def test_check_command_prints_partial_and_the_skipped_lines(tmp_path, capsys):
    from patcher.cli import main

    path = tmp_path / "train_gpt.py"
    path.write_text("import os\n\ndef f():\n    return 1\n\nrank = int(os.environ['RANK'])\nprint(rank)\n")
    assert main(["check", str(path), "--python", sys.executable]) == 0
    out = capsys.readouterr().out
    assert f"{path}: partial: import smoke ran 2 of 4 top-level statements" in out.splitlines()
    assert "skipped (they do work: training, I/O, process groups): line 6: rank = int(os.environ['RANK']); line 7: print(rank)" in out


def test_a_failed_check_says_whether_the_original_fails_too(tmp_path):
    from patcher.check.check import compare_with_original
    from patcher.read.source import read_script

    original, broken = tmp_path / "train_gpt.py", tmp_path / "out.py"
    original.write_text("import os\nif __name__ == '__main__':\n    print(os.sep)\n")
    broken.write_text("import os\nif __name__ == '__main__':\n    print(os.sep, planted)\n")
    result = compare_with_original(check_file(broken, "3.10", run_import=False), read_script(original), target="3.10", run_import=False)
    assert result.original is not None and result.original.ok
    assert result.summary == "FAILED (introduced by the patch: the original passes)"
    assert result.as_dict()["original_ok"] is True

    original.write_text("import os\nif __name__ == '__main__':\n    print(os.sep, planted)\n")
    result = compare_with_original(check_file(broken, "3.10", run_import=False), read_script(original), target="3.10", run_import=False)
    assert result.summary == "FAILED (the original fails too)"


def test_the_main_command_compares_a_failing_output_with_its_input(tmp_path):
    from patcher.patch_file import FileOptions, patch_file
    from patcher.patch import features_from

    script = tmp_path / "train_gpt.py"
    fixture = (Path(__file__).parent.parent / "fixtures" / "tokenstream_readable.py").read_text()
    script.write_text(fixture + "\n\ndef _unused():\n    return planted_undefined\n")
    options = FileOptions(enabled=frozenset(features_from(None, None)), run_import=False)
    done = patch_file(script, tmp_path / "out.py", options)
    assert done.status == "check failed"
    assert [u.name for u in done.check.undefined] == ["planted_undefined"]
    assert done.check.original is not None and not done.check.original.ok
    assert done.report["check"]["original_ok"] is False


@pytest.mark.parametrize("command", [["check", "{path}"], ["{path}", "-o", "{out}"]], ids=["check", "main-command"])
def test_a_target_python_that_is_not_installed_is_refused(tmp_path, capsys, command):
    from patcher.cli import main

    path, out = tmp_path / "train_gpt.py", tmp_path / "out.py"
    path.write_text((Path(__file__).parent.parent / "fixtures" / "tokenstream_readable.py").read_text())
    argv = [a.format(path=path, out=out) for a in command] + ["--python", "3.99"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("patch-prefetch: error: --python 3.99: no such interpreter")
    assert not out.exists()


def test_without_a_real_target_interpreter_the_check_is_partial(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_check, "find_python", lambda target: (None, ""))
    path = tmp_path / "train_gpt.py"
    path.write_text("import os\nif __name__ == '__main__':\n    print(os.sep)\n")
    result = check_file(path, "3.10", run_import=False)
    assert result.ok and result.verdict == "partial"
    assert result.summary == "partial: no real target interpreter: grammar check under the running Python only"
