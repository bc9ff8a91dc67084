"""Injected runtime: bits-per-byte byte counting on the host (feature `val_bytecount`).

parameter-golf's `eval_val` counts the UTF-8 bytes of every target token on the GPU:

    token_bytes = base_bytes_lut[tgt_ids].to(dtype=torch.int16)
    token_bytes += (has_leading_space_lut[tgt_ids] & ~is_boundary_token_lut[prev_ids]).to(dtype=torch.int16)
    val_byte_count += token_bytes.to(torch.float64).sum()

With `VAL_BYTECOUNT_DEVICE=cpu` the patched loop instead adds
`_val_byte_count(<the batch's host slice>, <the three lookup tables>)`: the same
lookups on host copies of the tables (made once per table), from the batch's CPU
token slice, so the GPU runs three gathers and a reduction fewer per batch and no
byte count waits on the GPU. The count is an exact integer: the original sums
integers in float64 (exact below 2**53), this sums them in int64, and adding the
int to the float64 accumulator gives the same value, so `val_bpb` is bit-identical.
"""

import torch

# id(table) -> (table, its host copy); the table is kept so that its id is not reused.
_host_luts = {}


def _host_lut(table):
    """A host copy of one lookup table, made once (one device-to-host copy per table)."""
    entry = _host_luts.get(id(table))
    if entry is None or entry[0] is not table:
        entry = _host_luts[id(table)] = (table, table.to(device="cpu"))
    return entry[1]


def _val_byte_count(tokens, base_bytes_lut, has_leading_space_lut, is_boundary_token_lut):
    """Bytes of the target tokens of one validation batch, counted on the host.

    Takes: tokens: the batch's token slice, any integer dtype, `[n + 1]` (inputs are
    `tokens[:-1]`, targets `tokens[1:]`), best on the host; base_bytes_lut: int16
    `[vocab]`, bytes of each token without its leading space; has_leading_space_lut:
    bool `[vocab]`; is_boundary_token_lut: bool `[vocab]` (a space after these is not
    counted).
    Returns: int, the sum over targets of `base_bytes[t] + (has_leading_space[t] and
    not is_boundary[prev])` (bytes), exactly what the script's float64 sum holds.
    Raises IndexError for a token id outside the tables, as the script's lookup does.
    """
    tokens = tokens.to(device="cpu", dtype=torch.int64).reshape(-1)
    prev_ids, tgt_ids = tokens[:-1], tokens[1:]
    # The script's own per-token arithmetic (int16); the sum is int64, exact.
    token_bytes = _host_lut(base_bytes_lut)[tgt_ids].to(dtype=torch.int16)
    token_bytes += (_host_lut(has_leading_space_lut)[tgt_ids] & ~_host_lut(is_boundary_token_lut)[prev_ids]).to(dtype=torch.int16)
    return int(token_bytes.sum(dtype=torch.int64))
