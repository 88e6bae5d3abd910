"""Tracing configuration from the standard OTEL_* variables: off unless asked, no cost when off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from quire.tracing import TracingConfig, make_tracing

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}


def test_off_by_default():
    cfg = TracingConfig.from_env("quire-router", environ={})
    assert not cfg.enabled
    assert make_tracing(cfg) is None


@pytest.mark.parametrize("environ, enabled", [
    (ENDPOINT, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    (ENDPOINT | {"OTEL_SDK_DISABLED": "true"}, False),
    (ENDPOINT | {"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),  # no endpoint
])
def test_enabled_by_an_endpoint_or_an_exporter(environ, enabled):
    assert TracingConfig.from_env("quire-router", environ=environ).enabled is enabled


def test_names_protocol_and_text_option():
    cfg = TracingConfig.from_env("quire-engine", environ=ENDPOINT)
    assert (cfg.service_name, cfg.protocol, cfg.include_text) == ("quire-engine", "grpc", False)
    cfg = TracingConfig.from_env("quire-engine", environ=ENDPOINT | {
        "OTEL_SERVICE_NAME": "engine-a", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "QUIRE_TRACE_INCLUDE_TEXT": "true"})
    assert (cfg.service_name, cfg.protocol, cfg.include_text) == \
        ("engine-a", "http/protobuf", True)
    cfg = TracingConfig.from_env("quire-engine", environ=ENDPOINT | {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})
    assert cfg.protocol == "grpc"  # the per-signal variable wins, as the spec says


@pytest.mark.parametrize("environ, field", [
    (ENDPOINT | {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "protocol"),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "exporter"),
])
def test_bad_values_name_the_field(environ, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        TracingConfig.from_env("quire-router", environ=environ)


def test_a_router_without_otel_variables_never_imports_opentelemetry():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = ("import sys; from quire.tracing import TracingConfig, make_tracing; "
            "from router.app import RouterServer; "
            "assert make_tracing(TracingConfig.from_env('quire-router')) is None; "
            "s = RouterServer.static(['127.0.0.1:1']); assert s.servicer.spans is None; "
            "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]; "
            "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
