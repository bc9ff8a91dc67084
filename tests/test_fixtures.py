"""Synthetic shards (`patcher.proof.shards`) and the fixture training scripts in `fixtures/`.

The fixture scripts are run as subprocesses on CPU, all at once on a thread pool
(one torch thread each), once per test run (fixture_training.py: test_end_to_end.py
reuses the first run of each); the tests then look at the outputs.
"""

from __future__ import annotations

import ast
import base64
import glob
import importlib.util
import lzma
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from patcher.families import registry
from patcher.proof import shards
from patcher.proof.shards import read_shard, write_shards

from fixture_training import original_runs

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"


def family_fixtures(units, directory: Path = FIXTURES) -> dict[str, list[str]]:
    """{family name: the stems of its fixtures `<directory>/<name>*.py`, sorted} for each unit."""
    return {unit.name: sorted(p.stem for p in directory.glob(f"{unit.name}*.py")) for unit in units}


def runnable(units, not_run: dict[str, str], others=(), directory: Path = FIXTURES) -> list[str]:
    """The fixtures to run: every family's (`family_fixtures`, in the units' order) but
    those `not_run` names (stem -> why), then `others` (fixtures of no family's name)."""
    stems = [stem for found in family_fixtures(units, directory).values() for stem in found]
    return [stem for stem in stems if stem not in not_run] + [stem for stem in others if stem not in stems]


def missing_parts(units, root: Path = ROOT) -> list[str]:
    """What each family lacks of what adding one means: its fixture
    `fixtures/<name>*.py` and its test file `tests/test_family_<name>.py`; empty when none."""
    found = family_fixtures(units, root / "fixtures")
    gaps = [f"{u.name}: no fixtures/{u.name}*.py" for u in units if not found[u.name]]
    return gaps + [f"{u.name}: no tests/test_family_{u.name}.py" for u in units if not (root / "tests" / f"test_family_{u.name}.py").is_file()]


# The fixtures of a family not run here, each with why; every other family fixture is
# (a new family's fixture runs here with no change to this file).
NOT_RUN = {
    "bestfit_packing": "a data-loader module, not a training script: tests/test_family_bestfit_packing.py verifies its loader",
    "distributed_data_loader": "needs CUDA to train: tests/test_family_distributed_data_loader.py verifies its loader on the host",
    "custom_loader": "tests/test_family_custom.py verifies its patched loader batch for batch",
    "generator_shards": "tests/test_feature_pinned_staging.py verifies it across two stage changes",
    "generator_toplevel": "tests/test_end_to_end.py trains it, original and patched",
    "tokenstream_validating": "a second TokenStream fixture, for validation inside the training loop: tests/test_step_timing.py runs it",
}
RUNNABLE = runnable(registry.UNITS, NOT_RUN, others=["curriculum", "batch_switch", "no_loader"])
WRAPPED = {"wrapped_lzma_raw": "shuffled_minified", "wrapped_lzma_oneline": "tokenstream_readable"}
ALL_SCRIPTS = sorted(p.name for p in FIXTURES.glob("*.py"))

STEP_RE = re.compile(r"^step:(\d+) train_loss:(\S+)$")
FINAL_RE = re.compile(r"^final val_loss:(\S+)$")
DEFAULT_ITERATIONS = 24


# ---------------------------------------------------------------------------
# shards
# ---------------------------------------------------------------------------


def test_write_shards_layout(tmp_path):
    info = write_shards(tmp_path, train_shards=2, val_shards=1, tokens_per_shard=1000, vocab_size=50, seed=3)
    assert [Path(p).name for p in info["train_files"]] == ["fineweb_train_000000.bin", "fineweb_train_000001.bin"]
    assert [Path(p).name for p in info["val_files"]] == ["fineweb_val_000000.bin"]
    assert sorted(glob.glob(info["train_pattern"])) == info["train_files"]
    for path in info["train_files"] + info["val_files"]:
        raw = Path(path).read_bytes()
        assert len(raw) == 256 * 4 + 1000 * 2
        header = np.frombuffer(raw[:1024], dtype="<i4")
        assert header[0] == 20240520 and header[1] == 1 and header[2] == 1000
        assert not header[3:].any()
        tokens = read_shard(path)
        assert tokens.dtype == np.uint16 and tokens.shape == (1000,)
        assert np.array_equal(tokens, np.frombuffer(raw[1024:], dtype="<u2"))
        assert int(tokens.max()) < 50


