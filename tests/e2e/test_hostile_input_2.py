"""Issue 32: hostile input, second round, against a real router (gRPC + HTTP) and a real
tiny-model engine on loopback (max_model_len 1024, vocabulary 49152). Items 1-5 and 7 of the
issue are numbered below; item 6 (memory) is at the end, on the command line."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
import zlib

import grpc
import pytest

from quire.list_limits import MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, MAX_STOP_TOKEN_IDS
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, request,
                                      start_engine)

MODEL = "tiny"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    running = start_engine(tiny_model_dir, metrics_port=0)
    yield running
    running.close()


@pytest.fixture(scope="module")
def router(engine):
    running = RunningRouter([address(engine)], http_port=0, model_name=MODEL,
                            http_header_timeout_s=5.0, http_body_timeout_s=5.0)
    yield running
    running.close()


def post(router, path: str, body=None, *, raw: bytes | None = None, headers=None):
    """(status, headers, parsed JSON body) of one POST over a fresh connection."""
    data = raw if raw is not None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, json.loads(response.read() or b"null")
    finally:
        conn.close()


def assert_error(status, body, code: int, param: str | None, *words: str) -> None:
    assert status == code, body
    error = body["error"]
    assert error["param"] == param and error["code"] == code, error
    for word in words:
        assert word in error["message"], error


def no_tracebacks(caplog) -> bool:
    return not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


def raw_exchange(port: int, head: bytes, body_parts=(), pause_s: float = 0.0) -> bytes:
    """Send ``head``, then each of ``body_parts`` (``pause_s`` apart); everything the server
    sends until it closes the connection (the test fails if it never does)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.sendall(head)
        for part in body_parts:
            threading.Event().wait(pause_s)
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break  # closed after its answer: the rest is not wanted
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
        return reply


# ---- 1. malformed compressed bodies ---------------------------------------------------------

@pytest.mark.parametrize("path,encoding,body", [
    ("/v1/completions", "gzip", b"\x1f\x8b" + b"\0" * 18),
    ("/v1/chat/completions", "deflate", b"not-deflate"),
    ("/v1/completions", "br", b"\x0b"),
    ("/v1/completions", "gzip", zlib.compress(b'{"prompt": "hi", "max_tokens": 1}')),
])
def test_1_a_compressed_body_is_a_415_naming_the_encoding(router, caplog, path, encoding,
                                                          body):
    caplog.set_level(logging.INFO)
    status, headers, answer = post(router, path, raw=body,
                                   headers={"Content-Encoding": encoding})
    assert_error(status, answer, 415, "body", "Content-Encoding", encoding, "uncompressed")
    assert headers["Accept-Encoding"] == "identity"
    assert headers["Connection"] == "close"
    assert no_tracebacks(caplog)


def test_1_identity_is_the_uncompressed_body(router):
    status, _, answer = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                             headers={"Content-Encoding": "identity"})
    assert status == 200, answer


def test_1_a_malformed_chunk_after_the_headers_is_a_4xx_without_a_traceback(router, caplog):
    """The headers first, then a chunk longer than it said: aiohttp stops feeding the body,
    and the body reader's deadline answers."""
    caplog.set_level(logging.INFO)
    reply = raw_exchange(router.server.http_port,
                         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n",
                         [b"5\r\n{\"pro", b"mpt\": 1}\r\n0\r\n\r\n"], pause_s=0.3)
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:300]
    assert_error(408, json.loads(reply.split(b"\r\n\r\n", 1)[1]), 408, "body")
    assert no_tracebacks(caplog)


def test_1_a_payload_error_in_the_body_reader_is_a_400(router):
    """aiohttp's RequestPayloadError (what a body it could not decode raised: a 500 with a
    traceback before) on a request aiohttp builds itself."""
    from aiohttp import web
    from aiohttp.streams import StreamReader
    from aiohttp.test_utils import make_mocked_request

    front = router.server.front

    async def read() -> BaseException:
        payload = StreamReader(protocol=_Protocol(), limit=1 << 16)
        payload.set_exception(web.RequestPayloadError("400, message:\n  Can not decode"))
        try:
            await front._body(make_mocked_request("POST", "/v1/completions", payload=payload),
                              chat=False)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return e
        raise AssertionError("the body was read")

    error = router.call(read())
    assert (error.status, error.param, str(error)) == (400, "body",
                                                      "body: malformed (Can not decode)")


