"""verify: identical on every fixture the tool patches, and it catches broken prefetchers."""

from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.mark.parametrize("name", ["tokenstream_readable", "shuffled_minified", "coprime_dataclass", "curriculum", "document_packing", "wrapped_lzma_raw"])
def test_identical_on_patched_fixtures(tmp_path, name):
    original, out = patched(tmp_path, name)
    result = verify(original, out, batches=24, world_size=2)
    assert result.identical, result.difference
    assert result.batches_compared == 2 * (24 + 4)


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


def test_cannot_verify_a_script_without_loader(tmp_path):
    with pytest.raises(CannotVerify, match="no loader|no training loader"):
        verify(FIXTURES / "no_loader.py", FIXTURES / "no_loader.py")
