"""The router's quire.v1.EngineService: the engine's own API, placed across engines.

Per request: tokenize once (off the event loop; token-id prompts pass through), hash the
prompt's full blocks exactly as the engines do (cache salt included), ask the pool how much of
the prompt each engine holds, let the balancer pick, then forward the request *as token ids*
and relay the stream. An engine that fails before its first message is retried on another one
(bounded, within the deadline); once tokens were relayed the request is never replayed from the
start, since the client already has them: the stream goes on on another engine from the next
token (``router.resume``), where nothing but those tokens carries the state of the completion.
Cancelling the client call cancels the upstream call, which
aborts the request on the engine. The chosen engine is sent back as the initial metadata
``quire-engine-id``, and every placement is kept in the decision log. With tracing on, each
request also gets a span (``router.tracing``) whose context goes to the engine as metadata.
"""

from __future__ import annotations

from quire.errors import FieldError, NotFoundError
import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from quire.load_stream import load_reports
from quire.limits import (DEFAULT_MAX_N, check_cache_salt, check_lora_name, check_n,
                          check_request_id, request_prompt)
from quire.list_limits import MAX_STOP_TOKEN_IDS, check_length
from quire.structured_outputs import (check_logit_bias, no_kind_error, spec_from_proto,
                                      structured_outputs_kind)
from quire.tracing import traced_generate
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.admission import AdmissionGate
from router.balancer import Decision, NoEndpointError, Policy, RoutingRequest, choose
from router.errors import RETRYABLE_CODES, abort_with
from router.lora_adapters import AdapterSources, load_everywhere, unload_everywhere
from router.metrics import DecisionRecord, RouterMetrics
from router.pool import EnginePool, ModelIdentity, PromptHashes
from router.resume import (as_continued, continuation, last_message, max_tokens_left,
                           resume_refusal)
from router.tenants import TenantTable

if TYPE_CHECKING:
    from router.tracing import RouterSpan

logger = logging.getLogger(__name__)

ENGINE_ID_METADATA = "quire-engine-id"
_LONG_TEXT_CHARS = 512  # shorter prompts tokenize faster than a thread hop costs
_LONG_PROMPT_TOKENS = 4096  # and shorter token-id prompts hash faster
# GetModelInfo: what each engine says of how it runs, reported where every serving engine
# says the same (else left unset: the pool is mixed; ask an engine), and the speculative
# decoding counters, summed. An engine's incarnation id is its own: never the router's.
_SHARED_DESCRIPTION = (
    "backend", "backend_reason", "backend_fallback", "cuda_graphs", "quantization",
    "speculative_config", "runner", "pooling_type", "pooling_normalize", "hidden_size",
    "tensor_parallel_size", "pipeline_parallel_size", "all_reduce_backend",
    "distributed_executor_backend", "layer_execution")
_SUMMED_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                    "spec_decode_num_accepted_tokens")


