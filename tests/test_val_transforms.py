"""val_prefetch, val_bytecount and val_progress: skip reasons, idempotence, Python 3.10,
and the patched evaluation's numbers. The exact rewrites, whole outputs, are the tables of
test_feature_val_prefetch.py, test_feature_val_bytecount.py and test_feature_val_progress.py."""

from __future__ import annotations

import subprocess

import pytest
import torch

from patcher.patch import features_from, patch_source
from patcher.transforms.features import FEATURES

HEADER = '''
import math
import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

def log(msg):
    print(msg)
'''

EVAL = '''
def eval_val(args, model, rank, world_size, device, val_tokens, base_bytes_lut, has_leading_space_lut, is_boundary_token_lut):
    seq_len = args.train_seq_len
    local_batch_seqs = 4
    total_seqs = (val_tokens.numel() - 1) // seq_len
    seq_start = (total_seqs * rank) // world_size
    seq_end = (total_seqs * (rank + 1)) // world_size
    val_loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    val_byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for batch_seq_start in range(seq_start, seq_end, local_batch_seqs):
        batch_seq_end = min(batch_seq_start + local_batch_seqs, seq_end)
        raw_start = batch_seq_start * seq_len
        raw_end = batch_seq_end * seq_len + 1
        local = val_tokens[raw_start:raw_end].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        val_loss_sum += model(x, y).to(torch.float64)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_bytes_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (has_leading_space_lut[tgt_ids] & ~is_boundary_token_lut[prev_ids]).to(dtype=torch.int16)
        val_byte_count += token_bytes.to(torch.float64).sum()
    return val_loss_sum, val_byte_count
'''


def patched(source: str, features=None):
    return patch_source(source, features_from(features, None) if features else set(FEATURES))  # diagnostics included


def notes(result, feature):
    return [n for n in result.notes if n.feature == feature]


MINIFIED = '''import os,torch
class Hyperparameters():seed=int(os.environ.get('SEED',1));val_batch=int(os.environ.get('VAL_BATCH',4))
def log(msg):print(msg)
def eval_val(h,device,val_tokens,model,base_bytes_lut,has_leading_space_lut,is_boundary_token_lut):
\tseq_len=h.seq_len;seq_start=0;seq_end=(val_tokens.numel()-1)//seq_len;local_batch_seqs=h.val_batch;val_byte_count=torch.zeros((),device=device,dtype=torch.float64)
\tfor batch_seq_start in range(seq_start,seq_end,local_batch_seqs):
\t\tbatch_seq_end=min(batch_seq_start+local_batch_seqs,seq_end);raw_start=batch_seq_start*seq_len;raw_end=batch_seq_end*seq_len+1;local=val_tokens[raw_start:raw_end].to(device=device,dtype=torch.int64,non_blocking=True);x=local[:-1].reshape(-1,seq_len);y=local[1:].reshape(-1,seq_len)
\t\tmodel(x,y);prev_ids=x.reshape(-1);tgt_ids=y.reshape(-1);token_bytes=base_bytes_lut[tgt_ids].to(dtype=torch.int16);token_bytes+=(has_leading_space_lut[tgt_ids]&~is_boundary_token_lut[prev_ids]).to(dtype=torch.int16);val_byte_count+=token_bytes.to(torch.float64).sum();n=1
\treturn val_byte_count
'''


def _loop_change(old: str, new: str) -> str:
    assert old in EVAL
    return HEADER + EVAL.replace(old, new, 1)


NOOP_PREFETCH = [
    pytest.param(
        "    for batch_seq_start in range(seq_start, seq_end, local_batch_seqs):",
        "    for batch_seq_start in sorted(range(seq_start, seq_end, local_batch_seqs)):",
        "iterates over no `range(...)`",
        id="not-a-range",
    ),
    pytest.param("        raw_end = batch_seq_end * seq_len + 1", "        raw_end = next_end(batch_seq_end) * seq_len + 1", "calls `next_end`", id="bound-calls-a-function"),
    pytest.param(
        "        x = local[:-1].reshape(-1, seq_len)",
        "        x = local[:-1].reshape(-1, seq_len)\n        raw_start += 1",
        "`raw_start` in eval_val is assigned in the loop other than once",
        id="bound-changed-after-the-slice",
    ),
    pytest.param(
        ".to(device=device, dtype=torch.int64, non_blocking=True)",
        ".to(device, dtype=torch.int64)",
        "only device=, dtype=, non_blocking= keywords",
        id="positional-device",
    ),
    pytest.param(
        "        val_loss_sum += model(x, y).to(torch.float64)",
        "        val_loss_sum += model(x, y).to(torch.float64)\n        device = other_device",
        "argument `device` in eval_val changes inside the loop",
        id="device-changes-in-loop",
    ),
]


@pytest.mark.parametrize("old, new, reason", NOOP_PREFETCH)
def test_val_prefetch_noop(old, new, reason):
    # The loop left as it was: the noop rows of test_feature_val_prefetch.py.
    found = notes(patched(_loop_change(old, new)), "val_prefetch")
    assert len(found) == 1 and not found[0].applied and reason in found[0].reason


