"""The input processor's request checks (issue 32): a max_tokens the client set that does not fit
beside the prompt is refused in vLLM's words, the server's own default is cut to fit, and stop
token ids are bounded in number and checked against the vocabulary."""

from __future__ import annotations

import pytest

from engine_worker.input_processor import DefaultMaxTokens, InputProcessor
from engine_worker.sampling_params import SamplingParams
from engine_worker.tokenizer import Tokenizer
from quire.list_limits import MAX_STOP_TOKEN_IDS


@pytest.fixture(scope="module")
def processor(embedded_model_dir) -> InputProcessor:
    return InputProcessor(Tokenizer(embedded_model_dir), max_model_len=64,
                          kv_capacity_tokens=1024, vocab_size=49152, max_num_seqs=4)


def _max_tokens(processor, num_prompt_tokens: int, max_tokens) -> int:
    processed = processor.process("r", [5] * num_prompt_tokens,
                                  SamplingParams(max_tokens=max_tokens), 0.0, 0)
    return processed.request.max_tokens


def test_a_max_tokens_is_cut_to_the_room_the_prompt_leaves_as_vllm_cuts_it(processor):
    """vLLM 0.32's server (get_max_tokens) cuts max_tokens to max_model_len - prompt; only a
    prompt that leaves no room is refused."""
    assert _max_tokens(processor, 60, 10) == 4
    assert _max_tokens(processor, 60, 4) == 4  # exactly fits
    assert _max_tokens(processor, 60, None) == 4  # up to the model's length
    assert _max_tokens(processor, 10, 16) == 16
    with pytest.raises(ValueError, match=r"^prompt: 64 tokens leave no room"):
        _max_tokens(processor, 64, 1)
    # a client's max_tokens past max_model_len itself is refused, as vLLM 0.32 refuses it; the
    # server's own default cap is only cut
    with pytest.raises(ValueError, match=r"^max_tokens: max_tokens=65 cannot be greater than "
                                         r"max_model_len=64"):
        _max_tokens(processor, 10, 65)
    assert _max_tokens(processor, 10, DefaultMaxTokens(4096)) == 54


def test_a_prompt_that_leaves_no_room_is_refused_as_before(processor):
    with pytest.raises(ValueError, match=r"^prompt: 64 tokens leave no room"):
        _max_tokens(processor, 64, None)


@pytest.mark.parametrize("ids, message", [
    ([5] * (MAX_STOP_TOKEN_IDS + 1),
     f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids, got "
     f"{MAX_STOP_TOKEN_IDS + 1}"),
    ([5, 49152], "stop_token_ids: 49152 is not a token id in [0, 49152)"),
    ([True], "stop_token_ids: True is not a token id in [0, 49152)"),
])
def test_stop_token_ids_are_bounded_and_in_the_vocabulary(processor, ids, message):
    with pytest.raises(ValueError) as err:
        processor.process("r", [5], SamplingParams(stop_token_ids=ids), 0.0, 0)
    assert str(err.value) == message


def test_stop_token_ids_at_the_limit_pass(processor):
    ids = list(range(49152 - MAX_STOP_TOKEN_IDS, 49152))
    processed = processor.process("r", [5], SamplingParams(stop_token_ids=ids), 0.0, 0)
    assert processed.request.sampling_params.stop_token_ids == ids


def test_a_server_chosen_max_tokens_is_cut_to_what_the_cache_holds(embedded_model_dir):
    """With no output cap by default, a request that sets no max_tokens asks for the model's
    length; where the KV cache holds less than that (an engine started with a small cache,
    which only warns), it is cut to what the cache holds, not refused. A client's own
    max_tokens that cannot fit is still a 400 naming it."""
    small = InputProcessor(Tokenizer(embedded_model_dir), max_model_len=4096,
                           kv_capacity_tokens=1024, vocab_size=49152, max_num_seqs=4)
    assert _max_tokens(small, 24, None) == 1001  # 24 + 1001 - 1 = 1024 cached at the peak
    assert _max_tokens(small, 24, DefaultMaxTokens(4096)) == 1001
    with pytest.raises(ValueError, match=r"^max_tokens: the request needs up to 2023 tokens"):
        _max_tokens(small, 24, 2000)
    with pytest.raises(ValueError, match=r"^prompt: the request needs"):
        _max_tokens(small, 1100, None)  # the prompt alone is more than the cache
