"""The router over real loopback gRPC: two tiny-model engines behind it, prefix-aware placement."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from quire.block_hash import BLOCK_HASH_ALGORITHM, hash_block_tokens
from quire.v1 import engine_pb2 as pb
from tests.e2e.router_harness import (TIMEOUT_S, RunningRouter, address, collect, engine_fleet,
                                      request, start_engine, wait_for)

_collect, _request, _wait_for, _start_engine = collect, request, wait_for, start_engine


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    yield from engine_fleet(tiny_model_dir)


@pytest.fixture(scope="module")
def router(engines):
    running = RunningRouter([address(e) for e in engines])
    yield running
    running.close()


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
    # what the engines say alike of how they run, the router says too; not an incarnation
    engine = engines[0].stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S)
    for name in ("backend", "backend_reason", "quantization", "runner", "hidden_size",
                 "tensor_parallel_size", "layer_execution"):
        assert getattr(info, name) == getattr(engine, name) != type(getattr(engine, name))()
    assert engine.incarnation_id and not info.incarnation_id


def test_placement_follows_the_prefix(router, engines):
    by_port = {f"127.0.0.1:{e.port}": e for e in engines}
    prefix = list(range(1000, 1080))  # 5 full blocks
    _collect(router.stub.Generate(_request(prefix + [5, 6, 7]), timeout=TIMEOUT_S))
    engine_a = router.last_engine()
    assert _wait_for(lambda: router.matches(prefix).get(engine_a) == 5)
    for tail in ([8], [9, 10, 11], list(range(20, 40))):
        _, last = _collect(router.stub.Generate(_request(prefix + tail), timeout=TIMEOUT_S))
        assert router.last_engine() == engine_a
        assert last.usage.cached_tokens >= 64
    # a prefix warmed directly on the *other* engine pulls its requests there, even though
    # the tie-break between idle engines would pick engine_a's sibling only by id
    other = next(eid for eid in by_port if eid != engine_a)
    prefix_b = list(range(2000, 2080))
    _collect(by_port[other].stub.Generate(_request(prefix_b + [1]), timeout=TIMEOUT_S))
    assert _wait_for(lambda: router.matches(prefix_b).get(other) == 5)
    _, last = _collect(router.stub.Generate(_request(prefix_b + [2, 3]), timeout=TIMEOUT_S))
    assert router.last_engine() == other and last.usage.cached_tokens >= 64
    # an unrelated prompt is served somewhere
    tokens, last = _collect(router.stub.Generate(_request(list(range(4000, 4030))),
                                                 timeout=TIMEOUT_S))
    assert len(tokens) == 8 and router.last_engine() in by_port


def test_cache_salt_changes_the_hashes(router):
    salted = _request(list(range(3000, 3040)))
    salted.cache_salt = "tenant-a"
    prompt = router.call(router.server.servicer.prepare(salted))
    assert prompt.block_hashes == tuple(hash_block_tokens(prompt.token_ids, 16,
                                                          cache_salt="tenant-a"))
    assert prompt.block_hashes != tuple(hash_block_tokens(prompt.token_ids, 16))


def test_the_router_fetches_the_engines_tokenizer(router, tiny_model_dir):
    identity = router.read(lambda: router.server.pool.identity)
    text = "Hello, tokenizer from the engine!"
    from quire.tokenizer import FastTokenizer

    local = FastTokenizer.from_dir(tiny_model_dir)
    assert identity.tokenizer.digest == local.digest
    assert identity.tokenizer.encode(text) == local.encode(text)


def test_engines_with_different_block_sizes_share_a_pool(engines, tiny_model_dir):
    """A 32-token-block engine beside 16-token ones is admitted (the router hashes each prompt
    at every block size in the pool) and a prefix it cached pulls its requests to it."""
    odd = _start_engine(tiny_model_dir, block_size=32)
    router = RunningRouter([address(engines[0])])
    try:
        from router.discovery import Endpoint

        members = frozenset(Endpoint(address(e), address(e)) for e in (engines[0], odd))
        router.call(router.server.pool.reconcile(members))
        assert _wait_for(lambda: router.healthy() == {address(engines[0]): True,
                                                      address(odd): True})
        assert router.read(router.server.pool.refused) == {}
        assert router.read(router.server.pool.block_sizes) == {16, 32}
        prefix = list(range(5000, 5096))  # 3 blocks of 32, 6 of 16
        _collect(odd.stub.Generate(_request(prefix + [1]), timeout=TIMEOUT_S))
        hashes32 = hash_block_tokens(prefix, 32)
        assert _wait_for(lambda: set(hashes32) <= router.read(
            router.server.pool.cached_blocks).get(address(odd), frozenset()))
        _, last = _collect(router.stub.Generate(_request(prefix + [2, 3]), timeout=TIMEOUT_S))
        assert router.last_engine() == address(odd) and last.usage.cached_tokens >= 64
    finally:
        router.close()
        odd.close()


def test_an_engine_with_another_tokenizer_is_refused(engines, tiny_model_dir, tmp_path, caplog):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_dir, other)
    raw = (other / "tokenizer.json").read_text()
    (other / "tokenizer.json").write_text(raw.replace("{", "{ ", 1))  # same tokens, new digest
    caplog.set_level(logging.WARNING, logger="router.engine_client")
    # the router is told to use a tokenizer none of the engines has: every engine is refused
    router = RunningRouter([address(engines[0])], ready=0, tokenizer=str(other))
    try:
        assert _wait_for(lambda: address(engines[0]) in router.read(router.server.pool.refused))
        refusal = router.read(router.server.pool.refused)[address(engines[0])]
        assert list(refusal.differences) == ["tokenizer_digest"]
        refused = [r.getMessage() for r in caplog.records if "-> refused" in r.getMessage()]
        assert len(refused) == 1 and "tokenizer_digest: router expects" in refused[0], refused
        with pytest.raises(grpc.RpcError) as err:
            _collect(router.stub.Generate(_request(text="hi"), timeout=TIMEOUT_S))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.close()


def test_stopping_an_engine_mid_run(engines, tiny_model_dir):
    doomed = _start_engine(tiny_model_dir)
    survivor = engines[0]
    router = RunningRouter([address(survivor), address(doomed)])
    doomed_id = address(doomed)
    try:
        prefix = list(range(6000, 6080))
        _collect(doomed.stub.Generate(_request(prefix + [1]), timeout=TIMEOUT_S))
        assert _wait_for(lambda: router.matches(prefix).get(doomed_id) == 5)
        # a long stream placed on the doomed engine
        stream = router.stub.Generate(_request(prefix + [2], max_tokens=800), timeout=TIMEOUT_S)
        first = next(stream)
        assert router.last_engine() == doomed_id and first.outputs
        assert dict(stream.initial_metadata())["quire-engine-id"] == doomed_id
        doomed.close()
        started = time.monotonic()
        # tokens were streamed: no replay from the start, no hang; the stream goes on on the
        # survivor from the next token (router.resume), every token once
        tokens, last = _collect(stream)
        tokens = [t for d in first.outputs for t in d.token_ids] + tokens
        assert len(tokens) == 800 and last.finished
        assert last.usage.completion_tokens == 800
        assert time.monotonic() - started < TIMEOUT_S
        assert [d.engine_id for d in router.decisions()][-2:] == [doomed_id, address(survivor)]
        assert _wait_for(lambda: not router.healthy()[doomed_id])
        for i in range(4):  # the prefix now lives nowhere healthy; all go to the survivor
            tokens, last = _collect(router.stub.Generate(_request(prefix + [3 + i]),
                                                         timeout=TIMEOUT_S))
            assert len(tokens) == 8 and last.finished
            assert router.last_engine() == address(survivor)
    finally:
        router.close()


def test_router_modules_do_not_import_torch():
    code = ("import sys, router.app, router.openai_api, router.discovery; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, timeout=60).returncode == 0


def test_client_cancellation_reaches_the_engine(router, engines):
    by_address = {address(e): e for e in engines}
    stream = router.stub.Generate(_request(list(range(7000, 7040)), max_tokens=900),
                                  timeout=TIMEOUT_S)
    next(stream)
    engine = by_address[router.last_engine()]
    stream.cancel()
    assert _wait_for(engine.holds_no_request)
