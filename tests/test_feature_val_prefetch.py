"""val_prefetch: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

The prefetching runtime (same batches, pinned memory, copy stream) is tested in
test_val_templates.py, and the patched evaluation's numbers in test_val_transforms.py
and the end-to-end runs; these tables pin down exactly what the rewrite changes in
the evaluation loop and which loops it leaves alone.
"""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch, assert_refused_beside_others

from patcher.patch import patch_source

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
SLICE_FN = (
    "    def _val_slice(start):\n"
    "        end = min(start + batch_seqs, last)\n"
    "        lo = start * seq_len\n"
    "        hi = end * seq_len + 1\n"
    "        return tokens[lo:hi]\n"
)
TO = "dict(device=device, dtype=torch.int64, non_blocking=True)"


def prefetched(eval_source: str = EVAL, copy_stream: str = "False", prefetch: str = "Hyperparameters.val_prefetch") -> str:
    """`eval_source` with its loop rewritten (slice function, `_val_prefetch` iterable, batch read)."""
    return eval_source.replace(
        LOOP, SLICE_FN + f"    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice, {TO}, prefetch={prefetch}, copy_stream={copy_stream}):\n", 1
    ).replace(SLICE, "        local = _val_batch\n", 1)


def with_toggles(head: str, *lines: str) -> str:
    """`head` with the runtime block after the imports and `lines` added to Hyperparameters."""
    return head.replace("import torch\n", "import torch\n" + RUNTIME).replace(
        '    seed = int(os.environ.get("SEED", 1337))\n', '    seed = int(os.environ.get("SEED", 1337))\n' + "".join(f"    {line}\n" for line in lines)
    )


PREFETCH_TOGGLE = 'val_prefetch = int(os.environ.get("VAL_PREFETCH", 1))'
COPY_STREAM_TOGGLE = 'val_copy_stream = int(os.environ.get("VAL_COPY_STREAM", 1))'

NO_CLASS = HEAD.replace('class Hyperparameters:\n    seed = int(os.environ.get("SEED", 1337))\n\n', "")

UNUSED_PREFIX = EVAL.replace("        end = min(", "        n_tokens = batch_seqs * seq_len\n        end = min(")

