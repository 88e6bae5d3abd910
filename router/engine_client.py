"""A Quire engine as the router reaches it (``EngineConnection`` of kind ``quire``): a grpc.aio
channel, the admission check, the feeds that keep the router's view fresh, and per-request
Generate calls.

- Admission (the pool's ``admit``, then ``check_identity``) refuses an engine that would make the
  router's block hashes wrong (another hash algorithm, seed or tokenizer): routing on hashes
  the engine does not share would send every request to the wrong place while looking healthy.
  It runs again after every reconnect, since a restarted pod may serve something else.
- ``grpc.health.v1`` Watch is the engine's own readiness: a draining or dead engine says
  NOT_SERVING, a vanished one breaks the stream. Either takes it out of placement at once.
- The KV feed (snapshot, then batches) and the load feed are *reported* to the pool, which
  alone writes the routing state (``router.pool``). A gap or a broken stream is reported as a
  lost feed, and the client re-subscribes with backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quire.kv_events import batch_from_proto, snapshot_from_proto
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.backoff import Backoff
from router.connection import (ClientOptions, EngineMismatchError, EngineReports, EngineState,
                               ModelExpectation, ModelIdentity, change_state, refuse)
from router.endpoint import Endpoint
from router.generate_many import GenerateMany

logger = logging.getLogger(__name__)

ENGINE_SERVICE = "quire.v1.EngineService"
# Not the block size: the router hashes each prompt at every block size its engines use.
_CHECKED_FIELDS = ("block_hash_algorithm", "block_hash_seed", "tokenizer_digest",
                   "quantization")


def compare_model_info(engine_id: str, expected: ModelExpectation, info: pb.ModelInfo) -> None:
    """Raise ``EngineMismatchError`` naming every field that differs."""
    differences = {name: (getattr(expected, name), getattr(info, name))
                   for name in _CHECKED_FIELDS if getattr(expected, name) != getattr(info, name)}
    if differences:
        raise EngineMismatchError(engine_id, differences)


def channel_options(options: ClientOptions) -> list[tuple[str, int]]:
    """gRPC channel arguments for an engine's channel. gRPC reconnects a channel on its own
    schedule (from 1 s, growing 1.6x to 120 s), and a call made between two of its attempts
    fails at once without trying: an engine that came back after a minute away went unused
    for up to another minute whatever the router's own backoff said. The channel's backoff
    is the router's (``min_backoff_s`` to ``max_backoff_s``)."""
    min_ms = max(1, round(options.min_backoff_s * 1000))
    max_ms = max(min_ms, round(options.max_backoff_s * 1000))
    return [("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", min_ms),
            ("grpc.min_reconnect_backoff_ms", min_ms),
            ("grpc.max_reconnect_backoff_ms", max_ms)]


