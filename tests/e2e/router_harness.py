"""Shared pieces of the router's end-to-end tests: real engines and routers on loopback."""

from __future__ import annotations

import time

import grpc

from engine_worker.server.config import ServerConfig
from quire.block_hash import hash_block_tokens
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.app import RouterServer
from tests.e2e.loop_thread import LoopThread
from tests.e2e.test_engine_server import RunningServer, _engine

TIMEOUT_S = 60


class RunningRouter(LoopThread):
    """A RouterServer on its own event-loop thread, for synchronous test clients.

    Waits until ``ready`` engines serve (default: as many as ``addresses``)."""

    def __init__(self, addresses, ready: int | None = None, build=None, **kwargs) -> None:
        super().__init__()
        kwargs.setdefault("placement", {"reconnect_max_backoff_s": 0.5})
        self.server = self.call(self._build(addresses, kwargs, build))
        self.port = self.call(self.server.start())
        want = len(addresses) if ready is None else ready
        if want and not self.call(self.server.wait_ready(want, timeout_s=TIMEOUT_S)):
            raise RuntimeError(f"engines not serving: {self.server.engine_states()}")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)

    @staticmethod
    async def _build(addresses, kwargs, build) -> RouterServer:
        """``build()`` makes the RouterServer (on the router's loop) when given."""
        if build is not None:
            return build()
        return RouterServer.static(addresses, host="127.0.0.1", port=0, **kwargs)

    def read(self, fn):
        """Run ``fn()`` on the router's loop (its state is not thread-safe)."""
        async def run():
            return fn()
        return self.call(run())

    def matches(self, token_ids) -> dict[str, int]:
        """Leading blocks of the prompt each engine holds, as its KV feed reports them."""
        hashes = hash_block_tokens(token_ids, 16)
        matches = {}
        for engine_id, cached in self.read(self.server.pool.cached_blocks).items():
            num_blocks = 0
            while num_blocks < len(hashes) and hashes[num_blocks] in cached:
                num_blocks += 1
            if num_blocks:
                matches[engine_id] = num_blocks
        return matches

    def healthy(self) -> dict[str, bool]:
        return self.read(lambda: {eid: c.healthy for eid, c in self.server.pool.clients.items()})

    def last_engine(self) -> str:
        return self.read(lambda: self.server.metrics.decisions.latest(1)[0].engine_id)

    def decisions(self, limit: int = 1000):
        return self.read(lambda: self.server.metrics.decisions.latest(limit))


def start_engine(model_dir, **engine_kwargs) -> RunningServer:
    engine_kwargs.setdefault("enable_prefix_caching", True)
    server_kwargs = {k: engine_kwargs.pop(k) for k in list(engine_kwargs)
                     if k in ServerConfig.__dataclass_fields__}
    return RunningServer(_engine(model_dir, **engine_kwargs),
                         ServerConfig(host="127.0.0.1", port=0, **server_kwargs))


def engine_fleet(model_dir, count: int = 2, **engine_kwargs):
    """``count`` engines for a fixture: ``yield from engine_fleet(...)`` closes them after."""
    running = [start_engine(model_dir, **engine_kwargs) for _ in range(count)]
    try:
        yield running
    finally:
        for engine in running:
            engine.close()


def address(engine: RunningServer) -> str:
    return f"127.0.0.1:{engine.port}"


def request(ids=None, text=None, max_tokens=8, **sampling) -> pb.GenerateRequest:
    prompt = {"text": text} if text is not None else {"token_ids": pb.TokenIds(ids=ids)}
    return pb.GenerateRequest(**prompt, sampling=pb.SamplingOptions(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling))


def collect(stream):
    tokens, last = [], None
    for message in stream:
        for delta in message.outputs:
            tokens += delta.token_ids
        last = message
    return tokens, last


def wait_for(predicate, timeout_s=10.0, interval_s=0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
