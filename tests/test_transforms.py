"""Noop and before -> after tables per transform (the pyupgrade way), on small sources."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
import python_minifier

from patcher.patch import features_from, patch_source
from patcher.survey.survey import survey

LOADER = '''
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

class TokenStream:
    def __init__(self, pattern):
        self.tokens = torch.arange(10_000)
        self.pos = 0

    def take(self, n):
        out = self.tokens[self.pos : self.pos + n]
        self.pos += n
        return out

class DistributedTokenLoader:
    def __init__(self, pattern, rank, world_size, device):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.stream = TokenStream(pattern)

    def next_batch(self, global_tokens, seq_len, grad_accum_steps):
        local_tokens = global_tokens // (self.world_size * grad_accum_steps)
        chunk = self.stream.take((local_tokens + 1) * self.world_size)
        local = chunk[: local_tokens + 1].to(dtype=torch.int64)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
'''


def script(main_body: str, loader: str = LOADER) -> str:
    return loader + "\ndef main():\n" + textwrap.indent(textwrap.dedent(main_body), "    ")


def notes_for(source: str, feature: str, enabled=None):
    result = patch_source(source, enabled)
    return result, [n for n in result.notes if n.feature == feature]


CONSTANT_LOOP = """
args = Hyperparameters()
grad_accum_steps = 8 // int(os.environ.get("WORLD_SIZE", "1"))
train_loader = DistributedTokenLoader("x", 0, 1, device)
for step in range(10):
    x, y = train_loader.next_batch(512, 64, grad_accum_steps)
"""


@pytest.mark.parametrize(
    "body, reason_part",
    [

        pytest.param(
            """
            calib_loader = DistributedTokenLoader("x", 0, 1, device)
            x, y = calib_loader.next_batch(512, 64, 1)
            """,
            "not the training loader",
            id="gptq-calibration-loader",
        ),
        pytest.param(
            """
            train_loader = DistributedTokenLoader("x", 0, 1, device)
            """,
            "no next_batch call",
            id="built-but-never-drawn",
        ),
    ],
)
def test_train_prefetch_noop(body, reason_part):
    source = script(body)
    result, notes = notes_for(source, "train_prefetch")
    assert notes and not any(n.applied for n in notes)
    assert reason_part in notes[0].reason
    assert "_make_train_loader(" not in result.source


@pytest.mark.parametrize(
    "loader_change, reason_part",
    [
        pytest.param(("self.stream = TokenStream(pattern)", "self.stream = TokenStream(pattern); torch.manual_seed(0)"), "global torch RNG", id="global-torch-rng"),
        pytest.param(("chunk = self.stream.take", "dist.barrier(); chunk = self.stream.take"), "torch.distributed", id="dist-in-next-batch"),
        pytest.param(("local_tokens = global_tokens", "import threading; self.t = threading.Thread(target=print); local_tokens = global_tokens"), "already prefetches", id="loader-already-prefetches"),
        pytest.param(("x = local[:-1]", "pad = torch.zeros(1, device=self.device); x = local[:-1]"), "self.device", id="device-used-beyond-copy"),
    ],
)
def test_train_prefetch_noop_unsafe_loaders(loader_change, reason_part):
    old, new = loader_change
    source = script(CONSTANT_LOOP, LOADER.replace(old, new))
    _, notes = notes_for(source, "train_prefetch")
    assert not any(n.applied for n in notes)
    assert reason_part in notes[0].reason


BATCH_SWITCH = """
train_loader = DistributedTokenLoader("x", 0, 1, device)
batch_tokens = 512
for step in range(10):
    batch_tokens = batch_tokens * 2
    x, y = train_loader.next_batch(batch_tokens, 64, 1)
