"""val_progress: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`),
and the three validation features together.

`_val_progress` (same items, a line every N batches) is tested in test_val_templates.py;
these tables pin down exactly which loop's iterable gets wrapped, with which log
function, and which loops are left alone.
"""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch, assert_refused_beside_others
from test_feature_val_bytecount import DEVICE_TOGGLE, counted
from test_feature_val_prefetch import COPY_STREAM_TOGGLE, EVAL, HEAD, LOOP, PREFETCH_TOGGLE, SLICE, prefetched, with_toggles

from patcher.transforms.features import FEATURES
from patcher.patch import patch_source

EVERY_TOGGLE = 'val_progress_log_every = int(os.environ.get("VAL_PROGRESS_LOG_EVERY", 0))'


def wrapped(source: str, log: str = "log", function: str = "eval_val") -> str:
    """`source` with its loop's `range(...)` wrapped in `_val_progress`."""
    assert LOOP in source
    return source.replace(LOOP, f'    for start in _val_progress(range(first, last, batch_seqs), {log}, Hyperparameters.val_progress_log_every, "{function}"):\n', 1)


IMPURE = EVAL.replace("        hi = end * seq_len + 1", "        hi = next_end(end) * seq_len + 1")

PRINT0_HEAD = HEAD.replace("def log(msg):", "def print0(msg):")
RUN_EVAL = EVAL.replace("def eval_val(", "def run_eval(")

IN_MAIN = "def main(model, device, tokens):\n    def log0(msg):\n        print(msg)\n" + EVAL.replace("\n", "\n    ").replace("\n    \n", "\n\n").rstrip(" ").replace("def eval_val(", "    def eval_val(", 1)
NO_LOG_HEAD = HEAD.replace("def log(msg):\n    print(msg)\n\n", "")

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
MINIFIED_AFTER = (
    "import os,torch\n"
    + RUNTIME
    + "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_progress_log_every=int(os.environ.get('VAL_PROGRESS_LOG_EVERY',0))\n"
    + MINIFIED.split("\n", 2)[2].replace("\tfor start in range(0,last,n):\n", "\tfor start in _val_progress(range(0,last,n),log,Hyperparameters.val_progress_log_every,'eval_val'):\n")
)

