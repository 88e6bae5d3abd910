"""Tool calling end to end: the official ``openai`` client through the router to an engine
serving the embedded model (SmolLM2, whose template ignores tools: the router writes the
Hermes format into the prompt). A round trip is a call, the tool's result, then an answer."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e.test_structured_outputs import MODEL
from tests.e2e.test_structured_outputs import client as client_fixture
from tests.e2e.test_structured_outputs import engines as engines_fixture
from tests.e2e.test_structured_outputs import router as router_fixture

engines, router, client = engines_fixture, router_fixture, client_fixture

pytestmark = pytest.mark.slow  # the embedded SmolLM2 behind a router

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CONVERT = {"type": "function", "function": {
    "name": "convert_currency", "description": "Convert an amount between currencies",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["amount", "to"],
                   "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 10000},
                                  "to": {"type": "string", "enum": ["EUR", "USD", "JPY"]}}}}}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _round_trip(client, message):
    """The call's result sent back, then the final answer (tools still offered, none used)."""
    messages = QUESTION + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "22 degrees celsius and sunny"}
        for c in message.tool_calls]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="none", max_tokens=24, temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "convert_currency"}}])
def test_enforced_calls_round_trip(client, tool_choice):
    # one call: a small model asked for "one or more" may list calls until max_tokens
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                            tool_choice=tool_choice, max_tokens=80,
                                            temperature=0, parallel_tool_calls=False)
    choice = result.choices[0]
    assert choice.message.content is None, (choice.finish_reason, choice.message.content)
    _check_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert choice.finish_reason == "stop"  # OpenAI's for a named function
        assert [c.function.name for c in choice.message.tool_calls] == \
            [tool_choice["function"]["name"]]
    else:
        assert choice.finish_reason == "tool_calls"
    _round_trip(client, choice.message)


def test_sampled_required_calls_always_parse(client):
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            n=6, temperature=1.0, seed=4, max_tokens=100)
    for choice in result.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


def test_auto_round_trip(client):
    """SmolLM2-135M decides for itself whether to call; either way the answer is well formed,
    and a call it makes is parsed into tool_calls whose arguments validate."""
    result = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Always use a tool."}] + QUESTION,
        tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=0)
    choice = result.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
        _round_trip(client, choice.message)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "convert_currency"}}])
def test_streamed_calls_equal_the_whole_answer(client, tool_choice):
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=80, temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:  # accumulated as the openai client documents it
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": "",
                                                      "pieces": 0})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                call["pieces"] += bool(delta.function.arguments)
            finish = choice.finish_reason or finish
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert finish == whole.finish_reason
    for call in calls.values():  # named once, its arguments streamed as they were written
        assert call["id"].startswith("call_") and call["id"].count("call_") == 1
        assert call["pieces"] > 3, call


@pytest.mark.parametrize("kwargs, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5,
                                               "maximum": 1}}}}}],
      "tool_choice": "required"}, "tools", "cannot be compiled"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]}, "messages",
     "tool_calls"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(client, kwargs, param, words):
    kwargs = {"model": MODEL, "messages": QUESTION, "max_tokens": 5} | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    body = e.value.body
    assert body["param"] == param and words in body["message"], body
