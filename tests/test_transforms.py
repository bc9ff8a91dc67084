"""Noop and before -> after tables per transform (the pyupgrade way), on small sources."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
import torch

from patcher.patch import features_from, patch_source
from patcher.survey import survey

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


def test_train_prefetch_rewrites_every_construction_and_keeps_the_rest():
    body = CONSTANT_LOOP + 'train_loader = DistributedTokenLoader("x", 0, 1, device)\nx, y = train_loader.next_batch(512, 64, grad_accum_steps)\n'
    source = script(body)
    result, notes = notes_for(source, "train_prefetch")
    assert [n.applied for n in notes] == [True]
    assert result.source.count(
        '_make_train_loader(lambda loader_device: DistributedTokenLoader("x", 0, 1, loader_device), device, '
        "prefetch=Hyperparameters.train_prefetch, queue_depth=Hyperparameters.train_prefetch_queue, "
        "copy_stream=Hyperparameters.train_copy_stream, host_copy=False)"
    ) == 2
    # minimal diff: every original line that no transform targets is still there, in order
    untouched = [l for l in source.splitlines() if "DistributedTokenLoader(" not in l and ".to(self.device" not in l]
    remaining = iter(result.source.splitlines())
    assert all(any(line == p for p in remaining) for line in untouched)  # a subsequence


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


def test_loader_without_array_writes_skips_the_host_copy():
    body = """
    train_loader = DistributedTokenLoader("x", 0, 1, device)
    x, y = train_loader.next_batch(512, 64, 1)
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


def test_copy_stream_rewrites_h2d_calls_only_in_the_loader():
    result, notes = notes_for(script(CONSTANT_LOOP), "copy_stream")
    assert notes[0].applied
    assert "return _h2d(x, self.device, Hyperparameters.train_copy_stream), _h2d(y, self.device, Hyperparameters.train_copy_stream)" in result.source
    assert "def _h2d(tensor, device, copy_stream=True):" in result.source


def test_env_toggles_copy_the_script_idiom_and_log_once():
    loader = LOADER + "\ndef log0(msg):\n    print(msg)\n"
    body = CONSTANT_LOOP.replace("train_loader = Dist", "log0('start')\ntrain_loader = Dist")
    # log0 must be visible where the loader is built: make it module level
    result, notes = notes_for(script(body, loader), "env_toggles")
    assert all(n.applied for n in notes)
    assert '    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))' in result.source
    assert '    train_prefetch_queue = int(os.environ.get("TRAIN_PREFETCH_QUEUE", 2))' in result.source
    assert '    train_copy_stream = int(os.environ.get("TRAIN_COPY_STREAM", 1))' in result.source
    assert result.source.count('log0(f"patch_prefetch train_prefetch:{Hyperparameters.train_prefetch}') == 1


def test_env_toggles_minified_oneline_class():
    minified = (
        "import os,torch\n"
        "class Hyperparameters():seed=int(os.environ.get('SEED',1));n=2\n"
        "class L:\n"
        "\tdef __init__(self,h,device):self.device=device;self.i=0\n"
        "\tdef next_batch(self,a,b):self.i+=1;x=torch.full((a,),self.i);return x.to(self.device,non_blocking=True),x.to(self.device,non_blocking=True)\n"
        "def main(h,device):\n"
        "\ttrain_loader=L(h,device)\n"
        "\tfor i in range(3):x,y=train_loader.next_batch(h.n,h.n)\n"
    )
    result = patch_source(minified)
    assert "seed=int(os.environ.get('SEED',1));n=2;train_prefetch=int(os.environ.get('TRAIN_PREFETCH',1));" in result.source
    assert "\ttrain_loader=_make_train_loader(lambda loader_device:L(h,loader_device),device,prefetch=Hyperparameters.train_prefetch," in result.source
    assert "\n\tdef shutdown(self):" in result.source  # runtime indented with the script's tabs
    assert '"""' not in result.source.split("# patch-prefetch ", 1)[1].split("class Hyperparameters", 1)[0]  # no docstrings
    compile(result.source, "minified", "exec")


