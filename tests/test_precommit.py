"""The pre-commit hooks (.pre-commit-hooks.yaml), run as pre-commit runs them: in a git
repository laid out like parameter-golf's records, the staged files that match a hook's
`files` pattern are appended to its `entry` and `args`, run from the repository root."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import libcst as cst
import libcst.matchers as m
import pytest
import yaml  # a dependency of libcst

from patcher.hooks import pairs_beside


ROOT = Path(__file__).resolve().parent.parent
RECORD = "records/track_10min_16mb/2026-04-01_Prefetch"
FIXTURE = ROOT / "fixtures" / "tokenstream_readable.py"


def hooks() -> dict[str, dict]:
    return {hook["id"]: hook for hook in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}


def console_scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def start_hook(repo: Path, hook_id: str, args: list[str] = ()) -> subprocess.Popen:
    """Start hook `hook_id` over the files staged in `repo`, as pre-commit would: its entry,
    then `args` (a user's `args:`), then the staged files its `files` pattern matches.
    The entry's console script runs through its `module:function` in this interpreter,
    so that an installed copy of an older version cannot stand in for it."""
    hook = hooks()[hook_id]
    staged = subprocess.run(["git", "diff", "--cached", "--name-only"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    # pre-commit's own matching: re.search of the pattern on each path (file names, not source).
    files = [name for name in staged if re.search(hook["files"], name)]
    script, *rest = shlex.split(hook["entry"])
    module, function = console_scripts()[script].split(":")
    launcher = f"import sys; sys.argv[0] = {script!r}; from {module} import {function}; sys.exit({function}())"
    return subprocess.Popen([sys.executable, "-c", launcher, *rest, *args, *files], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(hook: subprocess.Popen) -> subprocess.CompletedProcess:
    """Wait for a started hook (at most 120 s) and return its exit code and output."""
    stdout, stderr = hook.communicate(timeout=120)
    return subprocess.CompletedProcess(hook.args, hook.returncode, stdout, stderr)


def git_repo(path: Path, files: dict[str, str]) -> Path:
    """A git repository at `path` with `files` (relative path -> text) written and staged."""
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=path, check=True)
    return path


@pytest.fixture(scope="module")
def patched_text(tmp_path_factory) -> str:
    """The bundled parameter-golf-shaped fixture, patched by the command (unchecked: the
    hooks are what checks it here)."""
    out = tmp_path_factory.mktemp("patched") / "train_gpt_patched.py"
    subprocess.run([sys.executable, "-m", "patcher.cli", str(FIXTURE), "-o", str(out), "-q", "--no-check"], check=True, timeout=60)
    return out.read_text()


class TokensPlusOne(cst.CSTTransformer):
    """`chunk[...].long()` -> `chunk[...].long() + 1`: every token the loader hands out
    is off by one, from the first batch."""

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if m.matches(updated_node, m.Call(func=m.Attribute(attr=m.Name("long")))):
            return cst.BinaryOperation(updated_node, cst.Add(), cst.Integer("1"))
        return updated_node


def test_every_hook_runs_a_declared_console_script_and_matches_record_scripts() -> None:
    declared = console_scripts()
    found = hooks()
    assert set(found) == {"patch-prefetch-check", "patch-prefetch-verify"}
    for hook in found.values():
        script = shlex.split(hook["entry"])[0]
        assert script in declared, f"{hook['id']}: entry {script!r} is no console script of pyproject.toml"
        module, function = declared[script].split(":")
        assert callable(getattr(__import__(module, fromlist=[function]), function))
        assert hook["language"] == "python"  # pre-commit installs this package (torch included)
        assert re.search(hook["files"], f"{RECORD}/train_gpt.py")
        assert not re.search(hook["files"], "data/cached_challenge_fineweb.py")
    assert re.search(found["patch-prefetch-verify"]["files"], f"{RECORD}/train_gpt.py.orig")
    assert not re.search(found["patch-prefetch-check"]["files"], f"{RECORD}/train_gpt.py.orig")


def test_verify_pairs_by_the_names_the_command_leaves(tmp_path: Path) -> None:
    for name in ("a/train_gpt.py", "a/train_gpt_patched.py", "b/train_gpt.py", "b/train_gpt.py.orig", "c/train_gpt.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    a, b, c = (str(tmp_path / d) for d in "abc")
    # Either file of a pair staged gives the pair, once; a file with no partner, nothing.
    assert pairs_beside([f"{a}/train_gpt_patched.py", f"{a}/train_gpt.py"]) == [(f"{a}/train_gpt.py", f"{a}/train_gpt_patched.py")]
    assert pairs_beside([f"{b}/train_gpt.py.orig"]) == [(f"{b}/train_gpt.py.orig", f"{b}/train_gpt.py")]
    assert pairs_beside([f"{b}/train_gpt.py"]) == [(f"{b}/train_gpt.py.orig", f"{b}/train_gpt.py")]
    assert pairs_beside([f"{c}/train_gpt.py"]) == []


def test_check_hook_passes_a_patched_record_and_fails_a_syntax_error(tmp_path: Path, patched_text: str) -> None:
    good = git_repo(tmp_path / "good", {f"{RECORD}/train_gpt.py": FIXTURE.read_text(), f"{RECORD}/train_gpt_patched.py": patched_text, "README.md": "# records\n"})
    broken = patched_text + "\ndef broken(:\n    pass\n"
    bad = git_repo(tmp_path / "bad", {f"{RECORD}/train_gpt.py": FIXTURE.read_text(), f"{RECORD}/train_gpt_patched.py": broken})
    on_good, on_bad = start_hook(good, "patch-prefetch-check", ["--no-import"]), start_hook(bad, "patch-prefetch-check", ["--no-import"])

    done = finish(on_good)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{RECORD}/train_gpt.py: ok" in done.stdout and f"{RECORD}/train_gpt_patched.py: ok" in done.stdout
    assert "README" not in done.stdout  # not a training script: not passed

    done = finish(on_bad)
    line = len(broken.splitlines()) - 1
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"patch-prefetch: error: {RECORD}/train_gpt_patched.py:{line}: syntax error" in done.stderr
    assert f"{RECORD}/train_gpt.py: ok" in done.stdout  # the other file is still checked


def test_verify_hook_passes_a_patched_copy_and_fails_a_changed_loader(tmp_path: Path, patched_text: str) -> None:
    good = git_repo(tmp_path / "good", {f"{RECORD}/train_gpt.py": FIXTURE.read_text(), f"{RECORD}/train_gpt_patched.py": patched_text})
    # --in-place's layout: the patched script under the record's name, the original as .orig.
    changed = cst.parse_module(patched_text).visit(TokensPlusOne()).code
    assert changed != patched_text
    bad = git_repo(tmp_path / "bad", {f"{RECORD}/train_gpt.py.orig": FIXTURE.read_text(), f"{RECORD}/train_gpt.py": changed})
    on_good, on_bad = start_hook(good, "patch-prefetch-verify", ["--batches", "4"]), start_hook(bad, "patch-prefetch-verify", ["--batches", "4"])

    done = finish(on_good)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"patch-prefetch verify {RECORD}/train_gpt.py {RECORD}/train_gpt_patched.py\n" in done.stdout
    assert "\nidentical: " in done.stdout

    done = finish(on_bad)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"patch-prefetch verify {RECORD}/train_gpt.py.orig {RECORD}/train_gpt.py\n" in done.stdout
    assert "\nDIFFER: rank 0, warmup batch 0, field 0: bytes differ" in done.stdout


def test_the_configurations_in_docs_name_these_hooks() -> None:
    """Every `repos:` block of docs/ci.md names hooks that exist, and its local
    (`language: system`) copies run the same entry on the same files."""
    text = (ROOT / "docs" / "ci.md").read_text()
    blocks = [yaml.safe_load(block.split("\n", 1)[1]) for block in text.split("```")[1::2] if block.startswith("yaml\n")]
    configs = [block for block in blocks if isinstance(block, dict) and "repos" in block]
    assert len(configs) == 2
    found = hooks()
    for config in configs:
        for repo in config["repos"]:
            assert [hook["id"] for hook in repo["hooks"]] == list(found)
            for hook in repo["hooks"]:
                if repo["repo"] == "local":
                    assert (hook["entry"], hook["files"]) == (found[hook["id"]]["entry"], found[hook["id"]]["files"])


def test_the_verify_hook_says_did_you_mean_for_a_mistyped_option(capsys) -> None:
    from patcher.hooks import main

    with pytest.raises(SystemExit) as stopped:
        main(["--batchs", "4"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("unrecognized arguments: --batchs; did you mean --batches?")


def test_the_github_actions_job_in_docs_passes_a_patched_record(tmp_path: Path, patched_text: str) -> None:
    """docs/ci.md's workflow: its check and verify steps, run as written by a shell in a
    repository laid out as parameter-golf's records/, with the command installed here."""
    text = (ROOT / "docs" / "ci.md").read_text()
    blocks = [yaml.safe_load(block.split("\n", 1)[1]) for block in text.split("```")[1::2] if block.startswith("yaml\n")]
    (workflow,) = [block for block in blocks if isinstance(block, dict) and "jobs" in block]
    steps = {step.get("name"): step.get("run") for step in workflow["jobs"]["check"]["steps"]}
    check, verify = steps["check every record script"], steps["verify every patched script against its original"]
    repo = git_repo(tmp_path / "records-repo", {f"{RECORD}/train_gpt.py": FIXTURE.read_text(), f"{RECORD}/train_gpt_patched.py": patched_text})
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    started = [subprocess.Popen(["bash", "-c", command], cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for command in (check, verify)]
    on_check, on_verify = (finish(step) for step in started)
    assert on_check.returncode == 0, on_check.stdout + on_check.stderr
    assert f"{RECORD}/train_gpt.py: ok" in on_check.stdout and f"{RECORD}/train_gpt_patched.py: ok" in on_check.stdout
    assert on_verify.returncode == 0, on_verify.stdout + on_verify.stderr
    assert f"patch-prefetch verify {RECORD}/train_gpt.py {RECORD}/train_gpt_patched.py\n" in on_verify.stdout and "\nidentical: " in on_verify.stdout