"""


def test_batch_size_curriculum_gets_rollback():
    result, notes = notes_for(script(BATCH_SWITCH), "train_prefetch")
    assert notes[0].applied and "per-step argument `batch_tokens`" in notes[0].reason
    assert "rollback=True" in result.source


def test_batch_size_curriculum_on_an_in_place_loader_is_skipped():
    loader = LOADER.replace("        self.pos += n\n", "        self.pos += n\n        self.seen[0] = n\n").replace("self.pos = 0", "self.pos = 0\n        self.seen = [0]")
    result, notes = notes_for(script(BATCH_SWITCH, loader), "train_prefetch")
    assert not notes[0].applied
    assert "per-step argument `batch_tokens`" in notes[0].reason and "self.seen[0]" in notes[0].reason
    assert "_make_train_loader(" not in result.source


def test_seq_len_curriculum_is_prefetched_with_reshape_arg():
    body = """
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        seq_len = 32 if step < 5 else 64
        x, y = train_loader.next_batch(512, seq_len, 1)
    """
    result, notes = notes_for(script(body), "train_prefetch")
    assert notes[0].applied
    assert "reshape_arg=1" in result.source


# host_copy is an option of the full runtime (the lean one always copies out of its
# shared-memory slots): the scripts below read a loader attribute, which needs it.
def test_loader_without_array_writes_skips_the_host_copy():
    body = """
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = train_loader.next_batch(512, 64, 1)
    print(train_loader.rank)
    """
    result, notes = notes_for(script(body), "train_prefetch")
    assert notes[0].applied and "host_copy=False" in result.source


@pytest.mark.parametrize(
    "write",
    ["self.buf.copy_(local)", "self.buf[0] = 1", "torch.add(local, 0, out=self.buf)"],
)
def test_loader_that_writes_a_kept_array_keeps_the_host_copy(write):
    loader = LOADER.replace("self.stream = TokenStream(pattern)", "self.stream = TokenStream(pattern)\n        self.buf = torch.zeros(1)").replace(
        "        x = local[:-1]", f"        {write}\n        x = local[:-1]"
    )
    body = """
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = train_loader.next_batch(512, 64, 1)
    """
    result, notes = notes_for(script(body, loader), "train_prefetch")
    assert notes[0].applied and "_make_train_loader(" in result.source
    assert "host_copy=False" not in result.source


def test_writes_into_a_list_attribute_are_not_array_writes():
    # ShuffledSequenceLoader-style `self.start_inds[si] = ...` on a list of lists: the
    # batches are fresh tensors, no host copy needed.
    loader = LOADER.replace("self.stream = TokenStream(pattern)", "self.stream = TokenStream(pattern)\n        self.order: list = [[] for _ in range(4)]").replace(
        "        x = local[:-1]", "        self.order[0] = [1, 2]\n        self.order[1][0] = 3\n        x = local[:-1]"
    )
    body = """
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = train_loader.next_batch(512, 64, 1)
    print(train_loader.rank)
    """
    result, notes = notes_for(script(body, loader), "train_prefetch")
    assert notes[0].applied and "host_copy=False" in result.source


GENERATOR_SCRIPT = """
import torch
import torch.distributed as dist

def data_generator(pattern, num_tokens, seq_len):
    rank = dist.get_rank() if dist.is_initialized() else 0
    tokens, pos = torch.arange(100_000), 0
    while True:
        buf = tokens[pos + rank * num_tokens :][: num_tokens + 1]
        EXTRA
        new = yield buf[:-1].to(device="cuda", non_blocking=True), buf[1:].to(device="cuda", non_blocking=True)
        pos += num_tokens

train_loader = data_generator("x", 512, 64)
for step in range(10):
    x, y = LOOP
"""


def generator_script(extra="pass", loop="next(train_loader)"):
    return GENERATOR_SCRIPT.replace("EXTRA", extra).replace("LOOP", loop)


def test_top_level_generator_is_wrapped_and_its_copies_noted():
    result, notes = notes_for(generator_script(), "train_prefetch")
    assert notes[0].applied and "generator data_generator" in notes[0].reason
    assert 'train_loader = _prefetch_iterator(lambda: data_generator("x", 512, 64), prefetch=' in result.source
    assert "def _prefetch_iterator(" in result.source and "def data_generator(" in result.source
    copy_notes = [n for n in result.notes if n.feature == "copy_stream"]
    assert copy_notes[0].applied and "copy stream" in copy_notes[0].reason
    compile(result.source, "out.py", "exec")


@pytest.mark.parametrize(
    "extra, loop, reason_part",
    [
        ("pass", "train_loader.throw(ValueError)", "`train_loader.throw`"),
        ("noise = torch.randint(0, 9, (1,))", "next(train_loader)", "global torch RNG"),
        ("dist.all_reduce(buf)", "next(train_loader)", "collective"),
        ("pass", "0, 0", "never advanced with next()"),
    ],
)
def test_generator_left_alone_with_the_reason(extra, loop, reason_part):
    result, notes = notes_for(generator_script(extra, loop), "train_prefetch")
    assert not notes[0].applied and reason_part in notes[0].reason
    assert "_prefetch_iterator(" not in result.source


def test_generator_receiving_send_is_wrapped_and_its_sends_surveyed():
    source = generator_script(loop="train_loader.send((1024, 64) if step == 5 else None)")
    result, notes = notes_for(source, "train_prefetch")
    assert notes[0].applied
    assert "train_loader = _prefetch_iterator(lambda: data_generator(" in result.source
    sites = [i for i in survey(cst.parse_module(source)).iterators if i.training]
    assert [cst.Module([]).code_for_node(c.args[0].value) for c in sites[0].sends] == ["(1024, 64) if step == 5 else None"]


def test_validation_generator_is_not_wrapped():
    source = generator_script() + "val_loader = data_generator('v', 512, 64)\nxv, yv = next(val_loader)\n"
    result, _ = notes_for(source, "train_prefetch")
    assert result.source.count("_prefetch_iterator(lambda") == 1
    assert "val_loader = data_generator('v', 512, 64)" in result.source


DDL_SCRIPT = """
class SOAP:
    pass

