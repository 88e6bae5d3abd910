"""OpenTelemetry traces of real requests, exported over OTLP to a real receiver on loopback:
client -> router span -> engine span in one trace, the routing decision and the GenAI attributes
on the spans, retries as events, no prompt or completion text unless asked, and `quire up`
configured by the standard OTEL_* variables alone."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.request

import pytest

from engine_worker.server.config import ServerConfig
from quire.tracing import Tracing, TracingConfig, make_tracing
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, request,
                                      wait_for)
from tests.e2e.test_engine_server import RunningServer, _engine
from tests.otlp_receiver import OTLPReceiver

SERVER = 2  # OTLP SpanKind
ERROR = 2  # OTLP Status code
CANARY_PROMPT = "zq-canary-prompt-7f3a9"


class Stack:
    """Two traced engines behind a traced router (HTTP front on), spans to ``receiver``."""

    def __init__(self, model_dir, receiver: OTLPReceiver, *, include_text: bool = False,
                 num_engines: int = 2) -> None:
        self.receiver = receiver
        self.tracings = [_tracing(receiver, "quire-engine", include_text),
                         _tracing(receiver, "quire-router", include_text)]
        self.engines = [RunningServer(_engine(model_dir, enable_prefix_caching=True),
                                      ServerConfig(host="127.0.0.1", port=0),
                                      tracing=self.tracings[0])
                        for _ in range(num_engines)]
        self.router = RunningRouter([address(e) for e in self.engines], http_port=0,
                                    tracing=self.tracings[1])

    def trace(self, trace_id: str, num_spans: int) -> list:
        """The spans of ``trace_id`` once ``num_spans`` arrived (spans end just after the last
        message, so flush until they are all there)."""
        def arrived(spans) -> bool:
            for tracing in self.tracings:
                tracing.force_flush()
            return sum(s.trace_id == trace_id for s in spans) >= num_spans
        spans = self.receiver.wait_for(arrived)
        return [s for s in spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.router.close()
        for engine in self.engines:
            engine.close()
        for tracing in self.tracings:
            tracing.shutdown()


def _tracing(receiver: OTLPReceiver, service: str, include_text: bool = False) -> Tracing:
    return make_tracing(TracingConfig(enabled=True, service_name=service,
                                      endpoint=receiver.grpc_endpoint,
                                      include_text=include_text))


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _by_service(spans, service: str) -> list:
    return [s for s in spans if s.service == service]


@pytest.fixture(scope="module")
def receiver():
    running = OTLPReceiver().start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stack(tiny_model_dir, receiver):
    running = Stack(tiny_model_dir, receiver)
    yield running
    running.close()


def test_client_router_and_engine_spans_form_one_trace(stack):
    trace_id, client_span_id, traceparent = _traceparent()
    prefix = list(range(100, 180))  # 5 full blocks of 16
    collect(stack.router.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
    assert wait_for(lambda: max(stack.router.matches(prefix).values(), default=0) == 5)
    tokens, last = collect(stack.router.stub.Generate(
        request(prefix + [2], max_tokens=6, top_p=0.9), timeout=TIMEOUT_S,
        metadata=(("traceparent", traceparent),)))
    assert len(tokens) == 6

    spans = stack.trace(trace_id, 2)
    (router,), (engine,) = _by_service(spans, "quire-router"), _by_service(spans, "quire-engine")
    assert router.parent_span_id == client_span_id and router.kind == SERVER
    assert engine.parent_span_id == router.span_id and engine.kind == SERVER
    assert router.start_ns <= engine.start_ns <= engine.end_ns

    # Why it was placed where it was: every candidate's score, the winner, the prediction.
    addresses = sorted(address(e) for e in stack.engines)
    attrs = router.attributes
    assert attrs["quire.routing.policy"] == "prefix_aware"
    assert attrs["quire.routing.candidates"] == addresses
    assert len(attrs["quire.routing.scores"]) == 2
    assert attrs["quire.routing.engine_id"] in addresses
    assert attrs["quire.routing.predicted_cached_tokens"] == 80
    assert attrs["quire.routing.num_prompt_tokens"] == 81
    assert attrs["quire.usage.cached_tokens"] == last.usage.cached_tokens == 80
    assert [e[0] for e in router.events] == ["flow.admitted", "placement", "first_message"]
    admitted = router.events[0][2]  # the wait in the router's queue (none: engines had room)
    assert admitted["quire.flow.wait_s"] >= 0 and admitted["quire.flow.priority"] == 0
    assert admitted["quire.flow.tenant"] == "other"

    # Where its time went on the engine, after the GenAI conventions.
    attrs = engine.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"]
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"]) == (6, 0.0)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (81, 6)
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["quire.usage.cached_tokens"] == 80
    assert attrs["quire.queue_time_s"] >= 0
    assert attrs["quire.time_to_first_token_s"] >= attrs["quire.queue_time_s"]
    names = [e[0] for e in engine.events]
    assert names == ["queued", "scheduled", "first_token", "finished"]
    times = [e[1] for e in engine.events]
    assert times == sorted(times) and engine.start_ns <= times[0] and times[-1] <= engine.end_ns


def test_a_retry_is_an_event_and_both_engines_are_in_the_trace(stack):
    a, b = stack.engines
    prefix = list(range(300, 380))
    collect(a.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))  # pulls it to a
    assert wait_for(lambda: stack.router.matches(prefix).get(address(a)) == 5)
    a.server.servicer.draining = True  # refuses new work while its health says SERVING
    try:
        trace_id, _, traceparent = _traceparent()
        tokens, _ = collect(stack.router.stub.Generate(
            request(prefix + [2], max_tokens=4), timeout=TIMEOUT_S,
            metadata=(("traceparent", traceparent),)))
        assert len(tokens) == 4
    finally:
        a.server.servicer.draining = False
    spans = stack.trace(trace_id, 3)
    (router,) = _by_service(spans, "quire-router")
    assert [e[0] for e in router.events] == ["flow.admitted", "placement", "retry", "placement",
                                             "first_message"]
    retry = router.events[2][2]
    assert retry["quire.routing.engine_id"] == address(a)
    assert retry["rpc.grpc.status_code"] == "UNAVAILABLE"
    assert router.attributes["quire.routing.engine_id"] == address(b)
    assert router.attributes["quire.routing.attempts"] == 2
    engines = {s.attributes.get("quire.usage.cached_tokens") is None: s
               for s in _by_service(spans, "quire-engine")}
    refused, served = engines[True], engines[False]
    assert refused.parent_span_id == served.parent_span_id == router.span_id
    assert refused.status_code == ERROR
    assert refused.attributes["rpc.grpc.status_code"] == "UNAVAILABLE"
    assert served.attributes["gen_ai.usage.output_tokens"] == 4


def test_the_http_front_joins_the_callers_trace(stack):
    trace_id, client_span_id, traceparent = _traceparent()
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 3,
                       "temperature": 0}).encode()
    http = urllib.request.Request(
        f"http://127.0.0.1:{stack.router.server.http_port}/v1/completions", data=body,
        headers={"Content-Type": "application/json", "traceparent": traceparent})
    with urllib.request.urlopen(http, timeout=TIMEOUT_S) as response:
        assert response.status == 200
    spans = stack.trace(trace_id, 2)
    (router,), (engine,) = _by_service(spans, "quire-router"), _by_service(spans, "quire-engine")
    assert router.parent_span_id == client_span_id
    assert engine.parent_span_id == router.span_id


def _text_request(stack: Stack) -> tuple[str, str]:
    trace_id, _, traceparent = _traceparent()
    stream = stack.router.stub.Generate(
        request(text=f"Remember {CANARY_PROMPT} for later", max_tokens=8), timeout=TIMEOUT_S,
        metadata=(("traceparent", traceparent),))
    completion = "".join(d.text for m in stream for d in m.outputs)
    return trace_id, completion


def test_no_prompt_or_completion_text_on_spans_by_default(stack):
    trace_id, completion = _text_request(stack)
    spans = stack.trace(trace_id, 2)
    assert len(spans) == 2
    every_span = b"".join(s.raw for s in stack.receiver.spans())
    assert CANARY_PROMPT.encode() not in every_span
    assert len(completion) >= 8  # 8 random-model tokens: long enough not to occur by chance
    assert completion.encode() not in every_span
    assert not any("gen_ai.prompt" in s.attributes or "gen_ai.completion" in s.attributes
                   for s in spans)


def test_text_is_on_spans_only_when_asked(tiny_model_dir, receiver):
    stack = Stack(tiny_model_dir, receiver, include_text=True, num_engines=1)
    try:
        trace_id, completion = _text_request(stack)
        spans = stack.trace(trace_id, 2)
    finally:
        stack.close()
    (router,), (engine,) = _by_service(spans, "quire-router"), _by_service(spans, "quire-engine")
    assert CANARY_PROMPT in router.attributes["gen_ai.prompt"]
    assert engine.attributes["gen_ai.completion"] == [completion]


@pytest.mark.slow  # starts engine processes
def test_quire_up_exports_one_trace_from_the_otel_variables(tiny_model_dir, receiver):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200"}
    receiver.clear()
    result = subprocess.run(
        [sys.executable, "-m", "quire_cli", "up", "--model", str(tiny_model_dir), "--dtype",
         "float32", "--kv-cache-memory-bytes", str(1 << 24), "--router-port", "0",
         "--http-port", "0", "--num-engines", "1", "--once", "true"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    # Both processes flush on shutdown, before `quire up` returns.
    spans = receiver.spans()
    routers = _by_service(spans, "quire-router")
    engines = _by_service(spans, "quire-engine")
    assert len(routers) == 1 and len(engines) == 1, spans
    (router,), (engine,) = routers, engines
    assert router.parent_span_id == ""  # the example request carries no trace context
    assert engine.trace_id == router.trace_id and engine.parent_span_id == router.span_id
    assert router.attributes["quire.routing.engine_id"] == router.attributes[
        "quire.routing.candidates"][0]
    assert engine.attributes["gen_ai.usage.output_tokens"] > 0
    assert [e[0] for e in engine.events][-1] == "finished"


def test_http_protobuf_export(receiver, monkeypatch):
    """OTLP/HTTP, with the base endpoint from the environment as a collector would be set."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.http_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    cfg = TracingConfig.from_env(default_service_name="quire-http-check")
    assert cfg.enabled and cfg.protocol == "http/protobuf"
    tracing = make_tracing(cfg)
    try:
        tracing.tracer.start_span("probe").end()
        tracing.force_flush()
    finally:
        tracing.shutdown()
    assert wait_for(lambda: _by_service(receiver.spans(), "quire-http-check"))
