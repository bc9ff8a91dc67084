"""Stand-in for nanochat's `nanochat/tokenizer.py` (a byte-level tokenizer, no files, no rustbpe or tiktoken).

Copied over the run tree's `nanochat/tokenizer.py` by `bench/gpu_e2e.py`, on both sides
of an A/B. Token id = byte + 1, BOS = 0 (as `patcher.proof.module_verify.ByteTokenizer`),
vocabulary 257 padded by nanochat's model itself.
"""

import torch


class ByteTokenizer:
    """Picklable: nanochat's loader, and the patched loader's producer, get a copy."""

    def get_vocab_size(self) -> int:
        return 257

    def get_bos_token_id(self) -> int:
        return 0

    def encode(self, text, prepend=None, append=None, num_threads=8):
        """Ids of one string or a list of strings; `prepend` / `append`: an id or a special token's name."""
        if isinstance(text, str):
            return self.encode([text], prepend, append)[0]
        first = [] if prepend is None else [0 if isinstance(prepend, str) else prepend]
        last = [] if append is None else [0 if isinstance(append, str) else append]
        return [first + [b + 1 for b in t.encode("utf-8")] + last for t in text]

    __call__ = encode

    def decode(self, ids) -> str:
        return bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")


def get_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def get_token_bytes(device="cpu") -> torch.Tensor:
    """Bytes per token id (int32 [257]): 0 for BOS, 1 for every byte."""
    out = torch.ones(257, dtype=torch.int32, device=device)
    out[0] = 0
    return out
