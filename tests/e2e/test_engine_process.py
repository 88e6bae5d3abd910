"""`quire engine` as a real process: serving, /metrics, SIGTERM drain; and engine death."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quire.v1 import engine_pb2_grpc
from tests.e2e.test_engine_server import RunningServer, _collect, _engine, _request
from engine_worker.server.config import ServerConfig

pytestmark = pytest.mark.slow  # starts engine processes


def _start_engine(model_dir, *extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "quire_cli", "engine", "--model", str(model_dir), "--dtype",
         "float32", "--kv-cache-memory-bytes", str(1 << 24), "--host", "127.0.0.1", "--port",
         "0", "--metrics-port", "0", "--drain-timeout-s", "30", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"listening on 127\.0\.0\.1:(\d+), metrics on (\S+)", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, int(match.group(1)), match.group(2)


def test_engine_process_serves_exports_metrics_and_drains_on_sigterm(tiny_model_dir):
    proc, port, metrics_url = _start_engine(tiny_model_dir)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        tokens, _, last = _collect(stub.Generate(_request([1, 2, 3, 4], max_tokens=5)))
        assert len(tokens) == 5 and last.finished
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert re.search(r'vllm:generation_tokens_total\{model_name="[^"]+"\} 5\.0', text)
        assert "vllm:time_to_first_token_seconds_bucket" in text
        assert "vllm:kv_cache_usage_perc" in text
        # a long request in flight when SIGTERM arrives still finishes
        result = {}

        def long_request():
            result["tokens"] = _collect(stub.Generate(_request([9, 8, 7], max_tokens=150)))[0]
        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = health_pb2_grpc.HealthStub(channel)
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:  # new requests are refused while draining
                _collect(stub.Generate(_request([1, 2], max_tokens=2)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        except grpc.RpcError:
            pass  # the server may already have closed after draining
        worker.join(60)
        assert len(result.get("tokens", [])) == 150
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_injected_engine_failure_ends_every_stream_unavailable(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    server = RunningServer(engine, ServerConfig(host="127.0.0.1", port=0))
    try:
        streams = [server.stub.Generate(_request([5, 6, 7 + i], max_tokens=500))
                   for i in range(4)]
        for stream in streams:
            next(stream)  # all four are running

        def broken(*args, **kwargs):  # fault injection into the real model
            raise RuntimeError("injected device failure")
        engine.runner.model.forward = broken
        start = time.monotonic()
        for stream in streams:
            with pytest.raises(grpc.RpcError) as err:
                _collect(stream)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "injected device failure" in err.value.details()
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        status = None
        while time.monotonic() < deadline:
            status = server.health.Check(health_pb2.HealthCheckRequest()).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            _collect(server.stub.Generate(_request([1, 2], max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()


def test_the_start_block_names_the_threads_the_model_runs_on(tiny_model_dir):
    # the count is the model thread's (libgomp keeps it per thread): with --num-threads 1 the
    # main thread would still say the machine's default
    proc, _, _ = _start_engine(tiny_model_dir, "--num-threads", "1")
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        log = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    line = next(line for line in log.splitlines() if "Threads: " in line)
    assert "the model on 1 OpenMP thread (the engine loop and 0 workers;" in line, line
    # a server process takes its start-up heap out of the collector's full walks
    frozen = re.search(r"froze (\d+) start-up objects", log)
    assert frozen and int(frozen.group(1)) > 10_000, log
