"""Two router replicas subscribed to the same engines hold the same prefix index."""

from __future__ import annotations

import time

from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import RunningRouter, start_engine as _start_engine


def _index(router: RunningRouter) -> dict[str, frozenset[int]]:
    return router.read(router.server.pool.cached_blocks)


def _truth(engines) -> dict[str, frozenset[int]]:
    return {f"127.0.0.1:{e.port}": e.cached_block_hashes() for e in engines}


def test_two_replicas_hold_the_same_index(tiny_model_dir):
    engines = [_start_engine(tiny_model_dir) for _ in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    first = RunningRouter(addresses)
    try:
        # traffic through the first replica only, before and after the second subscribes
        for i in range(3):
            prompt = list(range(1000 * i + 100, 1000 * i + 180))
            list(first.stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingOptions(temperature=0, max_tokens=4)), timeout=60))
        second = RunningRouter(addresses)
        try:
            for i in range(3, 6):
                prompt = list(range(1000 * i + 100, 1000 * i + 180))
                list(first.stub.Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt),
                    sampling=pb.SamplingOptions(temperature=0, max_tokens=4)), timeout=60))
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                a, b, truth = _index(first), _index(second), _truth(engines)
                if a == b == truth:
                    break
                time.sleep(0.05)
            assert a == b == truth
            assert sum(len(v) for v in truth.values()) >= 6 * 5  # 80-token prompts: 5 blocks
        finally:
            second.close()
    finally:
        first.close()
        for engine in engines:
            engine.close()


def test_three_replicas_sharing_traffic_each_place_on_the_full_index(tiny_model_dir):
    """Traffic spread over three replicas, one request at a time: each replica subscribes to
    every engine, so a prefix computed through one replica is found by the others (no replica
    holds only its own share of the cache)."""
    engines = [_start_engine(tiny_model_dir) for _ in range(2)]
    addresses = [f"127.0.0.1:{e.port}" for e in engines]
    routers = [RunningRouter(addresses) for _ in range(3)]
    try:
        prefix = list(range(4000, 4080))  # 5 blocks
        for i, router in enumerate(routers + routers):
            if i:  # the previous request's blocks are reported to every replica
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and any(
                        router_.matches(prefix) == {} for router_ in routers):
                    time.sleep(0.05)
            message = pb.GenerateRequest(request_id=f"r{i}", token_ids=pb.TokenIds(
                ids=prefix + [i + 1]), sampling=pb.SamplingOptions(temperature=0, max_tokens=4))
            list(router.stub.Generate(message, timeout=60))
        placed = [d for router in routers for d in router.decisions()]
        assert len(placed) == 6
        later = [d for d in placed if d.request_id != "r0"]
        assert all(d.predicted_cached_tokens == 80 == d.actual_cached_tokens for d in later), [
            (d.request_id, d.predicted_cached_tokens, d.actual_cached_tokens) for d in placed]
        assert len({d.engine_id for d in placed}) == 1  # one copy serves all three replicas
    finally:
        for router in routers:
            router.close()
        for engine in engines:
            engine.close()
