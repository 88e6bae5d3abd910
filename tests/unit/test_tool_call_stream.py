"""Streamed tool calls as OpenAI streams them: a call's first delta names it, later ones carry
its arguments' new text. Each stream is read back by the official ``openai`` client's own
accumulator (``ChatCompletionStreamState``) and compared with the answer the same text gets
whole (``ToolChoice.parse``), for every way of cutting it into pieces tried here."""

from __future__ import annotations

import json
import random

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from quire.tool_call_stream import ToolCallStream
from quire.tool_calls import tool_choice_of
from tests.unit.test_tool_calls import TIME, WEATHER


def _choice(**body):
    return tool_choice_of({"tools": [WEATHER, TIME]} | body)


def _stream(choice, pieces, finish="stop"):
    """(content, [(name, arguments)], deltas) as the openai client accumulates the stream."""
    stream, state, deltas = ToolCallStream(choice), ChatCompletionStreamState(), []
    state.handle_chunk(_chunk({"role": "assistant"}, None))
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        text, calls = stream.feed(piece, finished=last)
        deltas.append(calls)
        delta = ({"content": text} if text else {}) | ({"tool_calls": calls} if calls else {})
        state.handle_chunk(_chunk(delta, choice.finish_reason(stream.calls, finish)
                                  if last else None))
    message = state.current_completion_snapshot.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert len({c.id for c in message.tool_calls or []}) == len(calls)  # ids: one per call
    return message.content or "", calls, deltas


