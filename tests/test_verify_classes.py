"""verify on scripts as they stand: each class of "cannot verify" found on real scripts has a
fixture of ours (fixtures/verify/), and verify's exit codes say what happened."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

from patcher.cli import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, main
from patcher.proof.harness import load_module, unload
from patcher.proof.recipes import LoaderRecipe, hparams_factory, patched_constructions
from patcher.proof import rank_compare
from patcher.proof.shards import write_shards
from patcher.patch import patch_source
from patcher.read.source import read_script, render
from patcher.proof.verify import CannotVerify, verify

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "verify"


def patch_to(directory: Path, name: str, extra: str = "", edits: tuple = (), fixtures: Path = FIXTURES) -> tuple[Path, Path]:
    """(the fixture `name` of `fixtures`, its patched output in `directory`, `extra`
    appended to it). With `edits` ((old, new) pairs, every `old` replaced, found at
    least once), the fixture is a variant of `name` written into `directory` first: one
    miniature, one shape changed."""
    original = fixtures / f"{name}.py"
    if edits:
        source = original.read_text()
        for old, new in edits:
            assert source.count(old) >= 1, old
            source = source.replace(old, new)
        original = Path(directory) / f"{name}.py"
        original.write_text(source)
    script = read_script(original)
    out = Path(directory) / f"{name}_patched.py"
    out.write_text(render(script, patch_source(script.source).source, rewrap=False) + extra)
    return original, out


# Variants of fixtures/verify/own_configuration.py, one shape each.
# It locates its repository when imported: it walks up from its own file to the directory
# holding `records/` and `data/cached_challenge_fineweb.py`, and raises FileNotFoundError
# where there is none (a copy outside its repository).
REPOSITORY_ANCHOR = (
    ("import os\n", "import os\nfrom pathlib import Path\n"),
    (
        "\n\nclass Hyperparameters:",
        "\n\ndef find_repository(start):\n"
        "    for candidate in (start, *start.parents):\n"
        "        if (candidate / \"records\").is_dir() and (candidate / \"data\" / \"cached_challenge_fineweb.py\").is_file():\n"
        "            return candidate\n"
        "    raise FileNotFoundError(f\"Could not locate repository above {start}\")\n\n\n"
        "REPOSITORY = find_repository(Path(__file__).resolve().parent)\n\n\nclass Hyperparameters:",
    ),
    ('os.environ.get("DATA_PATH", "./data")', 'os.environ.get("DATA_PATH", str(REPOSITORY / "data"))'),
)
# The loader walks its shards once, as a run over real shards does (80 and more of them,
# never all read): synthetic shards sized for the run to wrap around run out.
NO_WRAP = (("self.shard = (self.shard + 1) % len(self.paths)", "self.shard += 1"),)
# fixtures/generator_toplevel.py whose Hyperparameters reads `run_id` before any statement
# binds it (a leftover of `run_id: str = f"{uuid.uuid4()}"`): the script fails there when run.
UNBOUND_RUN_ID = (("    lr: float = 0.01\n", '    lr: float = 0.01\n    run_id: str = run_id  # was f"{uuid.uuid4()}"\n'),)
SHORT_HPARAMS_NAME = (("class Hyperparameters:", "class HP:"), ("    args = Hyperparameters()", "    args = HP()"))
BATCH_WARMUP = (
    ('int(os.environ.get("TRAIN_BATCH_TOKENS", 384))', 'int(os.environ.get("TRAIN_BATCH_TOKENS", 768))\n    batch_warmup_steps = int(os.environ.get("BATCH_WARMUP_STEPS", 6))'),
    (
        "    for step in range(args.iterations):\n        inputs, targets = train_loader.next_batch(args.train_batch_tokens, args.train_seq_len, grad_accum_steps)",
        "    for step in range(args.iterations):\n        cur = args.train_batch_tokens\n        if step < args.batch_warmup_steps:\n            cur = args.train_batch_tokens // 2\n"
        "        inputs, targets = train_loader.next_batch(cur, args.train_seq_len, grad_accum_steps)",
    ),
)
FACTORY_BUILT = (
    ("\n\ndef main(", "\n\ndef build_train_loader(args, rank, world_size, device):\n    return DistributedTokenLoader(args.train_files, rank, world_size, device)\n\n\ndef main("),
    ("    train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)", "    train_loader = build_train_loader(args, rank, world_size, device)"),
)


def test_names_bound_inside_main_and_under_the_main_guard(tmp_path):
    # numpy is imported only under `if __name__ == "__main__":`, math inside main()
    original, out = patch_to(tmp_path, "local_imports")
    result = verify(original, out, batches=16)
    assert result.identical, result.difference
    assert any("gradient accumulation 4" in note for note in result.notes)  # math.gcd(8, 8 // 2), the script's own


def test_a_script_that_finds_its_data_from_its_own_path(tmp_path):
    # parents[3] of a patched copy in a shallow temporary directory does not exist;
    # verify imports both as if they stood at the original's path
    with tempfile.TemporaryDirectory(dir="/tmp") as shallow:
        original, out = patch_to(Path(shallow), "file_anchor")
        assert len(out.resolve().parents) <= 3
        result = verify(original, out, batches=8)
    assert result.identical, result.difference
    assert any(f"as if at {original.resolve()}" in note for note in result.notes)


def test_check_imports_the_output_as_if_it_stood_at_the_input(tmp_path, capsys):
    with tempfile.TemporaryDirectory(dir="/tmp") as shallow:
        code = main([str(FIXTURES / "file_anchor.py"), "-o", str(Path(shallow) / "out.py")])
    out = capsys.readouterr()
    assert code == EXIT_OK, out.err
    assert f"as if at {(FIXTURES / 'file_anchor.py').resolve()}" in out.out + out.err


def test_check_of_a_file_imports_it_where_it_stands(capsys):
    code = main(["check", str(FIXTURES / "file_anchor.py")])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "import smoke" in out and "FAILED" not in out


def test_the_scripts_own_gradient_accumulation_keeps_its_divisibility_rule(tmp_path):
    # grad_accum_steps = 3 in main(): 384 // (2 * 3) = 64 tokens per rank, one sequence;
    # the records' 8 // world_size would give 48, which the loader rejects
    original, out = patch_to(tmp_path, "own_configuration")
    result = verify(original, out, batches=8)
    assert result.identical, result.difference
    assert any("gradient accumulation 3" in note for note in result.notes)


def test_a_calibration_loader_and_the_runtimes_own_names_do_not_count(tmp_path):
    original, out = patch_to(tmp_path, "calibration_loader")
    source = read_script(original).source
    recipe = LoaderRecipe.from_source(source)
    assert [c.target for c in recipe.constructions] == ["train_loader", "train_loader"]
    sites = patched_constructions(out.read_text(), recipe, source)
    assert len(sites) == 2 and all("DistributedTokenLoader(args.train_files" in s for s in sites)
    result = verify(original, out, batches=8)
    assert result.identical, result.difference


def test_an_injected_definition_assigning_the_same_variable_is_not_a_construction(tmp_path):
    original, out = patch_to(tmp_path, "calibration_loader", extra="\n\ndef _injected_helper(args, rank, world_size, device):\n    train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)\n    return train_loader\n")
    source = read_script(original).source
    recipe = LoaderRecipe.from_source(source)
    assert len(patched_constructions(out.read_text(), recipe, source)) == 2


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None, reason="sentencepiece is installed here")
def test_a_module_the_loader_imports_lazily_is_cannot_verify_not_a_difference(tmp_path, capsys):
    original, out = patch_to(tmp_path, "lazy_module")
    with pytest.raises(CannotVerify, match="needs sentencepiece"):
        verify(original, out, batches=4)
    code = main(["verify", str(original), str(out), "--batches", "4"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert "cannot verify: needs sentencepiece" in err and "pip install sentencepiece" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_harness_failure_is_exit_2_in_one_line(tmp_path, capsys, monkeypatch):
    import patcher.proof.verify

    def broken(*args, **kwargs):
        raise KeyError("harness bug")

    monkeypatch.setattr(patcher.proof.verify, "_plan", broken)
    original, out = patch_to(tmp_path, "own_configuration")
    code = main(["verify", str(original), str(out), "--batches", "4"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert "cannot verify: the harness failed" in err and "KeyError" in err and len(err.strip().splitlines()) == 1


# Appended to a patched script: its own loader fails on the 7th batch it builds.
FAIL_ON_SEVENTH = """
_original_next_batch = DistributedTokenLoader.next_batch


