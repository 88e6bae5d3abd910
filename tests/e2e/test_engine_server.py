"""The engine pod over real loopback gRPC, on the tiny model."""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_worker import LLM, SamplingParams
from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from engine_worker.server.app import SERVICE_NAME, EngineServer
from engine_worker.server.config import ServerConfig
from quire.errors import FIELD_METADATA
from quire.kv_events import KVCacheMirror, batch_from_proto, snapshot_from_proto
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from tests.conftest import cpu_kernels_unavailable_reason
from tests.e2e.loop_thread import LoopThread


class RunningServer(LoopThread):
    """An EngineServer on its own event loop thread, for synchronous test clients."""

    def __init__(self, engine: LLMEngine, cfg: ServerConfig, **server_kwargs) -> None:
        super().__init__()
        self.server = EngineServer(engine, cfg, **server_kwargs)
        self.port = self.call(self.server.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def load(self):
        """The counts the engine loop published after its last step."""
        return self.server.async_engine.load

    def holds_no_request(self) -> bool:
        return self.load.num_running == 0 and self.load.num_waiting == 0

    def cached_block_hashes(self) -> frozenset[int]:
        """Every block hash the engine's prefix cache holds, read on the engine loop thread
        (the snapshot a KV-event subscriber starts from)."""
        async def read():
            snapshot, sink = await self.server.async_engine.subscribe_kv_events()
            self.server.async_engine.unsubscribe_kv_events(sink)
            return snapshot.block_hashes
        return self.call(read())


def _engine(model_dir, **kwargs) -> LLMEngine:
    args = dict(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24) | kwargs
    return LLMEngine.from_engine_args(EngineArgs(**args))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = RunningServer(_engine(tiny_model_dir), ServerConfig(host="127.0.0.1", port=0,
                                                                  max_n=4, metrics_port=0))
    yield running
    running.close()


def _request(ids, max_tokens=8, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, **sampling))


def _collect(stream):
    tokens, text, last = [], "", None
    for message in stream:
        for delta in message.outputs:
            tokens += delta.token_ids
            text += delta.text
        last = message
    return tokens, text, last


PROMPT = list(range(300, 340))


def test_streams_the_same_tokens_as_the_offline_api(server, tiny_model_dir):
    tokens, text, last = _collect(server.stub.Generate(_request(PROMPT, max_tokens=12)))
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22)
    ref = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert tokens == ref.token_ids and text == ref.text
    assert last.finished and last.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 12)


def test_many_concurrent_streams_and_a_late_joiner(server):
    def run(i):
        return _collect(server.stub.Generate(_request(PROMPT[:10] + [1000 + i], max_tokens=200)))
    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(run, i) for i in range(36)]
        deadline = time.monotonic() + 30
        while server.load.num_running < 36 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.load.num_running == 36  # all decoding together
        late = server.stub.Generate(_request([7, 8, 9], max_tokens=2))
        first_message = next(late)
        # it joined the running batch: its first token came while the others still decode
        still_running = sum(not f.done() for f in futures)
        results = [f.result(timeout=300) for f in futures]
    assert first_message.outputs[0].token_ids
    assert still_running == 36
    assert all(len(tokens) == 200 for tokens, _, _ in results)


def test_cancelling_a_stream_aborts_and_frees_blocks(server):
    stream = server.stub.Generate(_request(PROMPT, max_tokens=900))  # long: cancelled well before
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.load.num_running:
        time.sleep(0.05)
    assert server.load.num_running == 0 and server.holds_no_request()


