"""One engine as the router reaches it: a grpc.aio channel, the model-identity check, the
KV-event and load feeds that keep the router's view fresh, and per-request Generate calls.

``connect`` refuses an engine that would make the router's block hashes wrong (another block
size, hash algorithm, seed or tokenizer): routing on hashes the engine does not share would
send every request to the wrong place while looking healthy. After ``connect`` two background
tasks run until ``close``:

- the KV feed: a snapshot resets the engine's entry in the shared ``PrefixIndex``, every later
  batch is applied; on a gap or a broken stream the entry is dropped and the feed re-subscribes
  (a fresh snapshot) after a short backoff;
- the load feed: keeps the latest ``LoadReport``.

The engine counts as healthy while both feeds are alive: a dead feed means the router is
blind to the engine, and in practice that the engine is gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from quire.kv_events import batch_from_proto, snapshot_from_proto
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.balancer import EndpointSnapshot
from router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

_CHECKED_FIELDS = ("block_size", "block_hash_algorithm", "block_hash_seed", "tokenizer_digest")


@dataclass(frozen=True, slots=True)
class ModelExpectation:
    """What the router hashes with; an engine must report exactly these in GetModelInfo."""

    block_size: int
    block_hash_algorithm: str
    block_hash_seed: int
    tokenizer_digest: str

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


class EngineMismatchError(RuntimeError):
    """The engine hashes or tokenizes differently from the router; it is refused."""

    def __init__(self, engine_id: str, differences: dict[str, tuple[object, object]]) -> None:
        self.engine_id = engine_id
        self.differences = differences  # field -> (router expects, engine reports)
        detail = ", ".join(f"{name}: router expects {want!r}, engine reports {got!r}"
                           for name, (want, got) in differences.items())
        super().__init__(f"engine {engine_id} refused: {detail}")


def compare_model_info(engine_id: str, expected: ModelExpectation, info: pb.ModelInfo) -> None:
    """Raise ``EngineMismatchError`` naming every field that differs."""
    differences = {name: (getattr(expected, name), getattr(info, name))
                   for name in _CHECKED_FIELDS if getattr(expected, name) != getattr(info, name)}
    if differences:
        raise EngineMismatchError(engine_id, differences)


class EngineClient:
    """The router's connection to one engine pod."""

    def __init__(self, engine_id: str, address: str, *, index: PrefixIndex,
                 expected: ModelExpectation, load_interval_ms: int = 100,
                 connect_timeout_s: float = 10.0, resubscribe_backoff_s: float = 0.1,
                 max_backoff_s: float = 2.0) -> None:
        self.engine_id = engine_id
        self.address = address
        self.index = index
        self.expected = expected
        self.load_interval_ms = load_interval_ms
        self.connect_timeout_s = connect_timeout_s
        self.resubscribe_backoff_s = resubscribe_backoff_s
        self.max_backoff_s = max_backoff_s
        self.info: pb.ModelInfo | None = None
        self.load: pb.LoadReport | None = None
        self.inflight_tokens = 0  # prompt tokens sent whose prefill has not answered yet
        self._channel: grpc.aio.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None
        self._kv_alive = False
        self._load_alive = False
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    async def connect(self) -> pb.ModelInfo:
        """Check the engine's model identity and start the feeds.

        Raises ``EngineMismatchError`` (the engine is refused, the channel closed) or
        ``grpc.aio.AioRpcError`` when the engine cannot be reached.
        """
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        try:
            info = await self._stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                 timeout=self.connect_timeout_s,
                                                 wait_for_ready=True)
            compare_model_info(self.engine_id, self.expected, info)
        except EngineMismatchError as e:
            logger.error("refusing %s", e)
            await self._channel.close()
            raise
        except BaseException:
            await self._channel.close()
            raise
        if not info.enable_prefix_caching:
            logger.warning("engine %s has prefix caching off: prefix-aware placement is moot",
                           self.engine_id)
        self.info = info
        self._tasks = [asyncio.create_task(self._follow_kv_events()),
                       asyncio.create_task(self._follow_load())]
        logger.info("engine %s at %s connected (%s, block_size %d)", self.engine_id,
                    self.address, info.model_name, info.block_size)
        return info

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.index.remove_engine(self.engine_id)
        self._kv_alive = self._load_alive = False
        if self._channel is not None:
            await self._channel.close()

    # ---------------------------------------------------------------------- state
    @property
    def healthy(self) -> bool:
        return self.info is not None and not self._closed and self._kv_alive and self._load_alive

    def snapshot(self, cached_blocks: int = 0) -> EndpointSnapshot:
        """The engine at decision time; ``cached_blocks`` comes from the prefix index match."""
        load = self.load or pb.LoadReport()
        return EndpointSnapshot(
            engine_id=self.engine_id, healthy=self.healthy, cached_blocks=cached_blocks,
            block_size=self.expected.block_size, num_running=load.num_running,
            num_waiting=load.num_waiting, num_queued_tokens=load.num_queued_tokens,
            kv_cache_usage=min(max(load.kv_cache_usage, 0.0), 1.0),
            inflight_tokens=self.inflight_tokens)

    # ------------------------------------------------------------------- requests
    async def generate(self, request: pb.GenerateRequest,
                       timeout_s: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """Relay the engine's stream. Closing the iterator (or cancelling the task reading it)
        cancels the upstream call, which aborts the request on the engine."""
        if self._stub is None:
            raise RuntimeError(f"engine {self.engine_id}: generate before connect")
        num_tokens = len(request.token_ids.ids)
        self.inflight_tokens += num_tokens
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for message in call:
                if num_tokens:
                    self.inflight_tokens -= num_tokens  # prefill done: the load report has it
                    num_tokens = 0
                yield message
        finally:
            self.inflight_tokens -= num_tokens
            if not call.done():
                call.cancel()

    # ---------------------------------------------------------------------- feeds
    async def _follow_kv_events(self) -> None:
        backoff_s = self.resubscribe_backoff_s
        while not self._closed:
            call = self._stub.StreamKVEvents(pb.StreamKVEventsRequest())
            try:
                async for message in call:
                    if message.HasField("snapshot"):
                        self.index.reset_from_snapshot(self.engine_id,
                                                       snapshot_from_proto(message.snapshot))
                        self._kv_alive = True
                        backoff_s = self.resubscribe_backoff_s
                    elif not self.index.apply(self.engine_id, batch_from_proto(message.batch)):
                        logger.warning("engine %s: KV event gap, re-subscribing", self.engine_id)
                        break
            except grpc.aio.AioRpcError as e:
                logger.warning("engine %s: KV event feed broke (%s), re-subscribing",
                               self.engine_id, e.code().name)
            finally:
                call.cancel()
                self._kv_alive = False
                self.index.remove_engine(self.engine_id)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.max_backoff_s)

    async def _follow_load(self) -> None:
        backoff_s = self.resubscribe_backoff_s
        while not self._closed:
            call = self._stub.StreamLoad(pb.StreamLoadRequest(interval_ms=self.load_interval_ms))
            try:
                async for report in call:
                    self.load = report
                    self._load_alive = True
                    backoff_s = self.resubscribe_backoff_s
            except grpc.aio.AioRpcError as e:
                logger.warning("engine %s: load feed broke (%s)", self.engine_id, e.code().name)
            finally:
                call.cancel()
                self._load_alive = False
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.max_backoff_s)
