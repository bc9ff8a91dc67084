"""Stand-in for tiktoken's "gpt2" encoding, without the network the real one needs for its file.

modded-nanogpt's train_gpt.py calls `tiktoken.get_encoding("gpt2")` at import and builds
its prefix-token table from `._mergeable_ranks` (token bytes -> id). Here: the 256 single
bytes, then one distinct byte string per further id up to 50,257, each extending a
shorter one (so the table has prefixes to find). The table differs from GPT-2's; it is
the same on both sides of an A/B, which is all a step-time comparison needs.
"""


class _Encoding:
    def __init__(self, n_vocab: int = 50257):
        ranks = {bytes([b]): b for b in range(256)}
        for token in range(256, n_vocab - 1):  # the last id is <|endoftext|>, a special token
            ranks[bytes([token % 256]) + token.to_bytes(2, "big")] = token
        self._mergeable_ranks = ranks
        self.eot_token = n_vocab - 1
        self.n_vocab = n_vocab


_CACHE: dict = {}


def get_encoding(name: str) -> _Encoding:
    if name not in _CACHE:
        _CACHE[name] = _Encoding()
    return _CACHE[name]
