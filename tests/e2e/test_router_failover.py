"""Router failover over real loopback gRPC with real tiny-model engines: retries before the first
token (bounded, within the deadline), engines leaving and rejoining the pool on their own health,
and engines that are unreachable when the router starts."""

from __future__ import annotations

import socket

import grpc
import pytest

from engine_worker.server.config import ServerConfig
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, engine_fleet,
                                      request, wait_for)
from tests.e2e.test_engine_server import RunningServer, _engine


@pytest.fixture
def pair(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir)


def _drain_without_telling(engine) -> None:
    """The engine refuses new work (UNAVAILABLE) while its health still says SERVING: the
    window between a pod starting to drain and its health change reaching the router."""
    engine.server.servicer.draining = True


def test_a_failure_before_the_first_token_is_retried_on_another_engine(pair):
    a, b = pair
    router = RunningRouter([address(a), address(b)])
    try:
        prefix = list(range(100, 180))
        collect(a.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))  # pulls it to a
        assert wait_for(lambda: router.matches(prefix).get(address(a)) == 5)
        _drain_without_telling(a)
        tokens, last = collect(router.stub.Generate(request(prefix + [2], max_tokens=10),
                                                    timeout=TIMEOUT_S))
        assert len(tokens) == 10 and last.finished
        first, second = router.decisions(2)
        assert (first.engine_id, first.attempt, first.outcome) == (address(a), 1, "UNAVAILABLE")
        assert (second.engine_id, second.attempt, second.outcome) == (address(b), 2, "OK")
        assert first.request_id == second.request_id
        text = router.read(lambda: router.server.metrics.render().decode())
        assert f'quire_router_retries_total{{engine="{address(a)}"}} 1.0' in text
    finally:
        router.close()


def test_retries_are_bounded(pair):
    router = RunningRouter([address(e) for e in pair], placement={"max_attempts": 2})
    try:
        for engine in pair:
            _drain_without_telling(engine)
        with pytest.raises(grpc.RpcError) as err:
            collect(router.stub.Generate(request(list(range(10, 30))), timeout=TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [d.attempt for d in router.decisions(2)] == [1, 2]
        assert {d.engine_id for d in router.decisions(2)} == {address(e) for e in pair}
    finally:
        router.close()


def test_an_engine_leaves_the_pool_while_not_serving_and_returns(pair):
    a, b = pair
    router = RunningRouter([address(a), address(b)])
    try:
        a.call(a.server._set_serving(False))  # what SIGTERM and a dead engine loop do first
        assert wait_for(lambda: not router.healthy()[address(a)], timeout_s=5)
        for i in range(4):
            collect(router.stub.Generate(request(list(range(500 + i, 540))), timeout=TIMEOUT_S))
            assert router.last_engine() == address(b)
        a.call(a.server._set_serving(True))
        assert wait_for(lambda: router.healthy()[address(a)], timeout_s=5)
        prefix = list(range(900, 980))
        collect(a.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(address(a)) == 5)
        collect(router.stub.Generate(request(prefix + [2]), timeout=TIMEOUT_S))
        assert router.last_engine() == address(a)
    finally:
        router.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_engine_unreachable_at_start_joins_when_it_comes_up(pair, tiny_model_dir):
    late_port = _free_port()
    late_address = f"127.0.0.1:{late_port}"
    router = RunningRouter([address(pair[0]), late_address], ready=1)
    late = None
    try:
        assert router.healthy() == {address(pair[0]): True, late_address: False}
        tokens, _ = collect(router.stub.Generate(request(list(range(40, 80))),
                                                 timeout=TIMEOUT_S))
        assert len(tokens) == 8 and router.last_engine() == address(pair[0])
        late = RunningServer(_engine(tiny_model_dir, enable_prefix_caching=True),
                             ServerConfig(host="127.0.0.1", port=late_port))
        assert wait_for(lambda: router.healthy()[late_address], timeout_s=20)
        prefix = list(range(1200, 1280))
        collect(late.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(late_address) == 5)
        collect(router.stub.Generate(request(prefix + [2]), timeout=TIMEOUT_S))
        assert router.last_engine() == late_address
    finally:
        router.close()
        if late is not None:
            late.close()


def test_a_restarted_engine_is_checked_and_resubscribed(pair, tiny_model_dir):
    a, b = pair
    port = _free_port()
    first = RunningServer(_engine(tiny_model_dir, enable_prefix_caching=True),
                          ServerConfig(host="127.0.0.1", port=port))
    router = RunningRouter([address(a), f"127.0.0.1:{port}"])
    second = None
    try:
        prefix = list(range(3000, 3080))
        collect(first.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(f"127.0.0.1:{port}") == 5)
        first.close()
        assert wait_for(lambda: not router.healthy()[f"127.0.0.1:{port}"])
        assert router.matches(prefix).get(f"127.0.0.1:{port}") is None  # its cache is gone
        second = RunningServer(_engine(tiny_model_dir, enable_prefix_caching=True),
                               ServerConfig(host="127.0.0.1", port=port))
        assert wait_for(lambda: router.healthy()[f"127.0.0.1:{port}"], timeout_s=20)
        collect(second.stub.Generate(request(prefix + [2]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(f"127.0.0.1:{port}") == 5)
    finally:
        router.close()
        if second is not None:
            second.close()
