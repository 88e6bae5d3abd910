"""An OpenAI-compatible HTTP front for the router (aiohttp): completions, chat, models, health.

Every generation goes through the router's own gRPC ``Generate`` over a loopback channel, so
placement, retries and the engine path are the one code path gRPC clients use; this module only
translates JSON <-> ``quire.v1`` messages. Chat renders the model's template here and sends
token ids. Request errors and gRPC statuses become HTTP errors with an OpenAI-style JSON body,
mapped in ``_error_response`` alone.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc

logger = logging.getLogger(__name__)

_HTTP_FOR_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout_error"}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A bad request body; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def _error_response(error: BaseException) -> web.Response:
    """The one place request errors and gRPC statuses become HTTP errors."""
    param = None
    if isinstance(error, RequestError):
        status, message, param = error.status, str(error), error.param
    elif isinstance(error, grpc.aio.AioRpcError):
        status, message = _HTTP_FOR_GRPC.get(error.code(), 500), error.details() or ""
        message = message or error.code().name
        if status == 400 and ":" in message:  # router/engine messages start with "field: ..."
            param = message.split(":", 1)[0].strip() or None
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


def _token_list(value) -> list[int] | None:
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    return None


def sampling_options(body: dict, *, chat: bool) -> pb.SamplingOptions:
    """``SamplingOptions`` for an OpenAI request body (RequestError naming the bad field)."""
    s = pb.SamplingOptions()
    simple = {"n": _number(body, "n", 1, 128, integer=True),
              "temperature": _number(body, "temperature", 0, 2),
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
    max_tokens = _number(body, limit, 1, integer=True)
    if max_tokens is not None:
        s.max_tokens = max_tokens
    s.stop[:] = _stop(body)
    if body.get("stop_token_ids") is not None:
        ids = _token_list(body["stop_token_ids"])
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


def _chat_messages(body: dict) -> list[dict]:
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
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


class _Request:
    """One OpenAI request in flight: its kind, ids and how to render deltas and usage."""

    def __init__(self, front: OpenAIFront, body: dict, *, chat: bool) -> None:
        self.front, self.body, self.chat = front, body, chat
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
                "model": self.front.model_name, "choices": choices}

    def logprobs(self, entries) -> dict | None:
        if not self.want_logprobs:
            return None
        token = self.front.token_text
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


def _usage(usage: pb.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


# ---- the server -------------------------------------------------------------------------------

class OpenAIFront:
    """Start with ``await start()`` (returns the port) on the router's loop; ``await stop()``."""

    def __init__(self, router_server, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 *, request_timeout_s: float | None = None) -> None:
        self.router = router_server
        self.model_name = model_name
        self.host, self.port = host, port
        self.request_timeout_s = request_timeout_s
        self.counts: Counter[tuple[str, int]] = Counter()
        self.tokens: Counter[str] = Counter()
        self._runner: web.AppRunner | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None

    @property
    def tokenizer(self):
        return self.router.servicer.tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.backend.decode([token_id], skip_special_tokens=False)

    async def start(self) -> int:
        if self.router.servicer is None:
            raise RuntimeError("start the router before its OpenAI front")
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.router.port}")
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        app = web.Application(middlewares=[self._count])
        app.add_routes([web.post("/v1/completions", self._completions),
                        web.post("/v1/chat/completions", self._chat),
                        web.get("/v1/models", self._models), web.get("/health", self._health),
                        web.get("/metrics", self._metrics)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        logger.info("OpenAI API serving on http://%s:%d/v1", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._channel is not None:
            await self._channel.close()

    @web.middleware
    async def _count(self, request: web.Request, handler):
        try:
            response = await handler(request)
        except web.HTTPException as e:  # unknown path, wrong method: still a JSON body
            response = _error_response(RequestError(f"{request.method} {request.path}: "
                                                    f"{e.reason}", None, e.status))
        resource = request.match_info.route.resource
        self.counts[(resource.canonical if resource else "other", response.status)] += 1
        return response

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "quire"}]})

    async def _health(self, request: web.Request) -> web.Response:
        healthy = sum(c.healthy for c in self.router.clients)
        return web.json_response({"healthy_engines": healthy}, status=200 if healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# TYPE quire_http_requests_total counter"]
        lines += [f'quire_http_requests_total{{path="{p}",status="{s}"}} {n}'
                  for (p, s), n in sorted(self.counts.items())]
        lines.append("# TYPE quire_http_tokens_total counter")
        lines += [f'quire_http_tokens_total{{kind="{k}"}} {n}'
                  for k, n in sorted(self.tokens.items())]
        lines += ["# TYPE quire_healthy_engines gauge",
                  f"quire_healthy_engines {sum(c.healthy for c in self.router.clients)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        call = None
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise RequestError(f"body: not valid JSON ({e})") from None
            if not isinstance(body, dict):
                raise RequestError("body: must be a JSON object")
            req = _Request(self, body, chat=chat)
            call = self._stub.Generate(self._generate_request(req), timeout=self.request_timeout_s)
            first = await call.read()  # errors before any output keep their HTTP status
            if req.stream:
                return await self._stream(request, req, call, first)
            return await self._collect(req, call, first)
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return _error_response(e)
        finally:
            if call is not None:
                call.cancel()  # no-op once finished; aborts the engine request otherwise

    def _generate_request(self, req: _Request) -> pb.GenerateRequest:
        body = req.body
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"model: the model `{model}` does not exist", "model", 404)
        out = pb.GenerateRequest(request_id=req.id, sampling=sampling_options(body, chat=req.chat))
        if req.chat:
            messages = _chat_messages(body)
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            out.token_ids.ids[:] = self.tokenizer.encode(text, add_special_tokens=False)
            return out
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            out.text = prompt
        elif (ids := _token_list(prompt)) is not None:
            out.token_ids.ids[:] = ids
        else:
            raise RequestError("prompt: must be a non-empty string or list of token ids "
                               "(batches of several prompts are not supported)", "prompt")
        return out

    def _account(self, usage: pb.Usage) -> None:
        self.tokens["prompt"] += usage.prompt_tokens
        self.tokens["completion"] += usage.completion_tokens
        self.tokens["cached"] += usage.cached_tokens

    async def _messages(self, call, first):
        message = first
        while message is not grpc.aio.EOF:
            yield message
            message = await call.read()

    async def _collect(self, req: _Request, call, first) -> web.Response:
        choices: dict[int, _Choice] = {}
        usage = pb.Usage()
        async for message in self._messages(call, first):
            for delta in message.outputs:
                choice = choices.setdefault(delta.index, _Choice())
                choice.text.append(delta.text)
                choice.logprobs.extend(delta.logprobs)
                if delta.finish_reason:
                    choice.finish_reason = _FINISH.get(delta.finish_reason, "stop")
            if message.HasField("usage"):
                usage = message.usage
        self._account(usage)
        body = req.envelope([req.choice(i, "".join(c.text), c.logprobs, c.finish_reason,
                                        chunk=False) for i, c in sorted(choices.items())])
        body["usage"] = _usage(usage)
        return web.json_response(body)

    async def _stream(self, request: web.Request, req: _Request, call, first):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        started: set[int] = set()
        try:
            async for message in self._messages(call, first):
                choices = []
                for delta in message.outputs:
                    finish = _FINISH.get(delta.finish_reason) if delta.finish_reason else None
                    if delta.text or finish or delta.logprobs or delta.index not in started:
                        choices.append(req.choice(delta.index, delta.text, delta.logprobs,
                                                  finish, chunk=True,
                                                  first=delta.index not in started))
                        started.add(delta.index)
                if choices:
                    await response.write(_sse(req.envelope(choices, chunk=True)))
                if message.HasField("usage"):
                    self._account(message.usage)
                    if req.include_usage:
                        chunk = req.envelope([], chunk=True) | {"usage": _usage(message.usage)}
                        await response.write(_sse(chunk))
        except grpc.aio.AioRpcError as e:  # headers are gone: report the error in-band
            await response.write(_sse(json.loads(_error_response(e).text)))
        except ConnectionResetError:
            return response  # the client left; the finally in _serve cancels the call
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
