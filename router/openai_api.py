"""An OpenAI-compatible HTTP front for the router (aiohttp): completions, chat, models, health,
metrics and the decision log.

Every generation goes through the router's own gRPC ``Generate`` over a loopback channel, so
placement, retries, auth and limits are the one code path gRPC clients use; this module only
translates JSON <-> ``quire.v1`` messages (``router.openai_protocol``). Chat renders the model's
template here, off the event loop, and sends token ids. The HTTP front makes no span of its own:
it hands the client's ``traceparent`` / ``tracestate`` headers to that gRPC call, whose span is
the router's one span of the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import grpc
from aiohttp import web

import quire
from quire.errors import FieldError, field_of
from quire.limits import load_json
from quire.ports import PortInUseError
from quire.tool_calls import render_inputs
from quire.tracing import TRACE_HEADERS
from quire.v1 import engine_pb2 as pb
from router.auth import OPEN_HTTP_PATHS, ApiKeys
from router.balancer import NoEndpointError
from router.chat_template import ChatTemplateOptions, flag
from router.config import RouterServerConfig
from router.http_guard import GuardedAppRunner, RateLimitedLog, deadline_of
from router.local_call import BatchCall, LocalCall, local_unary
from router.metrics import RouterMetrics
from router.openai_answer import OpenAIRequest, collect, stream
from router.openai_chat_batch import serve_chat_batch
from router.openai_protocol import (RequestError, cache_salt, chat_messages, check_batch,
                                    check_body, error_response, request_priority,
                                    sampling_options, shown, token_list, truncate_ids,
                                    truncation)
from router.openai_embeddings import (EMBEDDING_FIELDS, EMBEDDING_INPUTS_IN_FLIGHT,
                                      Conversation, EmbeddingsRequest, embeddings_response)
from router import openai_responses_serve as responses
from router.openai_tokenize import (DETOKENIZE_FIELDS, TOKENIZE_FIELDS, TokenizeRequest,
                                    detokenize_ids, tokenize_response)
from router.render_pool import Renderer, approx_chars
from router.responses_store import ResponsesStore

if TYPE_CHECKING:
    from quire.tokenizer import FastTokenizer

logger = logging.getLogger(__name__)

_KEEPALIVE_TIMEOUT_S = 75.0  # an idle keep-alive connection is closed after this
# After an answer sent before the whole body was read (415, 413, 408, a malformed body), what
# the client still sends is read and dropped for at most this long, so that it sees the answer
# rather than a connection reset; then the connection is closed.
_LINGER_S = 2.0
_RETRY_AFTER_S = "1"  # 503 answers: engines join (or the pool recovers) within seconds
# Request bodies are read as sent: no compressed body is inflated (vLLM's server decodes
# none either), so a gzip bomb is refused at the price of its headers.
_ACCEPTED_ENCODINGS = frozenset({"", "identity"})
_LORA_FIELDS = frozenset({"lora_name", "lora_path"})  # vLLM's load/unload_lora_adapter body


class BodyError(RequestError):
    """The body was refused before or while it was read; the connection is closed after the
    answer, so nothing more of that body is received."""


@dataclass(frozen=True, slots=True)
class FrontSeam:
    """What the HTTP front needs from the router, and nothing more (``router.app`` builds it).

    The callables are read on every request: they answer for the router's state *now*."""

    # The router servicer's Generate(request, context): every generation goes through it, in
    # this process (router.local_call), with the statuses a gRPC client would see.
    generate: Callable[..., AsyncIterator]
    keys: ApiKeys
    session_header: str  # the HTTP header forwarded as the gRPC session metadata
    model_name: Callable[[], str | None]  # None: no engine has fixed the model yet
    tokenizer: Callable[[], FastTokenizer | None]  # None: no engine admitted yet
    engine_states: Callable[[], dict[str, int]]  # engines per state, "serving" among them
    draining: Callable[[], bool]
    tenant_header: str | None = None  # the HTTP header forwarded as the gRPC tenant metadata
    # the smallest max_model_len of the serving engines (None: none serves)
    max_model_len: Callable[[], int | None] = lambda: None
    # what /tokenize and /v1/models report, which need no engine: the above, else the last
    # length known (None: no engine has joined yet)
    known_max_model_len: Callable[[], int | None] = lambda: None
    # the router servicer's Embed(request, context), called in process like ``generate``
    embed: Callable[..., Awaitable] | None = None
    # LoRA: the adapters the serving engines hold (name -> path), and loading / unloading one
    # on the pool (router.lora_adapters)
    adapters: Callable[[], dict[str, str]] = dict
    # whether a name no engine holds can be loaded on demand (router.lora_adapters)
    resolvable: Callable[[str], bool] = lambda name: False
    load_adapter: Callable[[object, object], Awaitable] | None = None
    unload_adapter: Callable[[object], Awaitable] | None = None


