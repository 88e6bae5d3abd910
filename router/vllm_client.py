"""A vLLM engine (``vllm serve``'s OpenAI HTTP server) as the router reaches it: an
``EngineConnection`` of kind ``vllm`` (``router.connection``), so the pool, the balancer and
both fronts treat it as any other engine.

- Requests go to ``/v1/completions`` with the prompt as token ids (the router tokenized and
  rendered the template once), streamed (``return_token_ids``, usage with cached tokens), and
  come back as ``quire.v1`` ``GenerateResponse`` messages. Closing the stream closes the HTTP
  response, which aborts the request in vLLM. The client's W3C ``traceparent`` is forwarded.
- Health: ``/health`` polled; load: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``
  and ``vllm:kv_cache_usage_perc`` from ``/metrics``, and the LoRA adapters running and
  waiting from its ``vllm:lora_requests_info``.
- KV events: vLLM's ZMQ publisher (``router.vllm_events``), re-hashed into the router's domain
  at vLLM's block size; without an event endpoint the pool's approximate index stands in.
- Admission: ``/v1/models`` must serve the model the pool serves; the block size comes from
  the client's options (vLLM does not report it) and the hashing fields are the router's own.
  Which routes it serves says what it runs (vLLM registers each only for a model that has the
  task): no ``/v1/completions`` is a ``--runner pooling`` server (no generation is placed
  there), ``/v1/embeddings`` takes the router's embeddings (token ids in, one vector out).
  vLLM serves no tokenizer files: a router whose first engine is a vLLM one needs its own
  ``--tokenizer``.

Upstream failures surface as ``grpc.aio.AioRpcError`` with the code a Quire engine would give,
so retries and error mapping work unchanged: no connection -> UNAVAILABLE (retried on another
engine before the first message), HTTP 400 -> INVALID_ARGUMENT, 429/503 -> RESOURCE_EXHAUSTED
/ UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.errors import FIELD_METADATA
from quire.kv_events import BlockStored, KVCacheSnapshot, KVEventBatch
from quire.local_context import rpc_error as aio_rpc_error
from quire.structured_outputs import spec_from_proto
from quire.v1 import engine_pb2 as pb
from router.backoff import Backoff
from router.connection import (ClientOptions, EngineMismatchError, EngineReports, EngineState,
                               ModelIdentity, change_state, refuse)
from router.endpoint import Endpoint
from router.vllm_events import VllmKVEventFeed
from router.vllm_logprobs import LogprobsReader, logprobs_fields

logger = logging.getLogger(__name__)

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
           "abort": pb.FINISH_REASON_ABORT}
_HTTP_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.INVALID_ARGUMENT,
               413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
               503: grpc.StatusCode.UNAVAILABLE}
_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc")


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What the router must be told about a vLLM engine (its API reports none of it)."""

    block_size: int = 128  # vLLM's KV block size (its CPU build's default: 128)
    kv_events: str | None = None  # the engine's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557
    kv_replay: str | None = None  # its replay (ROUTER) endpoint
    health_interval_s: float = 1.0


def rpc_error(code: grpc.StatusCode, details: str,
              field: str | None = None) -> grpc.aio.AioRpcError:
    """The status a Quire engine would answer (``field``: the field it names, as an engine's
    ``quire-error-field`` trailing metadata)."""
    return aio_rpc_error(code, details, trailing=[(FIELD_METADATA, field)] if field else ())


_LORA_INFO = "vllm:lora_requests_info"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_load(metrics_text: str) -> pb.LoadReport:
    """The three load gauges of vLLM's Prometheus text (summed over label sets), and its
    LoRA adapters: the latest ``vllm:lora_requests_info`` series (its value is when it was
    set) names the running and waiting adapters and ``max_lora``."""
    values = dict.fromkeys(_LOAD_METRICS, 0.0)
    lora: tuple[float, dict[str, str]] | None = None
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in values:
            values[name] += value
        elif name == _LORA_INFO and (lora is None or value >= lora[0]):
            lora = (value, dict(_LABEL.findall(line.split("{", 1)[-1].rsplit("}", 1)[0])))
    report = pb.LoadReport(num_running=int(values["vllm:num_requests_running"]),
                           num_waiting=int(values["vllm:num_requests_waiting"]),
                           kv_cache_usage=values["vllm:kv_cache_usage_perc"])
    if lora is not None:
        labels = lora[1]
        report.running_lora_adapters[:] = [n for n in
                                           labels.get("running_lora_adapters", "").split(",") if n]
        report.waiting_lora_adapters[:] = [n for n in
                                           labels.get("waiting_lora_adapters", "").split(",") if n]
        max_lora = labels.get("max_lora", "0")
        report.max_loras = int(max_lora) if max_lora.isdigit() else 0
    return report


