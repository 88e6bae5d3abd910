"""A soak test (issue 20): a few hundred mixed requests through the router into two tiny-model
engines, on both fronts, streaming and not, with random cancellations, deadlines and client
disconnects at random points. Afterwards every engine runs nothing and holds no KV block for a
request, and the router's prefix index for each engine equals that engine's cache.

Bounded: 300 requests on 6 client threads, small outputs; well under a minute on 2 cores."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.router_harness import RunningRouter, address, engine_fleet, request, wait_for

pytestmark = pytest.mark.soak

MODEL = "tiny"
NUM_REQUESTS = 300
PREFIXES = [" ".join(f"{word}{i}" for i in range(40)) for word in ("alpha", "beta", "gamma")]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir)


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines], http_port=0, model_name=MODEL)
    yield running
    running.close()


def _raw_http(port: int, body: dict, rng: random.Random, chat: bool) -> str:
    """POST over a raw socket; read all of the answer, or leave at a random point."""
    data = json.dumps(body).encode()
    path = b"/v1/chat/completions" if chat else b"/v1/completions"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        if rng.random() < 0.4:
            time.sleep(rng.uniform(0, 0.3))  # leave before, during or after the answer
            return "left"
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    status = int(received.split(b" ", 2)[1])
    assert status == 200, received[:300]
    return "done"


def _grpc(stub, rng: random.Random, text: str, max_tokens: int) -> str:
    call = stub.Generate(request(text=text, max_tokens=max_tokens),
                         timeout=rng.choice([30, 30, 0.05, 0.3]))
    try:
        for i, _ in enumerate(call):
            if rng.random() < 0.1:
                call.cancel()
                return "cancelled"
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED), e
        return e.code().name
    return "done"


def _one(router, seed: int) -> str:
    rng = random.Random(seed)
    text = rng.choice(PREFIXES) + f" tail{rng.randrange(1000)}"
    max_tokens = rng.choice([1, 4, 16, 64])
    kind = rng.choice(["grpc", "completion", "chat"])
    if kind == "grpc":
        return _grpc(router.stub, rng, text, max_tokens)
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": rng.random() < 0.5, "temperature": rng.choice([0, 1.0]),
            "n": rng.choice([1, 1, 2])}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return _raw_http(router.server.http_port, body, rng, chat=kind == "chat")


def _engine_idle(engine) -> bool:
    core = engine.server.async_engine.engine
    stats = core.stats()
    kv = stats.kv_cache
    return (engine.server.async_engine.num_unfinished == 0 and not core.has_unfinished_requests()
            and stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0
            and kv.num_allocated_slots == 0 and kv.num_free_blocks == kv.num_blocks)


def test_soak_leaves_no_request_running_and_every_index_true(router, engines):
    health_failures: list[str] = []
    stop = threading.Event()

    def watch_health() -> None:
        while not stop.wait(0.25):
            conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=10)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status != 200:
                    health_failures.append("not ready")
            except OSError as e:
                health_failures.append(repr(e))
            finally:
                conn.close()

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(lambda seed: _one(router, seed), range(NUM_REQUESTS)))
    finally:
        stop.set()
        watcher.join()
    assert not health_failures, health_failures[:3]
    assert outcomes.count("done") >= NUM_REQUESTS // 3
    assert {"left", "cancelled"} <= set(outcomes)

    for engine in engines:
        assert wait_for(lambda: _engine_idle(engine), 10), (
            engine.server.async_engine.num_unfinished,
            engine.server.async_engine.engine.stats())

    by_address = {address(e): e for e in engines}

    def index_true() -> bool:
        pool = router.server.pool
        clients = router.read(lambda: list(pool.clients.values()))
        for client in clients:
            engine = by_address[client.address]
            held = engine.server.async_engine.engine.kv_cache_snapshot().block_hashes
            cached = router.read(pool.cached_blocks).get(client.engine_id, frozenset())
            if cached != held:
                return False
        return len(clients) == len(engines)
    assert wait_for(index_true, 10)
    # and the stack still serves
    status, _ = _post_small(router)
    assert status == 200


def _post_small(router):
    conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"model": MODEL, "prompt": PREFIXES[0], "max_tokens": 2}),
            headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()
