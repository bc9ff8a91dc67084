"""val_progress: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`),
and the three validation features together.

`_val_progress` (same items, a line every N batches) is tested in test_val_templates.py;
these tables pin down exactly which loop's iterable gets wrapped, with which log
function, what the report says, and which loops are left alone and why.
"""

from __future__ import annotations

import pytest
from patch_tables import assert_noop, assert_patch, assert_refused_beside_others, notes_of
from test_feature_val_prefetch import EVAL, HEAD, LOOP, SLICE

from patcher.transforms.features import FEATURES

# the slice bound calls a function: no prefetch, but the loop still gets its progress line
IMPURE = EVAL.replace("        hi = end * seq_len + 1", "        hi = next_end(end) * seq_len + 1", 1)

PRINT0_HEAD = HEAD.replace("def log(msg):", "def print0(msg):", 1)
RUN_EVAL = EVAL.replace("def eval_val(", "def run_eval(", 1)
NO_LOG_HEAD = HEAD.replace("def log(msg):\n    print(msg)\n\n", "", 1)
LOG_PRINT_HEAD = NO_LOG_HEAD.replace("import torch\n", "import torch\n\n\ndef log_print(msg):\n    print(msg)\n", 1)

# the enabled features of `--only val_progress` and `--only val_prefetch,val_progress`
ALONE = {"val_progress", "env_toggles"}
WITH_VAL_PREFETCH = {"val_prefetch", "val_progress", "env_toggles"}

IN_MAIN = '''\
def main(model, device, tokens):
    def log0(msg):
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
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
            token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
        return byte_count
'''

MINIFIED = (
    "import os,torch\n"
    "class Hyperparameters():seed=int(os.environ.get('SEED',1))\n"
    "def log(msg):print(msg)\n"
    "def eval_val(h,device,tokens,model):\n"
    "\tseq_len=h.seq_len;n=4;last=(tokens.numel()-1)//seq_len;total=torch.zeros((),device=device)\n"
    "\tfor start in range(0,last,n):\n"
    "\t\tlo=start*seq_len;hi=min(start+n,last)*seq_len+1;local=tokens[lo:hi].to(device=device,dtype=torch.int64,non_blocking=True);total+=model(local[:-1],local[1:])\n"
    "\treturn total\n"
)