class EngineClient:
    """The router's connection to one Quire engine pod. ``start()`` it, ``await close()`` it."""

    kind = "quire"
    serves_embeddings = True

    @classmethod
    def connect(cls, endpoint: Endpoint, reports: EngineReports,
                options: ClientOptions) -> EngineClient:
        """The ``ConnectionFactory`` of this kind (``router.engine_kinds``)."""
        return cls(endpoint.engine_id, endpoint.address, reports=reports, options=options)

    def __init__(self, engine_id: str, address: str, *, reports: EngineReports,
                 options: ClientOptions = ClientOptions()) -> None:
        self.engine_id = engine_id
        self.address = address
        self.reports = reports
        self.options = options
        self.state = EngineState.UNREACHABLE
        self.info: pb.ModelInfo | None = None
        self.refusal: EngineMismatchError | None = None
        self.channel = self._open_channel()
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self._many = GenerateMany(self.stub, engine_id)
        self._supervisor: asyncio.Task | None = None
        self._feeds: list[asyncio.Task] = []
        self._closed = False

    def _open_channel(self) -> grpc.aio.Channel:
        options = channel_options(self.options)
        if self.options.server_name:
            options.append(("grpc.ssl_target_name_override", self.options.server_name))
        if self.options.credentials is not None:
            return grpc.aio.secure_channel(self.address, self.options.credentials, options)
        return grpc.aio.insecure_channel(self.address, options)

    def _backoff(self) -> Backoff:
        return Backoff(self.options.min_backoff_s, self.options.max_backoff_s)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise(), name=f"engine {self.engine_id}")

    async def close(self) -> None:
        """Stop supervising and close the channel (the pool forgets the engine's state)."""
        self._closed = True
        tasks = [t for t in (self._supervisor, *self._feeds) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._feeds = []
        self.state = EngineState.UNREACHABLE  # closed by the router: nothing to warn about
        await self._many.close()
        await self.channel.close()

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.SERVING and not self._closed

    def _set_state(self, state: EngineState) -> None:
        change_state(self, self.reports, state, "engine", logger)

    def check_identity(self, identity: ModelIdentity, info: pb.ModelInfo) -> None:
        """Hashing fields and the tokenizer must be the router's (the block size may differ:
        the router hashes each prompt at every block size its engines use)."""
        compare_model_info(self.engine_id, identity.expected, info)

    async def _supervise(self) -> None:
        backoff = self._backoff()
        health = health_pb2_grpc.HealthStub(self.channel)
        while not self._closed:
            try:
                info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(),
                                                    timeout=self.options.connect_timeout_s)
                await self.reports.admit(self, info)
            except EngineMismatchError as e:
                self._stop_feeds()
                refuse(self, self.reports, e, "engine", logger)
                await asyncio.sleep(self.options.refused_recheck_s)
                continue
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s unreachable: %s", self.engine_id, e.code().name)
                self._set_state(EngineState.UNREACHABLE)
                await backoff.sleep()
                continue
            if self.info is not None and self.info.incarnation_id != info.incarnation_id:
                self._stop_feeds()  # another process: subscribe to it now, not after backoff
            self.info, self.refusal = info, None
            self._start_feeds()
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest(
                        service=ENGINE_SERVICE)):
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    self._set_state(EngineState.SERVING if serving else EngineState.NOT_SERVING)
                    backoff.reset()
            except grpc.aio.AioRpcError as e:
                logger.debug("engine %s health watch ended: %s", self.engine_id, e.code().name)
            self._set_state(EngineState.UNREACHABLE)
            await backoff.sleep()

    # ------------------------------------------------------------------- requests
    def generate(self, request: pb.GenerateRequest, *, timeout_s: float | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()
                 ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Relay the engine's stream. Closing the iterator (or cancelling the task reading it)
        cancels the upstream call, which aborts the request on the engine. An engine that
        serves ``GenerateMany`` gets the call on the stream it shares with the router's other
        calls to it (``router.generate_many``; its iterator is returned as it is, no layer
        around every message)."""
        if self.info is not None and self.info.generate_many:
            return self._many.generate(request, timeout_s=timeout_s, metadata=metadata)
        return self._generate_call(request, timeout_s, metadata)

    async def _generate_call(self, request: pb.GenerateRequest, timeout_s: float | None,
                             metadata: tuple[tuple[str, str], ...]
                             ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One ``Generate`` call (an engine older than ``GenerateMany``)."""
        call = self.stub.Generate(request, timeout=timeout_s, metadata=metadata or None)
        try:
            async for message in call:
                yield message
        finally:
            if not call.done():
                call.cancel()

    async def embed(self, request: pb.EmbedRequest, *, timeout_s: float | None = None,
                    metadata: tuple[tuple[str, str], ...] = ()) -> pb.EmbedResponse:
        """The engine's ``Embed``; cancelling the caller cancels the call (and the request)."""
        return await self.stub.Embed(request, timeout=timeout_s, metadata=metadata or None)

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                timeout_s: float | None = None) -> bool:
        answer = await self.stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path), timeout=timeout_s)
        await self._refresh_info(timeout_s)
        return answer.loaded

    async def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> None:
        await self.stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=lora_name),
                                          timeout=timeout_s)
        await self._refresh_info(timeout_s)

    async def _refresh_info(self, timeout_s: float | None) -> None:
        """The engine's adapters changed: its ModelInfo again (same process, same identity)."""
        info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)
        if self.info is None or info.incarnation_id == self.info.incarnation_id:
            self.info = info

    async def fetch_tokenizer(self, timeout_s: float | None = None) -> pb.TokenizerFiles:
        """The engine's tokenizer files (``GetTokenizer``)."""
        return await self.stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=timeout_s)

    # ---------------------------------------------------------------------- feeds
    def _start_feeds(self) -> None:
        if not self._feeds:
            self._feeds = [asyncio.create_task(self._follow_kv_events()),
                           asyncio.create_task(self._follow_load())]

    def _stop_feeds(self) -> None:
        for task in self._feeds:
            task.cancel()
        self._feeds = []
        self.reports.kv_feed_lost(self)
        self.reports.load_report(self, None)

    async def _follow(self, open_call: Callable[[], grpc.aio.UnaryStreamCall],
                      on_message: Callable[[object], bool], on_end: Callable[[], None],
                      what: str, log_level: int = logging.WARNING) -> None:
        """Subscribe, hand every message to ``on_message`` (False: re-subscribe), and after
        the stream ends or breaks call ``on_end`` and re-subscribe with backoff. The backoff
        resets whenever ``on_message`` reports progress."""
        backoff = self._backoff()
        while not self._closed:
            call = open_call()
            try:
                async for message in call:
                    if not on_message(message):
                        logger.warning("engine %s: %s gap (or another engine process), "
                                       "re-subscribing", self.engine_id, what)
                        break
                    backoff.reset()
            except grpc.aio.AioRpcError as e:
                logger.log(log_level, "engine %s: %s broke (%s), re-subscribing",
                           self.engine_id, what, e.code().name)
            finally:
                call.cancel()
                on_end()
            await backoff.sleep()

    async def _follow_kv_events(self) -> None:
        def on_message(message: pb.KVEventsMessage) -> bool:
            if message.HasField("snapshot"):
                return self.reports.kv_snapshot(self, snapshot_from_proto(message.snapshot))
            return self.reports.kv_batch(self, batch_from_proto(message.batch))

        await self._follow(lambda: self.stub.StreamKVEvents(pb.StreamKVEventsRequest()),
                           on_message, lambda: self.reports.kv_feed_lost(self), "KV event feed")

    async def _follow_load(self) -> None:
        def on_message(report: pb.LoadReport) -> bool:
            self.reports.load_report(self, report)
            return True

        await self._follow(lambda: self.stub.StreamLoad(
            pb.StreamLoadRequest(interval_ms=self.options.load_interval_ms,
                                 admits_requests=True)),
            on_message, lambda: self.reports.load_report(self, None), "load feed", logging.DEBUG)
