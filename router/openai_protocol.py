"""The OpenAI wire format for the router's HTTP front: request validation (errors name the
field), ``quire.v1`` request building, response/chunk rendering, and the one mapping of errors
to HTTP statuses with an OpenAI-style JSON body.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from quire.limits import DEFAULT_MAX_N, check_n
from quire.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

_HTTP_FOR_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout_error"}
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A bad request body; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_response(error: BaseException) -> web.Response:
    """The one place request errors and gRPC statuses become HTTP errors."""
    param = None
    if isinstance(error, RequestError):
        status, message, param = error.status, str(error), error.param
    elif isinstance(error, grpc.aio.AioRpcError):
        status, message = _HTTP_FOR_GRPC.get(error.code(), 500), error.details() or ""
        message = message or error.code().name
        if status == 400 and ":" in message:  # router/engine messages start with "field: ..."
            param = message.split(":", 1)[0].strip().removeprefix("sampling.") or None
    else:
        logger.exception("internal error in the OpenAI front", exc_info=error)
        status, message = 500, f"internal error: {type(error).__name__}"
    body = {"error": {"message": message, "type": _ERROR_TYPES.get(
                          status, "invalid_request_error" if status < 500 else "internal_error"),
                      "param": param, "code": status}}
    return web.json_response(body, status=status)


# ---- validation -------------------------------------------------------------------------------

def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, *,
            integer: bool = False, lo_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(f"{name}: must be {'an integer' if integer else 'a number'}", name)
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (
            hi is not None and value > hi):
        bound = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
        upper = f"<= {hi}" if hi is not None else ""
        raise RequestError(f"{name}: must be {' and '.join(b for b in (bound, upper) if b)}, "
                           f"got {value}", name)
    return value


def _flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name}: must be a boolean", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop: must be a non-empty string or a list of them", "stop")
    return stops


def token_list(value) -> list[int] | None:
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    return None


def sampling_options(body: dict, *, chat: bool, max_n: int = DEFAULT_MAX_N,
                     max_tokens_limit: int = 0) -> pb.SamplingOptions:
    """``SamplingOptions`` for an OpenAI request body (RequestError naming the bad field).
    ``max_tokens_limit`` 0: no cap here (the engine still bounds it by its max_model_len)."""
    s = pb.SamplingOptions()
    if body.get("n") is not None:
        try:
            s.n = check_n(body["n"], max_n)
        except ValueError as e:
            raise RequestError(str(e), "n") from None
    simple = {"temperature": _number(body, "temperature", 0, 2),
              "top_p": _number(body, "top_p", 0, 1, lo_open=True),
              "min_p": _number(body, "min_p", 0, 1),
              "presence_penalty": _number(body, "presence_penalty", -2, 2),
              "frequency_penalty": _number(body, "frequency_penalty", -2, 2),
              "repetition_penalty": _number(body, "repetition_penalty", 0, lo_open=True),
              "min_tokens": _number(body, "min_tokens", 0, integer=True)}
    for name, value in simple.items():
        if value is not None:
            setattr(s, name, value)
    top_k = _number(body, "top_k", -1, integer=True)
    if top_k is not None:
        s.top_k = max(top_k, 0)  # -1 (vLLM's "off") is 0 here
    seed = _number(body, "seed", -(2 ** 63), 2 ** 64 - 1, integer=True)
    if seed is not None:
        s.seed = seed % 2 ** 64
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _number(body, limit, 1, max_tokens_limit or None, integer=True)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    s.stop[:] = _stop(body)
    if body.get("stop_token_ids") is not None:
        ids = token_list(body["stop_token_ids"])
        if ids is None:
            raise RequestError("stop_token_ids: must be a list of token ids", "stop_token_ids")
        s.stop_token_ids[:] = ids
    s.ignore_eos = bool(_flag(body, "ignore_eos"))
    if chat:
        top = _number(body, "top_logprobs", 0, MAX_LOGPROBS, integer=True)
        if _flag(body, "logprobs"):
            s.logprobs = top or 0
        elif top is not None:
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
    else:
        logprobs = _number(body, "logprobs", 0, MAX_LOGPROBS, integer=True)
        if logprobs is not None:
            s.logprobs = logprobs
        if _flag(body, "echo"):
            raise RequestError("echo: is not supported", "echo")
    return s


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list of messages is required", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise RequestError(f"messages[{i}].role: must be one of {sorted(_ROLES)}", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported",
                                   "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: must be a string", "messages")
        out.append({**message, "content": content or ""})
    return out


# ---- responses --------------------------------------------------------------------------------

@dataclass
class Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class OpenAIRequest:
    """One OpenAI request in flight: its kind, ids and how to render deltas and usage."""

    def __init__(self, body: dict, *, chat: bool, model_name: str,
                 token_text: Callable[[int], str]) -> None:
        self.body, self.chat = body, chat
        self.model_name, self.token_text = model_name, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.stream = bool(_flag(body, "stream"))
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError("stream_options: must be an object", "stream_options")
        self.include_usage = bool(options.get("include_usage"))
        self.want_logprobs = bool(_flag(body, "logprobs")) if chat else (
            body.get("logprobs") is not None)

    def envelope(self, choices: list[dict], *, chunk: bool = False) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.model_name, "choices": choices}

    def logprobs(self, entries) -> dict | None:
        if not self.want_logprobs:
            return None
        token = self.token_text
        if self.chat:
            def item(tid, lp):
                text = token(tid)
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}
            return {"content": [
                {**item(e.token_ids[0], e.logprobs[0]),
                 "top_logprobs": [item(t, lp) for t, lp in zip(e.token_ids[1:], e.logprobs[1:])]}
                for e in entries]}
        return {"tokens": [token(e.token_ids[0]) for e in entries],
                "token_logprobs": [e.logprobs[0] for e in entries],
                "top_logprobs": [{token(t): lp for t, lp in zip(e.token_ids[1:], e.logprobs[1:])}
                                 for e in entries],
                "text_offset": []}

    def choice(self, index: int, text: str, entries, finish: str | None, *,
               chunk: bool, first: bool = False) -> dict:
        body: dict = {"index": index, "logprobs": self.logprobs(entries),
                      "finish_reason": finish}
        if not self.chat:
            body["text"] = text
        elif chunk:
            body["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": text} if text or first else {})
        else:
            body["message"] = {"role": "assistant", "content": text}
        return body


def usage_json(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
