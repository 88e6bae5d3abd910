"""Incremental detokenization and stop strings on the embedded model's real tokenizer."""

from __future__ import annotations

import pytest

from engine_worker.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir) -> Tokenizer:
    return Tokenizer(embedded_model_dir)


def _stream(tokenizer, ids, **kwargs):
    detok = tokenizer.detokenizer([], True, kwargs.get("stop", []),
                                  kwargs.get("include", False))
    seen = []
    for token_id in ids:
        stop = detok.update([token_id])
        seen.append(detok.text(finished=False))
        if stop is not None:
            break
    return detok, seen


def test_multibyte_characters_come_out_whole(tokenizer):
    text = "héllo 世界 🎉 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok, seen = _stream(tokenizer, ids)
    assert detok.text(finished=True) == text
    assert all("\ufffd" not in s for s in seen)  # never a half character on the way


def test_stop_string_across_tokens_is_cut(tokenizer):
    text = "The answer is forty-two. Then more text follows."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, seen = _stream(tokenizer, ids, stop=["two. Th"])
    assert detok.stop_string == "two. Th"
    assert detok.text(finished=True) == "The answer is forty-"
    # while running, text that could still become the stop string is held back
    assert all(not s.endswith("tw") for s in seen[:-1])
    detok, _ = _stream(tokenizer, ids, stop=["two. Th"], include=True)
    assert detok.text(finished=True) == "The answer is forty-two. Th"


def test_eos_ids_come_from_generation_config(tokenizer):
    assert 2 in tokenizer.eos_token_ids  # <|im_end|>


def test_a_malformed_or_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer: cannot load a tokenizer from .*tokenizer.json"):
        Tokenizer(tmp_path)  # no tokenizer.json
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="tokenizer: cannot load a tokenizer from"):
        Tokenizer(tmp_path)
