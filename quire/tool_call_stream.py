"""Streamed tool calls: a choice's text read as it comes, its calls sent as OpenAI streams them
(and vLLM 0.32 does): a call's first delta carries its ``index``, ``id``, ``type`` and
``function.name`` (with the arguments come so far), and each later delta only the arguments'
new text, so a client shows a call as it is written.

The text is read once, character by character (``_CallReader``), so a long call costs the same
per token as a short one. It finds each call's object, its name (a complete JSON string) and
where its arguments' value starts and ends in the text:

- ``"auto"``: Hermes blocks, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; the
  text before the first block is content, held back only while it may be a tag's start.
  A block whose name is no tool of the request is not a call. ``</tool_call>`` ends a block
  wherever it comes, inside a JSON string too (as vLLM's Hermes parser splits on the tags): a
  block broken by the model (an unterminated string, a brace missing) then ends at its tag,
  and the calls after it are read. Arguments are held back while they may end in the tag's
  start. Arguments written as a JSON
  string (``"arguments": "{\\"city\\": ...}"``) go out decoded, once the string closes.
- ``"required"``: the grammar's array of ``{"name": ..., "parameters": ...}`` objects.
- a named function: every character is its arguments.

Arguments are passed on as the model wrote them (their concatenation parses to what the
non-streamed answer holds, which re-serializes them); a choice cut short by ``max_tokens``
leaves its last call's arguments unfinished, as vLLM streams them. The whole answer is what
the stream would have sent (``parse_whole``): a call counts once its name is a tool's and its
arguments have begun, whatever follows them, and a key is read as written (the first
``arguments`` of an object, ``"name"`` spelled without escapes).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from quire.tool_calls import TOOL_CALL_END, TOOL_CALL_START, ToolCall, ToolChoice, _compact

_KEY, _COLON, _VALUE, _STRING, _NESTED, _SCALAR, _AFTER = range(7)


@dataclass(slots=True)
class _Call:
    """One call's object as far as it has been read: absolute offsets into the text."""

    name: str | None = None  # once its string has closed (and decoded)
    args_at: int = -1  # where the arguments' value starts
    args_end: int = -1  # where it ends (-1 while open)
    args_kind: str = ""  # the value's first character: { [ " or a scalar's
    closed: bool = False  # the object has ended
    broken: bool = False  # it ended at </tool_call> before its closing brace
    index: int = -1  # its tool_calls index once announced
    sent: int = 0  # characters of its arguments sent
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class _CallReader:
    """Reads call objects out of text fed in pieces: the objects of a JSON array (``array``)
    or those that follow each ``<tool_call>`` tag (Hermes). ``arguments``: the keys that hold
    a call's arguments."""

    def __init__(self, array: bool, arguments: tuple[str, ...]) -> None:
        self.array, self.arguments = array, arguments
        self.text = ""  # all read so far: offsets are into it
        self.hermes = not array
        self.calls: list[_Call] = []
        self.done = False  # the array closed, or text no call can follow
        self._outside = ""  # Hermes: text since the last object, searched for the next tag
        self._depth = 0  # 0: outside any call object; 1: at a call object's own keys
        self._array_open = False
        self._string = self._escaped = False
        self._state, self._key, self._token_at = _KEY, "", 0

    def feed(self, text: str) -> None:
        at = len(self.text)
        whole, self.text = self.text, ""
        whole += text  # in place: the one reference (a long output stays linear to read)
        self.text = whole
        for i, ch in enumerate(text, at):
            if self.done:
                return
            if self._depth == 0:
                self._between(ch, i)
            elif ch == ">" and self.hermes and self.text.endswith(TOOL_CALL_END, 0, i + 1):
                self._tag_ended(i + 1 - len(TOOL_CALL_END))
            else:
                self._inside(ch, i)

    def _tag_ended(self, tag_at: int) -> None:
        """``</tool_call>`` inside a block's object (in a string or not): the block ends
        there; an open arguments value ends where the tag begins."""
        call = self.calls[-1]
        if call.args_at >= 0 and call.args_end < 0 and call.args_kind in "{[":
            call.args_end = tag_at  # (an open string or scalar is no arguments)
        call.closed = call.broken = True
        self._depth, self._string, self._escaped = 0, False, False
        self._outside = ""

    def _between(self, ch: str, i: int) -> None:
        if self.array:
            if ch.isspace() or (ch == "," and self._array_open):
                return
            if ch == "[" and not self._array_open:
                self._array_open = True
            elif ch == "{" and self._array_open:
                self._open(i)
            else:  # "]" or anything no array of calls holds
                self.done = True
            return
        if self._outside.endswith(TOOL_CALL_START):
            if ch.isspace():
                return
            self._outside = ""
            if ch == "{":
                self._open(i)
                return
        self._outside = (self._outside + ch)[-len(TOOL_CALL_START):]

    def _open(self, i: int) -> None:
        self.calls.append(_Call())
        self._depth, self._state, self._key = 1, _KEY, ""

    def _inside(self, ch: str, i: int) -> None:
        call = self.calls[-1]
        if self._string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._string = False
                if self._depth == 1:
                    self._string_closed(call, i)
            return
        if self._depth == 1 and self._state == _SCALAR and (ch in ",}" or ch.isspace()):
            self._value_ended(call, i)
        if ch == '"':
            self._string = True
            if self._depth == 1:
                if self._state == _VALUE:
                    self._value_started(call, i, _STRING)
                self._token_at = i
        elif ch in "{[":
            if self._depth == 1 and self._state == _VALUE:
                self._value_started(call, i, _NESTED)
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1 and self._state == _NESTED:
                self._value_ended(call, i + 1)
            elif self._depth == 0:
                call.closed = True
        elif self._depth == 1:
            if ch == ":" and self._state == _COLON:
                self._state = _VALUE
            elif ch == ",":
                self._state, self._key = _KEY, ""
            elif not ch.isspace() and self._state == _VALUE:
                self._value_started(call, i, _SCALAR)

    def _string_closed(self, call: _Call, i: int) -> None:
        if self._state == _KEY:
            self._key, self._state = self.text[self._token_at + 1:i], _COLON
        elif self._state == _STRING:
            if self._key == "name" and call.name is None:
                try:
                    name = json.loads(self.text[self._token_at:i + 1])
                except (ValueError, RecursionError):
                    name = None
                call.name = name if isinstance(name, str) else None
            self._value_ended(call, i + 1)

    def _value_started(self, call: _Call, i: int, state: int) -> None:
        self._state = state
        if self._key in self.arguments and call.args_at < 0:
            call.args_at, call.args_kind = i, self.text[i]

    def _value_ended(self, call: _Call, end: int) -> None:
        if self._key in self.arguments and call.args_end < 0 and call.args_at >= 0:
            call.args_end = end
        self._state = _AFTER


