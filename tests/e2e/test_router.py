"""The router over real loopback gRPC: two tiny-model engines behind it, prefix-aware placement."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from engine_worker.server.config import ServerConfig
from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH, hash_block_tokens
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.engine_client import EngineClient, EngineMismatchError, ModelExpectation
from router.prefix_index import PrefixIndex
from router.server import RouterServer
from tests.e2e.test_engine_server import RunningServer, _engine

TIMEOUT_S = 60


class RunningRouter:
    """A RouterServer on its own event loop thread, for synchronous test clients."""

    def __init__(self, addresses, tokenizer_dir, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = RouterServer(addresses, tokenizer_dir, policy="prefix_aware",
                                   host="127.0.0.1", port=0, **kwargs)
        self.port = self.call(self.server.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def matches(self, token_ids) -> dict[str, int]:
        hashes = hash_block_tokens(token_ids, 16)

        async def match():
            return self.server.index.match(hashes)
        return self.call(match())

    def healthy(self) -> dict[str, bool]:
        async def read():
            return {c.engine_id: c.healthy for c in self.server.clients}
        return self.call(read())

    def close(self) -> None:
        self.channel.close()
        try:
            self.call(self.server.stop(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _start_engine(model_dir) -> RunningServer:
    return RunningServer(_engine(model_dir, enable_prefix_caching=True),
                         ServerConfig(host="127.0.0.1", port=0))


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    running = [_start_engine(tiny_model_dir) for _ in range(2)]
    yield running
    for engine in running:
        engine.close()


@pytest.fixture(scope="module")
def router(engines, tiny_model_dir):
    running = RunningRouter([f"127.0.0.1:{e.port}" for e in engines], tiny_model_dir)
    yield running
    running.close()


def _request(ids=None, text=None, max_tokens=8) -> pb.GenerateRequest:
    prompt = {"text": text} if text is not None else {"token_ids": pb.TokenIds(ids=ids)}
    return pb.GenerateRequest(**prompt, sampling=pb.SamplingOptions(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


def _collect(stream):
    tokens, last = [], None
    for message in stream:
        for delta in message.outputs:
            tokens += delta.token_ids
        last = message
    return tokens, last


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _placements(caplog) -> list[str]:
    return [r.getMessage().split(" -> engine ")[1].split(" ")[0] for r in caplog.records
            if r.name == "router.server" and " -> engine " in r.getMessage()]


def test_router_returns_the_same_tokens_as_an_engine(router, engines):
    ids = list(range(300, 340))
    direct, _ = _collect(engines[0].stub.Generate(_request(ids, max_tokens=12),
                                                  timeout=TIMEOUT_S))
    routed, last = _collect(router.stub.Generate(_request(ids, max_tokens=12), timeout=TIMEOUT_S))
    assert routed == direct and last.finished
    text = "The quick brown fox jumps over the lazy dog"
    direct, _ = _collect(engines[1].stub.Generate(_request(text=text), timeout=TIMEOUT_S))
    routed, last = _collect(router.stub.Generate(_request(text=text), timeout=TIMEOUT_S))
    assert routed == direct and last.usage.prompt_tokens > 0  # the router tokenized it
    info = router.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S)
    assert info.block_size == 16 and info.block_hash_algorithm == BLOCK_HASH_ALGORITHM


def test_placement_follows_the_prefix(router, engines, caplog):
    caplog.set_level(logging.INFO, logger="router.server")
    by_port = {f"127.0.0.1:{e.port}": e for e in engines}
    prefix = list(range(1000, 1080))  # 5 full blocks
    _collect(router.stub.Generate(_request(prefix + [5, 6, 7]), timeout=TIMEOUT_S))
    engine_a = _placements(caplog)[-1]
    assert _wait_for(lambda: router.matches(prefix).get(engine_a) == 5)
    for tail in ([8], [9, 10, 11], list(range(20, 40))):
        _, last = _collect(router.stub.Generate(_request(prefix + tail), timeout=TIMEOUT_S))
        assert _placements(caplog)[-1] == engine_a
        assert last.usage.cached_tokens >= 64
    # a prefix warmed directly on the *other* engine pulls its requests there, even though
    # the tie-break between idle engines would pick engine_a's sibling only by id
    other = next(eid for eid in by_port if eid != engine_a)
    prefix_b = list(range(2000, 2080))
    _collect(by_port[other].stub.Generate(_request(prefix_b + [1]), timeout=TIMEOUT_S))
    assert _wait_for(lambda: router.matches(prefix_b).get(other) == 5)
    _, last = _collect(router.stub.Generate(_request(prefix_b + [2, 3]), timeout=TIMEOUT_S))
    assert _placements(caplog)[-1] == other and last.usage.cached_tokens >= 64
    # an unrelated prompt is served somewhere
    tokens, last = _collect(router.stub.Generate(_request(list(range(4000, 4030))),
                                                 timeout=TIMEOUT_S))
    assert len(tokens) == 8 and _placements(caplog)[-1] in by_port


def test_cache_salt_changes_the_hashes(router):
    salted = _request(list(range(3000, 3040)))
    salted.cache_salt = "tenant-a"
    prompt = router.server.servicer.prepare(salted)
    assert prompt.block_hashes == tuple(hash_block_tokens(prompt.token_ids, 16,
                                                          cache_salt="tenant-a"))
    assert prompt.block_hashes != tuple(hash_block_tokens(prompt.token_ids, 16))


@pytest.mark.parametrize("field, value", [("block_size", 32), ("tokenizer_digest", "0" * 64)])
def test_an_engine_that_hashes_differently_is_refused(engines, tiny_model_dir, caplog,
                                                      field, value):
    from router.tokenizer import RouterTokenizer

    fields = dict(block_size=16, block_hash_algorithm=BLOCK_HASH_ALGORITHM,
                  block_hash_seed=ROOT_HASH,
                  tokenizer_digest=RouterTokenizer.from_dir(tiny_model_dir).digest)
    fields[field] = value
    client = EngineClient("e0", f"127.0.0.1:{engines[0].port}", index=PrefixIndex(),
                          expected=ModelExpectation(**fields))
    with caplog.at_level(logging.ERROR, logger="router.engine_client"):
        with pytest.raises(EngineMismatchError) as err:
            asyncio.run(client.connect())
    assert field in str(err.value) and list(err.value.differences) == [field]
    assert any("refusing" in r.getMessage() and field in r.getMessage() for r in caplog.records)
    # a router whose only engine is refused does not start
    with pytest.raises(RuntimeError, match=field):
        RunningRouter([f"127.0.0.1:{engines[0].port}"], tiny_model_dir,
                      expected=ModelExpectation(**fields))


def test_stopping_an_engine_mid_run(engines, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="router.server")
    doomed = _start_engine(tiny_model_dir)
    survivor = engines[0]
    router = RunningRouter([f"127.0.0.1:{survivor.port}", f"127.0.0.1:{doomed.port}"],
                           tiny_model_dir)
    doomed_id = f"127.0.0.1:{doomed.port}"
    try:
        prefix = list(range(6000, 6080))
        _collect(doomed.stub.Generate(_request(prefix + [1]), timeout=TIMEOUT_S))
        assert _wait_for(lambda: router.matches(prefix).get(doomed_id) == 5)
        # a long stream placed on the doomed engine
        stream = router.stub.Generate(_request(prefix + [2], max_tokens=800), timeout=TIMEOUT_S)
        first = next(stream)
        assert _placements(caplog)[-1] == doomed_id and first.outputs
        doomed.close()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError):  # tokens were streamed: no replay, but no hang
            for _ in stream:
                pass
        assert time.monotonic() - started < TIMEOUT_S
        assert _wait_for(lambda: not router.healthy()[doomed_id])
        for i in range(4):  # the prefix now lives nowhere healthy; all go to the survivor
            tokens, last = _collect(router.stub.Generate(_request(prefix + [3 + i]),
                                                         timeout=TIMEOUT_S))
            assert len(tokens) == 8 and last.finished
            assert _placements(caplog)[-1] == f"127.0.0.1:{survivor.port}"
    finally:
        router.close()


def test_router_modules_do_not_import_torch():
    code = ("import sys, router.server, router.engine_client; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60).returncode == 0


def test_client_cancellation_reaches_the_engine(router, engines, caplog):
    caplog.set_level(logging.INFO, logger="router.server")
    by_port = {f"127.0.0.1:{e.port}": e for e in engines}
    stream = router.stub.Generate(_request(list(range(7000, 7040)), max_tokens=900),
                                  timeout=TIMEOUT_S)
    next(stream)
    engine = by_port[_placements(caplog)[-1]].server.async_engine.engine
    stream.cancel()
    assert _wait_for(lambda: not engine.scheduler.requests)