class OpenAIFront:
    """Start with ``await start()`` (returns the port) on the router's loop; ``await stop()``."""

    def __init__(self, seam: FrontSeam, cfg: RouterServerConfig, metrics: RouterMetrics, *,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.seam = seam
        self.cfg = cfg
        self.host, self.port = host, port
        self.metrics = metrics
        self._runner: web.AppRunner | None = None
        self._render: Renderer | None = None  # template and tokenizer work
        self.client_errors = RateLimitedLog(logger)  # one line per client mistake, bounded
        self.responses = ResponsesStore(cfg.responses_store_bytes)  # Responses API's store

    @property
    def model_name(self) -> str:
        """The served model; 503 (with Retry-After) until an engine has joined and fixed it:
        a placeholder name would be listed to clients that then get 404 for it."""
        name = self.seam.model_name()
        if name is None:
            raise RequestError("no engine has joined yet: the model is not known",
                               None, 503)
        return name

    @property
    def tokenizer(self) -> FastTokenizer:
        tokenizer = self.seam.tokenizer()
        if tokenizer is None:
            raise RequestError("no engine is available yet", None, 503)
        return tokenizer

    def _texts(self) -> dict:
        backend = self.tokenizer.backend  # how an answer names tokens (OpenAIRequest)
        return {"token_text": lambda i: backend.decode([i], skip_special_tokens=False),
                "decode": lambda ids: backend.decode(ids, skip_special_tokens=False),
                "pieces": self.tokenizer.pieces}

    async def start(self) -> int:
        self._render = Renderer(self.cfg.tokenizer_threads)
        app = web.Application(middlewares=[self._guard],
                              client_max_size=self.cfg.max_body_bytes)
        app.add_routes([web.post("/v1/completions", self._completions),
                        web.post("/v1/chat/completions", self._chat),
                        web.post("/v1/chat/completions/batch", partial(serve_chat_batch, self)),
                        web.post("/v1/embeddings", self._embeddings),
                        web.post("/v1/responses", partial(responses.create, self)),
                        web.get("/v1/responses/{response_id}",
                                partial(responses.retrieve, self)),
                        web.delete("/v1/responses/{response_id}",
                                   partial(responses.delete, self)),
                        web.post("/v1/responses/{response_id}/cancel",
                                 partial(responses.cancel, self)),
                        web.get("/v1/responses/{response_id}/input_items",
                                partial(responses.list_input_items, self)),
                        web.post("/tokenize", self._tokenize),
                        web.post("/detokenize", self._detokenize),
                        web.post("/v1/load_lora_adapter", self._load_lora),
                        web.post("/v1/unload_lora_adapter", self._unload_lora),
                        web.get("/v1/models", self._models), web.get("/health", self._health),
                        # vLLM's liveness route (SageMaker's name) and version
                        web.get("/ping", self._health), web.post("/ping", self._health),
                        web.get("/version", self._version),
                        web.get("/metrics", self._metrics),
                        web.get("/debug/decisions", self._decisions)])
        # handler_cancellation: a client that disconnects cancels its handler, whose finally
        # closes the local call, which aborts the request on the engine (streaming or not).
        self._runner = GuardedAppRunner(app, access_log=None, handler_cancellation=True,
                                        keepalive_timeout=_KEEPALIVE_TIMEOUT_S,
                                        lingering_time=_LINGER_S,
                                        header_timeout_s=self.cfg.http_header_timeout_s,
                                        client_errors=self.client_errors)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise PortInUseError(f"http_port: cannot listen on {self.host}:{self.port} "
                                 f"(router HTTP): {e.strerror or e}") from None
        self.port = self._runner.addresses[0][1]
        logger.info("OpenAI API serving on http://%s:%d/v1", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        # background Responses stop with the router: those running now, and any a request
        # still being answered starts before the runner's cleanup ends
        await asyncio.gather(*self.responses.cancel_all(), return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
        await asyncio.gather(*self.responses.cancel_all(), return_exceptions=True)
        if self._render is not None:
            self._render.shutdown()

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """API keys (health and metrics exempt), JSON errors for every failure, counting."""
        keys = self.seam.keys
        if keys.enabled and request.path not in OPEN_HTTP_PATHS and \
                not keys.check(request.headers.get("Authorization")):
            response = error_response(RequestError(
                "authorization: missing or invalid API key (send 'Authorization: Bearer "
                "<key>')", "authorization", 401))
        else:
            deadline = deadline_of(request)
            if deadline is not None:
                deadline.headers_done()
            try:
                response = await handler(request)
            except web.HTTPException as e:  # unknown path, wrong method: still a JSON body
                response = error_response(RequestError(f"{request.method} {request.path}: "
                                                       f"{e.reason}", None, e.status))
            finally:
                if deadline is not None:
                    deadline.request_done()
        if response.status == 503 and not response.prepared:
            # not ready yet or draining: a client (or a load balancer) should come back soon
            response.headers.setdefault("Retry-After", _RETRY_AFTER_S)
        resource = request.match_info.route.resource
        path = resource.canonical if resource else "other"
        self.metrics.http_requests.labels(path, str(response.status)).inc()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        try:
            name = self.model_name
        except RequestError as e:
            return error_response(e)
        # the context length too, as vLLM lists it (clients size prompts by it)
        known = self.seam.known_max_model_len()
        length = {} if known is None else {"max_model_len": known}
        return web.json_response({"object": "list", "data": [
            # "root" as vLLM's server gives it: clients such as `vllm bench serve` read it
            {"id": name, "object": "model", "created": 0, "owned_by": "quire",
             "root": name, "parent": None} | length] + [
            # LoRA adapters as vLLM lists them: their path as root, the base as parent
            {"id": adapter, "object": "model", "created": 0, "owned_by": "quire",
             "root": path or adapter, "parent": name} | length
            for adapter, path in sorted(self.seam.adapters().items())]})

    async def _load_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: on every engine."""
        try:
            body = await self._body(request, known=_LORA_FIELDS)
            if body.get("lora_name") == self.seam.model_name():  # the name clients use
                raise RequestError(f"lora_name: {shown(body['lora_name'])} is the base model's "
                                   "name: an adapter needs a name of its own", "lora_name")
            await self.seam.load_adapter(body.get("lora_name"), body.get("lora_path"))
        except NoEndpointError as e:
            return error_response(RequestError(str(e), None, 503))
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return self._error(request, e)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added "
                                 "successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: wherever it is loaded."""
        try:
            body = await self._body(request, known=_LORA_FIELDS)
            await self.seam.unload_adapter(body.get("lora_name"))
        except NoEndpointError as e:
            return error_response(RequestError(str(e), None, 503))
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return self._error(request, e)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' removed "
                                 "successfully.")

    async def _health(self, request: web.Request) -> web.Response:
        states = self.seam.engine_states()
        serving = states.get("serving", 0)
        ready = serving > 0 and not self.seam.draining()
        return web.json_response({"serving_engines": serving, "engines": states},
                                 status=200 if ready else 503)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": quire.__version__})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _decisions(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit", "20")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 6):
            return error_response(RequestError(f"limit: must be an integer in [0, 999999], got "
                                               f"{shown(raw)}", "limit"))
        limit = int(raw)
        return web.json_response({"decisions": [
            r.as_json() for r in self.metrics.decisions.latest(limit)]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        call = req = None
        try:
            body = await self._body(request, chat=chat)
            # the name answers carry: the adapter asked for, else the base model
            req = OpenAIRequest(body, chat=chat,
                                model_name=self._check_model(body) or self.model_name,
                                **self._texts())
            metadata = self._forwarded_metadata(request)
            calls = [LocalCall(self.seam.generate, message, timeout_s=self.cfg.request_timeout_s,
                               metadata=metadata)
                     for message in await self._generate_requests(req)]
            call = calls[0] if len(calls) == 1 else BatchCall(
                calls, calls[0].request.sampling.n or 1, pb.GenerateResponse)
            first = await call.read()  # errors before any output keep their HTTP status
            if req.stream:
                return await stream(request, req, call, first, self._account)
            return await collect(req, call, first, self._account)
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return self._error(request, e, None if req is None else req.field_aliases)
        finally:
            if call is not None:
                await call.aclose()  # no-op once finished; aborts the engine request otherwise

    def _error(self, request: web.Request, error: Exception,
               aliases: dict[str, str] | None = None) -> web.Response:
        if not isinstance(error, BodyError):
            return error_response(error, aliases)
        self.client_errors(logging.INFO, "HTTP %d to %s: %s", error.status, request.remote,
                           error)
        response = error_response(error)
        response.force_close()  # the rest of a body we refused is never parsed
        if error.status == 415:
            response.headers["Accept-Encoding"] = "identity"
        return response

    # ---------------------------------------------------------------------- embeddings
    async def _embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's /v1/embeddings: one Embed call per input on the router's gRPC front
        (admitted and placed like any request), at most ``EMBEDDING_INPUTS_IN_FLIGHT`` at
        once, so that one request of many inputs fills neither the engines' queues nor its
        tenant's queue in the router (``router.openai_embeddings``)."""
        calls = []
        window = asyncio.Semaphore(EMBEDDING_INPUTS_IN_FLIGHT)

        async def embed(message: pb.EmbedRequest, metadata) -> pb.EmbedResponse:
            async with window:
                return await local_unary(self.seam.embed, message,
                                         timeout_s=self.cfg.request_timeout_s,
                                         metadata=metadata)

        try:
            body = await self._body(request, known=EMBEDDING_FIELDS)
            self._check_model(body, adapters=False)
            req = EmbeddingsRequest.from_body(body, self.cfg.max_prompt_chars)
            metadata = self._forwarded_metadata(request)
            for item in req.inputs:
                if isinstance(item, Conversation):  # rendered here, sent as token ids
                    item = await self._render.run(approx_chars(item.messages),
                                                  self._render_chat, item.messages, (), req.chat)
                message = pb.EmbedRequest(**({"text": item} if isinstance(item, str) else
                                             {"token_ids": pb.TokenIds(ids=item)}),
                                          priority=req.priority, cache_salt=req.cache_salt)
                if req.normalize is not None:
                    message.normalize = req.normalize
                if req.truncate_prompt_tokens is not None:
                    message.truncate_prompt_tokens = req.truncate_prompt_tokens
                    message.truncation_side = req.truncation_side
                calls.append(asyncio.ensure_future(embed(message, metadata)))
            responses = await asyncio.gather(*(self._embedded(req, i, call)
                                               for i, call in enumerate(calls)))
            num_tokens = sum(r.usage.prompt_tokens for r in responses)
            self.metrics.tokens.labels("prompt").inc(num_tokens)
            self.metrics.tokens.labels("cached").inc(sum(r.usage.cached_tokens
                                                         for r in responses))
            return web.json_response(embeddings_response(
                req, [r.embedding for r in responses], num_tokens, self.model_name))
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return self._error(request, e)
        finally:
            for call in calls:
                call.cancel()  # no-op once finished; aborts the others after a failure

    @staticmethod
    async def _embedded(req: EmbeddingsRequest, index: int, call) -> pb.EmbedResponse:
        """One input's answer; a refused prompt (too long, bad token ids) names the input."""
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.OUT_OF_RANGE):
                raise
            detail = e.details() or ""
            field = field_of(e)
            if field in ("truncate_prompt_tokens", "truncation_side"):
                raise  # the request's field, not the input's
            if field and detail.startswith(f"{field}: "):
                detail = detail[len(field) + 2:]
            raise RequestError(f"{req.name(index)}: {detail}", req.field) from None

    # ------------------------------------------------------------ tokenize, detokenize
    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize, on the router's tokenizer (``router.openai_tokenize``)."""
        try:
            body = await self._body(request, known=TOKENIZE_FIELDS)
            self._check_model(body)
            req = TokenizeRequest.from_body(body, self.cfg.max_prompt_chars)
            tokenizer = self.tokenizer
            ids = await self._render.run(approx_chars(body), req.token_ids, tokenizer)
            return web.json_response(tokenize_response(
                req, ids, self._length(self.seam.known_max_model_len()), tokenizer))
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return self._error(request, e)

    async def _detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: the text of ``tokens`` (special tokens kept, as vLLM)."""
        try:
            body = await self._body(request, known=DETOKENIZE_FIELDS)
            self._check_model(body)
            backend = self.tokenizer.backend
            ids = detokenize_ids(body, backend.get_vocab_size(with_added_tokens=True),
                                 self.cfg.max_prompt_chars)
            text = await self._render.run(len(ids), lambda: backend.decode(
                ids, skip_special_tokens=False))
            return web.json_response({"prompt": text})
        except Exception as e:  # noqa: BLE001 - every failure gets a JSON body
            return self._error(request, e)

    @staticmethod
    def _length(value: int | None) -> int:
        """A length limit from the seam; 503 while there is none to give."""
        if value is None:
            raise RequestError("no engine is available yet", None, 503)
        return value

    def _check_model(self, body: dict, adapters: bool = True) -> str:
        """The LoRA adapter the body's ``model`` names ("" for the base model); 404 for a
        model that is neither (or an adapter where ``adapters`` is False)."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(f"model: must be a string, got {shown(model)}", "model")
        if model is None or model == self.model_name:
            return ""
        if adapters and (model in self.seam.adapters() or self.seam.resolvable(model)):
            return model
        raise RequestError(f"model: the model {shown(model)} does not exist", "model", 404)

    async def _body(self, request: web.Request, *, chat: bool = False,
                    known: frozenset[str] | None = None) -> dict:
        """The JSON object sent, checked (``check_body``) before anything reads it."""
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in _ACCEPTED_ENCODINGS:
            raise BodyError(f"body: Content-Encoding {shown(encoding)} is not accepted; send "
                            "the JSON body uncompressed", "body", 415)
        too_large = f"body: larger than {self.cfg.max_body_bytes} bytes"
        if (request.content_length or 0) > self.cfg.max_body_bytes:
            raise BodyError(too_large, "body", 413)  # said up front: not one byte is read
        try:
            async with asyncio.timeout(self.cfg.http_body_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyError(too_large, "body", 413) from None
        except TimeoutError:
            raise BodyError(f"body: not received within {self.cfg.http_body_timeout_s:g} s",
                            "body", 408) from None
        except web.RequestPayloadError as e:  # aiohttp's error in the body: the client's
            detail = " ".join(str(e).split()).removeprefix("400, message: ")[:200]
            raise BodyError(f"body: malformed ({detail})", "body") from None
        try:
            body = load_json(raw, "body")
        except FieldError as e:
            raise RequestError(str(e), e.field) from None
        if not isinstance(body, dict):
            raise RequestError("body: must be a JSON object", "body")
        check_body(body, chat=chat, known=known)
        return body

    def _forwarded_metadata(self, request: web.Request) -> tuple[tuple[str, str], ...]:
        """What the gRPC front needs from the HTTP request: the key, the session and the W3C
        trace context (so the router's span joins the HTTP client's trace)."""
        forwarded = []
        if (authorization := request.headers.get("Authorization")) is not None:
            forwarded.append(("authorization", authorization))
        session = self.seam.session_header
        if (value := request.headers.get(session)) is not None:
            forwarded.append((session.lower(), value))
        tenant = self.seam.tenant_header
        if tenant and (value := request.headers.get(tenant)) is not None:
            forwarded.append((tenant.lower(), value))
        for key in TRACE_HEADERS:
            if (value := request.headers.get(key)) is not None:
                forwarded.append((key, value))
        return tuple(forwarded)

    async def _generate_requests(self, req: OpenAIRequest) -> list[pb.GenerateRequest]:
        """One request per prompt: a chat, a completion, or each prompt of a completions
        batch (``prompt`` a list of strings or of token-id lists, as vLLM takes it: ids
        ``<id>-<k>``)."""
        prompt = req.body.get("prompt")
        batch = prompt if not req.chat and isinstance(prompt, list) and len(prompt) > 1 and \
            all(isinstance(p, (str, list)) for p in prompt) else None
        if batch is None:
            message = await self._generate_request(req)
            req.note_truncation(0)
            return [message]
        check_batch(batch)
        requests = []
        for k, item in enumerate(batch):
            try:
                message = await self._generate_request(req, item)
                req.note_truncation(k)
            except RequestError as e:
                if e.param != "prompt":
                    raise  # a field of the whole request
                raise RequestError(f"prompt[{k}]{str(e).removeprefix('prompt')}",
                                   "prompt") from None  # named as the batch's item
            message.request_id = f"{req.id}-{k}"
            requests.append(message)
        return requests

    async def _generate_request(self, req: OpenAIRequest, prompt=None) -> pb.GenerateRequest:
        """``prompt``: one prompt of a batch (None: the body's)."""
        body = req.body
        lora_name = self._check_model(body)
        cfg = self.cfg
        out = pb.GenerateRequest(request_id=req.id, sampling=sampling_options(
            body, chat=req.chat, max_n=cfg.max_n, max_tokens_limit=cfg.max_tokens_limit,
            max_stop_strings=cfg.max_stop_strings, max_stop_string_len=cfg.max_stop_string_len),
            priority=request_priority(body), lora_name=lora_name, cache_salt=cache_salt(body))
        truncate = truncation(body)
        if req.chat:
            messages = chat_messages(body, cfg.max_prompt_chars)
            options = ChatTemplateOptions.from_body(body, messages)
            schema = req.tools.schema() if req.tools is not None else None
            if schema is not None:  # required / named: arguments that always parse
                out.sampling.structured_outputs.json = json.dumps(schema)
            size = approx_chars(messages, req.prompt_tools, body.get("chat_template_kwargs"))
            ids = await self._render.run(size, self._render_chat, messages, req.prompt_tools,
                                         options)
            out.token_ids.ids[:] = self._truncated(ids, truncate, req)
            return out
        if prompt is None:
            prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            if len(prompt) > cfg.max_prompt_chars:  # before any copy or tokenizing
                raise RequestError(f"prompt: at most {cfg.max_prompt_chars} characters, got "
                                   f"{len(prompt)}", "prompt")
            special = flag(body, "add_special_tokens", True)
            if special and truncate is None:
                out.text = prompt  # the engine tokenizes it, as vLLM's default does
            else:
                # a tokenizer's one leading token (BOS) stays, as transformers' truncation
                # keeps it: only the text's tokens are cut
                head = self.tokenizer.encode("", add_special_tokens=True) if special else []
                head = head if len(head) == 1 else []
                ids = await self._render.run(len(prompt), partial(
                    self.tokenizer.encode, prompt, add_special_tokens=special and not head))
                keep = truncate if truncate is None or truncate[0] == -1 or not head else (
                    max(1, truncate[0] - len(head)), truncate[1])
                out.token_ids.ids[:] = head + self._truncated(ids, keep, req,
                                                              reserve=len(head))
        elif (ids := token_list(prompt)) is not None:
            out.token_ids.ids[:] = self._truncated(ids, truncate, req)
        else:
            raise RequestError("prompt: must be a non-empty string, a list of token ids, or a "
                               "list of those (a batch)", "prompt")
        return out

    def _truncated(self, ids: list[int], truncate: tuple[int, str] | None,
                   req: OpenAIRequest, reserve: int = 0) -> list[int]:
        """``truncate_ids`` on the pool's length limit (the router tokenized the prompt, so
        placement hashes what the engine runs); echo then repeats what ran."""
        if truncate is None:
            return ids
        ids, cut = truncate_ids(ids, truncate, self._length(self.seam.max_model_len()), reserve)
        req.cut_now = req.cut_now or cut
        return ids

    def _render_chat(self, messages: list[dict], tools: tuple[dict, ...],
                     options: ChatTemplateOptions) -> list[int]:
        tokenizer = self.tokenizer
        messages, template_tools = render_inputs(messages, tools, tokenizer.chat_template)
        return options.token_ids(tokenizer, messages, template_tools)

    def _account(self, usage: pb.Usage) -> None:
        self.metrics.tokens.labels("prompt").inc(usage.prompt_tokens)
        self.metrics.tokens.labels("completion").inc(usage.completion_tokens)
        self.metrics.tokens.labels("cached").inc(usage.cached_tokens)
