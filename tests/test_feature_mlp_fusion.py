"""mlp_fusion: before -> after and noop tables (whole outputs), and the same numbers."""

from __future__ import annotations

import pytest
import torch
from patch_tables import assert_patch

from patcher.patch import features_from, patch_source


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
def test_rewrites(before, after):
    head = "import torch\nimport torch.nn.functional as F\nclass MLP(torch.nn.Module):\n    def forward(self, x, up_w=None, down_w=None):\n"
    result = assert_patch(head + before, head + after, only="mlp_fusion")
    assert result.applied == ["mlp_fusion"]


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("        return x.square().mean(-1)\n", id="rmsnorm-square-not-activation"),
        pytest.param("        return torch.exp(-t.square() / 2.0)\n", id="gaussian-window"),
        pytest.param("        return (torch.relu(x).square() if x.numel() else x)\n", id="square-inside-a-conditional-expression"),
        pytest.param("        return self.proj(x.square())\n", id="square-of-a-name-not-from-an-activation"),
    ],
)
def test_noop(body):
    assert_patch("import torch\nclass N(torch.nn.Module):\n    def forward(self, x, t=None):\n" + body, None, only="mlp_fusion")


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


