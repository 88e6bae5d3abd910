"""vLLM's ``allowed_token_ids`` and ``bad_words``: greedy output token-identical to Hugging Face
transformers' generate under the same restriction (``prefix_allowed_tokens_fn``,
``bad_words_ids``), sampled output inside it (the OpenAI front's fields: test_openai_compat.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_worker import LLM, SamplingParams
from engine_worker.sampling_params import bad_words_token_ids
from quire.errors import FieldError

PROMPTS = [[5, 100, 200, 300, 400], list(range(1000, 1040)), [42] * 17]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                           dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26)
    return llm, hf


def _quire(llm, prompt, **params) -> list[int]:
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params), use_tqdm=False)
    return list(out.outputs[0].token_ids)


def _hf(hf, prompt, **kwargs) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                      pad_token_id=0, **kwargs)
    return out[0, len(prompt):].tolist()


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens)))


def _words_from(llm, tokens: list[int]) -> list[str]:
    """Two words the unrestricted output generates: one token's text and two tokens' text,
    each one that tokenizes back to those tokens (so banning it bans them)."""
    tokenizer = llm.engine.tokenizer
    words = []
    for span in ((3, 4), (8, 10)):
        for start in range(span[0], MAX_TOKENS - 2):
            piece = tokens[start:start + span[1] - span[0]]
            text = tokenizer.decode(piece)
            if text.strip() and tokenizer.encode(text.lstrip(), add_special_tokens=False) \
                    == piece:
                words.append(text)
                break
    return words


def test_bad_words_match_transformers_bad_words_ids(models):
    """The words' token sequences (tokenized as vLLM does) never appear in the output, and the
    output equals transformers' with ``bad_words_ids`` of the same sequences. The prompt's
    last token starts no word: there transformers (which reads the prompt too) and vLLM
    (which reads only the output) would differ."""
    llm, hf = models
    encode = llm.engine.tokenizer.encode
    checked = 0
    for prompt in PROMPTS:
        free = _quire(llm, prompt)
        words = _words_from(llm, free)
        banned = bad_words_token_ids(words, lambda t: encode(t, add_special_tokens=False))
        if not words or any(w[0] == prompt[-1] for w in banned):
            continue
        assert any(_contains(free, w) for w in banned)  # the ban has something to change
        restricted = _quire(llm, prompt, bad_words=words)
        assert not any(_contains(restricted, w) for w in banned)
        assert restricted == _hf(hf, prompt, bad_words_ids=[list(w) for w in banned])
        checked += 1
    assert checked >= 2


def test_allowed_token_ids_match_transformers_and_bound_sampling(models):
    llm, hf = models
    for prompt in PROMPTS:
        free = _quire(llm, prompt)
        allowed = sorted(set(range(500, 560)) | {free[5]})
        restricted = _quire(llm, prompt, allowed_token_ids=allowed)
        assert set(restricted) <= set(allowed) and restricted != free
        assert restricted == _hf(hf, prompt, prefix_allowed_tokens_fn=lambda b, ids: allowed)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(
        temperature=1.5, max_tokens=64, ignore_eos=True, seed=3, n=4,
        allowed_token_ids=[7, 8, 9]), use_tqdm=False)
    drawn = {t for sample in out.outputs for t in sample.token_ids}
    assert drawn <= {7, 8, 9} and len(drawn) > 1


@pytest.mark.parametrize("params, field", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),  # outside the vocabulary
    ({"bad_words": ["ok", " "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["x" * 257]}, "bad_words"),
])
def test_bad_lists_name_their_field(models, params, field):
    llm, _ = models
    with pytest.raises(FieldError) as e:
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(**params), use_tqdm=False)
    assert e.value.field == field



def test_allowed_tokens_win_over_min_tokens_bans(models):
    """Only the end token allowed, under min_tokens: every token drawn is still an allowed
    one (the bans would have left nothing, and token 0, outside the list, was drawn)."""
    llm, _ = models
    eos = min(llm.engine.tokenizer.eos_token_ids)
    for temperature in (0, 1.0):
        (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
            temperature=temperature, max_tokens=5, min_tokens=3, allowed_token_ids=[eos],
            seed=1), use_tqdm=False)
        # (before min_tokens, the end token does not end the completion)
        assert list(out.outputs[0].token_ids) == [eos] * 3
