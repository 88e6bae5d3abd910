"""Issue 20: hostile but fair clients against a real router (gRPC + HTTP) and a real tiny-model
engine on loopback. Every bad request is a 4xx naming the field (never a 500 or a wrapped
number), an abandoned request is stopped on the engine, and one giant request does not stall
the others. Reproductions 1-6 of the issue are numbered below."""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

from quire.ports import PortInUseError, check_port_free
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, request,
                                      start_engine, wait_for)

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    running = start_engine(tiny_model_dir, metrics_port=0, http_timeout_s=1.0,
                           max_tokens_limit=4096)  # an operator's cap (the default is none)
    yield running
    running.close()


@pytest.fixture(scope="module")
def router(engine):
    running = RunningRouter([address(engine)], http_port=0, model_name=MODEL,
                            http_header_timeout_s=1.0, http_body_timeout_s=1.0,
                            max_tokens_limit=4096)
    yield running
    running.close()


def post(router, path: str, body=None, raw: bytes | None = None, timeout: float = TIMEOUT_S):
    """(status, parsed JSON body) of one POST over a fresh connection."""
    data = raw if raw is not None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def assert_400(status, body, field, sent=None, code=400):
    assert status == code, body
    error = body["error"]
    assert error["param"] == field, error
    assert field in error["message"]
    if sent is not None:
        assert str(sent) in error["message"], error


def engine_metric(engine, name: str) -> float:
    port = engine.server.metrics_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def no_tracebacks(caplog) -> bool:
    return not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


# ---- 1. out-of-range numbers ----------------------------------------------------------------

@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "max_tokens", 1_000_000_000_000),
    ("/v1/completions", "max_tokens", 2 ** 63),
    ("/v1/completions", "max_tokens", 2 ** 32 + 1),
    ("/v1/chat/completions", "max_tokens", 1_000_000_000_000),
    ("/v1/chat/completions", "max_completion_tokens", 2 ** 63),
    ("/v1/chat/completions", "max_completion_tokens", 2 ** 32 + 1),
])
def test_1_huge_max_tokens_is_a_400_naming_the_field(router, path, field, value):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else \
        {"prompt": PROMPT}
    status, body = post(router, path, {"model": MODEL, field: value, **prompt})
    assert_400(status, body, field, value)