SLIDING = HEADER + '''
def eval_val_sliding(args, model, device, val_tokens, my_windows, batch_seqs, seq_len):
    for bi in range(0, len(my_windows), batch_seqs):
        batch_ws = my_windows[bi:bi + batch_seqs]
        x_batch = torch.zeros(len(batch_ws), seq_len, dtype=torch.int64, device=device)
        for i, ws in enumerate(batch_ws):
            chunk = val_tokens[ws:ws + seq_len + 1].to(dtype=torch.int64, device=device)
            x_batch[i] = chunk[:-1]
        model(x_batch)
'''


def test_sliding_window_loop_is_left_alone_with_the_reason():
    result = patched(SLIDING)
    found = notes(result, "val_prefetch")
    assert [n.applied for n in found] == [False]
    assert "`for i, ws in enumerate(batch_ws)` in eval_val_sliding iterates over no `range(...)`" in found[0].reason
    assert result.source == SLIDING


NOOP_BYTES = [
    pytest.param("        prev_ids = x.reshape(-1)", "        prev_ids = y.reshape(-1)", "`prev_ids` in eval_val is not the batch's inputs", id="prev-is-targets"),
    pytest.param("        tgt_ids = y.reshape(-1)", "        tgt_ids = y.reshape(-1)[::-1]", "`tgt_ids` in eval_val is not the batch's targets", id="targets-reordered"),
    pytest.param(
        "    val_byte_count = torch.zeros((), device=device, dtype=torch.float64)",
        "    val_byte_count = 0.0",
        "byte accumulator `val_byte_count` in eval_val is not one `torch.zeros(...)` tensor",
        id="float-accumulator",
    ),
    pytest.param(
        "    return val_loss_sum, val_byte_count",
        "    return val_loss_sum, val_byte_count, token_bytes",
        "`token_bytes` in eval_val is read outside the byte counting",
        id="token-bytes-used-later",
    ),
    pytest.param(
        "        val_byte_count += token_bytes.to(torch.float64).sum()",
        "        val_byte_count += token_bytes.to(torch.float32).sum()",
        "no `token_bytes = base_bytes_lut[tgt_ids]...` byte counting",
        id="float32-sum",
    ),
]


@pytest.mark.parametrize("old, new, reason", NOOP_BYTES)
def test_val_bytecount_noop(old, new, reason):
    # The counting left on the device: the noop rows of test_feature_val_bytecount.py.
    result = patched(_loop_change(old, new))
    found = notes(result, "val_bytecount")
    assert len(found) == 1 and not found[0].applied and reason in found[0].reason
    assert "val_prefetch" in result.applied  # the slice itself is still prefetched


def test_val_progress_skipped_where_log_is_not_visible():
    nested_log = HEADER.replace("def log(msg):\n    print(msg)\n", "") + EVAL + "\ndef main():\n    def log0(msg):\n        print(msg)\n    log0('x')\n"
    # The loop left unwrapped: the noop rows of test_feature_val_progress.py.
    found = notes(patched(nested_log), "val_progress")
    assert [n.applied for n in found] == [False] and found[0].reason == "log0 is defined inside main(), not visible in eval_val"


def test_val_progress_skips_a_loop_nested_in_another():
    nested = HEADER + EVAL.replace("    for batch_seq_start in", "    for chunk in range(2):\n     for batch_seq_start in").replace("\n        ", "\n         ")
    compile(nested, "nested", "exec")
    result = patched(nested)
    found = notes(result, "val_progress")
    assert [n.applied for n in found] == [False] and "runs inside another loop" in found[0].reason
    assert "val_prefetch" in result.applied


def test_only_one_feature_and_idempotent():
    once = patched(HEADER + EVAL, ["val_bytecount"])
    assert once.applied == ["val_bytecount", "env_toggles"]  # the output itself: test_feature_val_bytecount.py
    twice = patch_source(patched(HEADER + EVAL).source)
    assert twice.already_patched and not twice.changed


def test_patched_outputs_compile_on_python310(tmp_path, python310):
    files = []
    for name, source in (("readable", HEADER + EVAL), ("minified", MINIFIED), ("sliding", SLIDING)):
        files.append(tmp_path / f"{name}.py")
        files[-1].write_text(patched(source).source)
    done = subprocess.run([python310, "-m", "py_compile", *map(str, files)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_patched_eval_gives_the_same_numbers():
    """Run the original and the patched eval_val in-process on a toy model: same bytes, same loss."""
    namespace_original, namespace_patched = {}, {}
    exec(compile(HEADER + EVAL, "original", "exec"), namespace_original)
    exec(compile(patched(HEADER + EVAL).source, "patched", "exec"), namespace_patched)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 97, (8 * 37 + 1,), generator=g, dtype=torch.int32).to(torch.uint16)
    luts = (torch.randint(0, 9, (97,), generator=g, dtype=torch.int16), torch.rand(97, generator=g) < 0.5, torch.rand(97, generator=g) < 0.1)
    args = type("A", (), {"train_seq_len": 8})()

    def model(x, y):
        return (x * 3 + y).float().mean()

    reference = namespace_original["eval_val"](args, model, 0, 1, torch.device("cpu"), tokens, *luts)
    hp = namespace_patched["Hyperparameters"]
    for device_mode in ("cuda", "cpu"):
        for prefetch in (0, 1):
            hp.val_bytecount_device, hp.val_prefetch = device_mode, prefetch
            got = namespace_patched["eval_val"](args, model, 0, 1, torch.device("cpu"), tokens, *luts)
            assert [t.item() for t in got] == [t.item() for t in reference]
