"""EnginePool's membership and index choice, without engines: channels are created lazily and
nothing here dials them."""

from __future__ import annotations

import asyncio
import logging
import time

from quire.block_hash import BLOCK_HASH_ALGORITHM, ROOT_HASH
from quire.kv_events import BlockRemoved, KVCacheSnapshot, KVEventBatch
from quire.v1 import engine_pb2 as pb
from router.connection import (ClientOptions, EngineConnection, EngineMismatchError, EngineState,
                               ModelIdentity, change_state, refuse)
from router.discovery import Endpoint, StaticDiscovery
from router.engine_kinds import ENGINE_KINDS
from router.pool import EnginePool
from quire.tokenizer import FastTokenizer


def _pool() -> EnginePool:
    return EnginePool(StaticDiscovery([]), approx_index_blocks=64)


def _cached(pool: EnginePool, block_hashes) -> dict[str, int]:
    """What the balancer would see: leading blocks held, per engine holding any."""
    return {s.engine_id: s.cached_blocks for s in pool.candidates(block_hashes)
            if s.cached_blocks}


def test_reconcile_adds_removes_and_replaces_moved_engines():
    async def scenario():
        pool = _pool()
        await pool.reconcile(frozenset({Endpoint("a", "10.0.0.1:1"), Endpoint("b", "10.0.0.2:1")}))
        assert sorted(pool.clients) == ["a", "b"]
        first_a = pool.clients["a"]
        pool.record("b", [1, 2, 3])
        # b leaves (its approximate entries go with it); a moves to another address
        await pool.reconcile(frozenset({Endpoint("a", "10.0.0.9:1")}))
        assert sorted(pool.clients) == ["a"] and pool.clients["a"] is not first_a
        assert pool.clients["a"].address == "10.0.0.9:1"
        await pool.reconcile(frozenset({Endpoint("a", "10.0.0.9:1"), Endpoint("b", "10.0.0.2:1")}))
        assert _cached(pool, [1, 2, 3]) == {}  # b came back with no history
        await pool.stop()
    asyncio.run(scenario())


def test_match_uses_the_kv_feed_where_alive_and_routing_history_elsewhere():
    async def scenario():
        pool = _pool()
        await pool.reconcile(frozenset({Endpoint("live", "h:1"), Endpoint("blind", "h:2")}))
        live = pool.clients["live"]
        pool.kv_snapshot(live, KVCacheSnapshot(seq=1, block_hashes=frozenset({11, 12})))
        pool.record("blind", [11, 12, 13])
        assert _cached(pool, [11, 12, 13, 14]) == {"live": 2, "blind": 3}
        # a placement on a live engine counts at once, unconfirmed (speculative indexing)
        pool.record("live", [11, 12, 13])
        assert _cached(pool, [11, 12, 13, 14]) == {"live": 3, "blind": 3}
        live_batch = KVEventBatch(seq=2, timestamp_s=0.0, events=(BlockRemoved((13,)),))
        assert pool.kv_batch(live, live_batch)  # the engine says block 13 is not there
        assert _cached(pool, [11, 12, 13, 14]) == {"live": 2, "blind": 3}
        pool.kv_feed_lost(live)  # its feed broke: history takes over
        assert _cached(pool, [11, 12, 13, 14]) == {"live": 3, "blind": 3}
        assert [s.engine_id for s in pool.candidates([11], exclude={"live"})] == ["blind"]
        await pool.stop()
    asyncio.run(scenario())


def test_an_unmeasured_engine_is_assumed_as_fast_as_its_measured_peers():
    async def scenario():
        pool = _pool()  # the configured prior: 2000 tokens/s
        await pool.reconcile(frozenset({Endpoint("a", "h:1"), Endpoint("b", "h:2"),
                                        Endpoint("c", "h:3")}))
        rates = {s.engine_id: s.prefill_tokens_per_s for s in pool.candidates([1])}
        assert rates == {"a": 2000.0, "b": 2000.0, "c": 2000.0}
        for _ in range(400):
            pool._members["a"].rates.observe_prefill(100, 1.0)
        rates = {s.engine_id: s.prefill_tokens_per_s for s in pool.candidates([1])}
        assert abs(rates["a"] - 100.0) < 0.1 and rates["b"] == rates["c"] == rates["a"]
        # work pending on c for 100 s says c is slower still (or busy): c alone is bounded,
        # b still takes the measured peer's rate, not c's load
        pool._members["c"].rates.sent(time.monotonic() - 100.0, 500)
        rates = {s.engine_id: s.prefill_tokens_per_s for s in pool.candidates([1])}
        assert rates["c"] <= 5.0 + 1e-6 and abs(rates["b"] - rates["a"]) < 1e-6
        await pool.stop()
    asyncio.run(scenario())