@dataclass(frozen=True, slots=True)
class RoutedPrompt:
    token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # at the router's first block size
    hashes: PromptHashes  # at every block size the pool's engines use
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The engine's cheap limits, checked at the router before any tokenizing (so a giant
    prompt is refused at once, as the engine would refuse it, instead of after seconds of
    work). Errors name the field and echo what was sent."""

    max_n: int = DEFAULT_MAX_N
    max_tokens: int = 0  # 0: no router-side cap
    max_prompt_chars: int = 1 << 20
    max_stop_strings: int = 16
    max_stop_string_len: int = 256

    def check(self, request: pb.GenerateRequest) -> None:
        """Raise ValueError naming the field when the request exceeds a limit."""
        check_request_id(request.request_id)
        check_lora_name(request.lora_name)
        if request.cache_salt:
            check_cache_salt(request.cache_salt)
        sampling = request.sampling
        if sampling.HasField("n"):
            check_n(sampling.n, self.max_n, field="sampling.n")
        if self.max_tokens and sampling.HasField("max_tokens") and \
                sampling.max_tokens > self.max_tokens:
            raise FieldError("sampling.max_tokens", f"must be <= {self.max_tokens} (the router's "
                             f"--max-tokens-limit), got {sampling.max_tokens}")
        if len(sampling.stop) > self.max_stop_strings:
            raise FieldError("sampling.stop", f"at most {self.max_stop_strings} stop strings, "
                             f"got {len(sampling.stop)}")
        if any(len(s) > self.max_stop_string_len for s in sampling.stop):
            raise FieldError("sampling.stop", f"each stop string at most "
                             f"{self.max_stop_string_len} characters")
        check_length(sampling.stop_token_ids, MAX_STOP_TOKEN_IDS, "sampling.stop_token_ids",
                     "stop token ids")
        if sampling.HasField("structured_outputs"):  # its shape; the engine compiles it
            spec = spec_from_proto(sampling.structured_outputs)
            if spec is None:
                raise no_kind_error("sampling.structured_outputs")
            structured_outputs_kind(spec, field="sampling.structured_outputs")
        if sampling.logit_bias:
            check_logit_bias(sampling.logit_bias, field="sampling.logit_bias")
        if request.WhichOneof("prompt") == "text" and len(request.text) > self.max_prompt_chars:
            raise FieldError("text", f"at most {self.max_prompt_chars} characters, got "
                             f"{len(request.text)}")


class RouterServicer(engine_pb2_grpc.EngineServiceServicer):
    """quire.v1.EngineService in front of the engines of ``pool``."""

    def __init__(self, pool: EnginePool, *, policy: Policy, metrics: RouterMetrics,
                 limits: RequestLimits = RequestLimits(), max_attempts: int = 2,
                 session_header: str = "x-session-id",
                 spans: Callable[[pb.GenerateRequest, object], RouterSpan] | None = None,
                 tokenizer_threads: int = 2, admission: AdmissionGate | None = None,
                 adapter_sources: AdapterSources | None = None) -> None:
        """``spans`` (request, invocation metadata) -> a started ``RouterSpan``: given when
        tracing is on, None when off. Long prompts are tokenized on a pool of
        ``tokenizer_threads`` threads (the tokenizer releases the GIL), never on the loop.
        ``admission``: flow control, which every request passes before placement (None:
        none). ``adapter_sources``: where LoRA adapters no engine holds can be loaded from
        on demand (None: nowhere; such a request is NOT_FOUND)."""
        if max_attempts < 1:
            raise FieldError("max_attempts", f"must be >= 1, got {max_attempts}")
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.limits = limits
        self.max_attempts = max_attempts
        self.session_header = session_header.lower()
        self.spans = spans
        self.admission = admission or AdmissionGate(None, TenantTable())
        self.adapter_sources = adapter_sources or AdapterSources()
        self.draining = False
        self.tokenize_pool = ThreadPoolExecutor(tokenizer_threads,
                                                thread_name_prefix="router-tokenize")

    async def tokenize(self, fn, *args):
        """``fn(*args)`` on the bounded tokenizer pool."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def identity(self) -> ModelIdentity | None:
        return self.pool.identity

    async def prepare(self, request: pb.GenerateRequest) -> RoutedPrompt:
        """Token ids and block hashes of the request's prompt. Raises ValueError on a bad
        prompt and NoEndpointError while no engine has fixed the model identity."""
        identity = self.identity
        if identity is None:
            raise NoEndpointError("no engine is available yet")
        prompt = request_prompt(request)
        long = (len(prompt) > _LONG_TEXT_CHARS if isinstance(prompt, str)
                else len(prompt) > _LONG_PROMPT_TOKENS)
        salt = request.cache_salt or None
        # an EmbedRequest runs the base model: it names no adapter
        lora = (request.lora_name if isinstance(request, pb.GenerateRequest) else "") or None
        sizes = self.pool.block_sizes() | {identity.block_size}  # read on the loop, not a thread
        if long:  # tokenizing and hashing a long prompt would hold up every other request
            return await self.tokenize(self._route_prompt, identity, prompt, salt, sizes, lora)
        return self._route_prompt(identity, prompt, salt, sizes, lora)

    def _route_prompt(self, identity: ModelIdentity, prompt, salt: str | None,
                      sizes: frozenset[int], lora: str | None = None) -> RoutedPrompt:
        if isinstance(prompt, str):
            started = time.perf_counter()
            token_ids = tuple(identity.tokenizer.encode(prompt))
            self.metrics.tokenize_s.observe(time.perf_counter() - started)
        else:
            token_ids = tuple(prompt)
        # hashed at every block size the pool's engines use (a mixed pool: Quire 16, vLLM 128)
        by_size = {size: tuple(identity.tokenizer.block_hashes(token_ids, size, cache_salt=salt,
                                                               lora_name=lora))
                   for size in sizes}
        return RoutedPrompt(token_ids=token_ids, block_hashes=by_size[identity.block_size],
                            hashes=PromptHashes(by_size), lora_name=lora)

    def place(self, prompt: RoutedPrompt, exclude: set[str],
              session_key: str | None = None) -> Decision:
        """The engine for ``prompt`` among those not in ``exclude`` (NoEndpointError if none)."""
        return choose(RoutingRequest(block_hashes=prompt.block_hashes,
                                     num_prompt_tokens=len(prompt.token_ids),
                                     session_key=session_key),
                      self.pool.candidates(prompt.hashes, exclude, prompt.lora_name),
                      self.policy)

    def _session_key(self, context) -> str | None:
        for key, value in context.invocation_metadata() or ():
            if key == self.session_header:
                return value
        return None

    @traced_generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       span: RouterSpan | None):
        """Place the request on an engine and relay its stream (traced when ``spans`` is set)."""
        received = time.perf_counter()
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        try:
            self.limits.check(request)
            lacking = self._lacking_adapter(request.lora_name)
            prompt = await self.prepare(request)
        except (ValueError, NoEndpointError) as e:
            await abort_with(context, e)
            return
        # waits while the engines are full; released when the call ends, however it ends
        admission = await self.admission.admit(request, context, len(prompt.token_ids), span)
        forward = pb.GenerateRequest()
        forward.CopyFrom(request)
        forward.token_ids.ids[:] = prompt.token_ids  # sets the oneof: the engine skips tokenizing
        forward.request_id = request.request_id or uuid.uuid4().hex
        session_key = self._session_key(context)
        tried: set[str] = self._unable("generate") | lacking
        last_error: BaseException | None = None
        sending = forward  # the request as the current attempt sends it
        refusal = resume_refusal(forward)  # None: a stream that fails mid-way can move
        generated: list[int] = []  # token ids relayed to the client (when it can move)
        started = False  # the client has had a message
        for attempt in range(1, self.max_attempts + 1):
            placed = time.perf_counter()
            try:
                decision = self.place(prompt, tried, session_key)
            except NoEndpointError as e:
                await abort_with(context, last_error or e)
                return
            record = self._record(forward.request_id, decision, attempt, len(prompt.token_ids),
                                  time.perf_counter() - placed, span)
            engine_id = decision.engine_id
            tried.add(engine_id)
            if request.lora_name and engine_id not in self.pool.holding_adapter(
                    request.lora_name):
                try:  # placed where its adapter is to be read: load it there first
                    await self.adapter_sources.ensure(self.pool.clients[engine_id],
                                                      request.lora_name,
                                                      context.time_remaining())
                except grpc.aio.AioRpcError as e:
                    record.outcome = e.code().name
                    if self.pool.holding_adapter(request.lora_name) - tried:
                        last_error = e  # others hold it: place there instead
                        continue
                    await abort_with(context, _adapter_load_error(request.lora_name, e))
                    return
            stream = self.pool.generate(
                engine_id, sending, block_hashes=prompt.hashes,
                num_uncached_tokens=len(prompt.token_ids) - decision.predicted_cached_tokens,
                timeout_s=context.time_remaining(), metadata=span.metadata if span else ())
            moved, earlier = sending is not forward, len(generated)  # relayed before
            try:
                async for message in stream:
                    if not started:
                        started = True
                        await context.send_initial_metadata(
                            ((ENGINE_ID_METADATA, engine_id),))
                        self.metrics.ttft_s.observe(time.perf_counter() - received)
                        admission.started()
                        if span is not None:
                            span.first_message(engine_id)
                    if moved:
                        as_continued(message, len(forward.token_ids.ids), earlier)
                    if refusal is None and message.outputs:  # one completion (n <= 1)
                        generated += message.outputs[0].token_ids
                    if message.HasField("usage"):
                        admission.generated(message.usage.completion_tokens)
                        self.metrics.observe_usage(record, message.usage.cached_tokens)
                        if span is not None:
                            span.usage(message.usage)
                    yield message
                record.outcome = "OK"
                self.metrics.requests.labels(engine_id, "OK").inc()
                return
            except grpc.aio.AioRpcError as e:
                record.outcome = e.code().name
                self.metrics.requests.labels(engine_id, e.code().name).inc()
                if e.code() not in RETRYABLE_CODES:
                    await abort_with(context, e)
                    return
                if started:
                    if refusal is not None:
                        logger.warning("request %r: engine %s failed mid-stream (%s); not "
                                       "moved to another engine: %s", forward.request_id,
                                       engine_id, e.code().name, refusal)
                        await abort_with(context, e)
                        return
                    if max_tokens_left(forward, generated, self.limits.max_tokens) == 0:
                        # every token was relayed: only the message that ends it was lost
                        done = last_message(forward.request_id, len(forward.token_ids.ids),
                                            len(generated))
                        admission.generated(done.usage.completion_tokens)
                        yield done
                        return
                    logger.warning("request %r: engine %s failed after %d tokens (%s); "
                                   "going on on another engine", forward.request_id,
                                   engine_id, len(generated), e.code().name)
                    self.metrics.migrations.labels(engine_id).inc()
                    if span is not None:
                        span.migrated(engine_id, e.code().name, len(generated))
                    sending = continuation(forward, generated, self.limits.max_tokens)
                    try:  # hashed afresh: the engines holding its blocks are found again
                        prompt = await self.prepare(sending)
                    except NoEndpointError as no_model:
                        await abort_with(context, no_model)
                        return
                else:
                    logger.warning("request %r: engine %s failed before its first message "
                                   "(%s); trying another", forward.request_id, engine_id,
                                   e.code().name)
                    self.metrics.retries.labels(engine_id).inc()
                    if span is not None:
                        span.retried(engine_id, e.code().name)
                last_error = e
            finally:
                await stream.aclose()
        await abort_with(context, last_error)

    def _lacking_adapter(self, lora_name: str) -> set[str]:
        """Engines the request's LoRA adapter cannot run on (none for the base model): those
        not holding it, or, where the router knows a path to load it from, those that cannot
        load adapters. A NotFoundError naming it when no serving engine holds it and the
        router knows no path."""
        if not lora_name:
            return set()
        holding = self.pool.holding_adapter(lora_name)
        if self.adapter_sources.path_for(lora_name) is not None:
            able = self.pool.lora_capable()
            if able | holding:
                return set(self.pool.clients) - (able | holding)
        if not holding:
            raise NotFoundError("lora_name", f"the LoRA adapter {lora_name!r} is not loaded "
                                "on any engine")
        return set(self.pool.clients) - holding

    def _unable(self, task: str) -> set[str]:
        """Engines not to place ``task`` on ("generate": --runner pooling engines; "embed":
        kinds that serve no Embed), unless no other engine serves: then the request goes to
        one that refuses it with its own clear error."""
        unable = self.pool.unable(task)
        serving = {c.engine_id for c in self.pool.serving()}
        return set(unable) if serving - unable else set()

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """Place an Embed request as a Generate one (its prompt's cached blocks count) and
        return the engine's answer; an engine failing with a retryable status is retried on
        another one."""
        received = time.perf_counter()
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is shutting down")
        try:
            check_request_id(request.request_id)
            if request.cache_salt:
                check_cache_salt(request.cache_salt)
            if request.WhichOneof("prompt") == "text" and \
                    len(request.text) > self.limits.max_prompt_chars:
                raise FieldError("text", f"at most {self.limits.max_prompt_chars} characters, "
                                 f"got {len(request.text)}")
            prompt = await self._embed_prompt(request)
        except (ValueError, NoEndpointError) as e:
            await abort_with(context, e)
        # each input waits its turn as a generation does (priority, tenant share, shedding):
        # an embeddings flood is a tenant's demand like any other
        await self.admission.admit(request, context, len(prompt.token_ids), None)
        forward = pb.EmbedRequest()
        forward.CopyFrom(request)
        forward.token_ids.ids[:] = prompt.token_ids
        forward.request_id = request.request_id or uuid.uuid4().hex
        session_key = self._session_key(context)
        tried = self._unable("embed")
        last_error: BaseException | None = None
        for attempt in range(1, self.max_attempts + 1):
            placed = time.perf_counter()
            try:
                decision = self.place(prompt, tried, session_key)
            except NoEndpointError as e:
                await abort_with(context, last_error or e)
            record = self._record(forward.request_id, decision, attempt, len(prompt.token_ids),
                                  time.perf_counter() - placed, None)
            engine_id = decision.engine_id
            tried.add(engine_id)
            try:
                response = await self.pool.embed(
                    engine_id, forward, block_hashes=prompt.hashes,
                    num_uncached_tokens=len(prompt.token_ids) - decision.predicted_cached_tokens,
                    timeout_s=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                record.outcome = e.code().name
                self.metrics.requests.labels(engine_id, e.code().name).inc()
                if e.code() not in RETRYABLE_CODES:
                    await abort_with(context, e)
                self.metrics.retries.labels(engine_id).inc()
                last_error = e
                continue
            record.outcome = "OK"
            self.metrics.requests.labels(engine_id, "OK").inc()
            self.metrics.ttft_s.observe(time.perf_counter() - received)
            self.metrics.observe_usage(record, response.usage.cached_tokens)
            await context.send_initial_metadata(((ENGINE_ID_METADATA, engine_id),))
            return response
        await abort_with(context, last_error)

    async def _embed_prompt(self, request: pb.EmbedRequest) -> RoutedPrompt:
        """The prompt as the engine will pool it: truncated first (``truncate_prompt_tokens``)
        so that its blocks, and so its placement, are those the engine computes."""
        prompt = await self.prepare(request)
        if not request.HasField("truncate_prompt_tokens"):
            return prompt
        keep, side = request.truncate_prompt_tokens, request.truncation_side or "right"
        if keep == 0 or keep < -1:
            raise FieldError("truncate_prompt_tokens", f"must be -1 (max_model_len) or a "
                             f"positive integer, got {keep}")
        if side not in ("left", "right"):
            raise FieldError("truncation_side", f"must be left or right, got {side!r}")
        lengths = [c.info.max_model_len for c in self.pool.serving() if c.info is not None]
        limit = min(lengths) if lengths else None
        if limit is not None and keep > limit:  # as vLLM refuses it
            raise FieldError("truncate_prompt_tokens", f"must be at most max_model_len "
                             f"({limit}), got {keep}")
        if keep == -1:
            keep = limit if limit is not None else len(prompt.token_ids)
        if len(prompt.token_ids) <= keep:
            return prompt
        ids = prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep]
        truncated = pb.EmbedRequest(token_ids=pb.TokenIds(ids=ids),
                                    cache_salt=request.cache_salt)
        return await self.prepare(truncated)

    def _record(self, request_id: str, decision: Decision, attempt: int, num_tokens: int,
                placement_s: float, span: RouterSpan | None) -> DecisionRecord:
        self.metrics.placement_s.observe(placement_s)
        if span is not None:
            span.placed(decision, attempt, request_id, num_tokens)
        logger.info("request %r -> engine %s (attempt %d, policy %s, score %.4f, predicted "
                    "cached tokens %d of %d, placed in %.0f us)", request_id,
                    decision.engine_id, attempt, decision.policy,
                    decision.scores[decision.engine_id], decision.predicted_cached_tokens,
                    num_tokens, placement_s * 1e6)
        return self.metrics.decisions.add(DecisionRecord(
            request_id=request_id, engine_id=decision.engine_id, policy=decision.policy,
            attempt=attempt, scores=dict(decision.scores), num_prompt_tokens=num_tokens,
            predicted_cached_tokens=decision.predicted_cached_tokens,
            placement_us=placement_s * 1e6))

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        infos = [c.info for c in self.pool.serving() if c.info is not None]
        if not infos:
            await abort_with(context, NoEndpointError("no engine is serving"))
        first = infos[0]
        adapters = self.pool.adapters()
        # Hashing fields are equal on every engine (admission checked them); capacity adds up
        # and the length limit is the smallest, so any engine can take what the router accepts.
        return pb.ModelInfo(
            model_name=first.model_name, max_model_len=min(i.max_model_len for i in infos),
            block_size=first.block_size, block_hash_algorithm=first.block_hash_algorithm,
            block_hash_seed=first.block_hash_seed, tokenizer_digest=first.tokenizer_digest,
            vocab_size=first.vocab_size,
            enable_prefix_caching=all(i.enable_prefix_caching for i in infos),
            num_kv_blocks=sum(i.num_kv_blocks for i in infos),
            # LoRA: every adapter some engine holds (the router places it on those)
            enable_lora=any(i.enable_lora for i in infos),
            max_loras=max(i.max_loras for i in infos),
            max_lora_rank=max(i.max_lora_rank for i in infos),
            max_cpu_loras=max(i.max_cpu_loras for i in infos),
            lora_adapters=list(adapters), lora_adapter_paths=list(adapters.values()),
            **{name: getattr(first, name) for name in _SHARED_DESCRIPTION
               if all(getattr(i, name) == getattr(first, name) for i in infos)},
            **{name: sum(getattr(i, name) for i in infos) for name in _SUMMED_COUNTERS},
            spec_decode_num_accepted_tokens_per_pos=_summed_per_pos(infos))

    async def LoadLoRAAdapter(self, request, context) -> pb.LoadLoRAAdapterResponse:
        """Load on every serving engine, as the HTTP front's /v1/load_lora_adapter does."""
        try:
            if request.lora_name in {c.info.model_name for c in self.pool.serving() if c.info}:
                raise FieldError("lora_name", f"{request.lora_name!r} is the base model's "
                                 "name: an adapter needs a name of its own")
            loaded = await load_everywhere(self.pool, request.lora_name, request.lora_path,
                                           context.time_remaining(), self.adapter_sources)
        except Exception as e:  # noqa: BLE001 - mapped to a status, named where known
            await abort_with(context, e)
        return pb.LoadLoRAAdapterResponse(loaded=loaded > 0)

    async def UnloadLoRAAdapter(self, request, context) -> pb.UnloadLoRAAdapterResponse:
        """Unload from every serving engine holding it (NOT_FOUND when none does)."""
        try:
            await unload_everywhere(self.pool, request.lora_name, context.time_remaining(),
                                    self.adapter_sources)
        except Exception as e:  # noqa: BLE001 - mapped to a status, named where known
            await abort_with(context, e)
        return pb.UnloadLoRAAdapterResponse()

    async def GetTokenizer(self, request, context) -> pb.TokenizerFiles:
        """The first serving engine's tokenizer files (engines of a kind that serves none, such
        as vLLM's, are skipped)."""
        serving = self.pool.serving()
        if not serving:
            await abort_with(context, NoEndpointError("no engine is serving"))
        for client in serving:
            files = await client.fetch_tokenizer(timeout_s=context.time_remaining())
            if files is not None:
                return files
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "no serving engine serves tokenizer files (vLLM engines do not)")

    async def StreamLoad(self, request: pb.StreamLoadRequest, context):
        """The pool's load: sums over serving engines, KV usage averaged."""
        async for report in load_reports(request, self._pool_load):
            yield report

    def _pool_load(self) -> pb.LoadReport:
        loads = self.pool.serving_loads()
        report = pb.LoadReport(
            num_running=sum(x.num_running for x in loads),
            num_waiting=sum(x.num_waiting for x in loads),
            num_queued_tokens=sum(x.num_queued_tokens for x in loads),
            kv_cache_usage=sum(x.kv_cache_usage for x in loads) / max(len(loads), 1))
        if loads and all(x.HasField("batch_full") for x in loads):  # room in any: not full
            report.batch_full = all(x.batch_full for x in loads)
        return report

    async def StreamKVEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "a router has no KV cache of its own: subscribe to each engine's "
                            "StreamKVEvents")
        yield  # pragma: no cover - makes this an async generator


def _summed_per_pos(infos) -> list[int]:
    """The engines' accepted draft tokens at each draft position, added up."""
    out: list[int] = []
    for info in infos:
        for k, count in enumerate(info.spec_decode_num_accepted_tokens_per_pos):
            if k == len(out):
                out.append(0)
            out[k] += count
    return out


def _adapter_load_error(lora_name: str, error: grpc.aio.AioRpcError) -> BaseException:
    """What the client hears when its adapter could not be loaded where it was placed (and no
    other engine holds it): no adapter by that name at its path is NOT_FOUND naming it; a bad
    one (rank, target modules, a corrupt file) the engine's INVALID_ARGUMENT naming it; any
    other failure as the engine said it."""
    if error.code() == grpc.StatusCode.NOT_FOUND:
        return NotFoundError("lora_name", f"the LoRA adapter {lora_name!r} is not loaded on "
                             f"any engine, and none was found to load: {error.details()}")
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return FieldError("lora_name", f"the LoRA adapter {lora_name!r} could not be loaded: "
                          f"{error.details()}")
    return error
