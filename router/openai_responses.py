"""OpenAI's Responses API (``POST /v1/responses``), as vLLM serves it, on the router's HTTP
front. A request is translated into the chat completion it means and served by the chat path
(the same template, tools, grammars, flow control and placement):

- ``input`` (a string, or items: messages with text parts, ``function_call`` and
  ``function_call_output``) and ``instructions`` (a system message first) become ``messages``;
- ``tools`` (function tools, flat as the Responses API writes them), ``tool_choice`` and
  ``parallel_tool_calls`` become chat's; ``text.format`` becomes ``response_format``;
  ``max_output_tokens`` ``max_tokens``; ``reasoning.effort`` ``reasoning_effort``;
  ``truncation: "auto"`` vLLM's ``truncate_prompt_tokens: -1``.

The answer is a Response object (``output``: a message with its ``output_text``, then one
``function_call`` item per call), or streamed as the Responses events the official client reads
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).
``store`` (default true, as OpenAI's) keeps the answer in the router's store
(``router.responses_store``) for ``previous_response_id``, ``GET`` / ``DELETE`` and
``background`` responses (``router.openai_responses_serve``); ``include`` and the hosted
features are refused unless off. Errors name the Responses field.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable

import grpc
from aiohttp import web

from quire.tool_call_stream import ToolCallStream
from quire.v1 import engine_pb2 as pb
from router.openai_answer import messages_of
from router.openai_protocol import RequestError, shown

_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "seed", "priority", "logit_bias",
           "cache_salt", "parallel_tool_calls", "user", "metadata", "service_tier",
           "prompt_cache_key", "safety_identifier")
# Accepted only where they ask for nothing this server would have to keep or run.
_OFF = {"include": lambda v: v in (None, []),
        "conversation": lambda v: v is None,
        "prompt": lambda v: v is None,
        "max_tool_calls": lambda v: v is None,
        "top_logprobs": lambda v: v in (None, 0)}
RESPONSES_FIELDS = frozenset(_PASSED) | frozenset(_OFF) | {
    "input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "reasoning",
    "stream", "stream_options", "store", "truncation", "previous_response_id", "background"}
# chat's name of a field -> the Responses request's
ALIASES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
           "structured_outputs.json": "text", "reasoning_effort": "reasoning",
           "truncate_prompt_tokens": "truncation", "prompt": "input", "token_ids": "input"}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


def chat_body(body: dict, history: list[dict] | None = None) -> dict:
    """The chat completion ``body`` (a Responses request) means, after the conversation
    ``history`` (a stored response's, for ``previous_response_id``); RequestError naming the
    Responses field."""
    for name, off in _OFF.items():
        if name in body and not off(body[name]):
            raise RequestError(f"{name}: is not supported by this server, got "
                               f"{shown(body[name])}", name)
    _check_echoed(body)
    out = {name: body[name] for name in _PASSED if name in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions: must be a string", "instructions")
    system = [] if instructions is None else [{"role": "system", "content": instructions}]
    out["messages"] = system + list(history or ()) + input_messages(body)
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    # "auto" is the Responses default, which clients send with no tools too (as OpenAI's and
    # vLLM's take it); chat's check wants a tool for it
    if body.get("tool_choice") is not None and (body.get("tools") or
                                                body["tool_choice"] != "auto"):
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        out["response_format"] = fmt
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise RequestError("reasoning: must be an object", "reasoning")
        if reasoning.get("effort") is not None:
            out["reasoning_effort"] = reasoning["effort"]
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise RequestError(f"truncation: must be auto or disabled, got {shown(truncation)}",
                           "truncation")
    if truncation == "auto":
        out["truncate_prompt_tokens"] = -1
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or
                                not set(options) <= {"include_obfuscation"}):
        raise RequestError("stream_options: must be an object with at most "
                           "include_obfuscation", "stream_options")
    for name in ("store", "stream", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestError(f"{name}: must be a boolean, got {shown(body[name])}", name)
    return out


def _text(content, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or \
                not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}]: only text parts (input_text, output_text) are "
                               "supported", "input")
        texts.append(part["text"])
    return "\n".join(texts)  # as chat's parts (and vLLM's)


def input_messages(body: dict) -> list[dict]:
    """The chat messages of the request's ``input`` (without its ``instructions``)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    if not isinstance(items, list) or not items:
        raise RequestError("input: must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": item["role"],
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"),
                                                     item.get("arguments"))):
                raise RequestError(f"{where}: a function_call has string call_id, name and "
                                   "arguments", "input")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and i > 0 and \
                    (isinstance(items[i - 1], dict) and items[i - 1].get("role") ==
                     "assistant" or "tool_calls" in last):
                # the calls of one turn, with its text: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id: must be a string", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: chat templates leave it out too
        else:
            raise RequestError(f"{where}: must be a message (role user, system, developer or "
                               "assistant), a function_call or a function_call_output",
                               "input")
    return messages


