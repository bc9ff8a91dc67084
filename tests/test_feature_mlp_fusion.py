"""mlp_fusion: before -> after and noop tables (whole outputs), and the same numbers."""

from __future__ import annotations

import pytest
import torch
from patch_tables import assert_noop, assert_patch, notes_of

from patcher.patch import features_from, patch_source
from patcher.transforms.mlp_fusion import NOT_IN_TRAINING


# Unchanged by every row: the rows differ in the forward's body only.
HEAD = "import torch\nimport torch.nn.functional as F\nclass MLP(torch.nn.Module):\n    def forward(self, x, up_w=None, down_w=None):\n"

REWRITES = [
    pytest.param(
        HEAD + "        x = torch.relu(self.fc(x))\n        return self.proj(x.square())\n",
        HEAD + "        x = torch.relu(self.fc(x))\n        return self.proj(x * x)\n",
        (True, "relu2 square at line 6 -> h * h", 6),
        id="relu2-named",
    ),
    pytest.param(
        HEAD + "        return self.proj(F.leaky_relu(self.fc(x), negative_slope=0.5).square())\n",
        HEAD + "        h = F.leaky_relu(self.fc(x), negative_slope=0.5)\n        return self.proj(h * h)\n",
        (True, "leaky_relu2 square at line 5 -> h * h", 5),
        id="leaky-relu2-inline",
    ),
    pytest.param(
        HEAD + "        hidden = F.leaky_relu(F.linear(x, up_w.to(x.dtype)), negative_slope=0.5).square()\n        return F.linear(hidden, down_w.to(x.dtype))\n",
        HEAD + "        h = F.leaky_relu(F.linear(x, up_w.to(x.dtype)), negative_slope=0.5)\n        hidden = h * h\n        return F.linear(hidden, down_w.to(x.dtype))\n",
        (True, "banked square at line 5 -> h * h", 5),
        id="banked-casts-left-in-place",
    ),
    pytest.param(
        HEAD + "        h = self.norm(x)\n        return self.proj(F.gelu(self.fc(h)).square())\n",
        HEAD + "        h = self.norm(x)\n        h2 = F.gelu(self.fc(h))\n        return self.proj(h2 * h2)\n",
        (True, "act2 square at line 6 -> h * h", 6),
        id="other-activation-h-taken-so-h2",
    ),
    pytest.param(
        "import torch,torch.nn.functional as F\nclass MLP(torch.nn.Module):\n\tdef forward(self,x):return self.proj(F.leaky_relu(self.fc(x),negative_slope=.5).square())\n",
        "import torch,torch.nn.functional as F\nclass MLP(torch.nn.Module):\n\tdef forward(self,x):h=F.leaky_relu(self.fc(x),negative_slope=.5);return self.proj(h*h)\n",
        (True, "leaky_relu2 square at line 3 -> h * h", 3),
        id="minified-one-line-body",
    ),
    pytest.param(
        "import torch,torch.nn.functional as F\nclass MLP(torch.nn.Module):\n"
        "\tdef forward(self,x,up_w,down_w):x=F.leaky_relu(F.linear(x,up_w.to(x.dtype)),negative_slope=.5).square();return F.linear(x,down_w.to(x.dtype))\n",
        "import torch,torch.nn.functional as F\nclass MLP(torch.nn.Module):\n"
        "\tdef forward(self,x,up_w,down_w):h=F.leaky_relu(F.linear(x,up_w.to(x.dtype)),negative_slope=.5);x=h*h;return F.linear(x,down_w.to(x.dtype))\n",
        (True, "banked square at line 3 -> h * h", 3),
        id="minified-banked",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    """Without env_toggles (no switch possible) the square becomes `h * h` alone."""
    result = assert_patch(before, after, enabled={"mlp_fusion"})
    assert notes_of(result, "mlp_fusion") == [note]


SWITCHED = [
    pytest.param(
        HEAD + "        return self.proj(F.leaky_relu(self.fc(x), negative_slope=0.5).square())\n",
        HEAD.replace("class", 'import os\nMLP_FUSION = int(os.environ.get("MLP_FUSION", 1))\n\n\nclass')
        + "        h = F.leaky_relu(self.fc(x), negative_slope=0.5)\n        return self.proj(h * h if MLP_FUSION else h.square())\n",
        id="argument-unparenthesised",
    ),
    pytest.param(
        HEAD + "        return 1 + torch.relu(x).square()\n",
        HEAD.replace("class", 'import os\nMLP_FUSION = int(os.environ.get("MLP_FUSION", 1))\n\n\nclass')
        + "        h = torch.relu(x)\n        return 1 + (h * h if MLP_FUSION else h.square())\n",
        id="operand-parenthesised",
    ),
    pytest.param(
        "import os,torch,torch.nn.functional as F\nclass Hyperparameters:\n\tseed=int(os.environ.get('SEED',1))\nclass MLP(torch.nn.Module):\n\tdef forward(self,x):return self.proj(F.relu(self.fc(x)).square())\n",
        "import os,torch,torch.nn.functional as F\nclass Hyperparameters:\n\tseed=int(os.environ.get('SEED',1));mlp_fusion=int(os.environ.get('MLP_FUSION',1))\nclass MLP(torch.nn.Module):\n\tdef forward(self,x):h=F.relu(self.fc(x));return self.proj(h*h if Hyperparameters.mlp_fusion else h.square())\n",
        id="minified-hyperparameters-attribute",
    ),
]


@pytest.mark.parametrize("before, after", SWITCHED)
def test_switched_rewrites(before, after):
    """With env_toggles: `h * h if MLP_FUSION else h.square()`; patching again changes nothing."""
    result = assert_patch(before, after, only="mlp_fusion")
    assert patch_source(result.source, features_from(["mlp_fusion"], None)).source == result.source


NO_SQUARE = "no `act(x).square()` in an MLP forward"
COMPOUND = "square() inside a compound expression statement"

NOOPS = [
    pytest.param(HEAD + "        return x.square().mean(-1)\n", NO_SQUARE, None, id="rmsnorm-square-not-activation"),
    pytest.param(HEAD + "        return torch.exp(-up_w.square() / 2.0)\n", NO_SQUARE, None, id="gaussian-window"),
    pytest.param(HEAD + "        return self.proj(x.square())\n", NO_SQUARE, None, id="square-of-a-name-not-from-an-activation"),
    pytest.param(HEAD + "        x = torch.relu(self.fc(x))\n        x = x + 1\n        return self.proj(x.square())\n", NO_SQUARE, None, id="activation-name-rebound-before-the-square"),
    pytest.param(HEAD + "        h = torch.relu(self.fc(x))\n        return self.proj(h * h)\n", NO_SQUARE, None, id="already-fused"),
    pytest.param("import torch\ndef mlp(fc, x):\n    return torch.relu(fc(x)).square()\n", NO_SQUARE, None, id="square-outside-a-forward"),
    pytest.param(HEAD + "        return (torch.relu(x).square() if x.numel() else x)\n", COMPOUND, 5, id="square-inside-a-conditional-expression"),
    pytest.param(HEAD + "        f = lambda t: torch.relu(t).square()\n        return f(x)\n", COMPOUND, 5, id="square-inside-a-lambda"),
    pytest.param(
        HEAD + "        if self.training and self.use_fused:\n            return Fused(x, up_w, down_w)\n        return F.linear(F.leaky_relu(F.linear(x, up_w), negative_slope=0.5).square(), down_w)\n",
        f"{NOT_IN_TRAINING} (banked square at line 7, after `if self.training` returned)", 7,
        id="training-returns-a-fused-kernel-first",
    ),
    pytest.param(
        HEAD + "        if not self.training:\n            return self.proj(torch.relu(self.fc(x)).square())\n        return x\n",
        f"{NOT_IN_TRAINING} (relu2 square at line 6, after `if self.training` returned)", 6,
        id="square-under-not-training",
    ),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="mlp_fusion")


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
    result = patch_source(MLP_FORMS, {"mlp_fusion"})
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




def _ops(module, x, *args) -> list[str]:
    """The aten operations a forward runs, in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    seen: list[str] = []
    with Record():
        out = module(x, *args)
    return seen, out


def test_mlp_fusion_switch_off_runs_the_original_operations(monkeypatch):
    """MLP_FUSION=0: the same aten operations in the same order as the original, and the
    same outputs; MLP_FUSION=1: a `mul` where the original had `pow`, the same outputs."""
    result = patch_source(MLP_FORMS, features_from(["mlp_fusion"], None))
    assert "MLP_FUSION" in result.source
    original = {}
    exec(compile(MLP_FORMS, "original", "exec"), original)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    up_w, down_w = torch.randn(32, 16), torch.randn(16, 32)
    for switch in ("0", "1"):
        monkeypatch.setenv("MLP_FUSION", switch)
        patched = {}
        exec(compile(result.source, "patched", "exec"), patched)
        for name, args in (("ReluSquared", ()), ("LeakySquared", ()), ("Banked", (up_w, down_w))):
            torch.manual_seed(1)
            ops_before, before = _ops(original[name](), x, *args)
            torch.manual_seed(1)
            ops_after, after = _ops(patched[name](), x, *args)
            assert torch.equal(before, after), (name, switch)
            if switch == "0":
                assert ops_after == ops_before, name
            else:
                assert ops_after == [op.replace("aten.pow.Tensor_Scalar", "aten.mul.Tensor") for op in ops_before] != ops_before, name