def test_no_engine_serves_before_admission():
    async def scenario():
        pool = _pool()
        await pool.reconcile(frozenset({Endpoint("a", "127.0.0.1:9")}))
        assert pool.serving() == [] and pool.identity is None
        assert not await pool.wait_serving(1, timeout_s=0.2)
        await pool.stop()
    asyncio.run(scenario())


# ---------------------------------------------------------------- a third engine kind, in-process

class EchoConnection:
    """An engine kind of the test's own (``EngineConnection``): admitted at start, its stream
    echoes the prompt; it serves no tokenizer files and must serve the pool's model."""

    kind = "echo"
    serves_embeddings = True

    def __init__(self, endpoint: Endpoint, reports, options: ClientOptions) -> None:
        self.engine_id, self.address, self.reports = endpoint.engine_id, endpoint.address, reports
        self.model_name = endpoint.kv_events or "m"  # the test's way to vary the model
        self.state = EngineState.UNREACHABLE
        self.info = None
        self.refusal = None
        self.closed = False
        self._task = None

    @property
    def healthy(self) -> bool:
        return self.state is EngineState.SERVING and not self.closed

    def start(self) -> None:
        self._task = asyncio.create_task(self._admit())

    async def _admit(self) -> None:
        info = pb.ModelInfo(model_name=self.model_name, block_size=4,
                            block_hash_algorithm=BLOCK_HASH_ALGORITHM, block_hash_seed=ROOT_HASH)
        try:
            await self.reports.admit(self, info)
        except EngineMismatchError as e:
            refuse(self, self.reports, e, "echo engine", LOG)
            return
        self.info = info
        change_state(self, self.reports, EngineState.SERVING, "echo engine", LOG)

    async def close(self) -> None:
        self.closed = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def generate(self, request, *, timeout_s=None, metadata=()):
        yield pb.GenerateResponse(request_id=request.request_id, outputs=[pb.CompletionDelta(
            token_ids=list(request.token_ids.ids))], finished=True)

    async def embed(self, request, *, timeout_s=None, metadata=()):
        return pb.EmbedResponse(request_id=request.request_id,
                                embedding=[float(t) for t in request.token_ids.ids])

    async def fetch_tokenizer(self, timeout_s=None):
        return None

    def check_identity(self, identity: ModelIdentity, info: pb.ModelInfo) -> None:
        if info.model_name != identity.model_name:
            raise EngineMismatchError(self.engine_id, {"model_name": (identity.model_name,
                                                                      info.model_name)})


async def _until(condition, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


KINDS = {"echo": EchoConnection}
LOG = logging.getLogger(__name__)


def test_a_third_engine_kind_is_one_class_and_one_registry_entry(embedded_model_dir):
    assert isinstance(EchoConnection(Endpoint("a", "h:1"), None, ClientOptions()),
                      EngineConnection)

    async def scenario():
        tokenizer = FastTokenizer.from_dir(embedded_model_dir)
        pool = EnginePool(StaticDiscovery([]), tokenizer=tokenizer, kinds=KINDS)
        await pool.reconcile(frozenset({Endpoint("a", "h:1", "echo"),
                                        Endpoint("b", "h:2", "echo", kv_events="other")}))
        assert await pool.wait_serving(1, timeout_s=5)
        assert await _until(lambda: "b" in pool.refused())
        assert [c.engine_id for c in pool.serving()] == ["a"]
        # b serves another model: its kind's rule refuses it
        assert pool.refused()["b"].differences == {"model_name": ("m", "other")}
        assert pool.block_sizes() == {4}
        request = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[5, 6]))
        replies = [m async for m in pool.generate("a", request, block_hashes=[1],
                                                  num_uncached_tokens=2)]
        assert [list(r.outputs[0].token_ids) for r in replies] == [[5, 6]]
        await pool.stop()
    asyncio.run(scenario())


