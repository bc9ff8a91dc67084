"""val_bytecount: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

`_val_byte_count` (the host count, bit-identical to the device one) is tested in
test_val_templates.py, and the patched evaluation's numbers in test_val_transforms.py
and the end-to-end runs; these tables pin down exactly which byte counting gets a host
branch, what the report says, and which is left on the device and why.
"""

from __future__ import annotations

import pytest
from patch_tables import assert_noop, assert_patch, assert_refused_beside_others, notes_of
from test_feature_val_prefetch import EVAL, HEAD, LOOP, NO_CLASS, SLICE

BYTES = (
    "        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)\n"
    "        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)\n"
    "        byte_count += token_bytes.to(torch.float64).sum()\n"
)

# the ids sliced from the batch itself, not from x and y
STRAIGHT = EVAL.replace("        prev_ids = x.reshape(-1)\n        tgt_ids = y.reshape(-1)\n", "        prev_ids = local[:-1]\n        tgt_ids = local[1:]\n")

RENAMED = '''\
def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    total_bytes = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        inputs = x.reshape(-1)
        targets = y.reshape(-1)
        nbytes = base_lut[targets].to(dtype=torch.int16)
        nbytes += (space_lut[targets] & ~boundary_lut[inputs]).to(dtype=torch.int16)
        total_bytes += nbytes.to(torch.float64).sum()
    return total_bytes
'''

LUT_ATTRIBUTES = '''\
def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, luts):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = luts.base[tgt_ids].to(dtype=torch.int16)
        token_bytes += (luts.space[tgt_ids] & ~luts.boundary[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
'''

SHARED_LINE = '''\
def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1); token_bytes = base_lut[tgt_ids].to(dtype=torch.int16); token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16); byte_count += token_bytes.to(torch.float64).sum(); seen += 1
    return byte_count
'''

MINIFIED = (
    "import os,torch\n"
    "class Hyperparameters():seed=int(os.environ.get('SEED',1))\n"
    "def log(msg):print(msg)\n"
    "def eval_val(h,device,tokens,model,base_lut,space_lut,boundary_lut):\n"
    "\tseq_len=h.seq_len;n=4;last=(tokens.numel()-1)//seq_len;byte_count=torch.zeros((),device=device,dtype=torch.float64)\n"
    "\tfor start in range(0,last,n):\n"
    "\t\tlo=start*seq_len;hi=min(start+n,last)*seq_len+1;local=tokens[lo:hi].to(device=device,dtype=torch.int64,non_blocking=True);x=local[:-1];y=local[1:]\n"
    "\t\tmodel(x,y);prev_ids=x.reshape(-1);tgt_ids=y.reshape(-1);token_bytes=base_lut[tgt_ids].to(dtype=torch.int16);"
    "token_bytes+=(space_lut[tgt_ids]&~boundary_lut[prev_ids]).to(dtype=torch.int16);byte_count+=token_bytes.to(torch.float64).sum();seen=1\n"
    "\treturn byte_count\n"
)

REWRITES = [
    pytest.param(
        HEAD + EVAL,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        if Hyperparameters.val_bytecount_device == "cpu":
            byte_count += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)
        else:
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
            token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        "val_bytecount",
        [(True, "eval_val: byte counting at line 22 switchable to the host", 22)],
        id="ids-reshaped-from-the-batch",
    ),
    pytest.param(
        HEAD + STRAIGHT,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = local[:-1]
        tgt_ids = local[1:]
        if Hyperparameters.val_bytecount_device == "cpu":
            byte_count += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)
        else:
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
            token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        "val_bytecount",
        [(True, "eval_val: byte counting at line 22 switchable to the host", 22)],
        id="ids-sliced-straight-from-the-batch",
    ),
    pytest.param(
        HEAD + RENAMED,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    total_bytes = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        inputs = x.reshape(-1)
        targets = y.reshape(-1)
        if Hyperparameters.val_bytecount_device == "cpu":
            total_bytes += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)
        else:
            nbytes = base_lut[targets].to(dtype=torch.int16)
            nbytes += (space_lut[targets] & ~boundary_lut[inputs]).to(dtype=torch.int16)
            total_bytes += nbytes.to(torch.float64).sum()
    return total_bytes