class _Protocol:
    """What a StreamReader asks of its protocol (flow control), for a body read in a test."""

    _reading_paused = False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


# ---- 2. gzip bombs --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """1 GB of zeros, gzipped: about 1 MB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: the gzip container
    zeros = bytes(1 << 20)
    return b"".join(packer.compress(zeros) for _ in range(1024)) + packer.flush()


def test_2_gzip_bombs_are_refused_unread_and_their_connections_closed(router, gzip_bomb):
    port = router.server.http_port
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(gzip_bomb))
    # each bomb trickles in over ~6 s: the answer comes from the headers alone, and the
    # connection closes (after a short linger) without waiting for the rest
    parts = [gzip_bomb[i:i + 32768] for i in range(0, len(gzip_bomb), 32768)]
    replies = [b""] * 4

    def bomb(i: int) -> None:
        replies[i] = raw_exchange(port, head, parts, pause_s=0.2)

    threads = [threading.Thread(target=bomb, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    try:  # meanwhile the router serves others
        status, _, answer = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200, answer
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        for thread in threads:
            thread.join()
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 415 "), reply[:200]
        assert reply.count(b"HTTP/1.1") == 1


def test_2_a_body_declared_too_large_is_refused_before_it_is_read(router):
    reply = raw_exchange(router.server.http_port,
                         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000000000\r\n\r\n", [b"{" * 65536] * 3, pause_s=0.1)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b'"param": "body"' in reply


# ---- 3. a prompt and max_tokens that do not fit the model together --------------------------

def test_3_a_max_tokens_past_the_context_is_cut_to_fit_on_http(router):
    """As vLLM 0.32's server answers (get_max_tokens): the completion gets what the prompt
    leaves and ends with finish_reason length; only a prompt with no room is refused."""
    status, _, body = post(router, "/v1/completions", {"prompt": [5] * 1020, "max_tokens": 100,
                                                       "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == MAX_MODEL_LEN - 1020, body
    assert body["choices"][0]["finish_reason"] == "length"
    messages = [{"role": "user", "content": "hi " * 600}]
    status, _, body = post(router, "/v1/chat/completions", {"messages": messages,
                                                            "max_tokens": 1000,
                                                            "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == MAX_MODEL_LEN - body["usage"]["prompt_tokens"]
    status, _, body = post(router, "/v1/completions", {"prompt": [5] * MAX_MODEL_LEN,
                                                       "max_tokens": 1})
    assert_error(status, body, 400, "prompt", f"max_model_len={MAX_MODEL_LEN}")


def test_3_a_max_tokens_past_the_context_is_cut_to_fit_on_grpc(router, engine):
    for stub in (router.stub, engine.stub):
        tokens, _ = collect(stub.Generate(request(ids=[5] * 1020, max_tokens=100),
                                          timeout=TIMEOUT_S))
        assert len(tokens) == MAX_MODEL_LEN - 1020


def test_3_without_max_tokens_the_completion_runs_to_the_models_length(router, engine):
    status, _, body = post(router, "/v1/completions", {"prompt": [5] * 1020,
                                                       "ignore_eos": True})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"
    tokens, _ = collect(engine.stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5] * 1020),
        sampling=pb.SamplingOptions(temperature=0, ignore_eos=True)), timeout=TIMEOUT_S))
    assert len(tokens) == 4
    status, _, body = post(router, "/v1/completions", {"prompt": [5] * 1020, "max_tokens": 4,
                                                       "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body  # exactly fits


# ---- 4. list lengths and token ids ----------------------------------------------------------

def test_4_stop_token_ids_are_bounded_on_every_front(router, engine):
    ids = [5] * 500_000
    status, _, body = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                       "stop_token_ids": ids})
    assert_error(status, body, 400, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}",
                 "got 500000")
    for stub in (router.stub, engine.stub):
        with pytest.raises(grpc.RpcError) as err:
            collect(stub.Generate(request(text="hi", stop_token_ids=ids), timeout=TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stop_token_ids: at most 128 stop token ids, got 500000" in err.value.details()
    status, _, body = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                       "stop_token_ids": [5] * 128})
    assert status == 200, body


def test_4_stop_token_ids_outside_the_vocabulary_are_refused(router, engine):
    status, _, body = post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                       "stop_token_ids": [5, 1_000_000]})
    assert_error(status, body, 400, "stop_token_ids", "1000000", "[0, 49152)")
    with pytest.raises(grpc.RpcError) as err:
        collect(engine.stub.Generate(request(text="hi", stop_token_ids=[49152]),
                                     timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == \
        "sampling.stop_token_ids: 49152 is not a token id in [0, 49152)"


def test_4_chat_messages_and_content_parts_are_bounded(router):
    messages = [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)
    status, _, body = post(router, "/v1/chat/completions", {"messages": messages})
    assert_error(status, body, 400, "messages", f"at most {MAX_CHAT_MESSAGES} messages",
                 f"got {MAX_CHAT_MESSAGES + 1}")
    parts = [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)
    status, _, body = post(router, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": parts}]})
    assert_error(status, body, 400, "messages", "messages[0].content: at most "
                 f"{MAX_CONTENT_PARTS} parts")


# ---- 5. a client's mistakes are one line each, bounded under a flood ------------------------

def test_5_malformed_http_is_one_warning_line_without_a_traceback(router, caplog):
    caplog.set_level(logging.INFO)
    port = router.server.http_port
    for i in range(40):  # broken chunk framing: aiohttp refuses it before any handler runs
        raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\nzz%d\r\n" % i)
    assert no_tracebacks(caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    lines = [r.getMessage() for r in caplog.records if "chunk size" in r.getMessage()]
    assert 1 <= len(lines) <= 10, lines  # at most 10 client-error lines per 10 s
    assert lines[0].startswith("Error handling request from 127.0.0.1: HTTP 400 Invalid "
                               "character in chunk size"), lines[0]


def test_5_the_client_error_log_is_rate_limited():
    from router.http_guard import RateLimitedLog

    now = [0.0]
    records = []

    class Sink:
        def log(self, level, msg, *args):
            records.append((level, msg % args))

    log = RateLimitedLog(Sink(), burst=2, window_s=10.0, clock=lambda: now[0])
    for i in range(5):
        log(logging.WARNING, "bad request %d", i)
    now[0] = 10.0
    log(logging.INFO, "bad request %d", 5)
    assert records == [(logging.WARNING, "bad request 0"), (logging.WARNING, "bad request 1"),
                       (logging.INFO, "bad request 5 (3 similar lines dropped)")]


# ---- 7. (6 is below) engine metrics under `quire up`: see tests/e2e/test_quire_up.py ------

# ---- 6. memory: an engine refuses a KV budget the host cannot hold --------------------------

def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quire_cli", *argv], capture_output=True,
                          text=True, timeout=300)


def test_6_an_engine_refuses_a_kv_budget_above_available_memory(tiny_model_dir):
    result = _cli("engine", "--host", "127.0.0.1", "--port", "0", "--model",
                  str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory-bytes",
                  str(1 << 50))
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: kv_cache_memory_bytes: 1048576.00 GiB (1125899906842624 "
                           "bytes) is more than this host (or its cgroup, in a container) has "
                           "available: "), last
    assert "Traceback" not in result.stderr


def test_6_quire_up_refuses_engines_that_do_not_fit_together(tiny_model_dir):
    from engine_worker.host_memory import host_available_bytes

    each = host_available_bytes() // 3  # one fits; four do not
    result = _cli("up", "--num-engines", "4", "--model", str(tiny_model_dir), "--dtype",
                  "float32", "--kv-cache-memory-bytes", str(each), "--router-port", "0",
                  "--http-port", "0", "--once", "true")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: kv_cache_memory_bytes: 4 engines x "), \
        lines
    assert "more than this host" in lines[0] and "listening" not in result.stdout
