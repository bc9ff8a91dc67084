"""val_bytecount: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

`_val_byte_count` (the host count, bit-identical to the device one) is tested in
test_val_templates.py, and the patched evaluation's numbers in test_val_transforms.py
and the end-to-end runs; these tables pin down exactly which byte counting gets a host
branch and which is left on the device.
"""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch, assert_refused_beside_others
from test_feature_val_prefetch import EVAL, HEAD, LOOP, NO_CLASS, PREFETCH_TOGGLE, prefetched, with_toggles


BYTES = (
    "        token_bytes = base_lut[tgt_ids].to(dtype=torch.int16)\n"
    "        token_bytes += (space_lut[tgt_ids] & ~boundary_lut[prev_ids]).to(dtype=torch.int16)\n"
    "        byte_count += token_bytes.to(torch.float64).sum()\n"
)
DEVICE_TOGGLE = 'val_bytecount_device = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")'


def counted(source: str, bytes_lines: str = BYTES, acc: str = "byte_count", luts: str = "base_lut, space_lut, boundary_lut", toggle: str = "Hyperparameters.val_bytecount_device") -> str:
    """`source` with its three byte-counting lines in the else branch of a host branch."""
    assert bytes_lines in source
    branch = f'        if {toggle} == "cpu":\n            {acc} += _val_byte_count(tokens[lo:hi], {luts})\n        else:\n'
    return source.replace(bytes_lines, branch + "".join("    " + line for line in bytes_lines.splitlines(keepends=True)), 1)


STRAIGHT = EVAL.replace("        prev_ids = x.reshape(-1)\n        tgt_ids = y.reshape(-1)\n", "        prev_ids = local[:-1]\n        tgt_ids = local[1:]\n")

RENAMES = [("prev_ids", "inputs"), ("tgt_ids", "targets"), ("token_bytes", "nbytes"), ("byte_count =", "total_bytes ="), ("byte_count +=", "total_bytes +="), ("return byte_count", "return total_bytes")]


def renamed(text: str) -> str:
    for old, new in RENAMES:
        text = text.replace(old, new)
    return text


LUT_ATTRIBUTES = EVAL.replace("base_lut, space_lut, boundary_lut):", "luts):").replace("base_lut[", "luts.base[").replace("space_lut[", "luts.space[").replace("boundary_lut[", "luts.boundary[")
LUT_ATTRIBUTES_BYTES = BYTES.replace("base_lut[", "luts.base[").replace("space_lut[", "luts.space[").replace("boundary_lut[", "luts.boundary[")

SHARED_LINE = EVAL.replace("        tgt_ids = y.reshape(-1)\n" + BYTES, "        tgt_ids = y.reshape(-1); " + "; ".join(line.strip() for line in BYTES.splitlines()) + "; seen += 1\n")
SHARED_LINE_AFTER = EVAL.replace(
    "        tgt_ids = y.reshape(-1)\n" + BYTES,
    "        tgt_ids = y.reshape(-1)\n"
    '        if Hyperparameters.val_bytecount_device == "cpu":\n'
    "            byte_count += _val_byte_count(tokens[lo:hi], base_lut, space_lut, boundary_lut)\n"
    "        else:\n"
    "            " + "; ".join(line.strip() for line in BYTES.splitlines()) + "\n"
    "        seen += 1\n",
)

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
MINIFIED_AFTER = (
    "import os,torch\n"
    + RUNTIME
    + "class Hyperparameters():seed=int(os.environ.get('SEED',1));val_bytecount_device=os.environ.get('VAL_BYTECOUNT_DEVICE','cuda')\n"
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
)