MINIFIED_BYTES = (
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
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in _val_progress(range(first, last, batch_seqs), log, Hyperparameters.val_progress_log_every, "eval_val"):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        ALONE,
        ["val_progress", "env_toggles"],
        [(True, "eval_val: progress through log every VAL_PROGRESS_LOG_EVERY batches", 12)],
        id="range-wrapped-log-at-module-level",
    ),
    pytest.param(
        HEAD + IMPURE,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in _val_progress(range(first, last, batch_seqs), log, Hyperparameters.val_progress_log_every, "eval_val"):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = next_end(end) * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        ALONE,
        ["val_progress", "env_toggles"],
        [(True, "eval_val: progress through log every VAL_PROGRESS_LOG_EVERY batches", 12)],
        id="slice-that-cannot-be-built-ahead-still-gets-progress",
    ),
    pytest.param(
        PRINT0_HEAD + RUN_EVAL,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def print0(msg):
    print(msg)

def run_eval(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in _val_progress(range(first, last, batch_seqs), print0, Hyperparameters.val_progress_log_every, "run_eval"):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        ALONE,
        ["val_progress", "env_toggles"],
        [(True, "run_eval: progress through print0 every VAL_PROGRESS_LOG_EVERY batches", 12)],
        id="print0-and-the-function-name-in-the-line",
    ),
    pytest.param(
        LOG_PRINT_HEAD + EVAL,
        '''\
import os
import torch
#<runtime>


def log_print(msg):
    print(msg)

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for start in _val_progress(range(first, last, batch_seqs), log_print, Hyperparameters.val_progress_log_every, "eval_val"):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        ALONE,
        ["val_progress", "env_toggles"],
        [(True, "eval_val: progress through log_print every VAL_PROGRESS_LOG_EVERY batches", 13)],
        id="a-log_print-function-is-used",
    ),
    pytest.param(
        NO_LOG_HEAD + IN_MAIN,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def main(model, device, tokens):
    def log0(msg):
        print(msg)
    def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
        byte_count = torch.zeros((), device=device, dtype=torch.float64)
        for start in _val_progress(range(first, last, batch_seqs), log0, Hyperparameters.val_progress_log_every, "eval_val"):
            end = min(start + batch_seqs, last)
            lo = start * seq_len
            hi = end * seq_len + 1
            local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)
            x = local[:-1].reshape(-1, seq_len)
            y = local[1:].reshape(-1, seq_len)
            model(x, y)
            prev_ids = x.reshape(-1)
            tgt_ids = y.reshape(-1)
            token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
            token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
            byte_count += token_bytes.to(torch.float64).sum()
        return byte_count
''',
        ALONE,
        ["val_progress", "env_toggles"],
        [(True, "eval_val: progress through log0 every VAL_PROGRESS_LOG_EVERY batches", 12)],
        id="evaluation-defined-beside-log0-in-main",
    ),
    pytest.param(
        MINIFIED,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_progress_log_every=int(os.environ.get('VAL_PROGRESS_LOG_EVERY',0))\n"
            "def log(msg):print(msg)\n"
            "def eval_val(h,device,tokens,model):\n"
            "\tseq_len=h.seq_len;n=4;last=(tokens.numel()-1)//seq_len;total=torch.zeros((),device=device)\n"
            "\tfor start in _val_progress(range(0,last,n),log,Hyperparameters.val_progress_log_every,'eval_val'):\n"
            "\t\tlo=start*seq_len;hi=min(start+n,last)*seq_len+1;local=tokens[lo:hi].to(device=device,dtype=torch.int64,non_blocking=True);total+=model(local[:-1],local[1:])\n"
            "\treturn total\n"
        ),
        ALONE,
        ["val_progress", "env_toggles"],
        [(True, "eval_val: progress through log every VAL_PROGRESS_LOG_EVERY batches", 6)],
        id="minified",
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
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    def _val_slice(start):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        return tokens[lo:hi]
    for start, _val_batch in _val_progress(_val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=Hyperparameters.val_prefetch, copy_stream=False), log, Hyperparameters.val_progress_log_every, "eval_val", total=len(range(first, last, batch_seqs))):
        local = _val_batch
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
''',
        WITH_VAL_PREFETCH,
        ["val_prefetch", "val_progress", "env_toggles"],
        [(True, "eval_val: progress through log every VAL_PROGRESS_LOG_EVERY batches", 12)],
        id="after-val_prefetch-the-total-is-the-number-of-starts",
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
    val_copy_stream = int(os.environ.get("VAL_COPY_STREAM", 1))
    val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")
    val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    def _val_slice(start):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        return tokens[lo:hi]
    for start, _val_batch in _val_progress(_val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=Hyperparameters.val_prefetch, copy_stream=Hyperparameters.val_copy_stream), log, Hyperparameters.val_progress_log_every, "eval_val", total=len(range(first, last, batch_seqs))):
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
        set(FEATURES),
        ["val_bytecount", "val_prefetch", "val_progress", "env_toggles"],
        [(True, "eval_val: progress through log every VAL_PROGRESS_LOG_EVERY batches", 12)],
        id="every-feature-readable",
    ),
    pytest.param(
        MINIFIED_BYTES,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_prefetch=int(os.environ.get('VAL_PREFETCH',1));val_copy_stream=int(os.environ.get('VAL_COPY_STREAM',1));val_bytecount_device=os.environ.get('VAL_BYTECOUNT_DEVICE','cuda');val_progress_log_every=int(os.environ.get('VAL_PROGRESS_LOG_EVERY',0))\n"
            "def log(msg):print(msg)\n"
            "def eval_val(h,device,tokens,model,base_lut,space_lut,boundary_lut):\n"
            "\tseq_len=h.seq_len;n=4;last=(tokens.numel()-1)//seq_len;byte_count=torch.zeros((),device=device,dtype=torch.float64)\n"
            "\tdef _val_slice(start):lo=start*seq_len;hi=min(start+n,last)*seq_len+1;return tokens[lo:hi]\n"
            "\tfor start,_val_batch in _val_progress(_val_prefetch(range(0,last,n),_val_slice,dict(device=device,dtype=torch.int64,non_blocking=True),prefetch=Hyperparameters.val_prefetch,copy_stream=Hyperparameters.val_copy_stream),log,Hyperparameters.val_progress_log_every,'eval_val',total=len(range(0,last,n))):\n"
            "\t\tlo=start*seq_len;hi=min(start+n,last)*seq_len+1;local=_val_batch;x=local[:-1];y=local[1:]\n"
            "\t\tmodel(x,y);prev_ids=x.reshape(-1);tgt_ids=y.reshape(-1)\n"
            "\t\tif Hyperparameters.val_bytecount_device=='cpu':byte_count+=_val_byte_count(tokens[lo:hi],base_lut,space_lut,boundary_lut)\n"
            "\t\telse:token_bytes=base_lut[tgt_ids].to(dtype=torch.int16);token_bytes+=(space_lut[tgt_ids]&~boundary_lut[prev_ids]).to(dtype=torch.int16);byte_count+=token_bytes.to(torch.float64).sum()\n"
            "\t\tseen=1\n"
            "\treturn byte_count\n"
        ),
        set(FEATURES),
        ["val_bytecount", "val_prefetch", "val_progress", "env_toggles"],
        [(True, "eval_val: progress through log every VAL_PROGRESS_LOG_EVERY batches", 6)],
        id="every-feature-minified",
    ),
]


@pytest.mark.parametrize("before, after, enabled, applied, notes", REWRITES)
def test_rewrites(before, after, enabled, applied, notes):
    result = assert_patch(before, after, enabled=enabled)
    assert result.applied == applied
    assert notes_of(result, "val_progress") == notes
    compile(result.source, "patched", "exec")


def _change(old: str, new: str) -> str:
    """HEAD + EVAL with its one `old` text replaced by `new` (what the row changes)."""
    assert EVAL.count(old) == 1
    return HEAD + EVAL.replace(old, new)


NO_LOOP = "no evaluation loop over batches of a token slice"

NOOPS = [
    pytest.param(
        NO_LOG_HEAD + EVAL + "\ndef main():\n    def log0(msg):\n        print(msg)\n    log0('start')\n",
        "log0 is defined inside main(), not visible in eval_val",
        9,
        id="log0-defined-inside-main-not-visible-in-eval",
    ),
    pytest.param(NO_LOG_HEAD + EVAL, "no log function (log0, log, print0, log_print) in the script", 9, id="no-log-function-names-every-name-looked-for"),
    pytest.param(_change("        model(x, y)\n", "        model(x, y)\n        log = print\n"), "eval_val rebinds the name log", 12, id="evaluation-rebinds-the-log-name"),
    pytest.param(
        HEAD
        + """def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    for chunk in range(2):
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
         token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
         token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
         byte_count += token_bytes.to(torch.float64).sum()
    return byte_count
""",
        "the loop in eval_val runs inside another loop (one line per outer iteration)",
        13,
        id="loop-nested-in-another-loop",
    ),
    pytest.param(_change(LOOP, "    for start in sorted(range(first, last, batch_seqs)):\n"), NO_LOOP, None, id="not-a-range"),
    pytest.param(_change(SLICE, "        if hi > lo:\n    " + SLICE), NO_LOOP, None, id="slice-inside-a-nested-block"),
    pytest.param(HEAD + EVAL.replace("def eval_val(", "def score(", 1), NO_LOOP, None, id="function-not-named-for-evaluation"),
    pytest.param(HEAD.replace("import torch\n", "import numpy as np\n") + EVAL.replace("torch.", "np."), NO_LOOP, None, id="script-without-torch"),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="val_progress")


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop_beside_every_other_feature(source, reason, line):
    """Refused with every feature on: the output of every feature but this one."""
    assert_refused_beside_others(source, "val_progress")
