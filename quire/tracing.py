"""OpenTelemetry tracing shared by the router and the engine: configuration from the standard
``OTEL_*`` variables, the provider and exporter behind it, and W3C trace-context propagation.

Tracing is off unless an OTLP endpoint (or an explicit ``OTEL_TRACES_EXPORTER``) is configured.
Off means ``make_tracing`` returns None: OpenTelemetry is not even imported, and the servicers
pay one ``is None`` check per request. On, each component owns a ``Tracing`` (its own
``TracerProvider``, passed in, never installed as the global provider) and shuts it down on
exit so the batch processor flushes.

The OpenTelemetry SDK reads most variables itself (exporter headers, certificates, timeout,
compression, ``OTEL_TRACES_SAMPLER``/``_ARG``, ``OTEL_BSP_*``, ``OTEL_RESOURCE_ATTRIBUTES``); this
module reads only what decides whether and how to build the pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass

# W3C trace context (https://www.w3.org/TR/trace-context/). Lowercase: gRPC metadata keys are.
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOLS = ("grpc", "http/protobuf")
EXPORTERS = ("otlp", "console", "none")
_TRUE = ("1", "true", "yes", "on")
# gRPC codes that mark a server span failed (OpenTelemetry's RPC conventions); CANCELLED,
# INVALID_ARGUMENT and the like are the caller's doing and leave the status unset.
_SERVER_ERROR_CODES = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL",
                                 "UNAVAILABLE", "DATA_LOSS"})


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Whether and where spans are exported. ``from_env`` reads the standard variables."""

    enabled: bool = False
    service_name: str = "quire"
    exporter: str = "otlp"  # otlp, console (stdout, for a quick look) or none
    protocol: str = "grpc"  # OTLP transport: grpc (port 4317) or http/protobuf (port 4318)
    endpoint: str | None = None  # None: the exporter reads OTEL_EXPORTER_OTLP_*ENDPOINT itself
    include_text: bool = False  # prompt and completion text on spans (off: never exported)

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("service_name: must not be empty")
        if self.exporter not in EXPORTERS:
            raise ValueError(f"exporter (OTEL_TRACES_EXPORTER): must be one of {EXPORTERS}, "
                             f"got {self.exporter!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol (OTEL_EXPORTER_OTLP_PROTOCOL): must be one of "
                             f"{PROTOCOLS}, got {self.protocol!r}")

    @classmethod
    def from_env(cls, default_service_name: str,
                 environ: Mapping[str, str] | None = None) -> TracingConfig:
        """The configuration the standard ``OTEL_*`` variables (and ``QUIRE_TRACE_INCLUDE_TEXT``)
        describe. Enabled when an OTLP endpoint or an exporter is named, unless
        ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``."""
        env = os.environ if environ is None else environ
        exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
        endpoint_set = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or
                            env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        enabled = (endpoint_set or bool(exporter)) and not disabled and exporter != "none"
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or
                    env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
        return cls(enabled=enabled,
                   service_name=env.get("OTEL_SERVICE_NAME") or default_service_name,
                   exporter=exporter or "otlp", protocol=protocol,
                   include_text=env.get("QUIRE_TRACE_INCLUDE_TEXT", "").strip().lower()
                   in _TRUE)


class Tracing:
    """One component's tracer, its provider, and W3C propagation in and out of metadata."""

    def __init__(self, provider, *, include_text: bool = False) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("quire")
        self.include_text = include_text
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()

    def extract(self, metadata: Iterable[tuple[str, str | bytes]] | None):
        """The OpenTelemetry context that the W3C headers among ``metadata`` carry (an empty
        context when there are none: the span becomes a root)."""
        carrier = {key: value for key, value in metadata or () if key in TRACE_HEADERS}
        return self._propagator.extract(carrier)

    def metadata(self, span) -> tuple[tuple[str, str], ...]:
        """gRPC metadata that makes ``span`` the parent of the callee's span."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
        return tuple(carrier.items())

    def end(self, span, error: BaseException | None, context, end_time_ns: int | None = None
            ) -> None:
        """End a server span with the call's gRPC status: ``error`` is what ended the handler
        (None: it returned), ``context`` its ``grpc.aio.ServicerContext``."""
        from opentelemetry.trace import Status, StatusCode

        code = _status_name(error, context)
        span.set_attribute("rpc.grpc.status_code", code)
        if code in _SERVER_ERROR_CODES:
            span.set_status(Status(StatusCode.ERROR, code))
        span.end(end_time=end_time_ns)

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporter."""
        self.provider.shutdown()


def _status_name(error: BaseException | None, context) -> str:
    if error is None:
        return "OK"
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return "CANCELLED"  # the client went away or the deadline passed mid-stream
    code = context.code() if context is not None else None  # set by context.abort
    return code.name if code is not None else "UNKNOWN"


async def traced(stream: AsyncIterator, end: Callable[[BaseException | None], None]
                 ) -> AsyncIterator:
    """Relay ``stream``; then ``end(error)`` with what ended it (None: it finished). The stream
    is closed at once when the consumer leaves, so its own cleanup (cancelling upstream calls,
    aborting the engine request) is never left to the garbage collector."""
    error: BaseException | None = None
    try:
        async with contextlib.aclosing(stream):
            async for message in stream:
                yield message
    except BaseException as e:  # recorded, then raised on
        error = e
        raise
    finally:
        end(error)


def traced_generate(generate: Callable) -> Callable:
    """A servicer's streaming ``Generate`` from ``generate(self, request, context, span)``.

    ``self.spans`` (request, invocation metadata) -> a span with ``end(error, context)``, or
    None when tracing is off: then ``span`` is None and no tracing work is done. Shared by the
    engine's and the router's servicers; the result is an async generator function, as
    grpc.aio needs for a server-streaming handler.
    """
    async def handler(self, request, context):
        if self.spans is None:
            async with contextlib.aclosing(generate(self, request, context, None)) as stream:
                async for message in stream:
                    yield message
            return
        span = self.spans(request, context.invocation_metadata())
        async for message in traced(generate(self, request, context, span),
                                    lambda error: span.end(error, context)):
            yield message

    handler.__doc__ = generate.__doc__
    return handler


def _otlp_exporter(cfg: TracingConfig):
    if cfg.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=cfg.endpoint) if cfg.endpoint else OTLPSpanExporter()


def _console_exporter(cfg: TracingConfig):
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter(service_name=cfg.service_name)


_EXPORTERS = {"otlp": _otlp_exporter, "console": _console_exporter}


def make_tracing(cfg: TracingConfig) -> Tracing | None:
    """The tracing pipeline ``cfg`` describes, or None when tracing is off."""
    if not cfg.enabled or cfg.exporter == "none":
        return None
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ValueError(f"tracing: OTEL_* variables ask for traces but OpenTelemetry is not "
                         f"installed ({e}); install quire[router] or quire[engine]") from None
    # The sampler comes from OTEL_TRACES_SAMPLER(_ARG); the batch processor from OTEL_BSP_*.
    # Owners shut the provider down themselves, so no atexit hook piles up per instance.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: cfg.service_name}),
                              shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(_EXPORTERS[cfg.exporter](cfg)))
    return Tracing(provider, include_text=cfg.include_text)
