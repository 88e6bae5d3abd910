"""Hostile input, sixth round: what a probe of a running stack found (thirty-first session),
against the third round's stack (a real router with API keys and a real tiny-model engine on
loopback). Each was a 500 or a 400 blaming the wrong thing; none stopped other requests."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tests.e2e import test_hostile_input_3 as hostile_3

engines, router = hostile_3.engines, hostile_3.router
post, assert_400, no_tracebacks = hostile_3.post, hostile_3.assert_400, hostile_3.no_tracebacks
MODEL, USER = hostile_3.MODEL, hostile_3.USER


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/embeddings"])
@pytest.mark.parametrize("role", [{"a": 1}, ["user"]])
def test_a_role_that_is_not_a_string_is_a_400(router, caplog, path, role):
    """An object or list role was looked up in a set: 500 (unhashable type)."""
    status, body = post(router, path, {"model": MODEL,
                                       "messages": [{"role": role, "content": "hi"}]} |
                        ({"max_tokens": 2} if "chat" in path else {}))
    assert_400(status, body, "messages", "messages[0].role")
    assert no_tracebacks(caplog)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/embeddings"])
def test_an_escaped_lone_surrogate_in_earlier_arguments_is_served(router, caplog, path):
    """A call's arguments whose JSON escapes a lone surrogate decoded to text no tokenizer
    takes (500): such arguments are now written as sent (the JSON text, which is fine)."""
    conversation = [{"role": "user", "content": "q"},
                    {"role": "assistant", "tool_calls": [{
                        "id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    body = {"model": MODEL, "messages": conversation} | (
        {"max_tokens": 2} if "chat" in path else {})
    status, answer = post(router, path, body)
    assert status == 200, answer
    assert no_tracebacks(caplog)


def test_required_tools_with_definitions_are_enforced_not_refused(router):
    """Pydantic-style parameters (local ``$defs`` and ``definitions``) under
    ``tool_choice: "required"``: their definitions move to the root of the calls' schema, as
    vLLM moves them, so the refs resolve (before: 400 "Cannot find field '$defs'")."""
    location = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
                "required": ["loc"], "$defs": {"Loc": {
                    "type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False}}}
    count = {"type": "object", "properties": {"n": {"$ref": "#/definitions/N"}},
             "required": ["n"], "definitions": {"N": {"type": "integer", "minimum": 0}}}
    tools = [{"type": "function", "function": {"name": "where", "parameters": location}},
             {"type": "function", "function": {"name": "count", "parameters": count}}]
    status, answer = post(router, "/v1/chat/completions", {
        "model": MODEL, "messages": USER, "max_tokens": 60, "tools": tools,
        "tool_choice": "required", "temperature": 0, "parallel_tool_calls": False})
    assert status == 200, answer
    calls = answer["choices"][0]["message"].get("tool_calls") or []
    schemas = {"where": location, "count": count}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            schemas[call["function"]["name"]])
    clash = [tools[0], {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/Loc"}},
        "$defs": {"Loc": {"type": "string"}}}}}]
    status, answer = post(router, "/v1/chat/completions", {
        "model": MODEL, "messages": USER, "max_tokens": 4, "tools": clash,
        "tool_choice": "required"})
    assert_400(status, answer, "tools", "$defs/Loc")


@pytest.mark.parametrize("defs", ["x", [1], 5])
def test_required_tools_with_malformed_definitions_are_a_400(router, caplog, defs):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": defs}}}]
    status, answer = post(router, "/v1/chat/completions", {
        "model": MODEL, "messages": USER, "max_tokens": 4, "tools": tools,
        "tool_choice": "required"})
    assert_400(status, answer, "tools", "$defs must be an object")
    assert no_tracebacks(caplog)


def test_one_token_id_input_longer_than_the_input_cap_is_one_input(router):
    """A flat list of ids is one input, bounded by the model's length, not by the 2,048-input
    cap of a list of inputs."""
    status, answer = post(router, "/v1/embeddings", {"model": MODEL, "input": [5] * 3000})
    assert status == 200 or "inputs" not in answer["error"]["message"], answer
    status, answer = post(router, "/v1/embeddings", {"model": MODEL, "input": [5] * 3000,
                                                     "truncate_prompt_tokens": 100})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 100, answer


def test_tools_and_call_arguments_count_toward_the_prompt_limit(router):
    """--max-prompt-chars bounds what is rendered before any tokenizing: the tools' JSON and
    earlier calls' arguments too (before, megabytes of either were rendered and tokenized for
    seconds, then refused naming messages)."""
    limit = router.server.cfg.max_prompt_chars
    tools = [{"type": "function", "function": {"name": "f",
                                               "description": "word " * (limit // 5 + 1)}}]
    started = time.monotonic()
    status, answer = post(router, "/v1/chat/completions", {"model": MODEL, "messages": USER,
                                                           "tools": tools})
    assert_400(status, answer, "tools", f"at most {limit} characters")
    calls = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function",
        "function": {"name": "f", "arguments": json.dumps({"a": "word " * (limit // 5)})}}]}]
    status, answer = post(router, "/tokenize", {"model": MODEL, "messages": calls})
    assert_400(status, answer, "messages", "arguments included")
    assert time.monotonic() - started < 60  # (refused before rendering: well under a second)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": "hi", "encoding_format": ""}, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": False}, "encoding_format"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {
        "continue_final_message": True}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"self": 1}},
     "chat_template_kwargs"),
])
def test_loosely_typed_fields_are_400s_naming_them(router, caplog, path, body, param):
    status, answer = post(router, path, {"model": MODEL, **body})
    assert_400(status, answer, param)
    assert no_tracebacks(caplog)