def input_items(body: dict) -> list[dict]:
    """The request's ``input`` as ``/input_items`` lists it: items with their type and an id,
    message content as parts (the request was checked by ``input_messages``)."""
    items = body["input"]
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out, seen = [], set()
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                item["content"] = [{"type": "output_text", "text": item["content"],
                                    "annotations": []} if item.get("role") == "assistant"
                                   else {"type": "input_text", "text": item["content"]}]
            item.setdefault("status", "completed")
        # a client's id is kept where it can page: a string none of the others has
        if not isinstance(item.get("id"), str) or not item["id"] or item["id"] in seen:
            item["id"] = f"{_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"
        seen.add(item["id"])
        out.append(item)
    return out


def answer_message(output: list[dict]) -> dict:
    """A response's output items as the chat message that continues its conversation: its
    text, and its function calls as ``tool_calls``."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _check_echoed(body: dict) -> None:
    """What the answer echoes as sent must be JSON that strict parsers read: no NaN or
    Infinity anywhere (Python's parser takes them; JSON has none, so openai-node or Go would
    fail on the answer), ``user`` a string and ``metadata`` an object of strings (OpenAI's:
    at most 16, keys of 64 characters, values of 512)."""
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"user: must be a string, got {shown(body['user'])}", "user")
    metadata = body.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16 and all(
                len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
        raise RequestError("metadata: must be an object of at most 16 strings (keys of at "
                           "most 64 characters, values of at most 512)", "metadata")
    stack: list[tuple[str, object]] = [(k, v) for k, v in body.items()]
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"{where}: must be a finite number, got {shown(value)}",
                               where.split(".")[0].split("[")[0])
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise RequestError("tools: must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"tools[{i}]: only function tools are supported, got "
                               f"{shown(tool)}", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise RequestError(f'tool_choice: must be "auto", "none", "required" or {{"type": '
                       f'"function", "name": ...}}, got {shown(choice)}', "tool_choice")


def _format(text) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or not (fmt is None or isinstance(fmt, dict)):
        raise RequestError("text: must be an object with a format object", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise RequestError(f"text.format.type: must be text, json_object or json_schema, got "
                       f"{shown(fmt.get('type'))}", "text")


def renamed(error: Exception) -> Exception:
    """A chat-side RequestError named as the Responses request names its field."""
    if isinstance(error, RequestError) and error.param in ALIASES:
        alias = ALIASES[error.param]
        message = str(error)
        if message.startswith(error.param):
            message = alias + message[len(error.param):]
        return RequestError(message, alias, error.status)
    return error


def _usage(usage: pb.Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            # what the prefix cache held, and what this prompt added to it
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": usage.prompt_tokens -
                                     usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class ResponsesAnswer:
    """One Responses request's answer: whole (``collect``) or as events (``stream``). ``req``
    is the chat request it was served as (its tools say how calls are read)."""

    def __init__(self, body: dict, req, model_name: str, store: bool = False) -> None:
        self.body, self.req, self.model_name, self.store = body, req, model_name, store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._sequence = 0
        # called with the finished Response object before it is answered (the store keeps it)
        self.on_final: Callable[[dict], object] | None = None

    def response(self, status: str, output: list[dict], usage: dict | None = None,
                 finish: int = 0) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} \
            if finish == pb.FINISH_REASON_LENGTH else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": "incomplete" if incomplete else status, "error": None,
            "incomplete_details": incomplete, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": self.model_name,
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning"), "store": self.store,
            "background": body.get("background") is True,
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation") or "disabled",
            "usage": usage, "user": body.get("user"), "metadata": body.get("metadata") or {}}

    @staticmethod
    def message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status,
                "role": "assistant", "content": [] if status != "completed" else [
                    {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    async def collect(self, call, first, account: Callable[[pb.Usage], None]) -> web.Response:
        return web.json_response(await self.result(call, first, account))

    async def result(self, call, first, account: Callable[[pb.Usage], None]) -> dict:
        """The finished Response object."""
        texts, finish, usage = [], 0, pb.Usage()
        async for message in messages_of(call, first):
            for delta in message.outputs:
                texts.append(delta.text)
                finish = delta.finish_reason or finish
            if message.HasField("usage"):
                usage = message.usage
        account(usage)
        text = "".join(texts)
        content, calls = self.req.tools.parse(text) if self.req.tools else (text, [])
        output = [] if calls and not content else [self.message_item(content or "")]
        output += [self.call_item(c.id, c.name, c.arguments) for c in calls]
        return self._finished(self.response("completed", output, _usage(usage), finish))

    def _finished(self, final: dict) -> dict:
        if self.on_final is not None:
            self.on_final(final)
        return final

    def _event(self, kind: str, **fields) -> bytes:
        self._sequence += 1
        payload = {"type": kind, "sequence_number": self._sequence - 1, **fields}
        return (f"event: {kind}\ndata: "
                f"{json.dumps(payload, separators=(',', ':'))}\n\n").encode()

    async def stream(self, request: web.Request, call, first,
                     account: Callable[[pb.Usage], None]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(self._event("response.created",
                                         response=self.response("in_progress", []))
                             + self._event("response.in_progress",
                                           response=self.response("in_progress", [])))
        out = _StreamedOutput(self)
        tools = ToolCallStream(self.req.tools) if self.req.tools else None
        finish, usage = 0, pb.Usage()
        try:
            async for message in messages_of(call, first):
                chunks = []
                for delta in message.outputs:
                    finish = delta.finish_reason or finish
                    text, calls = (delta.text, []) if tools is None else tools.feed(
                        delta.text, finished=bool(delta.finish_reason))
                    chunks += out.text(text) + out.calls(calls)
                if message.HasField("usage"):
                    usage = message.usage
                if chunks:
                    await response.write(b"".join(chunks))
        except grpc.aio.AioRpcError as e:  # headers are gone: the error is an event
            await response.write(self._event("error", code=e.code().name,
                                             message=e.details() or "", param=None))
            await response.write_eof()
            return response
        except ConnectionResetError:
            return response  # the client left; the front's finally cancels the call
        account(usage)
        closing = b"".join(out.close())  # every item done: out.items is the whole output
        final = self._finished(self.response("completed", out.items, _usage(usage), finish))
        await response.write(closing + self._event("response.completed", response=final))
        await response.write_eof()
        return response


class _StreamedOutput:
    """The output items of a streamed answer, as events: the message (opened at its first
    text, closed when a call begins or the answer ends), then each call."""

    def __init__(self, answer: ResponsesAnswer) -> None:
        self.answer = answer
        self.items: list[dict] = []  # done items, in output order
        self._message: dict | None = None  # the open message item
        self._text: list[str] = []
        self._calls: dict[int, dict] = {}  # call index -> its open item
        self._index: dict[int, int] = {}  # call index -> output index

    def _open_message(self) -> list[bytes]:
        event = self.answer._event
        self._message = ResponsesAnswer.message_item("", status="in_progress")
        return [event("response.output_item.added", output_index=len(self.items),
                      item=self._message),
                event("response.content_part.added", item_id=self._message["id"],
                      output_index=len(self.items), content_index=0,
                      part={"type": "output_text", "text": "", "annotations": []})]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        out = self._open_message() if self._message is None else []
        self._text.append(text)
        return out + [self.answer._event(
            "response.output_text.delta", item_id=self._message["id"],
            output_index=len(self.items), content_index=0, delta=text, logprobs=[])]

    def _close_message(self) -> list[bytes]:
        if self._message is None:
            return []
        event, text = self.answer._event, "".join(self._text)
        item = self._message | {"status": "completed", "content": [
            {"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
        index = len(self.items)
        self.items.append(item)
        self._message = None
        return [event("response.output_text.done", item_id=item["id"], output_index=index,
                      content_index=0, text=text, logprobs=[]),
                event("response.content_part.done", item_id=item["id"], output_index=index,
                      content_index=0, part=item["content"][0]),
                event("response.output_item.done", output_index=index, item=item)]

    def calls(self, deltas: list[dict]) -> list[bytes]:
        event, out = self.answer._event, []
        for delta in deltas:
            k = delta["index"]
            if k not in self._calls:
                out += self._close_message()
                function = delta["function"]
                item = ResponsesAnswer.call_item(delta["id"], function["name"], "",
                                                 status="in_progress")
                self._calls[k], self._index[k] = item, len(self.items) + len(self._calls)
                out.append(event("response.output_item.added", output_index=self._index[k],
                                 item=item))
            arguments = delta["function"].get("arguments") or ""
            if arguments:
                self._calls[k]["arguments"] += arguments
                out.append(event("response.function_call_arguments.delta",
                                 item_id=self._calls[k]["id"], output_index=self._index[k],
                                 delta=arguments))
        return out

    def close(self) -> list[bytes]:
        """The events that end every open item (a message with no text at all, when the
        answer made neither text nor calls)."""
        event = self.answer._event
        if self._message is None and not self._calls and not self.items:
            return self._open_message() + self._close_message()
        out = self._close_message()
        for k, item in sorted(self._calls.items(), key=lambda kv: self._index[kv[0]]):
            item = item | {"status": "completed"}
            self.items.append(item)
            out += [event("response.function_call_arguments.done", item_id=item["id"],
                          output_index=self._index[k], name=item["name"],
                          arguments=item["arguments"]),
                    event("response.output_item.done", output_index=self._index[k],
                          item=item)]
        self._calls = {}
        return out
