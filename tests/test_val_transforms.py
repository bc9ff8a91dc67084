"""val_prefetch, val_bytecount and val_progress together: a sliding-window loop left
alone, idempotence, Python 3.10 and the patched evaluation's numbers. The exact rewrites
and skip reasons, whole outputs, are the tables of test_feature_val_prefetch.py,
test_feature_val_bytecount.py and test_feature_val_progress.py."""

from __future__ import annotations

import subprocess

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