TWO_LOOPS = EVAL.replace("    return byte_count\n", "    for start in range(first, last, batch_seqs):\n        lo = start * seq_len\n        local = tokens[lo:lo + seq_len + 1].to(device=device)\n        model(local[:-1], local[1:])\n    return byte_count\n")
TWO_LOOPS_AFTER = prefetched(TWO_LOOPS).replace(
    "    for start in range(first, last, batch_seqs):\n        lo = start * seq_len\n        local = tokens[lo:lo + seq_len + 1].to(device=device)\n",
    "    def _val_slice2(start):\n"
    "        lo = start * seq_len\n"
    "        return tokens[lo:lo + seq_len + 1]\n"
    "    for start, _val_batch in _val_prefetch(range(first, last, batch_seqs), _val_slice2, dict(device=device), prefetch=Hyperparameters.val_prefetch, copy_stream=False):\n"
    "        lo = start * seq_len\n"
    "        local = _val_batch\n",
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
MINIFIED_AFTER = (
    "import os,torch\n"
    + RUNTIME
    + "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_batch=int(os.environ.get('VAL_BATCH',4));val_prefetch=int(os.environ.get('VAL_PREFETCH',1))\n"
    "def log(msg):print(msg)\n"
    "def eval_val(h,device,tokens,model):\n"
    "\tseq_len=h.seq_len;first=0;last=(tokens.numel()-1)//seq_len;n=h.val_batch;total=torch.zeros((),device=device)\n"
    "\tdef _val_slice(start):end=min(start+n,last);lo=start*seq_len;hi=end*seq_len+1;return tokens[lo:hi]\n"
    "\tfor start,_val_batch in _val_prefetch(range(first,last,n),_val_slice,dict(device=device,dtype=torch.int64,non_blocking=True),prefetch=Hyperparameters.val_prefetch,copy_stream=False):\n"
    "\t\tend=min(start+n,last);lo=start*seq_len;hi=end*seq_len+1;local=_val_batch;total+=model(local[:-1],local[1:])\n"
    "\treturn total\n"
)

REWRITES = [
    pytest.param(HEAD + EVAL, with_toggles(HEAD, PREFETCH_TOGGLE) + prefetched(), id="slice-built-ahead-no-copy-stream-without-copy_stream"),
    pytest.param(HEAD + UNUSED_PREFIX, with_toggles(HEAD, PREFETCH_TOGGLE) + prefetched(UNUSED_PREFIX), id="only-the-bounds-the-slice-reads-move-into-the-slice-function"),
    pytest.param(HEAD + TWO_LOOPS, with_toggles(HEAD, PREFETCH_TOGGLE) + TWO_LOOPS_AFTER, id="second-loop-gets-a-second-slice-function"),
    pytest.param(
        NO_CLASS + EVAL,
        NO_CLASS.replace("import torch\n", 'import torch\nVAL_PREFETCH = int(os.environ.get("VAL_PREFETCH", 1))\n' + RUNTIME) + prefetched(prefetch="VAL_PREFETCH"),
        id="module-constant-without-a-class",
    ),
    pytest.param(
        "import torch\n\n" + EVAL,
        'import torch\nimport os\nVAL_PREFETCH = int(os.environ.get("VAL_PREFETCH", 1))\n' + RUNTIME + "\n" + prefetched(prefetch="VAL_PREFETCH"),
        id="import-os-added-for-the-constant",
    ),
    pytest.param(MINIFIED, MINIFIED_AFTER, id="minified-slice-function-on-one-line"),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    result = assert_patch(before, after, only="val_prefetch")
    assert result.applied == ["val_prefetch", "env_toggles"]
    compile(result.source, "patched", "exec")


def test_with_copy_stream_the_copies_switch_on_their_own_toggle():
    after = with_toggles(HEAD, PREFETCH_TOGGLE, COPY_STREAM_TOGGLE) + prefetched(copy_stream="Hyperparameters.val_copy_stream")
    result = assert_patch(HEAD + EVAL, after, only=["val_prefetch", "copy_stream"])
    assert result.applied == ["val_prefetch", "env_toggles"]  # copy_stream itself: no training loader here


@pytest.mark.parametrize("only, stream", [("val_prefetch", "compute"), (["val_prefetch", "copy_stream"], "copy")], ids=["alone", "with-copy_stream"])
def test_the_note_names_the_stream_the_copy_runs_on(only, stream):
    result = assert_patch(HEAD + EVAL, with_toggles(HEAD, PREFETCH_TOGGLE, *([COPY_STREAM_TOGGLE] if stream == "copy" else [])) + prefetched(copy_stream="Hyperparameters.val_copy_stream" if stream == "copy" else "False"), only=only)
    [note] = [n for n in result.notes if n.feature == "val_prefetch"]
    assert note.reason.endswith(f"built one batch ahead (pinned), H2D on the {stream} stream")


def test_a_positional_device_is_quoted_without_its_comma():
    result = patch_source(_loop_change(".to(device=device, dtype=torch.int64, non_blocking=True)", ".to(device, dtype=torch.int64)"), {"val_prefetch"})
    [note] = [n for n in result.notes if n.feature == "val_prefetch"]
    assert note.reason == "`.to(device)` in eval_val: only device=, dtype=, non_blocking= keywords are rebuilt"


def _loop_change(old: str, new: str) -> str:
    assert old in EVAL
    return HEAD + EVAL.replace(old, new, 1)


NOOPS = [
    pytest.param(_loop_change(LOOP, "    for start in sorted(range(first, last, batch_seqs)):\n"), id="not-a-range"),
    pytest.param(_loop_change("        hi = end * seq_len + 1", "        hi = next_end(end) * seq_len + 1"), id="bound-calls-a-function"),
    pytest.param(_loop_change("        model(x, y)\n", "        model(x, y)\n        lo += 1\n"), id="bound-changed-after-the-slice"),
    pytest.param(_loop_change("        lo = start * seq_len\n", "        lo = start * seq_len\n        lo = lo + 1\n"), id="bound-assigned-twice-before-the-slice"),
    pytest.param(_loop_change(".to(device=device, dtype=torch.int64, non_blocking=True)", ".to(device, dtype=torch.int64)"), id="positional-device"),
    pytest.param(_loop_change(".to(device=device, dtype=torch.int64, non_blocking=True)", ".to(dtype=torch.int64)"), id="no-device-named"),
    pytest.param(_loop_change("        model(x, y)\n", "        model(x, y)\n        device = other_device\n"), id="device-changes-in-the-loop"),
    pytest.param(_loop_change(SLICE, "        if hi > lo:\n    " + SLICE), id="slice-inside-a-nested-block"),
    pytest.param(_loop_change(SLICE, "        local = tokens[lo:hi].long()\n"), id="slice-never-copied-to-the-device"),
    pytest.param(HEAD + EVAL.replace("def eval_val(", "def score(", 1), id="function-not-named-for-evaluation"),
    pytest.param(
        HEAD
        + "def eval_val_sliding(model, device, tokens, windows, batch_seqs, seq_len):\n"
        "    for bi in range(0, len(windows), batch_seqs):\n"
        "        batch = windows[bi:bi + batch_seqs]\n"
        "        for i, ws in enumerate(batch):\n"
        "            chunk = tokens[ws:ws + seq_len + 1].to(dtype=torch.int64, device=device)\n"
        "            model(chunk[:-1], chunk[1:])\n",
        id="sliding-windows-fill-a-batch-window-by-window",
    ),
    pytest.param(HEAD.replace("import torch\n", "import numpy as np\n") + EVAL.replace("torch.", "np."), id="script-without-torch"),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="val_prefetch")


@pytest.mark.parametrize("source", NOOPS)
def test_noop_beside_every_other_feature(source):
    """Refused with every feature on: the output of every feature but this one."""
    assert_refused_beside_others(source, "val_prefetch")
