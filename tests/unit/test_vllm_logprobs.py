"""Reading a vLLM completions stream's logprobs (router.vllm_logprobs) in the shape vLLM 0.32
sends them with ``return_tokens_as_token_ids`` and ``echo``; the real server's answers are
compared in tests/e2e/test_router_vllm.py (CI's vLLM step)."""

from __future__ import annotations

import pytest

from quire.v1 import engine_pb2 as pb
from router.vllm_client import completion_body, response_from_chunk
from router.vllm_logprobs import LogprobsReader


def _sampling(**fields) -> pb.SamplingOptions:
    return pb.SamplingOptions(max_tokens=2, **fields)


def _chunk(index: int, positions: list) -> dict:
    """A completions chunk of choice ``index`` whose logprobs are ``positions``: (chosen id,
    its logprob, {id: logprob} of the top entries) or None (the prompt's first)."""
    return {"choices": [{"index": index, "text": "", "token_ids": [], "logprobs": {
        "tokens": [None if p is None else f"token_id:{p[0]}" for p in positions],
        "token_logprobs": [None if p is None else p[1] for p in positions],
        "top_logprobs": [None if p is None else {f"token_id:{t}": lp for t, lp in p[2].items()}
                         for p in positions]}}]}


def test_the_body_asks_for_ids_and_echoes_for_the_prompts_logprobs():
    plain = completion_body("m", pb.GenerateRequest(sampling=_sampling()))
    assert "logprobs" not in plain and "echo" not in plain
    body = completion_body("m", pb.GenerateRequest(sampling=_sampling(logprobs=3)))
    assert body["logprobs"] == 3 and body["return_tokens_as_token_ids"] and "echo" not in body
    body = completion_body("m", pb.GenerateRequest(sampling=_sampling(
        logprobs=1, prompt_logprobs=4)))
    assert body["logprobs"] == 4 and body["echo"] is True and "prompt_logprobs" not in body


def test_each_choices_echoed_prompt_is_split_off_once_and_top_k_kept():
    sampling = _sampling(logprobs=1, prompt_logprobs=2, n=2)
    reader = LogprobsReader(sampling, num_prompt_tokens=3)
    prompt = [None, (5, -1.0, {5: -1.0, 6: -0.5, 7: -2.0}), (8, -4.0, {9: -0.1, 10: -0.2})]
    first_output = [(11, -0.3, {11: -0.3, 12: -1.5})]
    messages = [response_from_chunk("r", _chunk(i, prompt + first_output), i == 0, reader)
                for i in (0, 1)]
    later = response_from_chunk("r", _chunk(0, [(13, -0.7, {14: -0.6, 13: -0.7})]), False,
                                reader)
    entries = messages[0].prompt_logprobs
    assert len(entries) == 3 and not entries[0].token_ids
    assert list(entries[1].token_ids) == [5, 6, 5] and entries[1].chosen_rank == 2
    assert list(entries[2].token_ids) == [8, 9, 10] and entries[2].chosen_rank == 0  # unknown
    assert entries[2].logprobs == pytest.approx([-4.0, -0.1, -0.2])
    assert not messages[1].prompt_logprobs  # the second choice's echo: the same prompt
    for message in messages:  # each choice's generated position, its top 1
        (delta,) = message.outputs
        assert [list(e.token_ids) for e in delta.logprobs] == [[11, 11]]
    (delta,) = later.outputs
    assert [list(e.token_ids) for e in delta.logprobs] == [[13, 14]]
    assert delta.logprobs[0].chosen_rank == 0


def test_without_logprobs_asked_nothing_is_read():
    reader = LogprobsReader(_sampling(), num_prompt_tokens=1)
    message = response_from_chunk("r", _chunk(0, [(1, -0.1, {1: -0.1})]), True, reader)
    assert not message.outputs[0].logprobs and not message.prompt_logprobs
