"""Router failover over real loopback gRPC with real tiny-model engines: retries before the first
token (bounded, within the deadline), engines leaving and rejoining the pool on their own health,
and engines that are unreachable when the router starts."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from engine_worker.server.config import ServerConfig
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
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


def test_an_engine_back_after_a_long_absence_rejoins_within_the_routers_backoff(
        pair, tiny_model_dir):
    """gRPC reconnects a channel on its own schedule (1 s growing 1.6x to 120 s) and fails calls
    between its attempts without trying: after 20 s away an engine went unused for seconds more
    (a minute in the restart bench) whatever the router's backoff said. The channel now uses
    the router's backoff (0.5 s here), so the engine is serving soon after it listens."""
    late_port = _free_port()
    late_address = f"127.0.0.1:{late_port}"
    engine = _engine(tiny_model_dir)  # built first: only the server's start is timed
    router = RunningRouter([address(pair[0]), late_address], ready=1)
    late = None
    try:
        time.sleep(20)  # the router keeps trying the absent address
        assert router.healthy()[late_address] is False
        late = RunningServer(engine, ServerConfig(host="127.0.0.1", port=late_port))
        assert wait_for(lambda: router.healthy()[late_address], timeout_s=3, interval_s=0.05)
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


def _engine_process(model_dir, port: int) -> subprocess.Popen:
    """`quire engine` as its own process on ``port``, once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "quire_cli", "engine", "--model", str(model_dir), "--dtype",
         "float32", "--kv-cache-memory-bytes", str(1 << 24), "--host", "127.0.0.1", "--port",
         str(port), "--metrics-port", "0", "--enable-prefix-caching"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert f"listening on 127.0.0.1:{port}" in line, line
    return proc


@pytest.mark.slow  # starts an engine process twice
def test_an_engine_killed_and_restarted_under_traffic_is_indexed_afresh(pair, tiny_model_dir):
    """SIGKILL an engine process under traffic and start another on the same port: the router
    sees a new incarnation, so no request is placed on the dead process's blocks (neither
    the precise index nor the router's own routing history keeps them), and the prefix is
    found again as soon as the new process has computed it."""
    stable = address(pair[0])
    port = _free_port()
    restarted = f"127.0.0.1:{port}"
    proc = _engine_process(tiny_model_dir, port)
    # the default reconnect backoff: a restart must not wait for the KV feed's next attempt
    router = RunningRouter([stable, restarted], placement={"reconnect_max_backoff_s": 5.0})
    cold, hot = list(range(5000, 5080)), list(range(6000, 6080))  # 5 blocks each
    stop, outcomes = threading.Event(), []

    def traffic():
        i = 0
        while not stop.is_set():
            i += 1
            try:
                collect(router.stub.Generate(request(hot + [i % 50 + 1], max_tokens=4),
                                             timeout=TIMEOUT_S))
                outcomes.append("OK")
            except grpc.RpcError as e:
                outcomes.append(e.code().name)
    def placed(prompt, request_id):
        """Send ``prompt`` alone through the router; its (last) placement."""
        message = request(prompt)
        message.request_id = request_id
        collect(router.stub.Generate(message, timeout=TIMEOUT_S))
        return [d for d in router.decisions() if d.request_id == request_id][-1]
    worker = threading.Thread(target=traffic)
    try:
        direct = engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(restarted))
        for prefix in (cold, hot):  # both prefixes warm on the engine that will die
            collect(direct.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(cold).get(restarted) == 5
                        and router.matches(hot).get(restarted) == 5)
        # recorded in the routing history too
        assert placed(cold + [2], "cold-0").engine_id == restarted
        worker.start()
        assert wait_for(lambda: len(outcomes) >= 3, timeout_s=TIMEOUT_S)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert wait_for(lambda: not router.healthy()[restarted], timeout_s=20)
        served_during_outage = len(outcomes)
        proc = _engine_process(tiny_model_dir, port)
        assert wait_for(lambda: router.healthy()[restarted], timeout_s=TIMEOUT_S)
        assert len(outcomes) > served_during_outage  # the traffic went on meanwhile
        # the cold prefix: nobody holds it any more, wherever the router places it
        first = placed(cold + [3], "cold-1")
        assert first.predicted_cached_tokens == 0 == first.actual_cached_tokens, first
        # ... and once computed again it is found again (the new process's feed is followed)
        assert wait_for(lambda: router.matches(cold).get(first.engine_id) == 5)
        again = placed(cold + [4], "cold-2")
        assert again.predicted_cached_tokens == 80 == again.actual_cached_tokens, again
        stop.set()
        worker.join()
        # no placement ever claimed blocks the engine did not have
        done = [d for d in router.decisions() if d.outcome == "OK"]
        assert all(d.predicted_cached_tokens <= d.actual_cached_tokens for d in done), [
            (d.engine_id, d.predicted_cached_tokens, d.actual_cached_tokens) for d in done]
        # none failed: before a token a request is retried, after one its stream moves on
        assert all(o == "OK" for o in outcomes), outcomes
    finally:
        stop.set()
        if worker.is_alive():
            worker.join()
        router.close()
        proc.kill()
        proc.wait()


def _killed_mid_stream(router, proc, message, kill_after: int):
    """Stream ``message`` through ``router``, SIGKILL ``proc`` once ``kill_after`` tokens have
    arrived; -> (token ids, messages, tokens seen when it was killed)."""
    tokens, messages, at_kill = [], [], None
    for m in router.stub.Generate(message, timeout=TIMEOUT_S):
        messages.append(m)
        for delta in m.outputs:
            tokens += delta.token_ids
        if at_kill is None and len(tokens) >= kill_after:
            at_kill = len(tokens)
            proc.send_signal(signal.SIGKILL)
    return tokens, messages, at_kill


@pytest.mark.slow  # starts an engine process
def test_a_stream_whose_engine_dies_mid_way_goes_on_on_another_engine(pair, tiny_model_dir):
    """SIGKILL the engine while it streams a long greedy completion: the client's stream goes
    on from the next token on the other engine (the tokens so far sent as prompt), with no
    error, every token once, the same tokens as an unbroken run, and usage over the whole
    request."""
    stable = address(pair[0])
    port = _free_port()
    doomed = f"127.0.0.1:{port}"
    proc = _engine_process(tiny_model_dir, port)
    router = RunningRouter([stable, doomed])
    try:
        prefix = list(range(7000, 7080))  # 5 blocks, warm on the engine that will die
        direct = engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(doomed))
        collect(direct.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(doomed) == 5)
        prompt, max_tokens = prefix + [2], 600
        message = request(prompt, max_tokens=max_tokens, logprobs=1)
        message.request_id = "moved"
        tokens, messages, at_kill = _killed_mid_stream(router, proc, message, kill_after=2)
        proc.wait()
        # the unbroken run, on stable only now: had stable held the prompt's blocks before,
        # the router could have placed the request there, where no kill reaches it (CI, twice)
        reference, _ = collect(pair[0].stub.Generate(request(prompt, max_tokens=max_tokens),
                                                     timeout=TIMEOUT_S))
        first, second = [d for d in router.decisions() if d.request_id == "moved"]
        assert (first.engine_id, first.outcome) == (doomed, "UNAVAILABLE"), first
        assert (second.engine_id, second.attempt, second.outcome) == (stable, 2, "OK"), second
        # it went on from where it broke: the longer prompt, its cached part found on stable
        assert second.num_prompt_tokens > len(prompt) + at_kill - 1, second
        assert len(tokens) == max_tokens
        assert tokens == reference  # greedy: what an unbroken run gives
        assert sum(len(d.logprobs) for m in messages for d in m.outputs) == max_tokens
        assert [m.prompt_token_ids for m in messages if m.prompt_token_ids] == [prompt]
        last = messages[-1]
        assert last.finished and last.outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
            len(prompt), max_tokens)
        assert last.usage.cached_tokens <= len(prompt)
        text = router.read(lambda: router.server.metrics.render().decode())
        assert f'quire_router_migrations_total{{engine="{doomed}"}} 1.0' in text
    finally:
        router.close()
        proc.kill()
        proc.wait()


@pytest.mark.slow  # starts an engine process
def test_a_stream_that_cannot_go_on_elsewhere_fails_as_before(pair, tiny_model_dir):
    """Stop strings (text the engine may hold back) are not moved: the failure reaches the
    client after its tokens, with the engine's status, and nothing is retried."""
    port = _free_port()
    doomed = f"127.0.0.1:{port}"
    proc = _engine_process(tiny_model_dir, port)
    router = RunningRouter([address(pair[0]), doomed])
    try:
        prefix = list(range(7100, 7180))
        direct = engine_pb2_grpc.EngineServiceStub(grpc.insecure_channel(doomed))
        collect(direct.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(doomed) == 5)
        message = request(prefix + [2], max_tokens=600, stop=["never-in-the-output"])
        message.request_id = "kept"
        with pytest.raises(grpc.RpcError) as err:
            _killed_mid_stream(router, proc, message, kill_after=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [(d.engine_id, d.outcome) for d in router.decisions()
                if d.request_id == "kept"] == [(doomed, "UNAVAILABLE")]
        text = router.read(lambda: router.server.metrics.render().decode())
        assert "quire_router_migrations_total{" not in text
    finally:
        router.close()
        proc.kill()
        proc.wait()
