"""Placement under load and dynamic membership, over real loopback with real tiny-model engines:
a hot shared prefix spreads to a second engine when its first saturates, and engines found
through Kubernetes discovery join and leave the router as their EndpointSlices change."""

from __future__ import annotations

import threading
import time

from router.app import RouterServer
from router.config import DiscoveryConfig, PlacementConfig, RouterServerConfig
from router.discovery import make_discovery
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, request,
                                      start_engine, wait_for)
from tests.k8s_standin import K8sStandin, api_client_for, make_slice, pod_endpoint


def test_a_hot_prefix_spreads_when_its_engine_saturates(tiny_model_dir):
    # one sequence at a time per engine: a queue forms as soon as two requests overlap
    a, b = (start_engine(tiny_model_dir, max_num_seqs=1) for _ in range(2))
    router = RunningRouter([address(a), address(b)])
    try:
        prefix = list(range(2000, 2192))  # 12 blocks, warmed on a only
        collect(a.stub.Generate(request(prefix + [1]), timeout=TIMEOUT_S))
        assert wait_for(lambda: router.matches(prefix).get(address(a)) == 12)
        threads = []
        for i in range(12):
            thread = threading.Thread(target=lambda i=i: collect(router.stub.Generate(
                request(prefix + list(range(10 * i, 10 * i + 8)), max_tokens=150),
                timeout=TIMEOUT_S)))
            thread.start()
            threads.append(thread)
            time.sleep(0.03)
        for thread in threads:
            thread.join()
        decisions = router.decisions(12)
        engines = [d.engine_id for d in decisions]
        assert engines[0] == address(a)  # the prefix pulls the first request to a
        assert engines.count(address(a)) >= 2 and engines.count(address(b)) >= 2, engines
        on_b = [d for d in decisions if d.engine_id == address(b)]
        # the first request spread to b prefilled the prefix there; later ones hit it
        assert on_b[0].predicted_cached_tokens == 0
        assert any(d.predicted_cached_tokens == 192 and d.actual_cached_tokens == 192
                   for d in on_b[1:]), [(d.predicted_cached_tokens, d.actual_cached_tokens)
                                        for d in on_b]
        assert all(d.outcome == "OK" for d in decisions)
    finally:
        router.close()
        a.close()
        b.close()


def test_a_burst_of_one_new_prefix_lands_on_its_first_copies(tiny_model_dir):
    """Speculative indexing: a burst of one prefix neither engine holds, all placed before any
    KV event can arrive. Each placement claims its blocks at once, so only the first request
    on each engine is cold (the second goes to the idle engine: waiting behind the first
    one's prefill is slower than prefilling there) and every later one is placed on a copy.
    Without the claims all of them were cold and each recomputed the prefix. The engines'
    KV events then confirm every claim."""
    a, b = (start_engine(tiny_model_dir) for _ in range(2))
    router = RunningRouter([address(a), address(b)])
    try:
        prefix = list(range(7000, 7192))  # 12 blocks
        start = threading.Barrier(8)

        def send(i):
            start.wait()
            collect(router.stub.Generate(request(prefix + [100 + i], max_tokens=4),
                                         timeout=TIMEOUT_S))
        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        decisions = router.decisions(8)
        assert len(decisions) == 8 and all(d.outcome == "OK" for d in decisions)
        cold = [d for d in decisions if d.predicted_cached_tokens == 0]
        assert len(cold) <= 2 and len({d.engine_id for d in cold}) == len(cold), [
            (d.engine_id, d.predicted_cached_tokens) for d in decisions]
        assert all(d.predicted_cached_tokens == 192 for d in decisions if d not in cold)
        used = {d.engine_id for d in decisions}
        assert wait_for(lambda: all(router.matches(prefix).get(e) == 12 for e in used))
        assert wait_for(lambda: router.read(router.server.pool.unconfirmed_blocks) == {})
    finally:
        router.close()
        a.close()
        b.close()


def test_kubernetes_discovery_adds_and_removes_engines(tiny_model_dir):
    """No Kubernetes API server runs here: the loopback stand-in serves EndpointSlice list and
    watch over HTTP to the real ``kubernetes`` client, and the engines are real."""
    a, b = (start_engine(tiny_model_dir) for _ in range(2))
    standin = K8sStandin().start()
    cfg = DiscoveryConfig(discovery="kubernetes", k8s_namespace="llm", k8s_service="engines")

    def slice_for(name, engine, **conditions):
        return make_slice(name, "engines", [pod_endpoint(name, "127.0.0.1", **conditions)],
                          port=engine.port)

    def build():
        return RouterServer(RouterServerConfig(host="127.0.0.1", port=0, http_port=-1), cfg,
                            PlacementConfig(reconnect_max_backoff_s=0.5),
                            discovery_impl=make_discovery(
                                cfg, api_client=api_client_for(standin.url)))

    standin.put_slice("llm", slice_for("engine-0", a))
    standin.put_slice("llm", make_slice("other", "not-engines",
                                        [pod_endpoint("x", "127.0.0.1")], port=1))
    router = RunningRouter([address(a)], build=build)
    try:
        assert router.healthy() == {"engine-0": True}  # pod names are the engine ids
        standin.put_slice("llm", slice_for("engine-1", b))
        assert wait_for(lambda: router.healthy() == {"engine-0": True, "engine-1": True})
        standin.put_slice("llm", slice_for("engine-0", a, ready=False))  # a goes unready
        assert wait_for(lambda: set(router.healthy()) == {"engine-1"})
        for i in range(3):
            collect(router.stub.Generate(request(list(range(300 + i, 340))), timeout=TIMEOUT_S))
            assert router.last_engine() == "engine-1"
        standin.put_slice("llm", slice_for("engine-0", a, terminating=True, ready=True))
        assert wait_for(lambda: set(router.healthy()) == {"engine-1"})
        standin.put_slice("llm", slice_for("engine-0", a))  # back
        assert wait_for(lambda: router.healthy() == {"engine-0": True, "engine-1": True})
        standin.delete_slice("llm", "engine-1")
        assert wait_for(lambda: set(router.healthy()) == {"engine-0"})
    finally:
        router.close()
        standin.close()
        a.close()
        b.close()
