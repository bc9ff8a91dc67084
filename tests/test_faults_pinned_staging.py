"""Feature `pinned_staging`: only a tensor moved to a device is staged; anything else is the original `.to(...)`.

A staged generator's `x.to(torch.float16, non_blocking=True)` (a cast) or
`x.to(other, non_blocking=True)` (another tensor's dtype and device) is not an H2D
copy to a device: staged, it raised TypeError at the first batch. A batch object with
its own `.to()` must have that method called, with the original arguments. Each
script below is patched by the command itself and run on the CPU (and on the CUDA
path driven with host memory), with `TRAIN_PINNED_STAGING` at 0 and 1: what it
yields must be the original's.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy

import pytest
import torch

import patcher.templates.pinned_staging as staging
from patcher.cli import main
from patcher.proof.host_cuda import cuda_on_host

# A generator whose thread loads shards (so its copies are staged, not run ahead),
# yielding a cast, another tensor's dtype, a batch object with its own `.to()` (moved
# positionally and by keyword) and two plain copies. `RESULTS` records what a batch
# holds; `Batch.to` records its arguments.
SCRIPT = """\
import threading
import torch

RESULTS = []

class Batch:
    def __init__(self, tokens):
        self.tokens, self.moves = tokens, []

    def to(self, device, non_blocking=False):
        self.moves.append((str(device), non_blocking))
        return self

def batches(n):
    threading.Thread(target=int).start()
    tokens = torch.arange(1000)
    like = torch.zeros(1, dtype=torch.float64)
    while True:
        buf = tokens[:n]
        new = yield (
            buf.to(torch.float16, non_blocking=True),
            buf.to(like, non_blocking=True),
            Batch(buf).to(DEVICE, non_blocking=True),
            Batch(buf).to(device=DEVICE, non_blocking=True),
            buf.to(DEVICE, non_blocking=True),
            buf.to(device=DEVICE, non_blocking=True),
        )
        if new is not None:
            n = new

train_loader = batches(8)
for step in range(3):
    half, wide, batch, named, plain, keyword = train_loader.send(16 if step == 1 else None)
    RESULTS.append((half.dtype, half.tolist(), wide.dtype, wide.tolist(), batch.moves, named.moves, plain.tolist(), keyword.tolist()))
"""


def patched(tmp_path, device: str):
    """The script (device a literal `device`) and its patch by the command; the JSON report's notes."""
    source = SCRIPT.replace("DEVICE", repr(device))
    original = tmp_path / f"gen_{device}.py"
    original.write_text(source)
    out = tmp_path / f"gen_{device}_patched.py"
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        assert main([str(original), "-o", str(out), "--no-check", "--json", "-q"]) == 0
    return original, out, json.loads(report.getvalue())["notes"]


def results(path, monkeypatch, toggle: str | None):
    if toggle is not None:
        monkeypatch.setenv("TRAIN_PINNED_STAGING", toggle)
    return runpy.run_path(str(path))["RESULTS"]


@pytest.mark.parametrize("device, on_host", [("cpu", False), ("cuda", True)])
def test_patched_generator_yields_what_the_original_does_with_the_toggle_on_and_off(tmp_path, monkeypatch, device, on_host):
    # Before: TypeError at the first batch (`_pinned_h2d(buf, torch.float16, ...)`), and a
    # batch object handed back without its `.to()` called, with the toggle at 0 too.
    original, out, _ = patched(tmp_path, device)
    with cuda_on_host() if on_host else contextlib.nullcontext():
        expected = results(original, monkeypatch, None)
        assert expected[0][4:6] == ([(device, True)], [(device, True)])
        for toggle in ("0", "1"):
            assert results(out, monkeypatch, toggle) == expected, f"TRAIN_PINNED_STAGING={toggle}"


def test_only_device_targets_are_rewritten_and_the_others_are_noted(tmp_path):
    # Before: all six calls rewritten, the cast and the tensor target among them, with
    # an "applied" note for them all.
    _, out, notes = patched(tmp_path, "cuda")
    text = out.read_text()
    assert "buf.to(torch.float16, non_blocking=True)" in text and "buf.to(like, non_blocking=True)" in text
    assert '_pinned_h2d(buf, "cuda", staging=' in text.replace("'", '"') and '_pinned_h2d(buf, device="cuda", staging=' in text.replace("'", '"')
    ours = [(n["applied"], n["reason"], n["line"]) for n in notes if n["feature"] == "pinned_staging"]
    assert ours[0][0] and "H2D copies at line 23, 24, 25, 26 through pinned memory" in ours[0][1]
    assert [(applied, line) for applied, _, line in ours[1:]] == [(False, 21), (False, 22)]
    assert "`buf.to(torch.float16, non_blocking=True)`" in ours[1][1] and "not a device" in ours[1][1]


class _Moved:
    """A batch object with its own `.to()`, which records how it was called."""

    def __init__(self):
        self.calls = []

    def to(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "moved"


class _Tagged(torch.Tensor):
    """A tensor subclass whose `.to()` is its own."""

    def to(self, *args, **kwargs):
        return "own to"


@pytest.mark.parametrize("staged", [True, False])
def test_anything_but_a_plain_tensor_gets_its_own_to_with_the_original_arguments(staged):
    # Before: the object came back unmoved (a leaf that is not a tensor), with staging
    # on or off, and the subclass was staged as a plain tensor.
    with cuda_on_host():
        for args, kwargs in ((("cuda",), {}), ((), {"device": "cuda"}), ((), {"target": "cuda"})):
            batch = _Moved()
            assert staging._pinned_h2d(batch, *args, staging=staged, **kwargs) == "moved"
            assert batch.calls == [(args, {"non_blocking": True, **kwargs})]
        assert staging._pinned_h2d(torch.arange(3).as_subclass(_Tagged), "cuda", staging=staged) == "own to"


@pytest.mark.parametrize("staged", [True, False])
def test_a_target_that_is_not_a_device_is_the_original_call(staged):
    # Before: TypeError (a dtype, a tensor taken for a device), and another TypeError
    # than the original's for a dtype passed as `device=`.
    t = torch.arange(4)
    with cuda_on_host():
        assert staging._pinned_h2d(t, torch.float16, staging=staged).dtype == torch.float16
        assert staging._pinned_h2d(t, torch.zeros(1, dtype=torch.float64), staging=staged).dtype == torch.float64
        with pytest.raises(TypeError, match=r"^to\(\) received an invalid combination"):  # as the original
            staging._pinned_h2d(t, device=torch.float16, staging=staged)



def test_a_generator_whose_copies_are_all_casts_is_left_as_it_is():
    # Before: both casts rewritten into `_pinned_h2d(...)` (and the runtime injected).
    from patcher.patch import patch_source

    source = SCRIPT.replace("DEVICE", "'cuda'")
    casts_only = source.replace(source[source.index("            Batch(buf).to('cuda'"):source.index("        )\n")], "")
    result = patch_source(casts_only)
    assert "_pinned_h2d" not in result.source
    assert not any(n.applied for n in result.notes)
    # No report claims staging the output does not have.
    reason = next(n.reason for n in result.notes if n.feature == "train_prefetch")
    assert "pinned staging" not in reason and "no `.to(device, non_blocking=True)` to a device" in reason
