"""verify: identical on every fixture the tool patches, and it catches broken prefetchers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patcher.cli import EXIT_FAILED, EXIT_OK, main
from patcher.patch import patch_source
from patcher.source import read_script, render
from patcher.verify import CannotVerify, verify

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def patched(tmp_path: Path, name: str, breakage=None) -> tuple[Path, Path]:
    original = FIXTURES / f"{name}.py"
    script = read_script(original)
    source = patch_source(script.source).source
    if breakage is not None:
        old, new = breakage
        assert old in source, "the runtime changed; update this test's breakage"
        source = source.replace(old, new, 1)
    out = tmp_path / f"{name}_patched.py"
    out.write_text(render(script, source, rewrap=False))
    return original, out


@pytest.mark.parametrize("name", ["tokenstream_readable", "shuffled_minified", "coprime_dataclass", "curriculum", "document_packing", "wrapped_lzma_raw", "generator_toplevel"])
def test_identical_on_patched_fixtures(tmp_path, name):
    original, out = patched(tmp_path, name)
    result = verify(original, out, batches=24, world_size=2)
    assert result.identical, result.difference
    warmup = 0 if name == "generator_toplevel" else 4  # one construction: no warm-up rebuild
    assert result.batches_compared == 2 * (24 + warmup)


SWAP_TWO = (
    "        item = self._take()\n",
    "        item = self._take()\n"
    "        if len(self._handed_out) == 3:\n"
    "            self._held, item = item, self._take()\n"
    "        elif len(self._handed_out) == 4:\n"
    "            self._handed_out.append(args)\n"
    "            return self._to_device(self._held, args)\n",
)
DROP_ONE = (
    "        item = self._take()\n",
    "        item = self._take()\n        if len(self._handed_out) == 5:\n            item = self._take()\n",
)
IGNORE_CHANGED_ARG = (
    "                item = item.reshape(-1, n)\n",
    "                pass\n",
)


@pytest.mark.parametrize(
    "name, breakage, phase, batch",
    [
        pytest.param("tokenstream_readable", SWAP_TWO, "warmup", 3, id="swaps-two-batches"),
        pytest.param("shuffled_minified", None, None, None, id="control-minified-unbroken"),
        pytest.param("tokenstream_readable", DROP_ONE, "train", 5, id="drops-one-batch"),
        pytest.param("curriculum", IGNORE_CHANGED_ARG, "train", 5, id="ignores-a-changed-seq-len"),
    ],
)
def test_catches_a_broken_prefetch(tmp_path, capsys, name, breakage, phase, batch):
    original, out = patched(tmp_path, name, breakage)
    code = main(["verify", str(original), str(out), "--batches", "16"])
    stdout = capsys.readouterr().out
    if breakage is None:
        assert code == EXIT_OK
        return
    assert code == EXIT_FAILED
    result = verify(original, out, batches=16)
    assert not result.identical
    assert (result.difference.rank, result.difference.phase, result.difference.batch) == (0, phase, batch)
    assert f"rank 0, {phase} batch {batch}" in stdout


SKIP_ONE_ITEM = (
    "        value, ready = item\n",
    "        value, ready = item\n"
    "        self._taken = getattr(self, '_taken', 0) + 1\n"
    "        if self._taken == 6:\n"
    "            worker.queue.room()\n"
    "            return next(self)\n",
)


def test_catches_a_generator_that_skips_an_item(tmp_path):
    original, out = patched(tmp_path, "generator_toplevel", SKIP_ONE_ITEM)
    result = verify(original, out, batches=16)
    assert not result.identical
    assert (result.difference.rank, result.difference.phase, result.difference.batch) == (0, "train", 5)


def test_generator_ranks_read_their_own_span(tmp_path):
    # dist.get_rank() inside the generator answers the simulated rank: rank 1's first
    # item is not rank 0's (a harness that ignored ranks would compare rank 0 twice).
    from patcher.harness import IteratorRecipe, SimulatedDist, load_definitions
    from patcher.check import definitions_only

    source = (FIXTURES / "generator_toplevel.py").read_text()
    module = load_definitions(definitions_only(source), "generator_toplevel.py")
    assert "train_loader" not in vars(module) and "distributed_data_generator" in vars(module)  # no training ran
    recipe = IteratorRecipe.from_source(source, patch_source(source).source)
    assert recipe.original == ["distributed_data_generator(args.train_files, args.num_tokens, args.seq_len)"]
    assert recipe.patched[0].startswith("_prefetch_iterator(lambda: distributed_data_generator(")
    from patcher.shards import write_shards

    write_shards(tmp_path, bos_id=1)
    module.__dict__["device"] = "cpu"
    firsts = []
    for rank in (0, 1):
        module.__dict__["dist"] = SimulatedDist(rank, 2)
        generator = recipe.evaluate(f"distributed_data_generator({str(tmp_path / 'fineweb_train_*.bin')!r}, 512, 32)", module)
        firsts.append(next(generator)[0])
    assert not torch.equal(firsts[0], firsts[1])


def test_cannot_verify_a_script_without_loader(tmp_path):
    with pytest.raises(CannotVerify, match="no loader|no training loader"):
        verify(FIXTURES / "no_loader.py", FIXTURES / "no_loader.py")
