"""Batches compared by what they are: the original and the edited script are loaded apart,
so a batch class both define (a namedtuple, a dataclass, a plain class) is two class
objects with one name, fields and values."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from patcher.cli import EXIT_FAILED, EXIT_OK, main
from patcher.patch import patch_source
from patcher.proof.compare import copy_batch, first_difference

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

CLASSES = """\
import dataclasses
from collections import namedtuple
Pair = namedtuple("Pair", "x y")
@dataclasses.dataclass
class Batch:
    x: object
    y: object
class Plain:
    def __init__(self, x, y):
        self.x, self.y = x, y
"""


def load(source: str = CLASSES) -> dict:
    """One load of a script's definitions, as verify loads each side: its own namespace."""
    namespace: dict = {}
    exec(compile(source, "train_gpt.py", "exec"), namespace)
    return namespace


def test_two_loads_of_one_class_hand_out_the_same_batch():
    a, b = load(), load()
    assert a["Pair"] is not b["Pair"]
    for name in ("Pair", "Batch", "Plain"):
        assert first_difference(a[name](torch.arange(3), 7), b[name](torch.arange(3), 7)) is None, name


def test_a_value_that_differs_is_named_by_its_field():
    a, b = load(), load()
    assert first_difference(a["Pair"](torch.arange(3), 7), b["Pair"](torch.arange(3), 8)) == ("y", "7 vs 8")
    assert first_difference(a["Batch"](torch.arange(3), 7), b["Batch"](torch.tensor([0, 5, 2]), 7)) == ("x", "bytes differ: first at [1]: 1 vs 5")
    assert first_difference(a["Plain"](1, 2), b["Plain"](1, 3)) == ("y", "2 vs 3")


def test_a_class_of_another_name_or_other_fields_differs():
    a, b = load(), load(CLASSES.replace('"x y"', '"x z"').replace("    y: object", "    z: object").replace("self.y", "self.z"))
    assert first_difference(a["Pair"](1, 2), b["Pair"](1, 2)) == (0, "Pair fields ['x', 'y'] vs ['x', 'z']")
    assert first_difference(a["Batch"](1, 2), b["Batch"](1, 2)) == (0, "Batch fields ['x', 'y'] vs ['x', 'z']")
    assert first_difference(a["Plain"](1, 2), b["Plain"](1, 2)) == (0, "Plain attributes ['x', 'y'] vs ['x', 'z']")
    assert first_difference(a["Pair"](1, 2), a["Batch"](1, 2)) == (0, "Pair vs Batch")


def test_verify_of_a_loader_that_hands_out_a_namedtuple(tmp_path, capsys):
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    source = source.replace("from pathlib import Path\n", "from pathlib import Path\nfrom collections import namedtuple\n\nPair = namedtuple('Pair', 'x y')\n", 1)
    returned = "        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)\n"
    assert source.count(returned) == 1
    source = source.replace(returned, f"        return Pair({returned.strip().removeprefix('return ')})\n")
    original, patched = tmp_path / "train_gpt.py", tmp_path / "patched.py"
    original.write_text(source)
    patched.write_text(patch_source(source).source)
    assert main(["verify", str(original), str(patched)]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1].startswith("identical: 200 batches")


def test_a_numpy_field_names_where_and_what_differs():
    # A loader handing out numpy arrays: the verdict locates the first differing element.
    want = np.arange(12, dtype=np.uint16).reshape(3, 4)
    got = want.copy()
    got[2, 1] = 99
    assert first_difference((want, want), (want, got)) == (1, "bytes differ: first at [2, 1]: 9 vs 99")
    assert first_difference(want, want.astype(np.int32))[1] == "dtype uint16 vs int32"
    assert first_difference(np.float32([0.0]), np.float32([-0.0])) == (0, "bytes differ: first at [0]: 0.0 vs -0.0")


def test_tensors_that_share_memory_on_one_side_only_differ():
    # parameter-golf's loader on a CPU: x, y = t[:-1], t[1:], where a write to y shows in
    # x. A patched batch of equal values whose x and y are apart is another batch.
    t = torch.arange(17)
    shared, apart = (t[:-1], t[1:]), (t[:-1].clone(), t[1:].clone())
    assert first_difference(shared, apart) == (1, "memory shared in the original (tensor 1 starts 8 bytes after tensor 0, in one storage), not in the patched batch")
    assert first_difference(apart, shared)[1].startswith("memory shared in the patched batch")
    assert first_difference(shared, (t[:-1], t[1:])) is None
    far = torch.arange(1 << 16)  # one storage, no overlap: no sharing a write could show
    assert first_difference((far[:8], far[-8:]), (far[:8].clone(), far[-8:].clone())) is None


def test_a_copy_of_a_batch_keeps_the_sharing_of_its_tensors():
    t = torch.arange(17)
    x, y = copy_batch((t[:-1].view(2, 8), t[1:].view(2, 8)))
    assert x.data_ptr() != t.data_ptr() and first_difference((t[:-1].view(2, 8), t[1:].view(2, 8)), (x, y)) is None
    y[0, 0] = -1
    assert x[0, 1] == -1 and t[2] == 2  # the copy's x shows the write; the source does not


def test_verify_finds_a_hand_edit_whose_x_and_y_no_longer_share_memory(tmp_path, capsys):
    # On a CPU device the fixture's x and y overlap (views of one chunk); an edited copy
    # that clones y hands out equal values, but a loop that masks y in place would no
    # longer change x. The CPU run compares against the original drawn on a CPU device.
    source = (FIXTURES / "tokenstream_readable.py").read_text()
    edited = source.replace("        y = mine[1:].reshape(-1, seq_len)\n", "        y = mine[1:].reshape(-1, seq_len).clone()\n")
    assert edited != source
    original, patched = tmp_path / "train_gpt.py", tmp_path / "edited.py"
    original.write_text(source)
    patched.write_text(edited)
    assert main(["verify", str(original), str(patched)]) == EXIT_FAILED
    assert "memory shared in the original (tensor 1 starts 8 bytes after tensor 0, in one storage), not in the patched batch" in capsys.readouterr().out