class ToolCallStream:
    """One streamed choice of a request with tools: ``feed`` returns the content that may go
    out now and the ``tool_calls`` deltas (OpenAI's shape) that are new."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._names = choice.names  # (a set built once, not per call looked at)
        self.calls: list[_Call] = []  # announced, in index order
        self._settled = 0  # the reader's calls before this one need nothing more
        self._held = ""  # auto, before any call: text that may begin a <tool_call> tag
        self._in_calls = choice.mode != "auto"  # the text is the calls' from here on
        self._reader = None if choice.mode == "named" else _CallReader(
            array=choice.mode == "required",
            arguments=("parameters",) if choice.mode == "required" else ("arguments",
                                                                         "parameters"))

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        out = ""
        if not self._in_calls:  # auto, no call begun yet: the text is content so far
            text = self._held + delta
            start = text.find(TOOL_CALL_START)
            if start < 0:
                end = len(text) if finished else len(text) - _partial_tag(text)
                out, self._held = text[:end], text[end:]
                return out, []
            out, delta, self._held, self._in_calls = text[:start], text[start:], "", True
        if self._reader is None:
            return out, self._named(delta, finished)
        self._reader.feed(delta)
        deltas = self._deltas(finished)
        if finished and not self.calls:
            # no call after all: auto's text was content; required never shows its grammar
            out += self._reader.text if self.choice.mode == "auto" else ""
        return out, deltas

    def _named(self, delta: str, finished: bool) -> list[dict]:
        if not self.calls:
            if not delta and not finished:
                return []
            self.calls.append(_Call(name=self.choice.name, index=0))
            return [self._announce(self.calls[0], delta)]
        return [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def _deltas(self, finished: bool) -> list[dict]:
        text, deltas = self._reader.text, []
        # an open value's last characters may begin </tool_call> (Hermes): not sent yet
        hold = _partial_end(text) if self._reader.hermes and not finished else 0
        calls = self._reader.calls
        for call in calls[self._settled:]:
            if call.index < 0:
                if not self._ready(call) or (not self.choice.parallel and self.calls):
                    continue
                call.index = len(self.calls)
                self.calls.append(call)
                deltas.append(self._announce(call, self._arguments(call, hold)))
            elif call.args_kind in "{[" and call.args_at >= 0:
                end = call.args_end if call.args_end >= 0 else len(text) - hold
                new = text[call.args_at + call.sent:end]
                if new:
                    call.sent += len(new)
                    deltas.append({"index": call.index, "function": {"arguments": new}})
        while self._settled < len(calls) and self._done_with(calls[self._settled]):
            self._settled += 1  # so a long output of many calls costs linear time
        return deltas

    @staticmethod
    def _done_with(call: _Call) -> bool:
        """Nothing more can come of a call: its object has closed, and it went out whole (or
        never will: not a call, or one past the first without parallel calls)."""
        if not call.closed:
            return False
        if call.index < 0 or call.args_at < 0 or call.args_kind not in "{[":
            return True
        return call.args_end >= 0 and call.sent == call.args_end - call.args_at

    def _ready(self, call: _Call) -> bool:
        """A call goes out once its name is a tool's and its arguments have begun (a string's
        or a scalar's once whole, being sent decoded / whole), or its object closed without
        any (as ``{}``)."""
        if call.name is None or call.name not in self._names:
            return False
        if call.args_at < 0:
            return call.closed and not call.broken
        return call.args_kind in "{[" or call.args_end >= 0

    def _arguments(self, call: _Call, hold: int) -> str:
        """What has come of a call's arguments, as it is announced (the rest follows)."""
        if call.args_at < 0:
            return "{}"
        text = self._reader.text
        raw = text[call.args_at:call.args_end if call.args_end >= 0 else len(text) - hold]
        call.sent = len(raw)
        if call.args_kind == '"':
            try:
                return json.loads(raw)
            except (ValueError, RecursionError):
                return raw
        return raw

    @staticmethod
    def _announce(call: _Call, arguments: str) -> dict:
        return {"index": call.index, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": arguments}}


def parse_whole(choice: ToolChoice, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output, as its stream would have sent them: the content
    before the first call as it came (None when empty; as vLLM's Hermes parser leaves it, and
    as the stream sent it), each call's arguments re-serialized where
    they parse; with no call, auto's text whole as content (required: "", never the grammar's
    array)."""
    stream = ToolCallStream(choice)
    content, deltas = stream.feed(text, finished=True)
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        arguments.setdefault(delta["index"], []).append(delta["function"]["arguments"])
    calls = [ToolCall(call.name, _compact("".join(arguments.get(call.index, ()))), id=call.id)
             for call in stream.calls]
    if not calls:
        return content, []
    return (content or None) if choice.mode == "auto" else None, calls


def _partial_tag(text: str, tag: str = TOOL_CALL_START) -> int:
    """How many trailing characters of ``text`` may begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _partial_end(text: str) -> int:
    return _partial_tag(text, TOOL_CALL_END)