import os
import torch

class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world):
        self.B, self.T, self.pos = B, T, rank * B * T
        self.tokens = torch.arange(100_000)

    def next_batch(self):
        buf = self.tokens[self.pos : self.pos + self.B * self.T + 1]
        self.pos += self.B * self.T
        return buf[:-1].view(self.B, self.T).cuda(), buf[1:].view(self.B, self.T).cuda()

B, T = 4, 64
ddp_rank = int(os.environ.get("RANK", "0"))
train_loader = DistributedDataLoader("x", B, T, ddp_rank, 1)
for step in range(10):
    x, y = train_loader.next_batch()
"""


def test_loader_that_moves_batches_itself_runs_ahead():
    result, notes = notes_for(DDL_SCRIPT, "train_prefetch")
    assert notes[0].applied and ".cuda() copies" in notes[0].reason
    assert 'train_loader = _prefetch_next_batch(lambda: DistributedDataLoader("x", B, T, ddp_rank, 1), prefetch=' in result.source
    copy_notes = [n for n in result.notes if n.feature == "copy_stream"]
    assert copy_notes[0].applied
    # `import os` comes after the first class: the runtime's constants need their own.
    head = result.source.split("TRAIN_PREFETCH = ", 1)[0]
    assert "import os" in head
    exec(compile(result.source.split("train_loader = ", 1)[0], "out.py", "exec"), {})  # runs: no NameError


def test_loader_that_moves_batches_itself_with_a_per_step_argument_is_left_alone():
    source = DDL_SCRIPT.replace("def next_batch(self):", "def next_batch(self, rows=4):").replace(
        "train_loader.next_batch()", "train_loader.next_batch(step)"
    )
    result, notes = notes_for(source, "train_prefetch")
    assert not notes[0].applied and "per-step argument `step`" in notes[0].reason


def test_parallel_assignment_names_are_run_constants():
    # `B, T = 512, 64` binds each name once: the next_batch arguments are constant,
    # so no rollback is needed.
    body = """
    B, T = 512, 64
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    for step in range(10):
        x, y = train_loader.next_batch(B, T, 1)
    """
    result, notes = notes_for(script(body), "train_prefetch")
    assert notes[0].applied and "rollback=True" not in result.source and "per-step" not in notes[0].reason


def test_runtime_in_a_minified_script_takes_its_tabs_and_no_docstrings():
    from test_feature_env_toggles import MINIFIED

    result = patch_source(MINIFIED)  # the script's own lines: test_feature_env_toggles.py
    assert "\n\tdef shutdown(self):" in result.runtime  # runtime indented with the script's tabs
    assert '"""' not in result.source.split("# patch-prefetch ", 1)[1].split("class Hyperparameters", 1)[0]  # no docstrings
    compile(result.source, "minified", "exec")


def test_runtime_in_a_minified_script_is_written_as_pyminify_writes_it():
    # The records count their code after `pyminify --no-rename-locals --no-hoist-literals
    # --remove-literal-statements`: the injected code already in that form costs no
    # counted byte that minifying would save.
    from test_feature_env_toggles import MINIFIED

    runtime = patch_source(MINIFIED).runtime
    code = runtime.split("\n", 1)[1]  # after the header line
    assert "def _make_train_loader(make_loader,device," in code and ", " not in code and " = " not in code
    assert python_minifier.minify(code, rename_locals=False, hoist_literals=False, remove_literal_statements=True) == code.rstrip("\n")


def test_patching_twice_is_a_noop():
    once = patch_source(script(CONSTANT_LOOP)).source
    twice = patch_source(once)
    assert twice.already_patched
    assert twice.source == once
    assert not twice.changed


def test_unknown_feature_is_rejected():
    with pytest.raises(ValueError, match="unknown feature"):
        features_from(["warp_drive"], None)
