"""Tool calling in the router: checks, grammars, Hermes parsing (whole and streamed) and
rendering through the embedded model's template, which ignores tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from quire.errors import FieldError
from quire.tool_calls import render_inputs, tool_choice_of
from quire.tokenizer import FastTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def _choice(**body):
    return tool_choice_of({"tools": [WEATHER, TIME]} | body)


def test_auto_parses_hermes_calls_and_keeps_leading_text():
    choice = _choice()
    assert choice.mode == "auto" and choice.schema() is None
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = choice.parse(text)
    assert content == "Let me check.\n"  # as it came, as vLLM's Hermes parser leaves it
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert choice.finish_reason(calls, "stop") == "tool_calls"
    single = _choice(parallel_tool_calls=False)
    assert len(single.parse(text)[1]) == 1
    # unknown names and broken JSON are text, not calls
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 "<tool_call>{not json</tool_call>", "plain answer"):
        assert choice.parse(text) == (text, [])


def test_required_and_named_grammars_accept_what_they_parse():
    required = _choice(tool_choice="required", parallel_tool_calls=False)
    schema = required.schema()
    output = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    jsonschema.validate(json.loads(output), schema)
    with pytest.raises(jsonschema.ValidationError):  # at most one call, named as a tool
        jsonschema.validate(json.loads(output[:-1] + ', {"name": "get_time", '
                                       '"parameters": {}}]'), schema)
    content, calls = required.parse(output)
    assert content is None and calls[0].name == "get_weather"
    assert required.finish_reason(calls, "stop") == "tool_calls"
    named = _choice(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.schema() == WEATHER["function"]["parameters"]
    content, calls = named.parse('{"city": "Rome"}')
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert named.finish_reason(calls, "stop") == "stop"


@pytest.mark.parametrize("body, field", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools"),
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_name_the_field(body, field):
    with pytest.raises(FieldError) as e:
        tool_choice_of(body)
    assert e.value.field == field


def test_none_and_no_tools_use_no_tools():
    assert tool_choice_of({}) is None
    assert tool_choice_of({"tools": [WEATHER], "tool_choice": "none"}) is None


def test_rendering_without_template_support_writes_the_hermes_format(embedded_model_dir):
    tokenizer = FastTokenizer.from_dir(embedded_model_dir)
    assert "tools" not in tokenizer.chat_template  # SmolLM2's template ignores tools
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    rendered, tools = render_inputs(messages, _choice().tools, tokenizer.chat_template)
    assert tools is None
    text = tokenizer.apply_chat_template(rendered)
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_templates_that_read_tools_get_them():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }}){% endfor %}"
                "{% endfor %}")
    tokenizer = FastTokenizer(None, digest="", special_tokens={}, chat_template=template)
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Oslo"}'}}]}]
    rendered, tools = render_inputs(messages, _choice().tools, template)
    assert tokenizer.apply_chat_template(rendered, tools=tools) == \
        "[get_weather][get_time]assistant:(Oslo)"


def test_a_required_choice_cut_short_returns_its_calls_so_far_never_the_grammar_text():
    """max_tokens ending a "required" array mid-call: the complete calls, then the cut one's
    name and its arguments as far as they came (as vLLM answers; streamed in
    test_tool_call_stream.py); cut
    before any name is complete: no call and empty content, not the raw array."""
    required = _choice(tool_choice="required")
    cut = ('[{"name": "get_weather", "parameters": {"city": "Sydney"}}, '
           '{"name": "get_time", "parameters": {"zone": "U')
    content, calls = required.parse(cut)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Sydney"}'), ("get_time", '{"zone": "U')]
    assert required.finish_reason(calls, "length") == "length"
    for early in ('[{"name": "get_wea', "[", ""):
        assert required.parse(early) == ("", [])