def completion_body(model: str, request: pb.GenerateRequest) -> dict:
    """vLLM's /v1/completions body for a router request (prompt as token ids)."""
    s = request.sampling
    # a LoRA adapter is a model of its own on vLLM's OpenAI server
    body: dict = {"model": request.lora_name or model, "prompt": list(request.token_ids.ids),
                  "stream": True,
                  "stream_options": {"include_usage": True}, "return_token_ids": True,
                  "ignore_eos": s.ignore_eos,
                  "include_stop_str_in_output": s.include_stop_str_in_output}
    for name in ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "max_tokens", "min_tokens",
                 "skip_special_tokens"):
        if s.HasField(name):
            body[name] = getattr(s, name)
    body.update(logprobs_fields(s))
    if not s.HasField("max_tokens"):  # vLLM's completions default (16) is not the router's
        body["max_tokens"] = None
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    if s.allowed_token_ids:
        body["allowed_token_ids"] = list(s.allowed_token_ids)
    if s.bad_words:
        body["bad_words"] = list(s.bad_words)
    if s.logit_bias:
        body["logit_bias"] = {str(token_id): bias for token_id, bias in s.logit_bias.items()}
    if s.HasField("structured_outputs"):  # vLLM's extra-body field of the same shape
        spec = spec_from_proto(s.structured_outputs) or {}
        if "json" in spec:
            spec["json"] = json.loads(spec["json"])
        body["structured_outputs"] = spec
    if request.cache_salt:
        body["cache_salt"] = request.cache_salt
    if request.priority:
        body["priority"] = request.priority
    if request.request_id:
        body["request_id"] = request.request_id
    return body


def response_from_chunk(request_id: str, chunk: dict, first: bool,
                        logprobs: LogprobsReader | None = None) -> pb.GenerateResponse:
    """One streamed vLLM chunk as a ``GenerateResponse`` (``logprobs``: the stream's reader of
    them, where the request asked for any)."""
    message = pb.GenerateResponse(request_id=request_id)
    for choice in chunk.get("choices") or ():
        delta = message.outputs.add(index=choice.get("index", 0),
                                    token_ids=choice.get("token_ids") or (),
                                    text=choice.get("text") or "")
        if logprobs is not None:
            logprobs.read(choice, delta, message)
        if first and choice.get("prompt_token_ids"):
            message.prompt_token_ids[:] = choice["prompt_token_ids"]
        reason = choice.get("finish_reason")
        if reason:
            delta.finish_reason = _FINISH.get(reason, pb.FINISH_REASON_STOP)
            if choice.get("stop_reason") is not None:
                delta.stop_reason = str(choice["stop_reason"])
    usage = chunk.get("usage")
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        message.usage.CopyFrom(pb.Usage(prompt_tokens=usage.get("prompt_tokens", 0),
                                        completion_tokens=usage.get("completion_tokens", 0),
                                        cached_tokens=details.get("cached_tokens") or 0))
        message.finished = True
    return message


