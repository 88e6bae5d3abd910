"""OpenAI's Responses API on the router's HTTP front, read by the official ``openai`` client:
the same answers as the chat completion each request means, streamed as the events the client
assembles, with function tools and structured output. Real router + two real engines."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.e2e import test_router_openai as base

engines, router, front, client = base.engines, base.router, base.front, base.client
MODEL, _http = base.MODEL, base._http
QUESTION = "Name a colour."
# short whatever the (random tiny) model picks, so its calls end within a few tokens
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast",
          "parameters": WEATHER}]


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          **kwargs)


def test_a_response_is_the_chat_completion_it_means(client):
    """Greedy: the text and token counts equal chat's for the same conversation (instructions
    as a system message first), whole and streamed; a cut answer is incomplete."""
    answer = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                     max_output_tokens=8, temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": QUESTION}], max_tokens=8)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert (answer.status == "incomplete") == (chat.choices[0].finish_reason == "length")
    if answer.status == "incomplete":
        assert answer.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer.output_text == events[-1].response.output_text
    with client.responses.stream(model=MODEL, input=QUESTION, instructions="Be brief.",
                                 max_output_tokens=8, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == answer.output_text
    assert final.usage.output_tokens == answer.usage.output_tokens


def test_input_items_carry_the_conversation(client):
    """Messages with text parts, in order, as chat's messages."""
    items = [{"role": "developer", "content": "Answer in one word."},
             {"role": "user", "content": [{"type": "input_text", "text": "Sky colour?"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "And grass?"}]
    answer = client.responses.create(model=MODEL, input=items, max_output_tokens=6,
                                     temperature=0)
    chat = _chat(client, [{"role": "developer", "content": "Answer in one word."},
                          {"role": "user", "content": "Sky colour?"},
                          {"role": "assistant", "content": "Blue."},
                          {"role": "user", "content": "And grass?"}], max_tokens=6)
    assert answer.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_round_trip(client, stream):
    """tool_choice required: the answer is function_call items whose arguments validate;
    their output goes back as function_call_output, and the next answer reads it."""
    kwargs = dict(model=MODEL, input="Weather in Paris for 2 days?", tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                  temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        answer = events[-1].response
        deltas = "".join(e.delta for e in events
                         if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done and deltas == "".join(e.arguments for e in done)
    else:
        answer = client.responses.create(**kwargs)
    calls = [item for item in answer.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    follow = client.responses.create(
        model=MODEL, tools=TOOLS, max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Weather in Paris for 2 days?"},
               *[c.model_dump(exclude_none=True) for c in calls],
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 20 C."}])
    assert follow.output and follow.output[-1].type in ("message", "function_call")
    named = client.responses.create(**kwargs | {"tool_choice": {"type": "function",
                                                                 "name": "get_weather"}})
    assert [item.name for item in named.output if item.type == "function_call"] == \
        ["get_weather"]


def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string",
                                                          "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    answer = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(answer.output_text), schema)


@pytest.mark.parametrize("body, param", [
    ({"input": QUESTION, "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": QUESTION, "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": QUESTION, "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": QUESTION, "temperature": -1}, "temperature"),
    ({"input": QUESTION, "frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_are_400s_naming_the_responses_field(front, body, param):
    status, text = _http(front, "POST", "/v1/responses", {"model": MODEL, **body})
    answer = json.loads(text)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_the_official_client_raises_its_bad_request_error(client):
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=MODEL, input=QUESTION, background=True, store=False)