def test_a_new_incarnation_starts_with_an_empty_index_entry(embedded_model_dir):
    """A restarted engine (another incarnation id at the same address) holds nothing: its
    precise and approximate entries go; the same process re-admitted keeps them; a snapshot
    from the dead process, arriving late, is ignored."""
    def info(incarnation_id: str) -> pb.ModelInfo:
        return pb.ModelInfo(model_name="m", block_size=4, block_hash_algorithm=BLOCK_HASH_ALGORITHM,
                            block_hash_seed=ROOT_HASH, incarnation_id=incarnation_id)

    async def scenario():
        tokenizer = FastTokenizer.from_dir(embedded_model_dir)
        pool = EnginePool(StaticDiscovery([]), tokenizer=tokenizer, kinds=KINDS)
        await pool.reconcile(frozenset({Endpoint("a", "h:1", "echo")}))
        assert await pool.wait_serving(1, timeout_s=5)
        client = pool.clients["a"]
        await pool.admit(client, info("one"))
        assert pool.kv_snapshot(client, KVCacheSnapshot(0, frozenset({1, 2}), "one"))
        pool.record("a", [7, 8])  # what the approximate index would place by
        cached = lambda hashes: pool.candidates(hashes)[0].cached_blocks  # noqa: E731
        assert cached([1, 2]) == 2
        await pool.admit(client, info("one"))  # the same process, re-admitted after a blip
        assert cached([1, 2]) == 2
        await pool.admit(client, info("two"))  # restarted
        assert cached([1, 2]) == 0 and pool.cached_blocks() == {}
        pool.kv_feed_lost(client)
        assert cached([7, 8]) == 0  # the approximate index forgot the dead process too
        assert not pool.kv_snapshot(client, KVCacheSnapshot(0, frozenset({1, 2}), "one"))
        assert cached([1, 2]) == 0
        assert pool.kv_snapshot(client, KVCacheSnapshot(0, frozenset({3}), "two"))
        assert cached([3]) == 1
        await pool.stop()
    asyncio.run(scenario())


def test_a_kind_without_tokenizer_files_needs_the_routers_tokenizer():
    async def scenario():
        pool = EnginePool(StaticDiscovery([]), kinds=KINDS)
        await pool.reconcile(frozenset({Endpoint("a", "h:1", "echo")}))
        assert await _until(lambda: "a" in pool.refused())
        assert list(pool.refused()["a"].differences) == ["tokenizer"]
        assert "echo engine serves no tokenizer files" in str(pool.refused()["a"])
        assert pool.identity is None
        await pool.stop()
    asyncio.run(scenario())


def test_a_refusal_is_logged_with_its_reason_once_per_change(caplog):
    """A refused engine is re-checked every refused_recheck_s: the log names the reason when
    the state changes and when the reason changes, never on every re-check."""
    caplog.set_level(logging.INFO, logger=LOG.name)
    pool = EnginePool(StaticDiscovery([]), kinds=KINDS)
    client = EchoConnection(Endpoint("a", "h:1", "echo"), pool, ClientOptions())
    missing = EngineMismatchError("a", {"tokenizer": ("the router's --tokenizer", None)})
    for _ in range(3):
        refuse(client, pool, missing, "echo engine", LOG)
    other = EngineMismatchError("a", {"model_name": ("m", "other")})
    refuse(client, pool, other, "echo engine", LOG)
    refuse(client, pool, other, "echo engine", LOG)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "echo engine a at h:1: unreachable -> refused: engine a refused: tokenizer: router "
        "expects \"the router's --tokenizer\", engine reports None",
        "echo engine a at h:1: still refused, now: engine a refused: model_name: router "
        "expects 'm', engine reports 'other'"], lines
    assert client.state is EngineState.REFUSED and client.refusal is other


def test_both_built_in_kinds_implement_the_connection_protocol():
    from router.endpoint import ENGINE_KIND_NAMES

    assert set(ENGINE_KINDS) == set(ENGINE_KIND_NAMES) == {"quire", "vllm"}

    async def scenario():
        for kind, factory in ENGINE_KINDS.items():
            connection = factory(Endpoint("a", "127.0.0.1:9", kind), EnginePool(
                StaticDiscovery([])), ClientOptions(assumed_block_size=32))
            assert isinstance(connection, EngineConnection) and connection.kind == kind
            assert connection.state is EngineState.UNREACHABLE and not connection.healthy
            await connection.close()
    asyncio.run(scenario())


def test_a_4bit_and_a_16bit_engine_of_one_model_are_not_one_prefix_domain():
    """The quantization is part of the cache identity: the same tokens give other K/V."""
    import pytest

    from router.connection import ModelExpectation
    from router.engine_client import compare_model_info

    expected = ModelExpectation(block_size=16, block_hash_algorithm=BLOCK_HASH_ALGORITHM,
                                block_hash_seed=ROOT_HASH, tokenizer_digest="d" * 64,
                                quantization="gguf")
    same = pb.ModelInfo(model_name="m", block_size=16, block_hash_algorithm=BLOCK_HASH_ALGORITHM,
                        block_hash_seed=ROOT_HASH, tokenizer_digest="d" * 64, quantization="gguf")
    compare_model_info("a", expected, same)
    widened = pb.ModelInfo()
    widened.CopyFrom(same)
    widened.quantization = "dequantize"
    with pytest.raises(EngineMismatchError) as refused:
        compare_model_info("b", expected, widened)
    assert refused.value.differences == {"quantization": ("gguf", "dequantize")}
