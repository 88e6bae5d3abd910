"""Assembles the router pod: discovery -> engine pool -> gRPC front (EngineService, health,
reflection, optional API keys) and the OpenAI-compatible HTTP front with /metrics.

Health (``grpc.health.v1``): service "" is SERVING while the process runs (liveness); service
"quire.v1.EngineService" is SERVING while at least one engine serves (readiness). On SIGTERM
both go NOT_SERVING, new requests get UNAVAILABLE, in-flight ones finish within
``drain_timeout_s``, then the process exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from quire.gc_heap import freeze_startup_heap
from quire.grpc_server import NO_PORT_REUSE, BadRequestBytes, bind_port
from quire.tracing import Tracing, TracingConfig, make_tracing
from quire.v1 import engine_pb2_grpc
from router.auth import ApiKeyInterceptor, ApiKeys
from router.balancer import make_policy
from router.admission import AdmissionGate
from router.config import DiscoveryConfig, EngineTLSConfig, PlacementConfig, RouterServerConfig
from router.discovery import Discovery, make_discovery
from router.connection import ClientOptions
from router.engine_client import ENGINE_SERVICE
from router.engine_slots import EngineSlots
from router.flow import FlowController
from router.gradient_limit import GradientLimit
from router.flow_config import FlowConfig
from router.lora_adapters import AdapterSources, load_everywhere, unload_everywhere
from router.metrics import RouterMetrics
from router.pool import EnginePool, PromptHashes
from router.server import RequestLimits, RouterServicer
from quire.tokenizer import FastTokenizer

logger = logging.getLogger(__name__)


class RouterServer:
    """Start with ``await start()`` (returns the gRPC port); ``await stop()``."""

    def __init__(self, server: RouterServerConfig, discovery: DiscoveryConfig,
                 placement: PlacementConfig = PlacementConfig(),
                 tls: EngineTLSConfig = EngineTLSConfig(), flow: FlowConfig = FlowConfig(), *,
                 discovery_impl: Discovery | None = None,
                 client_options: ClientOptions | None = None,
                 tracing: Tracing | None = None) -> None:
        """``tracing``: where request spans go (None: tracing off; the owner shuts it down)."""
        self.cfg = server
        self.placement = placement
        self.keys = ApiKeys(server.keys())
        tokenizer = FastTokenizer.from_dir(server.tokenizer) if server.tokenizer else None
        options = client_options or ClientOptions(
            load_interval_ms=placement.load_interval_ms,
            connect_timeout_s=placement.connect_timeout_s,
            max_backoff_s=placement.reconnect_max_backoff_s,
            prefill_tokens_per_s=placement.prefill_tokens_per_s,
            lora_load_s=placement.lora_load_s,
            credentials=tls.credentials(), server_name=tls.engine_tls_server_name,
            assumed_block_size=placement.vllm_block_size)
        self.pool = EnginePool(discovery_impl or make_discovery(discovery), tokenizer=tokenizer,
                               options=options,
                               approx_index_blocks=placement.approx_index_blocks)
        self.metrics = RouterMetrics(self.engine_states)
        self.tracing = tracing
        self.flow = self._flow_controller(flow)
        self.adapter_sources = AdapterSources(placement.lora_resolver_dir)
        self.servicer = RouterServicer(
            self.pool, policy=make_policy(placement.policy), metrics=self.metrics,
            limits=RequestLimits(max_n=server.max_n, max_tokens=server.max_tokens_limit,
                                 max_prompt_chars=server.max_prompt_chars,
                                 max_stop_strings=server.max_stop_strings,
                                 max_stop_string_len=server.max_stop_string_len),
            max_attempts=placement.max_attempts, session_header=placement.session_header,
            spans=_span_factory(tracing), tokenizer_threads=server.tokenizer_threads,
            admission=AdmissionGate(self.flow, flow.table()),
            adapter_sources=self.adapter_sources)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.front = None
        self.port: int | None = None
        self.http_port: int | None = None
        self._readiness: asyncio.Task | None = None
        self._flow_task: asyncio.Task | None = None

    def _flow_controller(self, flow: FlowConfig) -> FlowController | None:
        if not flow.flow_control:
            return None
        # every engine, as the balancer sees it (no prompt: only load and health matter)
        slots = EngineSlots(lambda: self.pool.candidates(PromptHashes({})),
                            fixed=flow.engine_slots)
        # from one request per engine (the floor), so that the engines' speed with room to
        # spare is seen before the batch grows
        limit = GradientLimit(1) if flow.gradient_limit != "off" else None
        return FlowController(slots.observe, queue_timeout_s=flow.queue_timeout_s,
                              observer=self.metrics.flow, limit=limit,
                              limit_floor=lambda: slots.num_engines,
                              limit_when_shared=flow.gradient_limit == "auto")

    @classmethod
    def static(cls, addresses: Sequence[str], *, tokenizer: str | None = None,
               policy: str = "prefix_aware", host: str = "127.0.0.1", port: int = 0,
               http_port: int = -1, placement: dict | None = None, flow: dict | None = None,
               tracing: Tracing | None = None, **server_fields) -> RouterServer:
        """A router over a fixed list of engines (local stacks and tests)."""
        return cls(RouterServerConfig(host=host, port=port, http_port=http_port,
                                      tokenizer=tokenizer, **server_fields),
                   DiscoveryConfig(discovery="static", engines=",".join(addresses)),
                   PlacementConfig(policy=policy, **(placement or {})),
                   flow=FlowConfig(**(flow or {})), tracing=tracing)

    @property
    def model_name(self) -> str | None:
        """The served name; None until an engine has joined (even with ``--model-name``: the
        router does not serve a model before the pool knows one)."""
        identity = self.pool.identity
        if identity is None:
            return None
        return self.cfg.model_name or identity.model_name

    def engine_states(self) -> dict[str, int]:
        return self.pool.engine_states()

    def _tokenizer(self) -> FastTokenizer | None:
        identity = self.pool.identity
        return identity.tokenizer if identity is not None else None

    def _max_model_len(self) -> int | None:
        """The smallest length limit of the serving engines: what any of them accepts."""
        lengths = [c.info.max_model_len for c in self.pool.serving()
                   if c.info is not None]
        return min(lengths) if lengths else None

    def _known_max_model_len(self) -> int | None:
        """The length the router's own answers report (/tokenize, /v1/models), which need no
        engine: the serving engines' smallest; while none serves, the last engine admitted's
        (None before any joined)."""
        value = self._max_model_len()
        return value if value is not None else self.pool.last_max_model_len

    async def start(self) -> int:
        options = [("grpc.max_receive_message_length", self.cfg.max_message_bytes),
                   ("grpc.max_send_message_length", 64 << 20), NO_PORT_REUSE]
        interceptors = [ApiKeyInterceptor(self.keys)] if self.keys.enabled else []
        interceptors.append(BadRequestBytes())
        self.server = grpc.aio.server(options=options, interceptors=interceptors)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (ENGINE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = bind_port(self.server, self.cfg.host, self.cfg.port, what="router gRPC")
        await self.pool.start()
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._readiness = asyncio.create_task(self._follow_readiness())
        if self.flow is not None:  # re-read the engines' capacity as often as they report
            self._flow_task = asyncio.create_task(
                self.flow.run(self.placement.load_interval_ms / 1000), name="flow-control")
        if self.cfg.http_port >= 0:
            from router.openai_api import FrontSeam, OpenAIFront

            seam = FrontSeam(generate=self.servicer.Generate, keys=self.keys,
                             session_header=self.placement.session_header,
                             model_name=lambda: self.model_name, tokenizer=self._tokenizer,
                             engine_states=self.pool.engine_states,
                             draining=lambda: self.servicer.draining,
                             tenant_header=self.servicer.admission.table.header,
                             max_model_len=self._max_model_len,
                             known_max_model_len=self._known_max_model_len,
                             embed=self.servicer.Embed,
                             adapters=self.pool.adapters,
                             resolvable=lambda name: self.adapter_sources.path_for(
                                 name) is not None,
                             load_adapter=lambda name, path: load_everywhere(
                                 self.pool, name, path, self.cfg.request_timeout_s,
                                 self.adapter_sources),
                             unload_adapter=lambda name: unload_everywhere(
                                 self.pool, name, self.cfg.request_timeout_s,
                                 self.adapter_sources))
            front = OpenAIFront(seam, self.cfg, self.metrics, host=self.cfg.host,
                                port=self.cfg.http_port)
            try:
                self.http_port = await front.start()
            except Exception:
                await self.stop(0)  # a busy HTTP port: stop cleanly, the caller reports it
                raise
            self.front = front
        logger.info("router serving gRPC on %s:%d%s, policy %s", self.cfg.host, self.port,
                    f" and HTTP on :{self.http_port}" if self.front else "",
                    self.placement.policy)
        return self.port

    async def wait_ready(self, count: int = 1, timeout_s: float | None = None) -> bool:
        """Wait until ``count`` engines serve (False on timeout)."""
        return await self.pool.wait_serving(count, timeout_s)

    async def _follow_readiness(self) -> None:
        serving = None
        async for _ in self.pool.changes():
            now = bool(self.pool.serving())
            if now != serving:
                serving = now
                await self.health.set(ENGINE_SERVICE, health_pb2.HealthCheckResponse.SERVING
                                      if now else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def drain_and_stop(self) -> None:
        """Stop taking requests, let in-flight ones finish within the drain timeout, stop."""
        self.servicer.draining = True
        await self.health.enter_graceful_shutdown()
        await self.stop(grace_s=self.cfg.drain_timeout_s)

    async def stop(self, grace_s: float | None = None) -> None:
        for task in (self._readiness, self._flow_task):
            if task is not None:
                task.cancel()
        if self.front is not None:
            await self.front.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.pool.stop()
        self.servicer.close()


def _span_factory(tracing: Tracing | None):
    if tracing is None:
        return None
    from router.tracing import RouterSpan  # imports OpenTelemetry: only when tracing is on

    return functools.partial(RouterSpan, tracing)


async def serve(server: RouterServerConfig, discovery: DiscoveryConfig,
                placement: PlacementConfig, tls: EngineTLSConfig,
                flow: FlowConfig = FlowConfig()) -> None:
    """Run a router until SIGTERM / SIGINT, then drain and exit. Traces go where the
    standard ``OTEL_*`` variables say (off when they name no endpoint)."""
    from quire.signals import shutdown_event

    tracing = make_tracing(TracingConfig.from_env(default_service_name="quire-router"))
    router = RouterServer(server, discovery, placement, tls, flow, tracing=tracing)
    try:
        port = await router.start()
        freeze_startup_heap()  # a long-running process: its start-up heap is never garbage
        stop = shutdown_event()
        http = (f", OpenAI API on http://{server.host}:{router.http_port}/v1" if router.front
                else "")
        print(f"quire router listening on {server.host}:{port} (gRPC){http}; discovery "
              f"{discovery.discovery}", flush=True)
        await stop.wait()
        await router.drain_and_stop()
    finally:
        if tracing is not None:
            tracing.shutdown()  # flushes the spans still batched
