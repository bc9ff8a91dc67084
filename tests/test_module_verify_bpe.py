"""`verify --tokenizer bpe` of a data-loader module: nanochat's loader fixture driven with a
real BPE built as nanochat builds its tokenizer (rustbpe trained on the synthetic corpus,
wrapped in tiktoken). Skipped where rustbpe or tiktoken is not installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from patcher.patch import patch_source
from patcher.proof.compare import CannotVerify

needs_bpe = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("pyarrow", "rustbpe", "tiktoken")), reason="needs pyarrow, rustbpe and tiktoken")

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "bestfit_packing.py"
SOURCE = FIXTURE.read_text(encoding="utf-8")
NAME = "rustbpe BPE, vocab 512, trained on the synthetic corpus"


def test_without_rustbpe_bpe_cannot_verify(monkeypatch):
    from patcher.proof.module_verify import make_tokenizer

    monkeypatch.setitem(sys.modules, "rustbpe", None)  # import raises ImportError
    with pytest.raises(CannotVerify, match="needs rustbpe and tiktoken"):
        make_tokenizer("bpe")
    assert make_tokenizer("byte")[1] == "byte-level stand-in"


@needs_bpe
def test_the_bpe_tokenizer_is_nanochats_shape():
    from patcher.proof.module_verify import BPETokenizer, corpus_texts

    tokenizer = BPETokenizer([t for texts in corpus_texts() for t in texts])
    ids = tokenizer.encode(["abc defg", "hij"], prepend=tokenizer.get_bos_token_id(), num_threads=1)
    assert tokenizer.vocab_size == 512 and tokenizer.get_bos_token_id() == 503  # 256 bytes + 247 merges, then <|bos|>
    assert all(row[0] == 503 for row in ids) and max(max(row[1:]) for row in ids) > 255  # merged tokens, not bytes
    assert tokenizer.enc.decode(ids[0][1:]) == "abc defg"


@needs_bpe
def test_verify_with_bpe_is_identical_and_says_so(tmp_path, capsys):
    from patcher.cli import main

    patched = tmp_path / "bestfit_packing.py"
    patched.write_text(patch_source(SOURCE).source)
    assert main(["verify", str(FIXTURE), str(patched), "--batches", "6", "--world-size", "1", "--tokenizer", "bpe"]) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    assert verdict.startswith("identical:") and f"tokenizer: {NAME}" in verdict, verdict


@needs_bpe
def test_verify_with_bpe_catches_a_wrong_state(tmp_path):
    from patcher.proof.verify import verify

    patched = tmp_path / "bestfit_packing.py"
    source = patch_source(SOURCE).source
    old = 'state = {"pq_idx": pq_idx, "rg_idx": rg_idx, "epoch": epoch}'
    assert old in source
    patched.write_text(source.replace(old, old.replace("rg_idx, ", "rg_idx + 1, ")))
    result = verify(FIXTURE, patched, batches=4, world_size=1, tokenizer="bpe")
    assert not result.identical and result.difference.field is not None and result.tokenizer == NAME
