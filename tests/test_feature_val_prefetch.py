"""val_prefetch: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

The prefetching runtime (same batches, pinned memory, copy stream) is tested in
test_val_templates.py, and the patched evaluation's numbers in test_val_transforms.py
and the end-to-end runs; these tables pin down exactly what the rewrite changes in
the evaluation loop, what the report says, and which loops it leaves alone and why.
"""

from __future__ import annotations

import pytest
from patch_tables import assert_noop, assert_patch, assert_refused_beside_others, notes_of

from patcher.patch import features_from, patch_source

HEAD = '''import os
import torch

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))

def log(msg):
    print(msg)

'''

# The evaluation loop the three validation features read: a token slice per batch of
# sequences, copied to the device, and the bits-per-byte byte counting.
EVAL = '''def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
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

LOOP = "    for start in range(first, last, batch_seqs):\n"
SLICE = "        local = tokens[lo:hi].to(device=device, dtype=torch.int64, non_blocking=True)\n"
NO_CLASS = """import os
import torch

def log(msg):
    print(msg)

"""

# a statement the slice does not need stays in the loop only
UNUSED_PREFIX = EVAL.replace("        end = min(", "        n_tokens = batch_seqs * seq_len\n        end = min(", 1)

# a second loop over the same starts: a second slice function, its name made free
TWO_LOOPS = EVAL.replace(
    "    return byte_count\n",
    "    for start in range(first, last, batch_seqs):\n        lo = start * seq_len\n        local = tokens[lo:lo + seq_len + 1].to(device=device)\n        model(local[:-1], local[1:])\n    return byte_count\n",
)

MINIFIED = (
    "import os,torch\n"
    "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_batch=int(os.environ.get('VAL_BATCH',4))\n"
    "def log(msg):print(msg)\n"
    "def eval_val(h,device,tokens,model):\n"
    "\tseq_len=h.seq_len;first=0;last=(tokens.numel()-1)//seq_len;n=h.val_batch;total=torch.zeros((),device=device)\n"
    "\tfor start in range(first,last,n):\n"
    "\t\tend=min(start+n,last);lo=start*seq_len;hi=end*seq_len+1;local=tokens[lo:hi].to(device=device,dtype=torch.int64,non_blocking=True);total+=model(local[:-1],local[1:])\n"
    "\treturn total\n"
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
    val_prefetch = int(os.environ.get("VAL_PREFETCH", 1))

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
        "val_prefetch",
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the compute stream", 12)],
        id="slice-built-ahead-h2d-on-the-compute-stream-without-copy_stream",
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

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    def _val_slice(start):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        return tokens[lo:hi]
    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=Hyperparameters.val_prefetch, copy_stream=Hyperparameters.val_copy_stream):
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
        ["val_prefetch", "copy_stream"],
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the copy stream", 12)],
        id="with-copy_stream-the-copies-switch-on-their-own-toggle",
    ),
    pytest.param(
        HEAD + UNUSED_PREFIX,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_prefetch = int(os.environ.get("VAL_PREFETCH", 1))

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
        n_tokens = batch_seqs * seq_len
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
        "val_prefetch",
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the compute stream", 12)],
        id="only-the-bounds-the-slice-reads-move-into-the-slice-function",
    ),
    pytest.param(
        HEAD + TWO_LOOPS,
        '''\
import os
import torch
#<runtime>

class Hyperparameters:
    seed = int(os.environ.get("SEED", 1337))
    val_prefetch = int(os.environ.get("VAL_PREFETCH", 1))

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
        local = _val_batch
        x = local[:-1].reshape(-1, seq_len)
        y = local[1:].reshape(-1, seq_len)
        model(x, y)
        prev_ids = x.reshape(-1)
        tgt_ids = y.reshape(-1)
        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)
        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)
        byte_count += token_bytes.to(torch.float64).sum()
    def _val_slice2(start):
        lo = start * seq_len
        return tokens[lo:lo + seq_len + 1]
    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice2, dict(device=device), prefetch=Hyperparameters.val_prefetch, copy_stream=False):
        local = _val_batch
        model(local[:-1], local[1:])
    return byte_count
