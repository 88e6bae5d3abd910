"""The quire.v1.EngineService servicer: thin, it converts and streams; the engine batches.

With tracing on, each Generate call also feeds an ``EngineSpan`` (engine_worker.server.tracing),
written once the request ends; the engine loop itself does no tracing work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from engine_worker.server.async_engine import AsyncEngine
from engine_worker.server.convert import RequestLimits, request_from_proto, response_to_proto
from engine_worker.server.errors import abort_with
from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.tokenizer_digest import TOKENIZER_FILES, tokenizer_dir_digest
from quire.kv_events import batch_to_proto, snapshot_to_proto
from quire.load_stream import load_reports
from quire.tracing import traced_generate
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc

if TYPE_CHECKING:
    from engine_worker.server.tracing import EngineSpan

logger = logging.getLogger(__name__)


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncEngine, *, model_name: str, limits: RequestLimits,
                 tokenizer_dir: Path,
                 spans: Callable[[pb.GenerateRequest, object], EngineSpan] | None = None
                 ) -> None:
        """``spans`` (request, invocation metadata) -> an ``EngineSpan``: given when tracing
        is on, None when off."""
        self.engine = engine
        self.spans = spans
        self.model_name = model_name
        self.limits = limits
        self._tokenizer_dir = Path(tokenizer_dir)
        self._tokenizer_digest = tokenizer_dir_digest(tokenizer_dir)
        self.draining = False

    @traced_generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       span: EngineSpan | None):
        """Run one request on the engine and stream its outputs (DELTA)."""
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        try:
            prompt, params, priority, salt = request_from_proto(request, self.limits)
        except ValueError as e:
            await abort_with(context, e)
            return
        first = True
        counts: dict[int, int] = {}
        try:
            async for output in self.engine.generate(request.request_id, prompt, params,
                                                     priority=priority, cache_salt=salt):
                if span is not None:
                    span.observe(output)
                message = response_to_proto(output, first)
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
            await abort_with(context, e)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        engine = self.engine.engine
        return pb.ModelInfo(
            model_name=self.model_name, max_model_len=engine.max_model_len,
            block_size=engine.block_size,
            block_hash_algorithm=BLOCK_HASH_ALGORITHM, block_hash_seed=ROOT_HASH,
            tokenizer_digest=self._tokenizer_digest, vocab_size=engine.tokenizer.vocab_size,
            enable_prefix_caching=engine.enable_prefix_caching,
            num_kv_blocks=engine.num_blocks, backend=engine.backend.name,
            backend_reason=engine.backend.reason, backend_fallback=engine.backend.fallback,
            cuda_graphs=engine.cuda_graphs)

    async def GetTokenizer(self, request, context) -> pb.TokenizerFiles:
        files = {name: (self._tokenizer_dir / name).read_bytes() for name in TOKENIZER_FILES
                 if (self._tokenizer_dir / name).is_file()}
        if "tokenizer.json" not in files:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                "this engine's tokenizer has no tokenizer.json")
        return pb.TokenizerFiles(files=files, digest=self._tokenizer_digest)

    async def StreamLoad(self, request: pb.StreamLoadRequest, context):
        async for report in load_reports(request, self._load_report):
            yield report

    def _load_report(self) -> pb.LoadReport:
        load = self.engine.load
        return pb.LoadReport(num_running=load.num_running, num_waiting=load.num_waiting,
                             num_queued_tokens=load.num_queued_tokens,
                             kv_cache_usage=load.kv_cache_usage)

    async def StreamKVEvents(self, request, context):
        try:
            snapshot, sink = await self.engine.subscribe_kv_events()
        except Exception as e:
            await abort_with(context, e)
            return
        try:
            yield pb.KVEventsMessage(snapshot=snapshot_to_proto(snapshot))
            while True:
                batch = await sink.get()
                if batch is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine stopped")
                    return
                yield pb.KVEventsMessage(batch=batch_to_proto(batch))
        finally:
            self.engine.unsubscribe_kv_events(sink)