''',
        "val_bytecount",
        [(True, "eval_val: byte counting at line 22 switchable to the host", 22)],
        id="other-names-for-ids-bytes-and-accumulator",
    ),
    pytest.param(
        HEAD + LUT_ATTRIBUTES,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, luts):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        if Hyperparameters.val_bytecount_device == "cpu":
            byte_count += _val_byte_count(tokens[lo:hi], luts.base, luts.space, luts.boundary)
        else:
            token_bytes = luts.base[tgt_ids].to(dtype=torch.int16)
            token_bytes += (luts.space[tgt_ids] & ~luts.boundary[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        "val_bytecount",
        [(True, "eval_val: byte counting at line 22 switchable to the host", 22)],
        id="tables-read-through-attributes",
    ),
    pytest.param(
        HEAD + SHARED_LINE,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        if Hyperparameters.val_bytecount_device == "cpu":
            byte_count += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)
        else:
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16); token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16); byte_count += token_bytes.to(torch.float64).sum()
        seen += 1
    return byte_count
''',
        "val_bytecount",
        [(True, "eval_val: byte counting at line 21 switchable to the host", 21)],
        id="statements-sharing-a-line-split-around-the-branch",
    ),
    pytest.param(
        NO_CLASS + EVAL,
        '''\
import os
import torch
VAL_BYTECOUNT_DEVICE = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")
#<runtime>

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in range(first, last, batch_seqs):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        if VAL_BYTECOUNT_DEVICE == "cpu":
            byte_count += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)
        else:
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
            token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        "val_bytecount",
        [(True, "eval_val: byte counting at line 19 switchable to the host", 19)],
        id="string-module-constant-without-a-class",
    ),
    pytest.param(
        MINIFIED,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_bytecount_device=os.environ.get('VAL_BYTECOUNT_DEVICE','cuda')\n"
            "def log(msg):print(msg)\n"
            "def eval_val(h,device,tokens,model,base_lut,space_lut,boundary_lut):\n"
            "\tseq_len=h.seq_len;n=4;last=(tokens.numel()-1)//seq_len;byte_count=torch.zeros((),device=device,dtype=torch.float64)\n"
            "\tfor start in range(0,last,n):\n"
            "\t\tlo=start*seq_len;hi=min(start+n,last)*seq_len+1;local=tokens[lo:hi].to(device=device,dtype=torch.int64,non_blocking=True);x=local[:-1];y=local[1:]\n"
            "\t\tmodel(x,y);prev_ids=x.reshape(-1);tgt_ids=y.reshape(-1)\n"
            "\t\tif Hyperparameters.val_bytecount_device=='cpu':byte_count+=_val_byte_count(tokens[lo:hi],base_lut,space_lut,boundary_lut)\n"
            "\t\telse:token_bytes=base_lut[tgt_ids].to(dtype=torch.int16);token_bytes+=(space_lut[tgt_ids]&~boundary_lut[prev_ids]).to(dtype=torch.int16);byte_count+=token_bytes.to(torch.float64).sum()\n"
            "\t\tseen=1\n"
            "\treturn byte_count\n"
        ),
        "val_bytecount",
        [(True, "eval_val: byte counting at line 8 switchable to the host", 8)],
        id="minified-else-branch-on-one-line",
    ),
    pytest.param(
        HEAD + EVAL,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_prefetch = int(os.environ.get("VAL_PREFETCH", 1))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    def _val_slice(start):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        return tokens[lo:hi]
    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=Hyperparameters.val_prefetch, copy_stream=False):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = _val_batch
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        if Hyperparameters.val_bytecount_device == "cpu":
            byte_count += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)
        else:
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
            token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        ["val_bytecount", "val_prefetch"],
        [(True, "eval_val: byte counting at line 22 switchable to the host", 22)],
        id="with-val_prefetch-the-host-count-reads-the-slice-the-loop-still-cuts",
    ),
]


@pytest.mark.parametrize("before, after, only, notes", REWRITES)
def test_rewrites(before, after, only, notes):
    result = assert_patch(before, after, only=only)
    assert result.applied == (["val_bytecount", "val_prefetch", "env_toggles"] if "val_prefetch" in only else ["val_bytecount", "env_toggles"])
    assert notes_of(result, "val_bytecount") == notes
    compile(result.source, "patched", "exec")


def _change(old: str, new: str) -> str:
    """HEAD + EVAL with its one `old` text replaced by `new` (what the row changes)."""
    assert EVAL.count(old) == 1
    return HEAD + EVAL.replace(old, new)


NO_COUNTING = "no `token_bytes = base_bytes_lut[tgt_ids]...` byte counting in eval_val"
NOT_ZEROS = "byte accumulator `byte_count` in eval_val is not one `torch.zeros(...)` tensor"

NOOPS = [
    pytest.param(_change("        prev_ids = x.reshape(-1)", "        prev_ids = y.reshape(-1)"), "`prev_ids` in eval_val is not the batch's inputs `local[:-1]`", 12, id="previous-ids-are-the-targets"),
    pytest.param(_change("        tgt_ids = y.reshape(-1)", "        tgt_ids = y.reshape(-1)[::-1]"), "`tgt_ids` in eval_val is not the batch's targets `local[1:]`", 12, id="targets-reordered"),
    pytest.param(_change("    byte_count = torch.zeros((), device=device, dtype=torch.float64)", "    byte_count = 0.0"), NOT_ZEROS, 12, id="float-accumulator"),
    pytest.param(
        _change("        model(x, y)\n", "        model(x, y)\n        byte_count = torch.zeros((), device=device, dtype=torch.float64)\n"),
        NOT_ZEROS,
        12,
        id="accumulator-assigned-twice",
    ),
    pytest.param(_change("    return byte_count\n", "    return byte_count, token_bytes\n"), "`token_bytes` in eval_val is read outside the byte counting", 12, id="token-bytes-read-after-the-counting"),
    pytest.param(_change(LOOP, "    token_bytes = None\n" + LOOP), "`token_bytes` in eval_val is assigned outside the byte counting", 13, id="token-bytes-assigned-outside-the-counting"),
    pytest.param(_change("token_bytes.to(torch.float64).sum()", "token_bytes.to(torch.float32).sum()"), NO_COUNTING, 12, id="float32-sum"),
    pytest.param(_change("base_lut[tgt_ids]", "base_lut[tgt_ids.long()]"), NO_COUNTING, 12, id="table-indexed-by-an-expression"),
    pytest.param(
        _change(BYTES, "        if tgt_ids.numel(): token_bytes = base_lut[tgt_ids].to(dtype=torch.int16); token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16); byte_count += token_bytes.to(torch.float64).sum()\n"),
        "byte counting in eval_val sits on a one-line block; left on the device",
        12,
        id="counting-on-a-one-line-block",
    ),
    pytest.param(
        _change("        hi = end * seq_len + 1", "        hi = next_end(end) * seq_len + 1"),
        "slice bound `hi` in eval_val calls `next_end`; only abs, int, len, max, min are known to be pure",
        12,
        id="slice-not-a-pure-function-of-the-start",
    ),
    pytest.param(
        _change(SLICE, "        if hi > lo:\n    " + SLICE),
        "the slice `.to(...)` in eval_val is inside a nested block, not a statement of the loop",
        12,
        id="slice-inside-a-nested-block",
    ),
    pytest.param(_change(LOOP, "    for start in sorted(range(first, last, batch_seqs)):\n"), "no evaluation loop that copies a token slice to the device per batch", None, id="not-a-range"),
    pytest.param(_change(BYTES, ""), NO_COUNTING, 12, id="no-byte-counting"),
    pytest.param(
        HEAD.replace("import torch\n", "import numpy as np\n") + EVAL.replace("torch.", "np."),
        "script does not use torch (MLX or other framework)",
        None,
        id="script-without-torch",
    ),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="val_bytecount")


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop_beside_every_other_feature(source, reason, line):
    """Refused with every feature on (the slice still built ahead): the output of every feature but this one."""
    assert_refused_beside_others(source, "val_bytecount")