def _chunk(delta: dict, finish: str | None) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def _splits(text: str, seed: int) -> list[list[str]]:
    """The text in single characters, in threes, whole, and in seeded random pieces."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    return [list(text), [text[i:i + 3] for i in range(0, len(text), 3)], [text],
            [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]]


def _value(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # cut short: as far as they came


def _whole(choice, text):
    content, calls = choice.parse(text)
    return content or "", [(c.name, _value(c.arguments)) for c in calls]


HERMES = [
    'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    'Let me check.\n<tool_call>\n{"arguments": {"city": "a}b{\\"c]"}, "name": "get_weather"}'
    '\n</tool_call>',  # arguments first; braces and quotes inside a string
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
    '<tool_call>{"name": "get_time"}</tool_call>',  # no arguments: {}
    '<tool_call>{"name": "get_weather", "parameters": {"city": "Lima", "days": [1, {"x": 2}]}}'
    '</tool_call>',
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # no tool: text
    'a < b and <tool is not a tag',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Bern"}}</tool_call>'
    'trailing words<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
    # what a model may write (the fifth probe): whole and streamed read it alike
    '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>',  # was a 500 whole
    '<tool_call>{"name": {"a": 1}, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call>x</tool_call>"}}'
    '</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}, "arguments": {"city": "B"}}'
    '</tool_call>',
    '<tool_call>{"name": "get_weather", "parameters": {"city": "P"}, "arguments": {"city": "A"}}'
    '</tool_call>',
    '<tool_call>{"\\u006eame": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}}}</tool_call> and more',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Os',  # ended by a stop
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_w',
    # broken blocks end at their tag, and the calls after them are read (the review)
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>',
    '<tool_call>{"name": "get_time", "argu</tool_call><tool_call>{"name": "get_weather"}'
    '</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "{\\"city'
    '</tool_call><tool_call>{"name": "get_time"}</tool_call>',
]


@pytest.mark.parametrize("text", HERMES)
def test_streamed_auto_calls_read_back_as_the_whole_answer(text):
    choice = _choice()
    for seed, pieces in enumerate(_splits(text, seed=len(text))):
        content, calls, _ = _stream(choice, pieces)
        whole = _whole(choice, text)
        assert content == whole[0], (seed, pieces)
        assert [(n, _value(a)) for n, a in calls] == whole[1], (seed, pieces)


def test_auto_arguments_stream_while_the_call_is_written():
    """The call is named as soon as its arguments begin, before its block ends, and its
    arguments come in the pieces the model wrote them in, not whole at the end."""
    text = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
            '"unit": "celsius"}}</tool_call>')
    content, calls, deltas = _stream(_choice(), list(text))
    assert content == "Sure." and calls == [("get_weather",
                                             '{"city": "Oslo", "unit": "celsius"}')]
    first = next(i for i, d in enumerate(deltas) if d)
    assert first == text.index('{"city"')  # announced with the arguments' first character
    announce = deltas[first][0]
    assert announce["function"] == {"name": "get_weather", "arguments": "{"}
    assert announce["id"].startswith("call_") and announce["type"] == "function"
    fragments = [d[0] for d in deltas[first + 1:] if d]
    assert len(fragments) == len('"city": "Oslo", "unit": "celsius"}')
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"}
               for f in fragments)


def test_one_call_only_without_parallel_tool_calls():
    choice = _choice(parallel_tool_calls=False)
    content, calls, _ = _stream(choice, list(HERMES[0]))
    assert content == "Sure." and [n for n, _ in calls] == ["get_weather"]


def test_required_calls_stream_their_parameters_and_read_back_whole():
    choice = _choice(tool_choice="required")
    text = ('[{"name": "get_weather", "parameters": {"city": "Sydney"}}, '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    for pieces in _splits(text, seed=7):
        content, calls, deltas = _stream(choice, pieces)
        assert (content, [(n, json.loads(a)) for n, a in calls]) == _whole(choice, text)
    _, _, deltas = _stream(choice, list(text))
    named = [d[0]["function"]["name"] for d in deltas if d and "id" in d[0]]
    assert named == ["get_weather", "get_time"]
    assert sum(1 for d in deltas if d) > 10  # the parameters came in fragments


def test_a_required_choice_cut_short_streams_its_calls_so_far_never_the_grammar_text():
    choice = _choice(tool_choice="required")
    cut = ('[{"name": "get_weather", "parameters": {"city": "Sydney"}}, '
           '{"name": "get_time", "parameters": {"zone": "U')
    whole = choice.parse(cut)[1]
    for pieces in _splits(cut, seed=3):
        content, calls, _ = _stream(choice, pieces, finish="length")
        assert content == "" and [n for n, _ in calls] == [c.name for c in whole]
        assert json.loads(calls[0][1]) == json.loads(whole[0].arguments)
        assert calls[1][1] == whole[1].arguments == '{"zone": "U'
    for early in ('[{"name": "get_wea', "[", ""):
        assert _stream(choice, [early] if early else [""], finish="length")[:2] == ("", [])


def test_a_named_function_streams_every_piece_as_its_arguments():
    choice = _choice(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    text = '{"city": "Kyiv"}'
    for pieces in _splits(text, seed=5):
        content, calls, deltas = _stream(choice, pieces)
        assert content == "" and calls == [("get_weather", text)]
        assert [d for d in deltas if d][0][0]["function"] == {"name": "get_weather",
                                                              "arguments": pieces[0]}
        assert choice.finish_reason([object()], "stop") == "stop"  # named: stop, as OpenAI


def test_text_that_is_no_call_is_not_held_back_past_a_possible_tag():
    stream = ToolCallStream(_choice())
    assert stream.feed("Hello <tool", finished=False) == ("Hello ", [])
    assert stream.feed("kit", finished=False) == ("<toolkit", [])
    assert stream.feed(" done", finished=True) == (" done", [])


def test_many_calls_cost_linear_time():
    """Each call is looked at until it is settled, not on every piece after (the fifth probe:
    2,000 calls fed a character at a time took 9.4 s). Counted, not timed: the calls looked at
    per piece stay bounded as the output grows."""
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    stream = ToolCallStream(_choice())
    looked: list[int] = []
    for piece in (call * 400):
        stream.feed(piece, finished=False)
        looked.append(len(stream._reader.calls) - stream._settled)
    assert len(stream.calls) == 400 and max(looked) <= 2


@pytest.mark.parametrize("text, names", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', ["get_weather", "get_time"]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}</tool_call>'
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', ["get_weather", "get_time"]),
    ('<tool_call>{"name": "get_time", "argu</tool_call>'
     '<tool_call>{"name": "get_weather"}</tool_call>', ["get_weather"]),
])
def test_a_broken_block_ends_at_its_tag_and_later_calls_are_read(text, names):
    """A block the model broke (an unterminated string, a missing brace) ends at its
    ``</tool_call>``, as vLLM's Hermes parser splits on the tags; it used to swallow every
    call after it. Its arguments stop where the tag begins, and none of the tag is sent."""
    content, calls = _choice().parse(text)
    assert [c.name for c in calls] == names, calls
    assert all("</tool" not in c.arguments and "<tool_call>" not in c.arguments for c in calls)
    _, streamed, deltas = _stream(_choice(), list(text))
    assert [n for n, _ in streamed] == names
    assert not any("<" in d["function"]["arguments"] for ds in deltas for d in ds)