''',
        "val_prefetch",
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the compute stream", 12), (True, "eval_val: `tokens[lo:lo + seq_len + 1]` built one batch ahead (pinned), H2D on the compute stream", 25)],
        id="second-loop-gets-a-second-slice-function",
    ),
    pytest.param(
        NO_CLASS + EVAL,
        '''\
import os
import torch
VAL_PREFETCH = int(os.environ.get("VAL_PREFETCH", 1))
#<runtime>

def log(msg):
    print(msg)

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    def _val_slice(start):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        return tokens[lo:hi]
    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=VAL_PREFETCH, copy_stream=False):
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
        "val_prefetch",
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the compute stream", 9)],
        id="module-constant-without-a-class",
    ),
    pytest.param(
        "import torch\n\n" + EVAL,
        '''\
import torch
import os
VAL_PREFETCH = int(os.environ.get("VAL_PREFETCH", 1))
#<runtime>

def eval_val(model, device, tokens, seq_len, first, last, batch_seqs, base_lut, space_lut, boundary_lut):
    byte_count = torch.zeros((), device=device, dtype=torch.float64)
    def _val_slice(start):
        end = min(start + batch_seqs, last)
        lo = start * seq_len
        hi = end * seq_len + 1
        return tokens[lo:hi]
    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice, dict(device=device, dtype=torch.int64, non_blocking=True), prefetch=VAL_PREFETCH, copy_stream=False):
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
        "val_prefetch",
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the compute stream", 5)],
        id="import-os-added-for-the-constant",
    ),
    pytest.param(
        MINIFIED,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_batch=int(os.environ.get('VAL_BATCH',4));val_prefetch=int(os.environ.get('VAL_PREFETCH',1))\n"
            "def log(msg):print(msg)\n"
            "def eval_val(h,device,tokens,model):\n"
            "\tseq_len=h.seq_len;first=0;last=(tokens.numel()-1)//seq_len;n=h.val_batch;total=torch.zeros((),device=device)\n"
            "\tdef _val_slice(start):end=min(start+n,last);lo=start*seq_len;hi=end*seq_len+1;return tokens[lo:hi]\n"
            "\tfor start,_val_batch in _val_prefetch(range(first,last,n),_val_slice,dict(device=device,dtype=torch.int64,non_blocking=True),prefetch=Hyperparameters.val_prefetch,copy_stream=False):\n"
            "\t\tlocal=_val_batch;total+=model(local[:-1],local[1:])\n"
            "\treturn total\n"
        ),
        "val_prefetch",
        [(True, "eval_val: `tokens[lo:hi]` built one batch ahead (pinned), H2D on the compute stream", 6)],
        id="minified-slice-function-on-one-line",
    ),
]


@pytest.mark.parametrize("before, after, only, notes", REWRITES)
def test_rewrites(before, after, only, notes):
    result = assert_patch(before, after, only=only)
    assert result.applied == ["val_prefetch", "env_toggles"]  # copy_stream itself: no training loader here
    assert notes_of(result, "val_prefetch") == notes
    compile(result.source, "patched", "exec")
    # the rewrite leaves no dead assignment: what moved into the slice function left the loop
    assert _unused_locals(result.source) <= _unused_locals(before)


def _unused_locals(source: str) -> set[str]:
    """pyflakes' "local variable 'NAME' is assigned to but never used", as {NAME}."""
    import io

    from pyflakes.api import check
    from pyflakes.reporter import Reporter

    out = io.StringIO()
    check(source, "script", Reporter(out, io.StringIO()))
    return {line.split("'")[1] for line in out.getvalue().splitlines() if "assigned to but never used" in line}


def test_a_bound_the_rest_of_the_function_reads_stays_in_the_loop():
    """Only what nothing else reads moves out: a bound read after the slice stays, and so
    does the bound it is computed from."""
    before = HEAD + EVAL.replace("        model(x, y)\n", "        model(x, y, hi)\n", 1)
    loop = patch_source(before, features_from(["val_prefetch"], None)).source.split("in _val_prefetch(")[1]
    assert "        end = min(start + batch_seqs, last)\n        hi = end * seq_len + 1\n        local = _val_batch\n" in loop
    assert "lo = " not in loop


def _loop_change(old: str, new: str) -> str:
    """HEAD + EVAL with its one `old` text replaced by `new` (what the row changes)."""
    assert EVAL.count(old) == 1
    return HEAD + EVAL.replace(old, new)


NO_LOOP = "no evaluation loop that copies a token slice to the device per batch"
TWICE = "slice bound `lo` in eval_val is assigned in the loop other than once before the slice"
KEYWORDS = "in eval_val: only device=, dtype=, non_blocking= keywords are rebuilt"

NOOPS = [
    pytest.param(
        _loop_change(LOOP, "    for start in sorted(range(first, last, batch_seqs)):\n"),
        "`for start in sorted(range(first, last, batch_seqs))` in eval_val iterates over no `range(...)` of batch starts",
        12,
        id="not-a-range",
    ),
    pytest.param(
        _loop_change("        hi = end * seq_len + 1", "        hi = next_end(end) * seq_len + 1"),
        "slice bound `hi` in eval_val calls `next_end`; only abs, int, len, max, min are known to be pure",
        12,
        id="bound-calls-a-function",
    ),
    pytest.param(_loop_change("        model(x, y)\n", "        model(x, y)\n        lo += 1\n"), TWICE, 12, id="bound-changed-after-the-slice"),
    pytest.param(_loop_change("        lo = start * seq_len\n", "        lo = start * seq_len\n        lo = lo + 1\n"), TWICE, 12, id="bound-assigned-twice-before-the-slice"),
    pytest.param(_loop_change(".to(device=device, dtype=torch.int64, non_blocking=True)", ".to(device, dtype=torch.int64)"), "`.to(device)` " + KEYWORDS, 12, id="positional-device-quoted-without-its-comma"),
    pytest.param(
        _loop_change(".to(device=device, dtype=torch.int64, non_blocking=True)", ".to(device=device, dtype=torch.int64, copy=True)"),
        "`.to(copy=True)` " + KEYWORDS,
        12,
        id="keyword-the-copy-does-not-rebuild",
    ),
    pytest.param(_loop_change(".to(device=device, dtype=torch.int64, non_blocking=True)", ".to(dtype=torch.int64)"), "`.to(...)` in eval_val names no device", 12, id="no-device-named"),
    pytest.param(
        _loop_change("        model(x, y)\n", "        model(x, y)\n        device = other_device\n"),
        "`.to(...)` argument `device` in eval_val changes inside the loop",
        12,
        id="device-changes-in-the-loop",
    ),
    pytest.param(
        _loop_change(SLICE, "        if hi > lo:\n    " + SLICE),
        "the slice `.to(...)` in eval_val is inside a nested block, not a statement of the loop",
        12,
        id="slice-inside-a-nested-block",
    ),
    pytest.param(_loop_change(SLICE, "        local = tokens[lo:hi].long()\n"), NO_LOOP, None, id="slice-never-copied-to-the-device"),
    pytest.param(HEAD + EVAL.replace("def eval_val(", "def score(", 1), NO_LOOP, None, id="function-not-named-for-evaluation"),
    pytest.param(
        HEAD
        + "def eval_val_sliding(model, device, tokens, windows, batch_seqs, seq_len):\n"
        "    for bi in range(0, len(windows), batch_seqs):\n"
        "        batch = windows[bi:bi + batch_seqs]\n"
        "        for i, ws in enumerate(batch):\n"
        "            chunk = tokens[ws:ws + seq_len + 1].to(dtype=torch.int64, device=device)\n"
        "            model(chunk[:-1], chunk[1:])\n",
        "`for i, ws in enumerate(batch)` in eval_val_sliding iterates over no `range(...)` of batch starts",
        13,
        id="sliding-windows-fill-a-batch-window-by-window",
    ),
    pytest.param(
        HEAD.replace("import torch\n", "import numpy as np\n") + EVAL.replace("torch.", "np."),
        "script does not use torch (MLX or other framework)",
        None,
        id="script-without-torch",
    ),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="val_prefetch")


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop_beside_every_other_feature(source, reason, line):
    """Refused with every feature on: the output of every feature but this one."""
    assert_refused_beside_others(source, "val_prefetch")
