"""The Responses API's translation into the chat completion it means
(router.openai_responses.chat_body); served end to end in tests/e2e/test_openai_responses.py."""

from __future__ import annotations

import pytest

from router.openai_protocol import RequestError, truncate_ids
from router.openai_responses import chat_body


def test_a_turns_text_and_calls_are_one_assistant_message():
    body = chat_body({"input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}],
        "instructions": "Be brief."})
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assistant = body["messages"][2]
    assert assistant["content"] == "Let me look."
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]


def test_fields_map_to_chats_names():
    body = chat_body({"input": "hi", "max_output_tokens": 5, "reasoning": {"effort": "low"},
                      "text": {"format": {"type": "json_schema", "name": "x",
                                          "schema": {"type": "object"}, "strict": True}},
                      "tools": [{"type": "function", "name": "f", "parameters": {}}],
                      "tool_choice": {"type": "function", "name": "f"},
                      "truncation": "auto", "temperature": 0.5})
    assert body["max_tokens"] == 5 and body["reasoning_effort"] == "low"
    assert body["response_format"]["json_schema"]["name"] == "x"
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["truncate_prompt_tokens"] == -1 and body["temperature"] == 0.5


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "stream": "false"}, "stream"),
    ({"input": "hi", "store": 1}, "store"),
    ({"input": "hi", "background": 1}, "background"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]},
     "input"),
    ({"input": "hi", "truncation": "middle"}, "truncation"),
])
def test_bad_fields_name_themselves(body, param):
    with pytest.raises(RequestError) as error:
        chat_body(body)
    assert error.value.param == param


def test_truncation_keeps_the_side_asked_for_and_one_token_to_generate():
    ids = list(range(10))
    assert truncate_ids(ids, (3, "left"), 100) == ([7, 8, 9], True)
    assert truncate_ids(ids, (3, "right"), 100) == ([0, 1, 2], True)
    assert truncate_ids(ids, (-1, "left"), 8) == (ids[-7:], True)
    assert truncate_ids(ids, (-1, "left"), 8, reserve=1) == (ids[-6:], True)
    assert truncate_ids(ids, (20, "left"), 100) == (ids, False)
    with pytest.raises(RequestError) as error:
        truncate_ids(ids, (101, "left"), 100)
    assert error.value.param == "truncate_prompt_tokens"