REWRITES = [
    pytest.param(HEAD + EVAL, with_toggles(HEAD, EVERY_TOGGLE) + wrapped(EVAL), id="range-wrapped-log-at-module-level"),
    pytest.param(HEAD + IMPURE, with_toggles(HEAD, EVERY_TOGGLE) + wrapped(IMPURE), id="slice-that-cannot-be-built-ahead-still-gets-progress"),
    pytest.param(PRINT0_HEAD + RUN_EVAL, with_toggles(PRINT0_HEAD, EVERY_TOGGLE) + wrapped(RUN_EVAL, log="print0", function="run_eval"), id="print0-and-the-function-name-in-the-line"),
    pytest.param(
        NO_LOG_HEAD + IN_MAIN,
        with_toggles(NO_LOG_HEAD, EVERY_TOGGLE) + IN_MAIN.replace(LOOP.replace("    for", "        for"), '        for start in _val_progress(range(first, last, batch_seqs), log0, Hyperparameters.val_progress_log_every, "eval_val"):\n'),
        id="evaluation-defined-beside-log0-in-main",
    ),
    pytest.param(MINIFIED, MINIFIED_AFTER, id="minified"),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    result = assert_patch(before, after, only="val_progress")
    assert result.applied == ["val_progress", "env_toggles"]
    compile(result.source, "patched", "exec")


PREFETCH_LOOP = "    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=Hyperparameters.val_prefetch, copy_stream={copy_stream}):\n"
PROGRESS_LOOP = (
    "    for start, _val_batch in _val_progress(_val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), "
    'prefetch=Hyperparameters.val_prefetch, copy_stream={copy_stream}), log, Hyperparameters.val_progress_log_every, "eval_val", total=len(range(first, last, batch_seqs))):\n'
)


def test_after_val_prefetch_the_total_is_the_number_of_starts():
    after = with_toggles(HEAD, PREFETCH_TOGGLE, EVERY_TOGGLE) + prefetched().replace(PREFETCH_LOOP.format(copy_stream="False"), PROGRESS_LOOP.format(copy_stream="False"))
    result = assert_patch(HEAD + EVAL, after, only=["val_prefetch", "val_progress"])
    assert result.applied == ["val_prefetch", "val_progress", "env_toggles"]


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
MINIFIED_BYTES_AFTER = (
    "import os,torch\n"
    + RUNTIME
    + "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_prefetch=int(os.environ.get('VAL_PREFETCH',1));val_copy_stream=int(os.environ.get('VAL_COPY_STREAM',1));"
    "val_bytecount_device=os.environ.get('VAL_BYTECOUNT_DEVICE','cuda');val_progress_log_every=int(os.environ.get('VAL_PROGRESS_LOG_EVERY',0))\n"
    "def log(msg):print(msg)\n"
    "def eval_val(h,device,tokens,model,base_lut,space_lut,boundary_lut):\n"
    "\tseq_len=h.seq_len;n=4;last=(tokens.numel()-1)//seq_len;byte_count=torch.zeros((),device=device,dtype=torch.float64)\n"
    "\tdef _val_slice(start):lo=start*seq_len;hi=min(start+n,last)*seq_len+1;return tokens[lo:hi]\n"
    "\tfor start,_val_batch in _val_progress(_val_prefetch(range(0,last,n),_val_slice,dict(device=device,dtype=torch.int64,non_blocking=True),"
    "prefetch=Hyperparameters.val_prefetch,copy_stream=Hyperparameters.val_copy_stream),log,Hyperparameters.val_progress_log_every,'eval_val',total=len(range(0,last,n))):\n"
    "\t\tlo=start*seq_len;hi=min(start+n,last)*seq_len+1;local=_val_batch;x=local[:-1];y=local[1:]\n"
    "\t\tmodel(x,y);prev_ids=x.reshape(-1);tgt_ids=y.reshape(-1)\n"
    "\t\tif Hyperparameters.val_bytecount_device=='cpu':byte_count+=_val_byte_count(tokens[lo:hi],base_lut,space_lut,boundary_lut)\n"
    "\t\telse:token_bytes=base_lut[tgt_ids].to(dtype=torch.int16);token_bytes+=(space_lut[tgt_ids]&~boundary_lut[prev_ids]).to(dtype=torch.int16);byte_count+=token_bytes.to(torch.float64).sum()\n"
    "\t\tseen=1\n"
    "\treturn byte_count\n"
)

EVERY_FEATURE = [
    pytest.param(
        HEAD + EVAL,
        with_toggles(HEAD, PREFETCH_TOGGLE, COPY_STREAM_TOGGLE, DEVICE_TOGGLE, EVERY_TOGGLE)
        + prefetched(counted(EVAL), copy_stream="Hyperparameters.val_copy_stream").replace(
            PREFETCH_LOOP.format(copy_stream="Hyperparameters.val_copy_stream"), PROGRESS_LOOP.format(copy_stream="Hyperparameters.val_copy_stream")
        ),
        id="readable",
    ),
    pytest.param(MINIFIED_BYTES, MINIFIED_BYTES_AFTER, id="minified"),
]


@pytest.mark.parametrize("before, after", EVERY_FEATURE)
def test_every_feature_on_one_evaluation_loop(before, after):
    result = assert_patch(before, after, enabled=set(FEATURES))
    assert result.applied == ["val_bytecount", "val_prefetch", "val_progress", "env_toggles"]
    compile(result.source, "patched", "exec")


def _change(old: str, new: str) -> str:
    assert old in EVAL
    return HEAD + EVAL.replace(old, new, 1)


NOOPS = [
    pytest.param(
        NO_LOG_HEAD + EVAL + "\ndef main():\n    def log0(msg):\n        print(msg)\n    log0('start')\n",
        id="log0-defined-inside-main-not-visible-in-eval",
    ),
    pytest.param(NO_LOG_HEAD + EVAL, id="no-log-function"),
    pytest.param(_change("        model(x, y)\n", "        model(x, y)\n        log = print\n"), id="evaluation-rebinds-the-log-name"),
    pytest.param(
        HEAD + EVAL.replace(LOOP, "    for chunk in range(2):\n" + LOOP.replace("    for", "     for")).replace("\n        ", "\n         "),
        id="loop-nested-in-another-loop",
    ),
    pytest.param(_change(LOOP, "    for start in sorted(range(first, last, batch_seqs)):\n"), id="not-a-range"),
    pytest.param(_change(SLICE, "        if hi > lo:\n    " + SLICE), id="slice-inside-a-nested-block"),
    pytest.param(HEAD + EVAL.replace("def eval_val(", "def score(", 1), id="function-not-named-for-evaluation"),
    pytest.param(HEAD.replace("import torch\n", "import numpy as np\n") + EVAL.replace("torch.", "np."), id="script-without-torch"),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="val_progress")


@pytest.mark.parametrize("source", NOOPS)
def test_noop_beside_every_other_feature(source):
    """Refused with every feature on: the output of every feature but this one."""
    assert_refused_beside_others(source, "val_progress")


def test_no_log_function_names_every_name_looked_for():
    result = patch_source(NO_LOG_HEAD + EVAL, {"val_progress", "env_toggles"})
    [note] = [n for n in result.notes if n.feature == "val_progress"]
    assert note.reason == "no log function (log0, log, print0, log_print) in the script"


def test_a_log_print_function_is_used():
    result = patch_source(NO_LOG_HEAD.replace("import torch\n", "import torch\n\n\ndef log_print(msg):\n    print(msg)\n") + EVAL, {"val_progress", "env_toggles"})
    assert "val_progress" in result.applied
    assert "    for start in _val_progress(range(first, last, batch_seqs), log_print, Hyperparameters.val_progress_log_every, \"eval_val\"):\n" in result.source