@pytest.mark.parametrize(
    "before, after",
    [
        pytest.param(
            "        x = torch.relu(self.fc(x))\n        return self.proj(x.square())\n",
            "        x = torch.relu(self.fc(x))\n        return self.proj(x * x)\n",
            id="relu2-named",
        ),
        pytest.param(
            "        return self.proj(F.leaky_relu(self.fc(x), negative_slope=0.5).square())\n",
            "        h = F.leaky_relu(self.fc(x), negative_slope=0.5)\n        return self.proj(h * h)\n",
            id="leaky-relu2-inline",
        ),
        pytest.param(
            "        hidden = F.leaky_relu(F.linear(x, up_w.to(x.dtype)), negative_slope=0.5).square()\n        return F.linear(hidden, down_w.to(x.dtype))\n",
            "        up_w_cast = up_w.to(x.dtype)\n        h = F.leaky_relu(F.linear(x, up_w_cast), negative_slope=0.5)\n        hidden = h * h\n        return F.linear(hidden, down_w.to(x.dtype))\n",
            id="banked-cast-hoisted",
        ),
    ],
)
def test_mlp_fusion_rewrites(before, after):
    head = "import torch\nimport torch.nn.functional as F\nclass MLP(torch.nn.Module):\n    def forward(self, x, up_w=None, down_w=None):\n"
    result = patch_source(head + before, features_from(["mlp_fusion"], None))
    assert result.source == head + after


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("        return x.square().mean(-1)\n", id="rmsnorm-square-not-activation"),
        pytest.param("        return torch.exp(-t.square() / 2.0)\n", id="gaussian-window"),
    ],
)
def test_mlp_fusion_noop(body):
    source = "import torch\nclass N(torch.nn.Module):\n    def forward(self, x, t=None):\n" + body
    result = patch_source(source, features_from(["mlp_fusion"], None))
    assert result.source == source
    assert not result.applied


MLP_FORMS = """
import torch
import torch.nn.functional as F
class ReluSquared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.proj = torch.nn.Linear(32, 16)
    def forward(self, x):
        x = torch.relu(self.fc(x))
        return self.proj(x.square())
class LeakySquared(ReluSquared):
    def forward(self, x):
        return self.proj(F.leaky_relu(self.fc(x), negative_slope=0.5).square())
class Banked(torch.nn.Module):
    def forward(self, x, up_w, down_w):
        hidden = F.leaky_relu(F.linear(x, up_w.to(x.dtype)), negative_slope=0.5).square()
        return F.linear(hidden, down_w.to(x.dtype))
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mlp_fusion_same_numbers(dtype):
    """The patched MLP forwards give bit-identical outputs to the originals."""
    result = patch_source(MLP_FORMS, features_from(["mlp_fusion"], None))
    assert len(result.applied) == 1 and result.source != MLP_FORMS
    original, patched = {}, {}
    exec(compile(MLP_FORMS, "original", "exec"), original)
    exec(compile(result.source, "patched", "exec"), patched)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    for name in ("ReluSquared", "LeakySquared"):
        torch.manual_seed(1)
        before = original[name]().to(dtype)
        torch.manual_seed(1)
        after = patched[name]().to(dtype)
        assert torch.equal(before(x), after(x)), name
    up_w, down_w = torch.randn(32, 16), torch.randn(16, 32)
    assert torch.equal(original["Banked"]()(x, up_w, down_w), patched["Banked"]()(x, up_w, down_w))


def test_patching_twice_is_a_noop():
    once = patch_source(script(CONSTANT_LOOP)).source
    twice = patch_source(once)
    assert twice.already_patched
    assert twice.source == once
    assert not twice.changed


def test_skip_env_toggles_uses_literal_defaults():
    result = patch_source(script(CONSTANT_LOOP), features_from(None, ["env_toggles"]))
    assert "prefetch=1, queue_depth=2, copy_stream=1" in result.source
    assert "Hyperparameters.train_" not in result.source
    assert 'os.environ.get("TRAIN_' not in result.source


def test_unknown_feature_is_rejected():
    with pytest.raises(ValueError, match="unknown feature"):
        features_from(["warp_drive"], None)
