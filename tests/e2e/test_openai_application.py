"""An application written against the OpenAI API (the official ``openai`` client, vLLM's
extra-body fields) runs unchanged against ``quire up``: structured outputs whole and streamed,
a tool-call round trip, embeddings, logit_bias and stop, and vLLM's /tokenize agreeing with
what a chat completion sends. Real processes over loopback; a tiny random model, so every
check is on the shape the API promises (grammar-enforced output parses and validates), never
on what the text says."""

from __future__ import annotations

import json
import math
import re
import signal
import urllib.request

import jsonschema
import pytest

from tests.e2e.test_quire_up import start_up

pytestmark = pytest.mark.slow  # starts a router and an engine process

# bounded: a random model under this grammar always finishes well inside max_tokens
READING = {"type": "object", "properties": {
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "value": {"type": "integer", "minimum": -50, "maximum": 150}},
    "required": ["unit", "value"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "How warm is it in Paris?"}]


@pytest.fixture(scope="module")
def up_url(tiny_model_dir):
    proc, text = start_up(tiny_model_dir, "--num-engines", "1")
    try:
        match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", text)
        assert match, text + (proc.stderr.read()[-2000:] if proc.poll() is not None else "")
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0


@pytest.fixture(scope="module")
def client(up_url):
    import openai

    with openai.OpenAI(base_url=up_url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_structured_output_whole_and_streamed(client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": READING}}
    for seed in range(3):
        result = client.chat.completions.create(model=model, messages=MESSAGES,
                                                response_format=fmt, max_tokens=64, seed=seed)
        assert result.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(result.choices[0].message.content), READING)
    chunks = client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                            response_format=fmt, max_tokens=64, seed=7)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), READING)
    # vLLM's extra-body form of the same, with an option of vLLM's StructuredOutputsParams
    # (Quire's JSON never has free whitespace: json.dumps' spacing exactly)
    result = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=64, seed=11,
        extra_body={"structured_outputs": {"json": READING, "disable_any_whitespace": True}})
    text = result.choices[0].message.content
    assert text == json.dumps(json.loads(text))
    jsonschema.validate(json.loads(text), READING)
    result = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert result.choices[0].message.content in ("yes", "no")


def test_tool_call_round_trip(client, model):
    first = client.chat.completions.create(model=model, messages=MESSAGES,
                                           tools=[WEATHER_TOOL], tool_choice="required",
                                           max_tokens=64)
    calls = first.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
    history = MESSAGES + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": calls[0].id,
                           "content": json.dumps({"celsius": 21})}]
    final = client.chat.completions.create(model=model, messages=history,
                                           tools=[WEATHER_TOOL], tool_choice="none",
                                           max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    without = client.chat.completions.create(model=model, messages=history[:-1],
                                             tools=[WEATHER_TOOL], tool_choice="none",
                                             max_tokens=1)
    assert final.usage.prompt_tokens > without.usage.prompt_tokens  # the result was rendered
    # "none" forbids calls but still shows the tools, as vLLM does by default
    offered = client.chat.completions.create(model=model, messages=history[:-1],
                                             tools=[WEATHER_TOOL], max_tokens=1)
    bare = client.chat.completions.create(model=model, messages=history[:-1], max_tokens=1)
    assert without.usage.prompt_tokens == offered.usage.prompt_tokens > bare.usage.prompt_tokens
    named = client.chat.completions.create(
        model=model, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    jsonschema.validate(json.loads(named.choices[0].message.tool_calls[0].function.arguments),
                        WEATHER_TOOL["function"]["parameters"])


# What a model following the Hermes tool format writes to call get_weather (the tiny random
# model never would unprompted, so a regex makes it; under tool_choice "auto" the router only
# reads the text back, which is what this checks)
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "(Paris|Rome)"\}\}\n</tool_call>')


def test_auto_tool_call_round_trip_whole_and_streamed(client, model):
    # seeded: the whole and the streamed answer are the same sample (the same city)
    kwargs = dict(model=model, messages=MESSAGES, tools=[WEATHER_TOOL], tool_choice="auto",
                  max_tokens=128, seed=4,
                  extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    first = client.chat.completions.create(**kwargs).choices[0]
    assert first.finish_reason == "tool_calls" and not first.message.content
    [call] = first.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    streamed: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:  # accumulated as the openai client documents it
            for delta in choice.delta.tool_calls or ():
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == \
        [("get_weather", json.loads(call.function.arguments))]
    # the tool's result goes back, and the model answers under "auto" again
    history = MESSAGES + [first.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id,
                           "content": json.dumps({"celsius": 21})}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER_TOOL],
                                           tool_choice="auto", max_tokens=8, seed=5)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    before = client.chat.completions.create(model=model, messages=history[:-1],
                                            tools=[WEATHER_TOOL], max_tokens=1)
    assert final.usage.prompt_tokens > before.usage.prompt_tokens  # the result was rendered


def test_embeddings(client, model):
    result = client.embeddings.create(model=model, input=["hello", "a longer sentence"])
    assert [d.index for d in result.data] == [0, 1]
    for item in result.data:  # base64 on the wire (the client's default), floats here
        assert len(item.embedding) == 64
        assert math.isclose(math.fsum(v * v for v in item.embedding), 1.0, rel_tol=1e-4)
    assert result.usage.prompt_tokens > 0


def test_completions_with_logit_bias_stop_and_n(client, model):
    base = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    text = client.completions.create(**base).choices[0].text
    assert len(text) > 2
    cut = client.completions.create(**base, stop=[text[2:4]]).choices[0]
    assert cut.finish_reason == "stop" and text.startswith(cut.text) and len(cut.text) <= 2
    tok = json.loads(_post(client, "/tokenize", {"model": model, "prompt": " the"}))["tokens"]
    forced = client.completions.create(**base, logit_bias={str(tok[-1]): 100})
    assert forced.choices[0].text == " the" * 6
    several = client.completions.create(model=model, prompt="Hi", max_tokens=4, n=2, seed=3)
    assert sorted(c.index for c in several.choices) == [0, 1]


def test_tokenize_agrees_with_chat(client, model):
    counted = json.loads(_post(client, "/tokenize", {"model": model, "messages": MESSAGES}))
    sent = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert sent.usage.prompt_tokens == counted["count"]


def _post(client, path: str, body: dict) -> str:
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(root + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read().decode()