def test_1_max_tokens_above_the_operators_cap_is_refused_on_every_front(router, engine):
    status, body = post(router, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4097})
    assert_400(status, body, "max_tokens", 4097)
    assert "4096" in body["error"]["message"]
    for stub in (router.stub, engine.stub):
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(request(text=PROMPT, max_tokens=4097), timeout=TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in err.value.details() and "4097" in err.value.details()


def test_1_the_engine_caps_requests_that_set_no_max_tokens():
    from engine_worker.server.convert import RequestLimits, request_from_proto

    limits = RequestLimits(max_n=4, max_stop_strings=4, max_stop_string_len=8,
                           max_prompt_chars=100, max_tokens=8)
    _, params, _, _ = request_from_proto(pb.GenerateRequest(text="x"), limits)
    assert params.max_tokens == 8
    with pytest.raises(ValueError, match=r"^max_tokens: .*got 9$"):
        request_from_proto(pb.GenerateRequest(
            text="x", sampling=pb.SamplingOptions(max_tokens=9)), limits)


def test_negative_seed_echoes_what_was_sent(router):
    status, body = post(router, "/v1/completions", {"prompt": PROMPT, "seed": -1})
    assert_400(status, body, "seed", "-1")
    assert "18446744073709551615" not in body["error"]["message"]


# ---- 2. lone surrogates ---------------------------------------------------------------------

@pytest.mark.parametrize("path,raw,field", [
    ("/v1/completions", b'{"model":"tiny","prompt":"\\ud800x"}', "prompt"),
    ("/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"\\udc80"}]}', "messages"),
    ("/v1/completions", b'{"prompt":"hi","stop":["\\udfff"]}', "stop"),
])
def test_2_lone_surrogates_are_a_400(router, path, raw, field):
    status, body = post(router, path, raw=raw)
    assert_400(status, body, field)
    assert "surrogate" in body["error"]["message"]


# ---- 3. deep nesting ------------------------------------------------------------------------

@pytest.mark.parametrize("nested", [b"[" * 100_000 + b"]" * 100_000,
                                    b'{"a":' * 50_000 + b"1" + b"}" * 50_000])
def test_3_deep_nesting_is_a_400_without_a_traceback(router, nested, caplog):
    caplog.set_level(logging.INFO)
    status, body = post(router, "/v1/completions",
                        raw=b'{"model":"tiny","prompt":' + nested + b"}")
    assert_400(status, body, "body")
    assert "deep" in body["error"]["message"]
    assert no_tracebacks(caplog)


# ---- 4. abandoned requests ------------------------------------------------------------------

def _open_request(router, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", router.server.http_port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_4_a_client_that_goes_away_stops_its_request(router, engine, stream):
    aborted = engine_metric(engine, 'vllm:request_success_total{finished_reason="abort"')
    unfinished = lambda: engine.server.async_engine.num_unfinished  # noqa: E731
    sock = _open_request(router, {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
                                  "stream": stream})
    assert wait_for(lambda: unfinished() == 1, TIMEOUT_S)
    time.sleep(0.3)
    sock.close()
    assert wait_for(lambda: unfinished() == 0, 5), "the request kept running on the engine"
    assert wait_for(lambda: engine_metric(
        engine, 'vllm:request_success_total{finished_reason="abort"') == aborted + 1, 5)


def test_4_a_grpc_client_that_gives_up_stops_its_request(router, engine):
    """Unary-style use: read one message, then cancel (and a deadline that runs out)."""
    unfinished = lambda: engine.server.async_engine.num_unfinished  # noqa: E731
    call = router.stub.Generate(request(text=PROMPT, max_tokens=1000), timeout=TIMEOUT_S)
    next(call)
    call.cancel()
    assert wait_for(lambda: unfinished() == 0, 5)
    with pytest.raises(grpc.RpcError) as err:
        collect(router.stub.Generate(request(text=PROMPT, max_tokens=1000), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: unfinished() == 0, 5)


# ---- 5. one giant request must not stall the router -----------------------------------------

def _health_latencies(router, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=60)
        conn.request("GET", "/health")
        conn.getresponse().read()
        conn.close()
        out.append(time.perf_counter() - started)
        time.sleep(0.02)


def test_5_a_giant_grpc_prompt_is_refused_before_tokenizing(router):
    text = " ".join(f"word{i % 997}" for i in range(900_000))  # ~8 MB, as in the report
    started = time.perf_counter()
    with pytest.raises(grpc.RpcError) as err:
        collect(router.stub.Generate(request(text=text), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("text: at most 1048576 characters")
    assert time.perf_counter() - started < 3  # tokenizing it took seconds


def test_5_health_stays_fast_while_a_long_prompt_is_tokenized(router):
    text = " ".join(f"w{i % 991}" for i in range(200_000))[:1_000_000]  # under the limit
    stop, latencies = threading.Event(), []
    watcher = threading.Thread(target=_health_latencies, args=(router, stop, latencies))
    watcher.start()
    durations = []
    try:
        time.sleep(0.2)
        for _ in range(2):
            started = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:  # tokenized, then too long for the engine
                collect(router.stub.Generate(request(text=text), timeout=TIMEOUT_S))
            durations.append(time.perf_counter() - started)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stop.set()
        watcher.join()
    # Relative, not a wall-clock bound, so a loaded machine cannot fail it: were the loop
    # blocked while a long prompt is tokenized (most of each request's time), the health
    # checks in flight would wait that long, one a request, so the time spent in slow checks
    # would be most of the requests' time. One check held up by the machine's scheduler (seen
    # once in CI on 2 cores, with a pip install beside the suite: 0.57 s against requests of
    # 1.13 and 1.69 s) stays well under that.
    slow = sum(latency for latency in latencies if latency > 0.5)
    print(f"health checks: {len(latencies)}, max {max(latencies):.3f} s, in slow ones "
          f"{slow:.3f} s; requests {', '.join(f'{d:.3f}' for d in durations)} s")
    assert len(latencies) > 5 and slow < 0.4 * sum(durations), (latencies, durations)


# ---- 6. ports -------------------------------------------------------------------------------

def _reuseport_holder() -> tuple[socket.socket, int]:
    """A listener with SO_REUSEPORT on, as another gRPC server would hold its port."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock, sock.getsockname()[1]


def test_6_a_busy_grpc_port_is_an_error_naming_it(engine, tiny_model_dir):
    from engine_worker.server.app import EngineServer
    from engine_worker.server.config import ServerConfig
    from router.app import RouterServer
    from tests.e2e.loop_thread import LoopThread

    holder, port = _reuseport_holder()
    loop = LoopThread()
    try:
        router = RouterServer.static([address(engine)], host="127.0.0.1", port=port)
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}"):
            loop.call(router.start())
        server = EngineServer(engine.server.async_engine.engine,
                              ServerConfig(host="127.0.0.1", port=port))
        with pytest.raises(PortInUseError, match=f"127.0.0.1:{port}"):
            loop.call(server.start())
    finally:
        loop.loop.call_soon_threadsafe(loop.loop.stop)
        holder.close()


def _cli(*argv, timeout_s=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quire_cli", *argv], capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.parametrize("command", ["router-grpc", "router-http", "engine", "engine-metrics",
                                     "up-router", "up-http"])
@pytest.mark.slow  # starts a process for each command
def test_6_every_command_checks_its_ports_before_starting(command, tiny_model_dir):
    holder, port = _reuseport_holder()
    try:
        argv = {
            "router-grpc": ["router", "--host", "127.0.0.1", "--port", str(port),
                            "--engines", "127.0.0.1:9"],
            "router-http": ["router", "--host", "127.0.0.1", "--port", "0", "--http-port",
                            str(port), "--engines", "127.0.0.1:9"],
            "engine": ["engine", "--host", "127.0.0.1", "--port", str(port), "--model",
                       str(tiny_model_dir)],
            "engine-metrics": ["engine", "--host", "127.0.0.1", "--port", "0",
                               "--metrics-port", str(port), "--model", str(tiny_model_dir)],
            "up-router": ["up", "--router-port", str(port), "--model", str(tiny_model_dir)],
            "up-http": ["up", "--router-port", "0", "--http-port", str(port), "--model",
                        str(tiny_model_dir)],
        }[command]
        result = _cli(*argv)
    finally:
        holder.close()
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(port) in lines[0] and "port" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_check_port_free_passes_a_free_port_and_skips_any():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_port_free("127.0.0.1", port, "port")
    check_port_free("127.0.0.1", 0, "port")
    check_port_free("127.0.0.1", -1, "http_port")


# ---- weak spots -----------------------------------------------------------------------------

def _closed_within(sock: socket.socket, drip: bytes, limit_s: float) -> bool:
    """Send ``drip`` a byte every 0.2 s; True once the server closes the connection."""
    deadline = time.monotonic() + limit_s
    sock.settimeout(0.2)
    i = 0
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except socket.timeout:
            pass
        except (ConnectionResetError, BrokenPipeError):
            return True
        try:
            sock.sendall(drip[i % len(drip):i % len(drip) + 1])
        except (ConnectionResetError, BrokenPipeError):
            return True
        i += 1
    return False


def test_slow_headers_are_cut_off_on_both_http_fronts(router, engine):
    drip = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 10_000
    for port in (router.server.http_port, engine.server.metrics_server.port):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            assert _closed_within(sock, drip, 6), f"port {port} kept a slowloris connection"


def test_a_slow_body_gets_408(router):
    with socket.create_connection(("127.0.0.1", router.server.http_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        sock.settimeout(10)
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"param": "body"' in reply or b'"param":"body"' in reply


def test_garbage_protobuf_is_invalid_argument_in_one_log_line(router, engine, caplog):
    caplog.set_level(logging.INFO)
    for port in (router.port, engine.port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            generate = channel.unary_stream("/quire.v1.EngineService/Generate")
            with pytest.raises(grpc.RpcError) as err:
                list(generate(b"\xff\xff\xff\xff garbage", timeout=TIMEOUT_S))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("request: not a valid protobuf message")
    lines = [r for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(lines) == 2 and no_tracebacks(caplog)


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "best_of", 3), ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "echo", "yes"), ("/v1/chat/completions", "echo", [True]),
    ("/v1/completions", "logit_bias", {"1": 500}),
    ("/v1/completions", "frobnicate", 1),
    ("/v1/chat/completions", "tools", [{"type": "retrieval"}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "response_format", {"type": "xml"}),
    ("/v1/chat/completions", "top_logprobs", 50),
    ("/v1/completions", "n", 10 ** 30), ("/v1/completions", "logprobs", True),
])
def test_unsupported_or_bad_fields_are_a_400_naming_them(router, path, field, value):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else \
        {"prompt": PROMPT}
    status, body = post(router, path, {**prompt, "max_tokens": 2, field: value})
    assert_400(status, body, field)


def test_accepted_and_ignored_fields_are_served(router):
    status, body = post(router, "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 2, "user": "u", "best_of": 1,
                         "echo": False, "suffix": None, "logit_bias": {}})
    assert status == 200, body
    status, body = post(router, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "yo", "tool_calls": [], "refusal": None}],
        "max_tokens": 2, "tools": [], "tool_choice": "none", "parallel_tool_calls": False,
        "response_format": {"type": "text"}, "metadata": {"k": "v"}})
    assert status == 200, body
    assert re.fullmatch(r"chatcmpl-[0-9a-f]+", body["id"])


def test_long_texts_tokenize_the_same_with_the_gil_released(embedded_model_dir):
    from quire.tokenizer import FastTokenizer

    tokenizer = FastTokenizer.from_dir(embedded_model_dir)
    text = "Héllo wörld, <|im_start|> 123 " * 400  # past the encode_batch threshold
    for special in (True, False):
        assert tokenizer.encode(text, add_special_tokens=special) == \
            tokenizer.backend.encode(text, add_special_tokens=special).ids