def _failing_next_batch(self, *args):
    # counted per loader, so that the failing batch does not depend on thread timing
    self._failing_calls = getattr(self, "_failing_calls", 0) + 1
    if self._failing_calls == 7:
        raise RuntimeError("disk gone")
    return _original_next_batch(self, *args)


DistributedTokenLoader.next_batch = _failing_next_batch
"""


def test_a_crash_in_the_patched_loader_names_rank_and_batch(tmp_path, capsys):
    original, out = patch_to(tmp_path, "own_configuration", extra=FAIL_ON_SEVENTH)
    result = verify(original, out, batches=16)
    d = result.difference
    assert not result.identical and d.rank == 0 and d.field is None
    assert "raised RuntimeError: disk gone" in d.what
    assert (d.phase, d.batch) == ("train", 6), d  # the rebuilt loader's 7th call
    code = main(["verify", str(original), str(out), "--batches", "16"])
    captured = capsys.readouterr()
    assert code == EXIT_FAILED
    assert f"DIFFER: rank 0, {d.phase} batch {d.batch}: the patched loader raised RuntimeError: disk gone" in captured.out
    assert "Traceback" not in captured.out + captured.err


def test_a_warm_up_worker_left_running_after_the_rebuild_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_compare, "REBUILD_GRACE_S", 0.5)  # the left worker never ends: wait less for it
    # the rebuild no longer stops the loader it replaces
    original, out = patch_to(tmp_path, "own_configuration")
    text = out.read_text()
    if "def _stop_previous(" in text:  # the full runtime: nor does dropping the last reference to it
        out.write_text(text + "\n\ndef _stop_previous(name):\n    _live_prefetchers.pop(name, None)\n\n\n_PrefetchLoader.__del__ = lambda self: None\n")
    else:  # the lean runtime: a rebuild that cannot reset starts another worker; the replaced one is only ever stopped here
        assert text.count("        old.shutdown()\n") == 1 and text.count("old.reset(make_loader)") == 1
        out.write_text(text.replace("        old.shutdown()\n", "        pass\n").replace("old.reset(make_loader)", "False"))
    result = verify(original, out, batches=8)
    # No difference in the batches: a leak of its own, saying what is alive and where it started.
    assert result.identical and result.leaks, result.difference
    assert all("still alive after the script rebuilt its loader: " in leak for leak in result.leaks), result.leaks


def test_every_rank_reads_across_shard_boundaries_and_wraps(tmp_path):
    original, out = patch_to(tmp_path, "own_configuration")
    result = verify(original, out)
    assert result.identical, result.difference
    sizing = next(n for n in result.notes if n.startswith("4 shards x"))
    times = float(sizing.split("the shards read ")[1].split(" times")[0])
    assert times > 1.0, sizing  # every shard read, the stream wrapped around


def test_a_loader_the_script_reads_beyond_next_batch_is_verified_without_settling_it(tmp_path):
    # The script reads `train_loader.stream` after its rebuild: the loader is a
    # `_SettlingLoader`, which settles (stops its worker) at any attribute read. verify's
    # own looks at the producer (which one a rebuild kept, how far ahead it is) must not
    # read it through getattr, or the loader it drives is no longer the script's (with a
    # sequence length applied at hand-out, as in this curriculum, a settled loader's
    # next batch then raises).
    source = (FIXTURES.parent / "curriculum.py").read_text(encoding="utf-8")
    rebuild = "        train_loader = DistributedTokenLoader(args.train_files, rank, world_size, device)\n"
    assert source.count(rebuild) == 1
    source = source.replace(rebuild, rebuild + '        log0(f"stream at token {train_loader.stream.pos}")\n')
    original = tmp_path / "reads_the_stream.py"
    original.write_text(source, encoding="utf-8")
    out = tmp_path / "reads_the_stream_patched.py"
    out.write_text(patch_source(source).source, encoding="utf-8")
    assert "class _SettlingLoader" in out.read_text(encoding="utf-8")
    result = verify(original, out, batches=16)
    assert result.identical, result.difference


def test_minified_locals_that_shadow_module_aliases_stand_for_the_run(tmp_path):
    # main() binds B = Hyperparameters(), p (rank), S (world size), U (device), T = 8 // S,
    # and the module binds the same letters to builtins: the construction and the
    # next_batch call must read main()'s values, rank by rank
    original, out = patch_to(tmp_path, "shadowed_locals")
    result = verify(original, out, batches=8)
    assert result.identical, result.difference
    # `T` is passed to next_batch's grad_accum_steps: the shards are sized for 4, not 1
    assert any("next_batch(512, 64, 4) (global tokens 512, gradient accumulation 4:" in note for note in result.notes)
    source = read_script(original).source
    recipe = LoaderRecipe.from_source(source)
    write_shards(tmp_path / "data", train_shards=2, val_shards=0, tokens_per_shard=4096, vocab_size=256)
    module = load_module(source, str(original))
    try:
        ns = recipe.namespace(module, hparams_factory(recipe, module, 2, str(tmp_path / "data"))(1), 1, 2, torch.device("cpu"))
        loader = recipe.build(recipe.constructions[0], ns)
        assert (loader.rank, loader.world_size) == (1, 2)
        assert recipe.arguments(ns, 0) == (512, 64, 4)
    finally:
        unload(module)


def test_a_definition_that_reads_a_name_nothing_binds_names_its_line(tmp_path, capsys):
    # the script's own class body reads `run_id` before any statement binds it: running
    # the script fails there too, and the reason says where and what to do
    original, out = patch_to(tmp_path, "generator_toplevel", edits=UNBOUND_RUN_ID, fixtures=FIXTURES.parent)
    line = 1 + read_script(original).source.splitlines().index('    run_id: str = run_id  # was f"{uuid.uuid4()}"')
    with pytest.raises(CannotVerify, match=f"line {line} \\(`class Hyperparameters`\\) reads it before any statement of the script binds it.*bind `run_id` above line {line}"):
        verify(original, out, batches=4)
    code = main(["verify", str(original), str(out), "--batches", "4"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_definition_that_reads_a_name_only_the_run_binds_names_both_lines(tmp_path):
    bound_by_the_run = ("\n@dataclass(", '\nif os.environ.get("RANK", "0") == "0":\n    run_id = time.strftime("%H%M%S")\n\n\n@dataclass(')
    original, out = patch_to(tmp_path, "generator_toplevel", edits=(*UNBOUND_RUN_ID, bound_by_the_run), fixtures=FIXTURES.parent)
    binding = 1 + original.read_text().splitlines().index('if os.environ.get("RANK", "0") == "0":')
    with pytest.raises(CannotVerify, match=f"reads it, and only line {binding}, which runs with the training .* binds it"):
        verify(original, out, batches=4)


def test_a_hyperparameters_class_with_a_name_of_its_own_is_found_by_its_use(tmp_path):
    # `class HP` built as `args = HP()` in main(): its train_files point at the synthetic shards
    original, out = patch_to(tmp_path, "own_configuration", edits=SHORT_HPARAMS_NAME)
    result = verify(original, out, batches=8)
    assert result.identical, result.difference
    assert any("gradient accumulation 3" in note and "next_batch(384, 64, 3)" in note for note in result.notes)


def test_a_per_step_token_count_is_told_by_the_parameter_it_is_passed_to(tmp_path):
    # `cur` (a batch-size warm-up) is passed as next_batch's `global_tokens`: driven with
    # the Hyperparameters batch size and half of it, changing during the run
    original, out = patch_to(tmp_path, "own_configuration", edits=BATCH_WARMUP)
    result = verify(original, out, batches=12)
    assert result.identical, result.difference
    assert "per-step argument(s) ['cur'] driven with [[384, 768]], changing every 5 calls" in result.notes


def test_a_nested_configuration_points_at_the_synthetic_shards(tmp_path):
    # the loader is built from `config.data.train_glob` (config = ExperimentConfig.from_env()
    # in main()), and the batch-size warm-up's token count is assigned in the loop from
    # `config.train.train_batch_tokens`: its first value and half of it drive the loader
    original, out = patch_to(tmp_path, "nested_config")
    result = verify(original, out, batches=8)
    assert result.identical, result.difference
    assert any("['effective_batch_tokens', 'config.train.train_seq_len'] driven with [[6144, 12288], [512, 1024]]" in note for note in result.notes)


def test_a_script_that_locates_its_repository_says_where_and_verifies_inside_one(tmp_path):
    # outside a repository the script's own import fails: the reason names its line and
    # what to do; inside one (records/ and data/cached_challenge_fineweb.py above it) it verifies
    original, out = patch_to(tmp_path, "own_configuration", edits=REPOSITORY_ANCHOR)
    line = 1 + read_script(original).source.splitlines().index('    raise FileNotFoundError(f"Could not locate repository above {start}")')
    with pytest.raises(CannotVerify, match=f"Could not locate repository above .* \\(line {line}, run when the script is imported; .* run it on the script where it runs, in its repository\\)"):
        verify(original, out, batches=4)
    repository = tmp_path / "repository"
    (repository / "records" / "run").mkdir(parents=True)
    (repository / "data").mkdir()
    (repository / "data" / "cached_challenge_fineweb.py").write_text("")
    inside = repository / "records" / "run" / "train_gpt.py"
    inside.write_bytes(original.read_bytes())
    result = verify(inside, out, batches=4)
    assert result.identical, result.difference


def test_a_loader_built_by_a_factory_function_says_there_is_nothing_prefetched_to_verify(tmp_path, capsys):
    original, out = patch_to(tmp_path, "own_configuration", extra="\n# edited by hand\n", edits=FACTORY_BUILT)
    line = 1 + read_script(original).source.splitlines().index("class DistributedTokenLoader:")
    with pytest.raises(CannotVerify, match=f"DistributedTokenLoader defined \\(line {line}\\) but never built as `name = DistributedTokenLoader\\(...\\)`, so patch-prefetch leaves the training loader as it is"):
        verify(original, out, batches=4)
    code = main(["verify", str(original), str(out), "--batches", "4"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_loader_that_does_not_wrap_around_verifies_on_shards_it_reads_once(tmp_path):
    # 40 calls of 128 tokens over 4 shards of 768: the loader ran out at batch 23, and
    # the shards are sized again for the run to read each once
    original, out = patch_to(tmp_path, "own_configuration", edits=NO_WRAP)
    result = verify(original, out, batches=40)
    assert result.identical, result.difference
    [note] = [n for n in result.notes if "does not wrap around" in n]
    assert note.startswith("the original loader's batch 23 (train) on rank 0 fails here: IndexError: list index out of range, on 4 synthetic shards of 768 tokens: the loader walks its shards once"), note
    assert "its wrap-around is not exercised" in note
    assert [n for n in result.notes if n.startswith("4 shards x ")] == ["4 shards x 1600 tokens; next_batch(384, 64, 3) (global tokens 384, gradient accumulation 3: 128 tokens read per call by 2 ranks, the shards read 0.8 times in 40 calls); 4 warm-up + 40 batches per rank"]


def test_shards_a_user_sized_too_small_for_a_loader_that_does_not_wrap_name_the_size_it_needs(tmp_path, capsys):
    original, out = patch_to(tmp_path, "own_configuration", edits=NO_WRAP)
    code = main(["verify", str(original), str(out), "--batches", "40", "--shard-tokens", "700"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert "IndexError: list index out of range, on 4 synthetic shards of 700 tokens: the loader reads past the end of its data, and --shard-tokens 700 holds less than the run reads; a loader that does not wrap around needs --shard-tokens 1600 or more" in err


def test_a_generator_built_in_main_from_its_locals_is_drawn_on_shards_an_item_fits_in(tmp_path):
    # `args = Hyperparameters()` and `rank = int(os.environ.get("RANK", 0))` in main(); an
    # item of 64 x 1024 tokens cut from one shard at a time: the short draw's shards of
    # 40,960 tokens end the generator before its first item, so it is drawn again on
    # shards 16 times larger
    original, out = patch_to(tmp_path, "batch_of_sequences")
    result = verify(original, out, batches=8)
    assert result.identical, result.difference
    assert "the original generator ends (StopIteration) before its first item on shards of 40960 tokens (its items hold more than its arguments say): drawn on shards of 655360" in result.notes


@pytest.mark.parametrize("old, new", [
    # the patched generator cuts rank 0's slice on every rank
    ("tokens[start + rank * span : start + (rank + 1) * span + 1]", "tokens[start : start + span + 1]"),
    # the patched main() builds it as rank 0 on every rank: its own local, not the original's
    ('    rank = int(os.environ.get("RANK", 0))\n', "    rank = 0\n"),
])
def test_a_generator_built_from_the_environments_rank_is_built_as_each_rank(tmp_path, old, new):
    original, out = patch_to(tmp_path, "batch_of_sequences")
    source = out.read_text()
    assert source.count(old) == 1
    out.write_text(source.replace(old, new))
    result = verify(original, out, batches=4)
    assert not result.identical and result.difference.rank == 1, result.difference


IMPORTED_LOADER = "import torch\nfrom prepare import make_dataloader\n\ntrain_loader = make_dataloader(8, 64)\nfor step in range(3):\n    x, y = next(train_loader)\n"


def test_a_loader_imported_from_another_module_names_the_module_to_patch(tmp_path, capsys):
    # autoresearch's train.py: `from prepare import ..., make_dataloader`; its loader is prepare.py's
    result = patch_source(IMPORTED_LOADER)
    [reason] = [n.reason for n in result.notes if n.feature == "train_prefetch"]
    assert reason == "`train_loader` (line 4) is built by `make_dataloader`, imported from `prepare` (line 2): its loader is in that module's file; patch that file"
    original, edited = tmp_path / "train.py", tmp_path / "edited.py"
    original.write_text(IMPORTED_LOADER)
    edited.write_text(IMPORTED_LOADER.replace("range(3)", "range(4)"))
    code = main(["verify", str(original), str(edited)])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and reason in err, err
