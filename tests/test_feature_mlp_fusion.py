"""mlp_fusion: before -> after and noop tables (whole outputs), and the same numbers."""

from __future__ import annotations

import pytest
import torch
from patch_tables import assert_noop, assert_patch, notes_of

from patcher.patch import features_from, patch_source


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
        HEAD + "        up_w_cast = up_w.to(x.dtype)\n        h = F.leaky_relu(F.linear(x, up_w_cast), negative_slope=0.5)\n        hidden = h * h\n        return F.linear(hidden, down_w.to(x.dtype))\n",
        (True, "banked square at line 5 -> h * h", 5),
        id="banked-cast-hoisted",
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
        "\tdef forward(self,x,up_w,down_w):up_w_cast=up_w.to(x.dtype);h=F.leaky_relu(F.linear(x,up_w_cast),negative_slope=.5);x=h*h;return F.linear(x,down_w.to(x.dtype))\n",
        (True, "banked square at line 3 -> h * h", 3),
        id="minified-banked-only-the-casts-of-the-square-statement-hoisted",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="mlp_fusion")
    assert notes_of(result, "mlp_fusion") == [note]


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