def test_two_clients_may_send_one_request_id_at_once(server):
    """The engine keys its requests by the caller's id with a suffix of its own (as vLLM's
    PR 27987): two live requests of one id, as two clients behind a router may send, both
    run with that id on every message (before, the second was a 400), and cancelling one
    leaves the other running to its end."""
    def same(max_tokens, ids=PROMPT):
        return server.stub.Generate(pb.GenerateRequest(
            request_id="same", token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
                temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    first, kept = same(900), same(200, PROMPT[:20])
    assert next(first).request_id == "same" and next(kept).request_id == "same"
    # both had their first token, so both are live (the load is published just after a step)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.load.num_running != 2:
        time.sleep(0.005)
    assert server.load.num_running == 2
    first.cancel()  # aborts its own request only
    rest = list(kept)
    assert {m.request_id for m in rest} == {"same"} and rest[-1].finished
    assert rest[-1].outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not server.holds_no_request():
        time.sleep(0.05)
    assert server.holds_no_request()
    embedded = server.stub.Embed(pb.EmbedRequest(request_id="same",
                                                 token_ids=pb.TokenIds(ids=PROMPT[:8])))
    assert embedded.request_id == "same"


def test_deadline_is_honoured_and_work_stops(server):
    with pytest.raises(grpc.RpcError) as err:
        _collect(server.stub.Generate(_request(PROMPT, max_tokens=900), timeout=0.5))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not server.holds_no_request():
        time.sleep(0.05)
    assert server.holds_no_request()


def _sampled(**options) -> pb.GenerateRequest:
    return pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(**options))


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(text=""), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[10**7])), "token_ids"),
    (_sampled(temperature=-1), "sampling.temperature"),
    (_sampled(top_p=2), "sampling.top_p"),
    (_sampled(n=5), "sampling.n"),
    (_sampled(logprobs=50), "sampling.logprobs"),
    (_sampled(stop=["x"] * 17), "sampling.stop"),
    (_sampled(structured_outputs=pb.StructuredOutputs(json="{")),
     "sampling.structured_outputs.json"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 2000)), "prompt"),
])
def test_bad_input_gets_invalid_argument_naming_the_field(server, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        _collect(server.stub.Generate(request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # the field's path in the message sent (as the router's own checks name it)
    assert err.value.details().startswith(f"{field}: "), err.value.details()
    assert dict(err.value.trailing_metadata())[FIELD_METADATA] == field
    tokens, _, _ = _collect(server.stub.Generate(_request([1, 2, 3], max_tokens=2)))
    assert len(tokens) == 2  # and the server keeps serving


def test_model_info_health_and_reflection(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.block_size == 16 and info.block_hash_algorithm == "sha256-64-chained-v1"
    assert len(info.tokenizer_digest) == 64 and info.max_model_len == 1024
    for service in ("", SERVICE_NAME):
        response = server.health.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")])))
    names = {s.name for s in reply.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_model_info_and_metrics_say_which_backend_runs_and_why(server):
    """kernels=auto: the AVX-512 kernels where they run here, else the AVX2 ones (the right set
    for such a CPU, with the reason AVX-512 was passed over), else a loud fallback."""
    avx512 = cpu_kernels_unavailable_reason("avx512")
    avx2 = cpu_kernels_unavailable_reason("avx2")
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    if avx512 is None:
        assert (info.backend, info.backend_fallback) == ("cpu", False)
        assert info.backend_reason == "the fastest backend that runs on cpu"
    elif avx2 is None:
        assert (info.backend, info.backend_fallback) == ("cpu-avx2", False)
        assert info.backend_reason == f"compiled CPU kernels, AVX-512 unavailable: {avx512}"
    else:
        assert (info.backend, info.backend_fallback) == ("torch", True)
        assert info.backend_reason.endswith(f"AVX2 unavailable: {avx2}")
    port = server.server.metrics_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    infos = [s for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == "quire:backend_info"]
    assert len(infos) == 1 and infos[0].value == 1
    assert infos[0].labels["backend"] == info.backend
    assert infos[0].labels["reason"] == info.backend_reason
    # how the layers run, in both places too (which one depends on the set: this model's
    # head size is fused by the AVX2 set's stack, not by the AVX-512 set's)
    assert info.layer_execution == infos[0].labels["layers"]
    assert info.layer_execution in ("fused", "per-layer")
    # and that CUDA graphs are off on a CPU, in the same two places
    assert info.cuda_graphs == "off (cpu)"
    graphs = [s for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == "quire:cuda_graphs_info"]
    assert [(g.labels["cuda_graphs"], g.value) for g in graphs] == [("off (cpu)", 1)]


def test_load_reports_and_kv_event_feed(server):
    load = next(server.stub.StreamLoad(pb.StreamLoadRequest(interval_ms=10)))
    assert 0.0 <= load.kv_cache_usage <= 1.0
    # a Quire engine always says whether its batch is full (a vLLM engine leaves it unset)
    assert load.HasField("batch_full") and not load.batch_full
    # readers that admit requests (routers) are counted while their call is open; a
    # monitor's (this one's) is not
    assert load.num_load_readers == 0
    router_feed = server.stub.StreamLoad(pb.StreamLoadRequest(interval_ms=10,
                                                              admits_requests=True))
    assert next(router_feed).num_load_readers == 1
    router_feed.cancel()
    later = server.stub.StreamLoad(pb.StreamLoadRequest(interval_ms=10))
    assert _eventually(lambda: next(later).num_load_readers == 0)
    later.cancel()
    feed = server.stub.StreamKVEvents(pb.StreamKVEventsRequest())
    mirror = KVCacheMirror.from_snapshot(snapshot_from_proto(next(feed).snapshot))
    _collect(server.stub.Generate(_request(list(range(5000, 5050)), max_tokens=4)))
    truth = server.cached_block_hashes()
    deadline = time.monotonic() + 10
    while mirror.block_hashes != truth and time.monotonic() < deadline:
        assert mirror.apply(batch_from_proto(next(feed).batch))
    feed.cancel()
    assert mirror.block_hashes == truth


def _eventually(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
    return False