def test_write_shards_deterministic_per_seed(tmp_path):
    def contents(d, seed):
        info = write_shards(d, tokens_per_shard=512, seed=seed, bos_id=1)
        return [Path(p).read_bytes() for p in info["train_files"] + info["val_files"]]

    a = contents(tmp_path / "a", 7)
    assert a == contents(tmp_path / "b", 7)
    assert a != contents(tmp_path / "c", 8)
    assert len(set(a)) == len(a)  # shards differ from each other


def test_write_shards_bos(tmp_path):
    lo, hi = shards.DOC_LEN_RANGE
    info = write_shards(tmp_path, train_shards=1, val_shards=0, tokens_per_shard=5000, vocab_size=64, bos_id=5)
    tokens = read_shard(info["train_files"][0])
    starts = np.flatnonzero(tokens == 5)
    assert starts[0] == 0
    lengths = np.diff(starts)
    assert lengths.min() >= lo and lengths.max() <= hi
    assert int(tokens.max()) < 64
    no_bos = read_shard(write_shards(tmp_path / "n", train_shards=1, val_shards=0, tokens_per_shard=5000, vocab_size=64)["train_files"][0])
    assert len(set(no_bos.tolist())) == 64  # without bos_id every id may occur


def test_read_shard_rejects_bad_files(tmp_path):
    path = Path(write_shards(tmp_path, train_shards=1, val_shards=0, tokens_per_shard=64)["train_files"][0])
    raw = bytearray(path.read_bytes())
    bad_magic = tmp_path / "bad_magic.bin"
    bad_magic.write_bytes(b"\x00\x00\x00\x00" + bytes(raw[4:]))
    with pytest.raises(ValueError, match="magic"):
        read_shard(bad_magic)
    bad_version = tmp_path / "bad_version.bin"
    bad_version.write_bytes(bytes(raw[:4]) + np.array([2], dtype="<i4").tobytes() + bytes(raw[8:]))
    with pytest.raises(ValueError, match="version"):
        read_shard(bad_version)
    short = tmp_path / "short.bin"
    short.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ValueError, match="size"):
        read_shard(short)


def test_write_shards_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        write_shards(tmp_path, vocab_size=70000)
    with pytest.raises(ValueError):
        write_shards(tmp_path, vocab_size=16, bos_id=16)


def test_shards_cli(tmp_path, capsys):
    assert shards.main([str(tmp_path), "--train-shards", "2", "--val-shards", "1", "--tokens-per-shard", "300", "--seed", "4"]) == 0
    assert "wrote 2 train + 1 val" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fineweb_train_000000.bin", "fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    assert read_shard(tmp_path / "fineweb_train_000001.bin").shape == (300,)


# ---------------------------------------------------------------------------
# fixture sources
# ---------------------------------------------------------------------------


def test_every_family_has_its_fixture_and_its_test_file():
    assert missing_parts(registry.UNITS) == []


def test_every_fixture_not_run_is_a_family_fixture_that_says_why():
    # An entry whose fixture is gone or renamed leaves the list, so that it cannot keep
    # a later fixture of that name from running unseen.
    fixtures = {stem for found in family_fixtures(registry.UNITS).values() for stem in found}
    assert sorted(set(NOT_RUN) - fixtures) == []
    assert all(reason for reason in NOT_RUN.values())
    assert set(RUNNABLE) == fixtures - set(NOT_RUN) | {"curriculum", "batch_switch", "no_loader"}



@pytest.mark.parametrize("name", ALL_SCRIPTS)
def test_fixture_compiles(name):
    source = (FIXTURES / name).read_text(encoding="utf-8")
    compile(source, str(FIXTURES / name), "exec")


