"""One engine as the router reaches it: a grpc.aio channel, the admission check, the feeds that
keep the router's view fresh, and per-request Generate calls.

A client supervises its engine for as long as discovery lists it:

    UNREACHABLE --GetModelInfo ok, admitted--> (health watch) SERVING <--> NOT_SERVING
         ^                 |                              |
         |                 +--refused--> REFUSED (re-checked every refused_recheck_s)
         +------------- health stream broke (engine gone, restarting) ----+

- Admission (``admit``, supplied by the pool) refuses an engine that would make the router's
  block hashes wrong (another block size, hash algorithm, seed or tokenizer): routing on hashes
  the engine does not share would send every request to the wrong place while looking healthy.
  It runs again after every reconnect, since a restarted pod may serve something else.
- ``grpc.health.v1`` Watch is the engine's own readiness: a draining or dead engine says
  NOT_SERVING, a vanished one breaks the stream. Either takes it out of placement at once.
- The KV feed mirrors the engine's cache into the shared ``PrefixIndex`` (snapshot, then
  batches; a gap or broken stream drops the entry and re-subscribes). While it is down the
  router places this engine by its approximate index (``kv_feed_alive`` is False).
- The load feed keeps the latest ``LoadReport``; while it is down the load counts as unknown
  (zero), and the router's own in-flight count still applies.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quire.kv_events import batch_from_proto, snapshot_from_proto
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.balancer import EndpointSnapshot
from router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

ENGINE_SERVICE = "quire.v1.EngineService"
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


class EngineState(enum.Enum):
    UNREACHABLE = "unreachable"
    REFUSED = "refused"
    NOT_SERVING = "not_serving"
    SERVING = "serving"


@dataclass(frozen=True, slots=True)
class ClientOptions:
    load_interval_ms: int = 100
    connect_timeout_s: float = 10.0
    min_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    refused_recheck_s: float = 30.0
    prefill_tokens_per_s: float = 2000.0  # assumed prefill rate, for placement estimates
    max_message_bytes: int = 64 << 20  # GetTokenizer answers can be tens of MB
    credentials: grpc.ChannelCredentials | None = None  # None: plaintext
    server_name: str | None = None  # TLS: name to check in the engine's certificate


# Called on every (re)connect; raises EngineMismatchError to refuse the engine.
Admit = Callable[["EngineClient", pb.ModelInfo], Awaitable[None]]


class EngineClient:
    """The router's connection to one engine pod. ``start()`` it, ``await close()`` it."""

    def __init__(self, engine_id: str, address: str, *, index: PrefixIndex, admit: Admit,
                 options: ClientOptions = ClientOptions(),
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.engine_id = engine_id
        self.address = address
        self.index = index
        self.admit = admit
        self.options = options
        self.state = EngineState.UNREACHABLE
        self.info: pb.ModelInfo | None = None
        self.refusal: EngineMismatchError | None = None
        self.load: pb.LoadReport | None = None
        self.inflight_tokens = 0  # prompt tokens sent whose prefill has not answered yet
        self.kv_feed_alive = False
        self.channel = self._open_channel()
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._supervisor: asyncio.Task | None = None
        self._feeds: list[asyncio.Task] = []
        self._closed = False
        self.on_change = on_change  # called on every state change (the pool's readiness)

    def _open_channel(self) -> grpc.aio.Channel:
        options = [("grpc.max_receive_message_length", self.options.max_message_bytes)]
        if self.options.server_name:
            options.append(("grpc.ssl_target_name_override", self.options.server_name))
        if self.options.credentials is not None:
            return grpc.aio.secure_channel(self.address, self.options.credentials, options)
        return grpc.aio.insecure_channel(self.address, options)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name=f"engine {self.engine_id}")

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._supervisor, *self._feeds) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._feeds = []
        self.index.remove_engine(self.engine_id)
        self.kv_feed_alive = False
        self.state = EngineState.UNREACHABLE  # closed by the router: nothing to warn about
        await self.channel.close()

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.SERVING and not self._closed

    def _set_state(self, state: EngineState) -> None:
        if state is not self.state:
            logger.log(logging.INFO if state is EngineState.SERVING else logging.WARNING,
                       "engine %s at %s: %s -> %s", self.engine_id, self.address,
                       self.state.value, state.value)
            self.state = state
            self.on_change()

    async def _supervise(self) -> None:
        backoff_s = self.options.min_backoff_s
        health = health_pb2_grpc.HealthStub(self.channel)
        while not self._closed:
            try:
                info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                    timeout=self.options.connect_timeout_s)
                await self.admit(self, info)
            except EngineMismatchError as e:
                if self.state is not EngineState.REFUSED:
                    logger.error("refusing %s", e)
                self.refusal = e
                self._stop_feeds()
                self._set_state(EngineState.REFUSED)
                await asyncio.sleep(self.options.refused_recheck_s)
                continue
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s unreachable: %s", self.engine_id, e.code().name)
                self._set_state(EngineState.UNREACHABLE)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self.options.max_backoff_s)
                continue
            self.info, self.refusal = info, None
            self._start_feeds()
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest(
                        service=ENGINE_SERVICE)):
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    self._set_state(EngineState.SERVING if serving else EngineState.NOT_SERVING)
                    backoff_s = self.options.min_backoff_s
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s health watch ended: %s", self.engine_id, e.code().name)
            self._set_state(EngineState.UNREACHABLE)
            await asyncio.sleep(backoff_s)

    # ---------------------------------------------------------------------- state
    def snapshot(self, cached_blocks: int = 0) -> EndpointSnapshot:
        """The engine at decision time; ``cached_blocks`` comes from the prefix index match."""
        load = self.load if self.load is not None else pb.LoadReport()
        return EndpointSnapshot(
            engine_id=self.engine_id, healthy=self.healthy, cached_blocks=cached_blocks,
            block_size=self.info.block_size if self.info else 1, num_running=load.num_running,
            num_waiting=load.num_waiting, num_queued_tokens=load.num_queued_tokens,
            kv_cache_usage=min(max(load.kv_cache_usage, 0.0), 1.0),
            inflight_tokens=self.inflight_tokens,
            prefill_tokens_per_s=self.options.prefill_tokens_per_s)

    # ------------------------------------------------------------------- requests
    async def generate(self, request: pb.GenerateRequest, *, num_uncached_tokens: int,
                       timeout_s: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Relay the engine's stream. Closing the iterator (or cancelling the task reading it)
        cancels the upstream call, which aborts the request on the engine.

        ``num_uncached_tokens`` (the prefill the router expects this request to cost) counts
        as in-flight work until the first message: the engine's load reports lag behind."""
        num_tokens = num_uncached_tokens
        self.inflight_tokens += num_tokens
        call = self.stub.Generate(request, timeout=timeout_s, metadata=metadata or None)
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
    def _start_feeds(self) -> None:
        if not self._feeds:
            self._feeds = [asyncio.create_task(self._follow_kv_events()),
                           asyncio.create_task(self._follow_load())]

    def _stop_feeds(self) -> None:
        for task in self._feeds:
            task.cancel()
        self._feeds = []
        self.index.remove_engine(self.engine_id)
        self.kv_feed_alive = False
        self.load = None

    async def _follow_kv_events(self) -> None:
        backoff_s = self.options.min_backoff_s
        while not self._closed:
            call = self.stub.StreamKVEvents(pb.StreamKVEventsRequest())
            try:
                async for message in call:
                    if message.HasField("snapshot"):
                        self.index.reset_from_snapshot(self.engine_id,
                                                       snapshot_from_proto(message.snapshot))
                        self.kv_feed_alive = True
                        backoff_s = self.options.min_backoff_s
                    elif not self.index.apply(self.engine_id, batch_from_proto(message.batch)):
                        logger.warning("engine %s: KV event gap, re-subscribing", self.engine_id)
                        break
            except grpc.aio.AioRpcError as e:
                logger.warning("engine %s: KV event feed broke (%s), re-subscribing",
                               self.engine_id, e.code().name)
            finally:
                call.cancel()
                self.kv_feed_alive = False
                self.index.remove_engine(self.engine_id)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.options.max_backoff_s)

    async def _follow_load(self) -> None:
        backoff_s = self.options.min_backoff_s
        while not self._closed:
            call = self.stub.StreamLoad(
                pb.StreamLoadRequest(interval_ms=self.options.load_interval_ms))
            try:
                async for report in call:
                    self.load = report
                    backoff_s = self.options.min_backoff_s
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s: load feed broke (%s)", self.engine_id, e.code().name)
            finally:
                call.cancel()
                self.load = None
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self.options.max_backoff_s)
