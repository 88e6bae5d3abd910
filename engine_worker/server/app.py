"""Assembles the engine pod: gRPC server (EngineService, grpc.health.v1, reflection), the engine
loop thread, optional metrics HTTP server, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_worker.engine import EngineStats, LLMEngine
from engine_worker.metrics import EngineMetrics, MetricsServer
from engine_worker.server.async_engine import AsyncEngine
from engine_worker.server.config import ServerConfig
from engine_worker.server.convert import RequestLimits
from engine_worker.server.model_thread import ModelThread
from engine_worker.lora.paths import parse_adapter_dirs
from engine_worker.server.servicer import EngineServicer
from quire.grpc_server import NO_PORT_REUSE, BadRequestBytes, PortInUseError, bind_port
from quire.gc_heap import freeze_startup_heap
from quire.signals import shutdown_event
from quire.tracing import Tracing, TracingConfig, make_tracing
from quire.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if cfg.tls_cert_file is None:
        return None
    key, cert = Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes()
    client_ca = Path(cfg.tls_client_ca_file).read_bytes() if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


class EngineServer:
    """Start with ``await start()``; ``await drain_and_stop()`` is the SIGTERM path."""

    def __init__(self, engine: LLMEngine, cfg: ServerConfig, *,
                 tracing: Tracing | None = None, model_thread: ModelThread | None = None
                 ) -> None:
        """``tracing``: where request spans go (None: off; the owner shuts it down).
        ``model_thread``: the thread that built ``engine``, which then runs its loop."""
        self.cfg = cfg
        # served requests compile in worker processes, stopped past this (engine_worker.grammar)
        engine.grammars.compile_timeout_s = cfg.grammar_compile_timeout_s
        engine.grammars.compile_memory_bytes = cfg.grammar_compile_memory_bytes
        model_name = cfg.model_name or engine.info.model
        self.metrics = (EngineMetrics(model_name, engine.info)
                        if cfg.metrics_port is not None else None)
        self.metrics_server: MetricsServer | None = None
        self.async_engine = AsyncEngine(
            engine, max_waiting_requests=cfg.max_waiting_requests,
            max_queued_tokens=cfg.max_queued_tokens,
            on_step=_step_recorder(self.metrics) if self.metrics else None,
            on_finished=_request_recorder(self.metrics) if self.metrics else None,
            model_thread=model_thread)
        limits = RequestLimits(max_n=cfg.max_n, max_stop_strings=cfg.max_stop_strings,
                               max_stop_string_len=cfg.max_stop_string_len,
                               max_prompt_chars=cfg.max_prompt_chars,
                               max_tokens=cfg.max_tokens_limit)
        self.servicer = EngineServicer(self.async_engine, info=engine.info,
                                       model_name=model_name, limits=limits,
                                       spans=_span_factory(tracing, model_name),
                                       lora_adapter_dirs=parse_adapter_dirs(
                                           cfg.lora_adapter_dirs))
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._watchdog: asyncio.Task | None = None
        self._kv_zmq: asyncio.Task | None = None

    async def _publish_kv_events_zmq(self) -> None:
        """The engine's KV events, batch by batch, on vLLM's ZMQ wire (kv_events_zmq.py)."""
        from engine_worker.server.kv_events_zmq import ZmqKVEventPublisher

        publisher = ZmqKVEventPublisher(self.cfg.kv_events_zmq, self.cfg.kv_events_replay)
        _, sink = await self.async_engine.subscribe_kv_events()
        try:
            while (batch := await sink.get()) is not None:
                publisher.publish(batch)
        finally:
            self.async_engine.unsubscribe_kv_events(sink)
            await asyncio.to_thread(publisher.close)

    async def start(self) -> int:
        options = [("grpc.max_receive_message_length", self.cfg.max_message_bytes),
                   ("grpc.max_send_message_length", self.cfg.max_message_bytes), NO_PORT_REUSE]
        self.server = grpc.aio.server(options=options, interceptors=[BadRequestBytes()])
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        self.port = bind_port(self.server, self.cfg.host, self.cfg.port,
                              server_credentials(self.cfg), what="engine gRPC")
        self.async_engine.start()
        if self.metrics is not None:
            self.metrics_server = MetricsServer(self.metrics, self.cfg.host, self.cfg.metrics_port,
                                                timeout_s=self.cfg.http_timeout_s)
            try:
                self.metrics_server.start()
            except OSError as e:
                raise PortInUseError(f"metrics_port: cannot listen on {self.cfg.host}:"
                                     f"{self.cfg.metrics_port} (engine metrics): "
                                     f"{e.strerror or e}") from None
        if self.cfg.kv_events_zmq:
            self._kv_zmq = asyncio.create_task(self._publish_kv_events_zmq())
        await self.server.start()
        await self._set_serving(True)
        self._watchdog = asyncio.create_task(self._watch_engine())
        logger.info("engine serving on %s:%d", self.cfg.host, self.port)
        return self.port

    async def _set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            result = self.health.set(service, status)
            if asyncio.iscoroutine(result):
                await result

    async def _watch_engine(self) -> None:
        """A dead engine flips health to NOT_SERVING, so Kubernetes restarts the pod."""
        while self.async_engine.dead_reason is None:
            await asyncio.sleep(0.05)
        await self._set_serving(False)

    async def drain_and_stop(self) -> None:
        """Stop taking requests, let in-flight ones finish within the grace period, stop."""
        await self._set_serving(False)
        self.servicer.draining = True
        deadline = asyncio.get_running_loop().time() + self.cfg.drain_timeout_s
        while self.async_engine.num_unfinished and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await self.stop(grace_s=1.0)

    async def stop(self, grace_s: float | None = None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._kv_zmq is not None:
            self._kv_zmq.cancel()
            await asyncio.gather(self._kv_zmq, return_exceptions=True)
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.async_engine.engine.grammars.aclose()  # the compile worker processes
        await asyncio.to_thread(self.async_engine.stop)
        if self.metrics_server is not None:
            self.metrics_server.stop()


def _step_recorder(metrics: EngineMetrics):
    def record(stats: EngineStats) -> None:
        metrics.observe_step(num_running=stats.scheduler.num_running,
                             num_waiting=stats.scheduler.num_waiting,
                             kv_cache_usage=stats.kv_cache.usage,
                             prefix_cache_queries=stats.kv_cache.prefix_cache_queries,
                             prefix_cache_hits=stats.kv_cache.prefix_cache_hits,
                             num_preemptions=stats.scheduler.num_preemptions,
                             spec_decoding=stats.scheduler.spec_decoding, lora=stats.lora,
                             num_prompts_passed=stats.scheduler.num_prompts_passed)
    return record


def _request_recorder(metrics: EngineMetrics):
    def record(output, num_generated: int) -> None:
        m = output.metrics
        metrics.observe_finished(
            finish_reason=output.outputs[0].finish_reason or "abort",
            num_prompt_tokens=len(output.prompt_token_ids), num_generation_tokens=num_generated,
            arrival_time=m.arrival_time, first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time, finished_time=m.finished_time)
    return record


def _span_factory(tracing: Tracing | None, model_name: str):
    if tracing is None:
        return None
    from engine_worker.server.tracing import EngineSpan  # OpenTelemetry: only when tracing

    return functools.partial(EngineSpan, tracing, model_name=model_name)


async def serve(engine: LLMEngine, cfg: ServerConfig,
                model_thread: ModelThread | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain and return (the process exits 0). Traces go where
    the standard ``OTEL_*`` variables say (off when they name no endpoint). ``model_thread``:
    the thread that built ``engine`` (the loop runs there)."""
    tracing = make_tracing(TracingConfig.from_env(default_service_name="quire-engine"))
    server = EngineServer(engine, cfg, tracing=tracing, model_thread=model_thread)
    try:
        await server.start()
        freeze_startup_heap()  # a long-running process: its start-up heap is never garbage
        stop = shutdown_event()
        metrics_at = (f", metrics on http://{cfg.host}:{server.metrics_server.port}/metrics"
                      if server.metrics_server else "")
        print(f"quire engine listening on {cfg.host}:{server.port}{metrics_at}", flush=True)
        await stop.wait()
        logger.info("shutting down: draining in-flight requests (up to %.0f s)",
                    cfg.drain_timeout_s)
        await server.drain_and_stop()
    finally:
        if tracing is not None:
            tracing.shutdown()  # flushes the spans still batched