def test_fixtures_compile_on_python310(python310):
    code = (
        "import sys\n"
        "for p in sys.argv[1:]:\n"
        "    compile(open(p, encoding='utf-8').read(), p, 'exec')\n"
    )
    result = subprocess.run([python310, "-c", code, *[str(FIXTURES / n) for n in ALL_SCRIPTS]], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


SHAPE_MARKERS = {
    "tokenstream_readable.py": [
        ("class Hyperparameters:", 1),
        ("class TokenStream:", 1),
        ("def next_batch(self, global_tokens: int, seq_len: int, grad_accum_steps: int)", 1),
        ("train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)", 2),
        ("train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)", 2),
        ("x = torch.relu(self.fc(x))", 1),
        ("def log0(msg: str, console: bool = True)", 1),
    ],
    "shuffled_minified.py": [
        ("class Hyperparameters():data_path=", 1),
        ("_MMAP_CACHE={}", 1),
        ("def _get_shard_memmap(file):", 1),
        ("self.rng=np.random.Generator(np.random.PCG64(h.rank))", 1),
        ("train_loader=ShuffledSequenceLoader(h,device)", 2),
        ("calib_loader=ShuffledSequenceLoader(h,device)", 1),
        ("train_loader.next_batch(h.train_batch_tokens,h.grad_accum_steps)", 2),
        ("F.leaky_relu(self.fc(x),negative_slope=.5).square()", 1),
        ("return x.to(self.device,non_blocking=True),y.to(self.device,non_blocking=True)", 1),
    ],
    "coprime_dataclass.py": [
        ("@dataclass\nclass Hyperparameters:", 1),
        ("np.random.Generator(np.random.PCG64(seed))", 1),
        ("train_loader = DistributedTokenLoader(h.train_files, rank, world_size, device)", 2),
        ("x = F.leaky_relu(F.linear(x, up_w.to(x.dtype)), negative_slope=0.5)", 1),
        ("return F.linear(x.square(), down_w.to(x.dtype))", 1),
    ],
    "curriculum.py": [
        ("current_seq_len = get_seq_len(step)", 1),
        ("train_loader.next_batch(args.train_batch_tokens, current_seq_len, grad_accum_steps)", 1),
    ],
    "batch_switch.py": [
        ("active_batch_tokens = args.train_batch_tokens", 1),
        ("train_loader.next_batch(active_batch_tokens, args.train_seq_len, grad_accum_steps)", 2),
    ],
    "document_packing.py": [
        ("class DocumentPackingLoader:", 1),
        ("self._batch_pool=ThreadPoolExecutor(1)", 1),
        ("x,y,cu_seqlens=train_loader.next_batch(h.train_batch_tokens,h.grad_accum_steps)", 1),
    ],
    "no_loader.py": [("next_batch", 0), ("Loader", 0)],
}


@pytest.mark.parametrize("name", sorted(SHAPE_MARKERS))
def test_fixture_shape(name):
    source = (FIXTURES / name).read_text(encoding="utf-8")
    for marker, count in SHAPE_MARKERS[name]:
        assert source.count(marker) == count, (marker, source.count(marker))
    n_lines = source.count("\n")
    assert n_lines <= 420, n_lines


def test_minified_fixture_is_minified():
    source = (FIXTURES / "shuffled_minified.py").read_text(encoding="utf-8")
    assert "\n\t" in source and "\n    " not in source
    hp_line = next(line for line in source.splitlines() if line.startswith("class Hyperparameters"))
    assert hp_line.count(";") > 20


def _load_make_wrapped():
    spec = importlib.util.spec_from_file_location("make_wrapped", FIXTURES / "make_wrapped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exec_payload(path: Path) -> tuple[bytes, dict]:
    """Return (decompressed payload, {"format": ..., "wrapper_size": ...}) of a wrapped file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "exec")
    decompress = call.args[0]
    text = decompress.args[0].args[0].value
    kwargs = {k.arg: k for k in decompress.keywords}
    raw = base64.b85decode(text)
    if "format" in kwargs:
        data = lzma.decompress(raw, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}])
    else:
        data = lzma.decompress(raw)
    size = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "__wrapper_size__":
            size = node.value.value
    return data, {"format": "raw" if "format" in kwargs else "xz", "wrapper_size": size}


@pytest.mark.parametrize("wrapped", sorted(WRAPPED))
def test_wrapped_payload_is_current_source(wrapped):
    path = FIXTURES / f"{wrapped}.py"
    data, meta = _exec_payload(path)
    assert data == (FIXTURES / f"{WRAPPED[wrapped]}.py").read_bytes(), "stale: run python fixtures/make_wrapped.py"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "import lzma as L,base64 as B"
    if wrapped == "wrapped_lzma_raw":
        assert meta["format"] == "raw"
        assert meta["wrapper_size"] == path.stat().st_size
        assert lines[1] == f"__wrapper_size__={path.stat().st_size}"
        pieces = lines[2:]
        assert pieces[0].startswith('exec(L.decompress(B.b85decode("')
        assert pieces[-1].endswith('"),format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]))')
        middle = pieces[1:-1]
        assert middle and all(len(p) == 102 and p[0] == p[-1] == '"' for p in middle)
    else:
        assert meta["format"] == "xz" and meta["wrapper_size"] is None
        assert len(lines) == 2 and lines[1].startswith('exec(L.decompress(B.b85decode("') and lines[1].endswith('")))')
        assert lines[1].count('""') >= 10


def test_make_wrapped_is_deterministic():
    module = _load_make_wrapped()
    first = module.build_all()
    assert first == module.build_all()
    assert set(first) == {f"{w}.py" for w in WRAPPED}


# ---------------------------------------------------------------------------
# fixture runs
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def fixture_runs(tmp_path_factory):
    """{(script stem, run index): CompletedProcess}: every runnable fixture twice, every wrapped
    one once (run index 0 is shared with test_end_to_end.py: fixture_training.py). A fixture
    that a wrapped one carries runs once: the wrapped run is its second (`_second_run`)."""
    jobs = [(name, i) for name in RUNNABLE for i in (0, 1) if i == 0 or name not in WRAPPED.values()] + [(name, 0) for name in WRAPPED]
    return original_runs(tmp_path_factory, jobs)


def _stable_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if not line.startswith("train_time:")]


@pytest.mark.parametrize("name", RUNNABLE + sorted(WRAPPED))
def test_fixture_runs_on_cpu(fixture_runs, name):
    result = fixture_runs[(name, 0)]
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    steps = [STEP_RE.match(line) for line in lines]
    steps = [m for m in steps if m]
    assert len(steps) >= 20
    assert [int(m.group(1)) for m in steps] == list(range(1, DEFAULT_ITERATIONS + 1))
    losses = [float(m.group(2)) for m in steps]
    assert all(math.isfinite(v) and v > 0 for v in losses)
    assert losses[-1] < losses[0]  # it learns something
    finals = [FINAL_RE.match(line) for line in lines if FINAL_RE.match(line)]
    assert len(finals) == 1 and math.isfinite(float(finals[0].group(1)))
    assert "Traceback" not in result.stderr


def _second_run(fixture_runs, name):
    """A second, independent run of `name`: the run of the wrapped fixture that carries its
    bytes (its payload runs in a process of its own), else its run index 1."""
    wrapper = next((wrapped for wrapped, source in WRAPPED.items() if source == name), None)
    return fixture_runs[(wrapper, 0) if wrapper else (name, 1)]


@pytest.mark.parametrize("name", RUNNABLE)
def test_fixture_is_deterministic(fixture_runs, name):
    first, second = fixture_runs[(name, 0)], _second_run(fixture_runs, name)
    assert first.returncode == 0 and second.returncode == 0
    assert _stable_lines(first.stdout) == _stable_lines(second.stdout)


@pytest.mark.parametrize("wrapped", sorted(WRAPPED))
def test_wrapped_fixture_matches_source(fixture_runs, wrapped):
    assert _stable_lines(fixture_runs[(wrapped, 0)].stdout) == _stable_lines(fixture_runs[(WRAPPED[wrapped], 0)].stdout)


def test_special_fixture_behaviour(fixture_runs):
    out = {name: fixture_runs[(name, 0)].stdout for name in RUNNABLE}
    assert "step:10 batch_switch:512->1024" in out["batch_switch"]
    assert "seq_len_schedule: [16, 32, 64]" in out["curriculum"]
    assert "GPTQ:collected" in out["shuffled_minified"]
