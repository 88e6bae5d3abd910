"""vLLM's /v1/chat/completions/batch through the router (router + two engines, the stack of
test_router_openai), and under flow control with one slot."""

from __future__ import annotations

import json

import pytest

from tests.e2e import test_router_openai as base
from tests.e2e.router_harness import RunningRouter, address, wait_for

engines, router, front, client = base.engines, base.router, base.front, base.client
MODEL, _http = base.MODEL, base._http


def _post(front, path, body):
    status, text = _http(front, "POST", path, {"model": MODEL, **body})
    return status, json.loads(text)


def _ok(front, path, body) -> dict:
    status, answer = _post(front, path, body)
    assert status == 200, answer
    return answer


def test_chat_batch_answers_each_conversation_as_its_own_chat(front):
    """vLLM's /v1/chat/completions/batch (its batched_chat_completions.py example): one choice
    per conversation, index k for conversation k, each what chat answers for it alone, the
    usage summed; a structured output applies to each."""
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be terse."},
                      {"role": "user", "content": "Name a colour."}],
                     [{"role": "user", "content": "Count to three."}]]
    batch = _ok(front, "/v1/chat/completions/batch", {
        "messages": conversations, "max_tokens": 6, "temperature": 0})
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    alone = [_ok(front, "/v1/chat/completions", {"messages": c, "max_tokens": 6,
                                                  "temperature": 0}) for c in conversations]
    for choice, single in zip(batch["choices"], alone, strict=True):
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["finish_reason"] == single["choices"][0]["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in alone)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    shaped = _ok(front, "/v1/chat/completions/batch", {
        "messages": conversations[:2], "max_tokens": 20, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n",
                                                                   "schema": schema}}})
    for choice in shaped["choices"]:
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"])["n"], int)


@pytest.mark.parametrize("extra,param", [
    ({"stream": True}, "stream"), ({"n": 2}, "n"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"messages": [[]]}, "messages"), ({"messages": [[{"role": "user", "content": 5}]]},
                                       "messages"),
    ({"temperature": -1}, "temperature"), ({"frob": 1}, "frob"),
])
def test_chat_batch_refuses_what_vllms_refuses_naming_the_field(front, extra, param):
    body = {"model": MODEL, "messages": [[{"role": "user", "content": "hi"}]],
            "max_tokens": 2} | extra
    status, text = _http(front, "POST", "/v1/chat/completions/batch", body)
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == param


def test_a_failing_conversation_fails_the_batch_with_its_own_400(front, engines, caplog):
    """The second conversation is longer than the model: its engine refuses it while the
    first runs. The batch answers that 400 as JSON (a close of a stream another task still
    read turned it into a plain-text 500) and the other conversation's engine request ends."""
    long = " ".join(["word"] * 1500)  # past the tiny model's 1,024 tokens
    status, answer = _post(front, "/v1/chat/completions/batch", {
        "messages": [[{"role": "user", "content": "hi"}],
                     [{"role": "user", "content": long}]], "max_tokens": 300,
        "ignore_eos": True})
    assert status == 400 and answer["error"]["param"] == "messages", answer
    assert not [r for r in caplog.records if r.exc_info]
    assert wait_for(lambda: all(e.holds_no_request() for e in engines))


def test_a_batch_larger_than_its_flow_slots_completes(engines):
    """With one flow-control slot, conversations wait for the slot the batch's own others
    hold; each is read as it runs, so they finish in turn (a batch that read every first
    message before any stream on waited for itself until its deadline)."""
    one_slot = RunningRouter([address(engines[0])], http_port=0, model_name=MODEL,
                             flow={"engine_slots": 1})
    try:
        conversations = [[{"role": "user", "content": f"Say {w}."}]
                         for w in ("one", "two", "three")]
        status, text = _http(one_slot.server.front, "POST", "/v1/chat/completions/batch", {
            "model": MODEL, "messages": conversations, "max_tokens": 4, "temperature": 0})
        assert status == 200, text
        assert [c["index"] for c in json.loads(text)["choices"]] == [0, 1, 2]
    finally:
        one_slot.close()
