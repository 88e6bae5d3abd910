"""The quire.v1.EngineService servicer: thin, it converts and streams; the engine batches.

With tracing on, each Generate call also feeds an ``EngineSpan`` (engine_worker.server.tracing),
written once the request ends; the engine loop itself does no tracing work.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from engine_worker.lora.cache import UnknownLoRAError
from engine_worker.lora.paths import check_adapter_path
from engine_worker.server.async_engine import AsyncEngine, EngineUnavailableError
from engine_worker.server.convert import (RequestLimits, embed_request_from_proto,
                                          embed_response_to_proto, request_from_proto,
                                          response_to_proto, wire_error)
from engine_worker.server.errors import abort_with
from engine_worker.server.generate_many import GenerateManyStream, ProtocolError
from quire.errors import FieldError
from quire.limits import check_lora_name
from quire.tokenizer_digest import TOKENIZER_FILES
from quire.kv_events import batch_to_proto, snapshot_to_proto
from quire.load_stream import load_reports
from quire.tracing import traced_generate
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc

if TYPE_CHECKING:
    from engine_worker.engine_info import EngineInfo
    from engine_worker.server.tracing import EngineSpan

logger = logging.getLogger(__name__)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncEngine, *, info: EngineInfo, model_name: str,
                 limits: RequestLimits,
                 spans: Callable[[pb.GenerateRequest, object], EngineSpan] | None = None,
                 lora_adapter_dirs: tuple[Path, ...] = ()) -> None:
        """``info``: the engine's facts (GetModelInfo, GetTokenizer); ``spans`` (request,
        invocation metadata) -> an ``EngineSpan``: given when tracing is on, None when off;
        ``lora_adapter_dirs``: where LoadLoRAAdapter may read adapters (empty: nowhere)."""
        self.lora_adapter_dirs = lora_adapter_dirs
        self.engine = engine
        self.info = info
        self.spans = spans
        self.model_name = model_name
        self.limits = limits
        self.draining = False
        # Drawn once per engine process: a router seeing another id at this address knows the
        # engine restarted and that the blocks it indexed here are gone.
        self.incarnation_id = uuid.uuid4().hex
        self._load_readers = 0  # StreamLoad calls open now

    @traced_generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       span: EngineSpan | None):
        """Run one request on the engine and stream its outputs (DELTA)."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        try:
            prompt, params, priority, salt = request_from_proto(request, self.limits)
        except ValueError as e:
            await abort_with(context, wire_error(e, sampling=True))
            return
        first = True
        counts: dict[int, int] = {}
        try:
            async for output in self.engine.generate(request.request_id, prompt, params,
                                                     priority=priority, cache_salt=salt,
                                                     lora_name=request.lora_name or None):
                if span is not None:
                    span.observe(output)
                message = response_to_proto(output, first,
                                            num_logprobs=params.logprobs or 0,
                                            num_prompt_logprobs=params.prompt_logprobs or 0)
                first = False
                for completion in output.outputs:
                    counts[completion.index] = counts.get(completion.index, 0) + \
                        len(completion.token_ids)
                if output.finished:
                    message.usage.CopyFrom(pb.Usage(
                        prompt_tokens=len(output.prompt_token_ids),
                        completion_tokens=sum(counts.values()),
                        cached_tokens=max(0, output.num_cached_tokens)))
                yield message
        except (asyncio.CancelledError, GeneratorExit):
            raise  # the engine side aborts the request (AsyncEngine.generate's finally)
        except Exception as e:
            await abort_with(context, wire_error(e, sampling=True))

    async def GenerateMany(self, requests, context: grpc.aio.ServicerContext):
        """Many Generate calls on one stream (a router's), their news a message a turn."""
        stream = GenerateManyStream(self.Generate, peer=context.peer())
        try:
            async for message in stream.serve(requests):
                yield message
        except ProtocolError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Embed(self, request: pb.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """Pool one prompt on the engine (a pooling request batched with the step)."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        try:
            prompt, params, priority, salt = embed_request_from_proto(request, self.limits)
            output = await self.engine.embed(request.request_id, prompt, params,
                                             priority=priority, cache_salt=salt)
        except Exception as e:  # noqa: BLE001 - mapped to a status, named where known
            await abort_with(context, wire_error(e, sampling=False))
            return pb.EmbedResponse()  # not reached: abort raises
        if output.outputs is None:
            await context.abort(grpc.StatusCode.ABORTED, "the request was aborted")
        return embed_response_to_proto(output)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        """The engine's facts, fixed at start: what a router checks before it routes here;
        and speculative decoding's totals as of the last step."""
        info = self.info
        spec = self.engine.load.spec_decoding
        spec_fields = {} if spec is None else dict(
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos))
        loras = {}
        if info.enable_lora:  # read between steps, on the engine's thread
            try:
                loras = await self.engine.call(lambda engine: engine.list_loras())
            except EngineUnavailableError:
                pass  # a dead engine still says what it is; it serves no adapter
        lora_fields = dict(enable_lora=info.enable_lora, max_loras=info.max_loras,
                           max_lora_rank=info.max_lora_rank, max_cpu_loras=info.max_cpu_loras,
                           lora_adapters=list(loras),
                           lora_adapter_paths=[r.lora_path for r in loras.values()])
        return pb.ModelInfo(
            **lora_fields, model_name=self.model_name, max_model_len=info.max_model_len,
            block_size=info.block_size, block_hash_algorithm=info.block_hash_algorithm,
            block_hash_seed=info.block_hash_seed, tokenizer_digest=info.tokenizer_digest,
            vocab_size=info.vocab_size, enable_prefix_caching=info.enable_prefix_caching,
            num_kv_blocks=info.num_kv_blocks, backend=info.backend,
            backend_reason=info.backend_reason, backend_fallback=info.backend_fallback,
            cuda_graphs=info.cuda_graphs, quantization=info.quantization,
            speculative_config=info.speculative_config, runner=info.runner,
            pooling_type=info.pooling_type, pooling_normalize=info.pooling_normalize,
            hidden_size=info.hidden_size, tensor_parallel_size=info.tensor_parallel_size,
            pipeline_parallel_size=info.pipeline_parallel_size,
            all_reduce_backend=info.all_reduce_backend,
            distributed_executor_backend=info.distributed_executor_backend,
            layer_execution=info.layer_execution, incarnation_id=self.incarnation_id,
            generate_many=True, **spec_fields)

    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest,
                              context) -> pb.LoadLoRAAdapterResponse:
        """Load, check and register an adapter from inside the adapter directories."""
        try:
            if not request.lora_name:
                raise FieldError("lora_name", "must be a non-empty string")
            check_lora_name(request.lora_name)
            if request.lora_name == self.model_name:
                raise FieldError("lora_name", f"{request.lora_name!r} is the base model's name: "
                                 "an adapter needs a name of its own")
            path = check_adapter_path(request.lora_path, self.lora_adapter_dirs)
            loaded = await self.engine.call(lambda engine: engine.add_lora(
                engine.lora_request_for(request.lora_name, path)))
        except Exception as e:  # noqa: BLE001 - mapped to a status, named where known
            await abort_with(context, e)
            return pb.LoadLoRAAdapterResponse()  # not reached: abort raises
        logger.info("LoRA adapter %r loaded from %s", request.lora_name, path)
        return pb.LoadLoRAAdapterResponse(loaded=loaded)

    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest,
                                context) -> pb.UnloadLoRAAdapterResponse:
        try:
            removed = await self.engine.call(lambda engine: engine.remove_lora(
                request.lora_name))
            if not removed:
                raise UnknownLoRAError(request.lora_name)
        except Exception as e:  # noqa: BLE001 - mapped to a status, named where known
            await abort_with(context, e)
        return pb.UnloadLoRAAdapterResponse()

    async def GetTokenizer(self, request, context) -> pb.TokenizerFiles:
        """The files a router needs to tokenize exactly as this engine does."""
        directory = self.info.tokenizer_dir
        files = {name: (directory / name).read_bytes() for name in TOKENIZER_FILES
                 if (directory / name).is_file()}
        if "tokenizer.json" not in files:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                "this engine's tokenizer has no tokenizer.json")
        return pb.TokenizerFiles(files=files, digest=self.info.tokenizer_digest)

    async def StreamLoad(self, request: pb.StreamLoadRequest, context):
        # each router reading this engine's load (num_load_readers); a monitor is not one
        counted = int(request.admits_requests)
        self._load_readers += counted
        try:
            async for report in load_reports(request, self._load_report):
                yield report
        finally:
            self._load_readers -= counted

    def _load_report(self) -> pb.LoadReport:
        load = self.engine.load
        report = pb.LoadReport(num_running=load.num_running, num_waiting=load.num_waiting,
                               num_queued_tokens=load.num_queued_tokens,
                               kv_cache_usage=load.kv_cache_usage, batch_full=load.batch_full,
                               num_load_readers=self._load_readers)
        lora = load.lora
        if lora is not None:  # what a router places adapters by
            report.running_lora_adapters[:] = lora.running_adapters
            report.waiting_lora_adapters[:] = lora.waiting_adapters
            report.loaded_lora_adapters[:] = lora.loaded_adapters
            report.max_loras = lora.max_loras
            report.num_lora_adapter_loads = lora.num_adapter_loads
            report.lora_adapter_load_s = lora.mean_load_s
        return report

    async def StreamKVEvents(self, request, context):
        try:
            snapshot, sink = await self.engine.subscribe_kv_events()
        except Exception as e:
            await abort_with(context, e)
            return
        try:
            message = pb.KVEventsMessage(snapshot=snapshot_to_proto(snapshot))
            message.snapshot.incarnation_id = self.incarnation_id
            yield message
            while True:
                batch = await sink.get()
                if batch is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine stopped")
                    return
                yield pb.KVEventsMessage(batch=batch_to_proto(batch))
        finally:
            self.engine.unsubscribe_kv_events(sink)