REWRITES = [
    pytest.param(HEAD + EVAL, with_toggles(HEAD, DEVICE_TOGGLE) + counted(EVAL), id="ids-reshaped-from-the-batch"),
    pytest.param(HEAD + STRAIGHT, with_toggles(HEAD, DEVICE_TOGGLE) + counted(STRAIGHT), id="ids-sliced-straight-from-the-batch"),
    pytest.param(HEAD + renamed(EVAL), with_toggles(HEAD, DEVICE_TOGGLE) + renamed(counted(EVAL, acc="byte_count")), id="other-names-for-ids-bytes-and-accumulator"),
    pytest.param(
        HEAD + LUT_ATTRIBUTES,
        with_toggles(HEAD, DEVICE_TOGGLE) + counted(LUT_ATTRIBUTES, LUT_ATTRIBUTES_BYTES, luts="luts.base, luts.space, luts.boundary"),
        id="tables-read-through-attributes",
    ),
    pytest.param(HEAD + SHARED_LINE, with_toggles(HEAD, DEVICE_TOGGLE) + SHARED_LINE_AFTER, id="statements-sharing-a-line-split-around-the-branch"),
    pytest.param(
        NO_CLASS + EVAL,
        NO_CLASS.replace("import torch\n", 'import torch\nVAL_BYTECOUNT_DEVICE = os.environ.get("VAL_BYTECOUNT_DEVICE", "cuda")\n' + RUNTIME) + counted(EVAL, toggle="VAL_BYTECOUNT_DEVICE"),
        id="string-module-constant-without-a-class",
    ),
    pytest.param(MINIFIED, MINIFIED_AFTER, id="minified-else-branch-on-one-line"),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    result = assert_patch(before, after, only="val_bytecount")
    assert result.applied == ["val_bytecount", "env_toggles"]
    compile(result.source, "patched", "exec")


def test_with_val_prefetch_the_host_count_reads_the_slice_the_loop_still_cuts():
    after = with_toggles(HEAD, PREFETCH_TOGGLE, DEVICE_TOGGLE) + prefetched(counted(EVAL))
    result = assert_patch(HEAD + EVAL, after, only=["val_bytecount", "val_prefetch"])
    assert result.applied == ["val_bytecount", "val_prefetch", "env_toggles"]


def _change(old: str, new: str) -> str:
    assert old in EVAL
    return HEAD + EVAL.replace(old, new, 1)


NOOPS = [
    pytest.param(_change("        prev_ids = x.reshape(-1)", "        prev_ids = y.reshape(-1)"), id="previous-ids-are-the-targets"),
    pytest.param(_change("        tgt_ids = y.reshape(-1)", "        tgt_ids = y.reshape(-1)[::-1]"), id="targets-reordered"),
    pytest.param(_change("    byte_count = torch.zeros((), device=device, dtype=torch.float64)", "    byte_count = 0.0"), id="float-accumulator"),
    pytest.param(_change("        model(x, y)\n", "        model(x, y)\n        byte_count = torch.zeros((), device=device, dtype=torch.float64)\n"), id="accumulator-assigned-twice"),
    pytest.param(_change("    return byte_count\n", "    return byte_count, token_bytes\n"), id="token-bytes-read-after-the-counting"),
    pytest.param(_change(LOOP, "    token_bytes = None\n" + LOOP), id="token-bytes-assigned-outside-the-counting"),
    pytest.param(_change("token_bytes.to(torch.float64).sum()", "token_bytes.to(torch.float32).sum()"), id="float32-sum"),
    pytest.param(_change("base_lut[tgt_ids]", "base_lut[tgt_ids.long()]"), id="table-indexed-by-an-expression"),
    pytest.param(_change(BYTES, "        if tgt_ids.numel(): " + "; ".join(line.strip() for line in BYTES.splitlines()) + "\n"), id="counting-on-a-one-line-block"),
    pytest.param(_change("        hi = end * seq_len + 1", "        hi = next_end(end) * seq_len + 1"), id="slice-not-a-pure-function-of-the-start"),
    pytest.param(_change(LOOP, "    for start in sorted(range(first, last, batch_seqs)):\n"), id="not-a-range"),
    pytest.param(_change(BYTES, ""), id="no-byte-counting"),
    pytest.param(HEAD.replace("import torch\n", "import numpy as np\n") + EVAL.replace("torch.", "np."), id="script-without-torch"),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="val_bytecount")


@pytest.mark.parametrize("source", NOOPS)
def test_noop_beside_every_other_feature(source):
    """Refused with every feature on (the slice still built ahead): the output of every feature but this one."""
    assert_refused_beside_others(source, "val_bytecount")
