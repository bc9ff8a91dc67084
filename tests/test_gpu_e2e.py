"""bench/gpu_e2e.py: the end-to-end stages' statistics, log reading, and stand-ins, in process."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_e2e  # noqa: E402
import gpu_prepare  # noqa: E402


def _stand_in(name: str):
    """A stand-in of bench/shims/offline loaded under a private name (the real package,
    where installed, stays what `import NAME` gives the rest of the suite)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_stand_in_{name}", ROOT / "bench" / "shims" / "offline" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_between_run_interval_is_on_the_log_ratio_and_gives_the_resolution():
    steady = lambda level: [level * (1 + 0.001 * (i % 5)) for i in range(20)]  # noqa: E731
    faster = gpu_e2e.compare([steady(100.0), steady(101.0), steady(100.5)], [steady(90.0), steady(90.4), steady(90.2)])
    assert faster["basis"].startswith("between runs") and faster["verdict"].startswith("patched faster")
    assert faster["interval"][0] < faster["ratio"] < faster["interval"][1] < 1
    # Runs far apart on one side: an interval that cannot go negative, no verdict, its width said.
    noisy = gpu_e2e.compare([steady(7.0), steady(7.1)], [steady(396.0), steady(1069.0)])
    assert noisy["interval"][0] > 0 and noisy["verdict"].startswith("no difference seen")
    assert f"{noisy['resolution_pct']:.2f} %" in noisy["verdict"]


def test_one_run_a_side_gives_a_within_run_resolution_and_no_verdict():
    a, b = [100.0 + (i % 3) for i in range(30)], [80.0 + (i % 3) for i in range(30)]
    one = gpu_e2e.compare([a], [b])
    assert one["basis"].startswith("within one run each")
    assert "faster" not in one["verdict"] and "slower" not in one["verdict"] and 0 < one["resolution_pct"] < 5


def test_step_samples_from_cumulative_times_and_step_lines():
    cumulative = {step: 1000.0 + 10.0 * step + (5.0 if step == 7 else 0.0) for step in range(1, 23)}
    # Windows of WINDOW steps after the warm-up: a jitter inside a window leaves its mean alone.
    assert gpu_e2e.step_samples(cumulative, "cumulative", warmup=2) == pytest.approx([10.0] * 3)
    assert gpu_e2e.parse_step("step:12/1285 train_time:3456ms step_avg:288.00ms", gpu_e2e.MODDED_STEP, "cumulative", 0.0) == (12, 3456.0)
    line = "step 00012/00040 (30.00%) | loss: 5.1 | lrm: 1.00 | dt: 151.25ms | tok/sec: 866,000 | epoch: 1"
    assert gpu_e2e.parse_step(line, gpu_e2e.NANOCHAT_STEP, "dt", 0.0) == (12, 151.25)


def _reference(q, k, v, cu, left):
    """Each document on its own, causal, keys at most `left` back (-1: all), in float64."""
    out = torch.empty_like(q, dtype=torch.float64)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = (t[start:end].double().transpose(0, 1) for t in (q, k, v))
        scores = qd @ kd.transpose(1, 2) / math.sqrt(q.shape[-1])
        i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None, :]
        allowed = (j <= i) & ((j >= i - left) if left >= 0 else True)
        out[start:end] = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vd).transpose(0, 1)
    return out


@pytest.mark.parametrize("left,chunk", [(-1, 1024), (3, 1024), (3, 4), (6, 4)])
def test_the_flash_attention_stand_in_attends_within_documents_and_the_window(left, chunk):
    kernels = _stand_in("kernels")
    kernels.CHUNK = chunk  # 4: chunks, keys reaching back past a chunk, a padded last chunk
    torch.manual_seed(0)
    q, k, v = (torch.randn(23, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 5, 17, 23], dtype=torch.int32)
    attn = kernels.get_kernel("kernels-community/flash-attn3", version=1).flash_attn_interface
    got = attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12, causal=True, window_size=(left, 0))
    assert torch.allclose(got.double(), _reference(q, k, v, cu, left), atol=1e-5)
    # No NaN reaches the gradients from the padding.
    for t in (q, k, v):
        t.requires_grad_(True)
    attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, window_size=(left, 0)).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_the_tiktoken_stand_in_has_a_prefix_table_to_build():
    ranks = _stand_in("tiktoken").get_encoding("gpt2")._mergeable_ranks
    assert len(ranks) == 50256 and sorted(ranks.values()) == list(range(50256))
    assert sum(1 for b in ranks if len(b) > 1 and b[:1] in ranks) == 50256 - 256


def test_prepare_copies_a_tree_from_a_git_snapshot_and_names_its_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("train_gpt.py", "triton_kernels.py", "dc_triton_kernels.py"):
        (repo / name).write_text(f"# {name}\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    entry, script = gpu_prepare.copy_tree("modded", repo, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "modded_tree").iterdir()) == ["dc_triton_kernels.py", "triton_kernels.py"]
    assert script.read_text() == "# train_gpt.py\n" and len(entry["commit"]) == 40
    (repo / "triton_kernels.py").unlink()
    subprocess.run([*git, "commit", "-qam", "y"], check=True)
    with pytest.raises(gpu_prepare.PrepareError, match="triton_kernels.py"):
        gpu_prepare.copy_tree("modded", repo, tmp_path / "out2")
