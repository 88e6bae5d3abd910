"""router.resume: which failed streams may go on elsewhere, and the request and messages of
the continuation."""

from __future__ import annotations

import pytest

from quire.v1 import engine_pb2 as pb
from router.resume import (as_continued, continuation, last_message, max_tokens_left,
                           resume_refusal)


def _request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                              sampling=pb.SamplingOptions(**sampling), cache_salt="s",
                              priority=3, lora_name="ad")


@pytest.mark.parametrize("sampling, reason", [
    ({}, None),
    ({"n": 1, "temperature": 1.0, "seed": 4, "logprobs": 2, "repetition_penalty": 1.2,
      "stop_token_ids": [9], "logit_bias": {3: 1.0}}, None),
    ({"n": 2}, "n > 1"),
    ({"structured_outputs": pb.StructuredOutputs(regex="a+")}, "structured outputs"),
    ({"presence_penalty": 0.5}, "presence or frequency penalty"),
    ({"frequency_penalty": -0.5}, "presence or frequency penalty"),
    ({"bad_words": ["x"]}, "bad words"),
    ({"stop": ["\n"]}, "stop strings"),
])
def test_what_may_go_on_elsewhere(sampling, reason):
    assert resume_refusal(_request(**sampling)) == reason


def test_an_empty_structured_outputs_message_is_no_grammar():
    request = _request()
    request.sampling.structured_outputs.SetInParent()
    assert resume_refusal(request) is None


def test_the_continuation_takes_the_tokens_as_prompt_and_shrinks_the_budgets():
    request = _request(max_tokens=10, min_tokens=4, prompt_logprobs=1, temperature=0.5)
    out = continuation(request, [11, 12, 13])
    assert list(out.token_ids.ids) == [5, 6, 7, 11, 12, 13]
    assert (out.sampling.max_tokens, out.sampling.min_tokens) == (7, 1)
    assert not out.sampling.HasField("prompt_logprobs")
    assert out.sampling.temperature == pytest.approx(0.5)
    assert (out.request_id, out.cache_salt, out.priority, out.lora_name) == ("r", "s", 3, "ad")
    assert request.sampling.max_tokens == 10 and list(request.token_ids.ids) == [5, 6, 7]


def test_min_tokens_already_met_become_zero():
    out = continuation(_request(max_tokens=10, min_tokens=2), [1, 2, 3])
    assert out.sampling.min_tokens == 0 and out.sampling.HasField("min_tokens")


def test_an_unset_max_tokens_stays_unset_unless_the_router_caps_it():
    assert not continuation(_request(), [1, 2]).sampling.HasField("max_tokens")
    assert continuation(_request(), [1, 2], default_max_tokens=8).sampling.max_tokens == 6


@pytest.mark.parametrize("sampling, default, generated, left", [
    ({"max_tokens": 5}, 0, 3, 2),
    ({"max_tokens": 5}, 100, 5, 0),
    ({"max_tokens": 5}, 0, 7, 0),
    ({}, 0, 3, None),
    ({}, 4, 3, 1),
])
def test_max_tokens_left(sampling, default, generated, left):
    assert max_tokens_left(_request(**sampling), [1] * generated, default) == left


def test_the_continuations_messages_read_as_the_original_streams():
    first = pb.GenerateResponse(prompt_token_ids=[5, 6, 7, 11, 12],
                                prompt_logprobs=[pb.PositionLogprobs()],
                                outputs=[pb.CompletionDelta(token_ids=[13])])
    as_continued(first, prompt_tokens=3, earlier=2)
    assert not first.prompt_token_ids and not first.prompt_logprobs
    assert list(first.outputs[0].token_ids) == [13] and not first.HasField("usage")
    end = pb.GenerateResponse(finished=True, usage=pb.Usage(prompt_tokens=5, completion_tokens=4,
                                                            cached_tokens=5))
    as_continued(end, prompt_tokens=3, earlier=2)
    assert (end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.cached_tokens) == (
        3, 6, 3)


def test_the_last_message_of_a_stream_whose_tokens_all_arrived():
    m = last_message("r", prompt_tokens=3, generated=5)
    assert m.finished and m.request_id == "r"
    assert m.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert (m.usage.prompt_tokens, m.usage.completion_tokens) == (3, 5)