class VllmEngineClient:
    """The router's connection to one vLLM server. ``start()`` it, ``await close()`` it."""

    kind = "vllm"

    @classmethod
    def connect(cls, endpoint: Endpoint, reports: EngineReports,
                options: ClientOptions) -> VllmEngineClient:
        """The ``ConnectionFactory`` of this kind (``router.engine_kinds``): the endpoint names
        the KV-event endpoints, the options the block size vLLM does not report."""
        return cls(endpoint.engine_id, endpoint.address, reports=reports, options=options,
                   vllm=VllmOptions(block_size=options.assumed_block_size,
                                    kv_events=endpoint.kv_events, kv_replay=endpoint.kv_replay))

    def __init__(self, engine_id: str, address: str, *, reports: EngineReports,
                 options: ClientOptions = ClientOptions(),
                 vllm: VllmOptions = VllmOptions()) -> None:
        self.engine_id = engine_id
        self.address = address
        self.reports = reports
        self.options = options
        self.vllm = vllm
        self.base_url = f"http://{address}"
        self.state = EngineState.UNREACHABLE
        self.info: pb.ModelInfo | None = None
        self.refusal: EngineMismatchError | None = None
        self.model: str | None = None
        self.serves_embeddings = False  # until admission finds /v1/embeddings
        self._runner = "generate"  # "pooling" where admission finds no /v1/completions
        self._session = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout_s))
        self._tasks = [asyncio.create_task(self._supervise(), name=f"vllm {self.engine_id}")]

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.state = EngineState.UNREACHABLE
        if self._session is not None:
            await self._session.close()

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.SERVING and not self._closed

    def _set_state(self, state: EngineState) -> None:
        change_state(self, self.reports, state, "vLLM engine", logger)

    def check_identity(self, identity: ModelIdentity, info: pb.ModelInfo) -> None:
        """It must serve the pool's model (its hashing fields are the router's own, and its
        tokenizer cannot be checked: vLLM reports no digest)."""
        if info.model_name != identity.model_name:
            raise EngineMismatchError(self.engine_id, {"model_name": (
                identity.model_name, info.model_name)})

    async def embed(self, request: pb.EmbedRequest, *, timeout_s: float | None = None,
                    metadata: tuple[tuple[str, str], ...] = ()) -> pb.EmbedResponse:
        """vLLM's /v1/embeddings on the prompt's token ids (``normalize`` as its
        ``use_activation``); errors as a Quire engine's statuses."""
        if not self.serves_embeddings:
            raise rpc_error(grpc.StatusCode.UNIMPLEMENTED,
                            f"vLLM engine {self.engine_id} serves no embeddings")
        body = {"model": self.model, "encoding_format": "float",
                "input": (list(request.token_ids.ids) if request.HasField("token_ids")
                          else request.text)}
        if request.HasField("normalize"):
            body["use_activation"] = request.normalize
        if request.HasField("truncate_prompt_tokens"):
            body["truncate_prompt_tokens"] = request.truncate_prompt_tokens
            body["truncation_side"] = request.truncation_side or "right"
        if request.priority:  # as a generation's (vLLM refuses it unless it schedules by it)
            body["priority"] = request.priority
        headers = {k: v for k, v in metadata if k in ("traceparent", "tracestate")}
        answer = json.loads(await self._post_text(
            "/v1/embeddings", body, timeout_s, headers=headers, field="prompt",
            on_404=grpc.StatusCode.INVALID_ARGUMENT))
        usage = answer.get("usage") or {}
        return pb.EmbedResponse(request_id=request.request_id,
                                embedding=answer["data"][0]["embedding"],
                                usage=pb.Usage(prompt_tokens=usage.get("prompt_tokens", 0)))

    async def _read_routes(self) -> None:
        """What the server runs, from the routes it registered (an empty POST is a 404 where
        it did not, a validation error where it did; nothing runs either way)."""
        async def has(path: str) -> bool:
            async with self._session.post(f"{self.base_url}{path}", json={}) as resp:
                return resp.status != 404
        self._runner = "generate" if await has("/v1/completions") else "pooling"
        self.serves_embeddings = await has("/v1/embeddings")

    async def fetch_tokenizer(self, timeout_s: float | None = None) -> None:
        """None: vLLM serves no tokenizer files."""
        return None

    async def _model_info(self) -> pb.ModelInfo:
        async with self._session.get(f"{self.base_url}/v1/models") as resp:
            resp.raise_for_status()
            models = (await resp.json())["data"]
        # the base model, then its LoRA adapters (listed with their ``parent``, vLLM's way)
        model = next((m for m in models if not m.get("parent")), models[0])
        adapters = [m for m in models if m.get("parent") == model["id"]]
        self.model = model["id"]
        return pb.ModelInfo(model_name=model["id"], max_model_len=model.get("max_model_len") or 0,
                            runner=self._runner,
                            block_size=self.vllm.block_size,
                            block_hash_algorithm=BLOCK_HASH_ALGORITHM, block_hash_seed=ROOT_HASH,
                            enable_prefix_caching=True, enable_lora=bool(adapters),
                            lora_adapters=[m["id"] for m in adapters],
                            lora_adapter_paths=[str(m.get("root") or "") for m in adapters])

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                timeout_s: float | None = None) -> bool:
        """vLLM's /v1/load_lora_adapter (its server needs VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
        await self._post("/v1/load_lora_adapter", {"lora_name": lora_name,
                                                   "lora_path": lora_path}, timeout_s)
        return True

    async def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> None:
        await self._post("/v1/unload_lora_adapter", {"lora_name": lora_name}, timeout_s)

    async def _post(self, path: str, body: dict, timeout_s: float | None) -> None:
        """An adapter call, then the model list read again (its adapters changed)."""
        import aiohttp

        await self._post_text(path, body, timeout_s)
        try:
            self.info = await self._model_info()
        except (aiohttp.ClientError, OSError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM engine {self.engine_id}: {e}")

    async def _post_text(self, path: str, body: dict, timeout_s: float | None, *,
                         headers: dict[str, str] | None = None, field: str | None = None,
                         on_404: grpc.StatusCode = grpc.StatusCode.NOT_FOUND) -> str:
        """vLLM's answer to a POST of ``body``; its failures as a Quire engine's statuses
        (``field``: the field an HTTP error's message starts with; ``on_404``: what a 404 means
        here)."""
        import aiohttp

        if self._session is None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM engine {self.engine_id} not ready")
        try:
            async with self._session.post(f"{self.base_url}{path}", json=body, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:500]
                    code = on_404 if resp.status == 404 else \
                        _HTTP_CODES.get(resp.status, grpc.StatusCode.INTERNAL)
                    prefix = f"{field}: " if field else ""
                    raise rpc_error(code, f"{prefix}vLLM answered {resp.status}: {text}")
                return await resp.text()
        except (aiohttp.ClientError, OSError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM engine {self.engine_id}: {e}")

    async def _supervise(self) -> None:
        import aiohttp

        backoff = Backoff(self.options.min_backoff_s, self.options.max_backoff_s)
        while not self._closed:
            try:
                await self._read_routes()
                info = await self._model_info()
                await self.reports.admit(self, info)
            except EngineMismatchError as e:
                refuse(self, self.reports, e, "vLLM engine", logger)
                await asyncio.sleep(self.options.refused_recheck_s)
                continue
            except (aiohttp.ClientError, OSError, KeyError, IndexError, ValueError) as e:
                logger.debug("vLLM engine %s unreachable: %s", self.engine_id, e)
                self._set_state(EngineState.UNREACHABLE)
                await backoff.sleep()
                continue
            self.info, self.refusal = info, None
            feeds = [asyncio.create_task(self._follow_load()),
                     asyncio.create_task(self._follow_kv_events())]
            try:
                await self._watch_health(backoff)
            finally:
                for task in feeds:
                    task.cancel()
                await asyncio.gather(*feeds, return_exceptions=True)
                self.reports.kv_feed_lost(self)
                self.reports.load_report(self, None)
            self._set_state(EngineState.UNREACHABLE)
            await backoff.sleep()

    async def _watch_health(self, backoff: Backoff) -> None:
        """Poll /health until the server stops answering."""
        import aiohttp

        while not self._closed:
            try:
                async with self._session.get(f"{self.base_url}/health") as resp:
                    ok = resp.status == 200
            except (aiohttp.ClientError, OSError):
                return
            self._set_state(EngineState.SERVING if ok else EngineState.NOT_SERVING)
            backoff.reset()
            await asyncio.sleep(self.vllm.health_interval_s)

    async def _follow_load(self) -> None:
        import aiohttp

        while True:
            try:
                async with self._session.get(f"{self.base_url}/metrics") as resp:
                    self.reports.load_report(self, parse_load(await resp.text()))
            except (aiohttp.ClientError, OSError):
                self.reports.load_report(self, None)
            await asyncio.sleep(self.options.load_interval_ms / 1000)

    async def _follow_kv_events(self) -> None:
        if not self.vllm.kv_events:
            self.reports.kv_feed_lost(self)  # the approximate index stands in
            return
        feed = VllmKVEventFeed(
            self.vllm.kv_events, self.vllm.kv_replay,
            on_reset=lambda: self.reports.kv_snapshot(self, KVCacheSnapshot(0, frozenset())),
            on_batch=self._kv_batch)
        await feed.run()

    def _kv_batch(self, batch: KVEventBatch) -> bool:
        """Apply a batch; the block size the events carry is the engine's (vLLM's API does not
        report it, so the configured one is only a first guess)."""
        for event in batch.events:
            if isinstance(event, BlockStored) and self.info is not None and \
                    event.block_size != self.info.block_size:
                logger.warning("vLLM engine %s uses %d-token KV blocks, not %d: matching its "
                               "cache at %d", self.engine_id, event.block_size,
                               self.info.block_size, event.block_size)
                self.info.block_size = event.block_size
        return self.reports.kv_batch(self, batch)

    # ------------------------------------------------------------------- requests
    async def generate(self, request: pb.GenerateRequest, *, timeout_s: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Relay vLLM's stream; closing the iterator closes the HTTP response (vLLM aborts)."""
        import aiohttp

        if self._session is None or self.model is None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM engine {self.engine_id} not ready")
        if self.info is not None and self.info.runner == "pooling":  # (it has no completions)
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                            "runner: this vLLM server runs with --runner pooling: it serves "
                            "embeddings only, not generation", field="runner")
        headers = {k: v for k, v in metadata if k in ("traceparent", "tracestate")}
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            resp = await self._session.post(f"{self.base_url}/v1/completions",
                                            json=completion_body(self.model, request),
                                            headers=headers, timeout=timeout)
        except (aiohttp.ClientError, OSError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"vLLM engine {self.engine_id}: {e}")
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        try:
            if resp.status != 200:
                text = (await resp.text())[:500]
                code = _HTTP_CODES.get(resp.status, grpc.StatusCode.INTERNAL)
                raise rpc_error(code, f"vLLM answered {resp.status}: {text}")
            first = True
            logprobs = LogprobsReader(request.sampling, len(request.token_ids.ids))
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise rpc_error(grpc.StatusCode.INTERNAL, str(chunk["error"])[:500])
                yield response_from_chunk(request.request_id, chunk, first, logprobs)
                first = False
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, OSError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"vLLM engine {self.engine_id} broke the stream: {e}")
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        finally:
            resp.close()
