"""GenerateMany over real loopback gRPC, on the tiny model: many Generate calls on one stream,
each behaving as its own call, a step's news for all of them in one message."""

from __future__ import annotations

import asyncio
import queue
import time

import grpc
import pytest

from quire.errors import FIELD_METADATA
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc
from router.generate_many import GenerateMany
from tests.e2e.test_engine_server import PROMPT, RunningServer, _collect, _engine, _request
from engine_worker.server.config import ServerConfig
from engine_worker.server.generate_many import split_message


def _server(model_dir) -> RunningServer:
    return RunningServer(_engine(model_dir), ServerConfig(host="127.0.0.1", port=0, max_n=4,
                                                          metrics_port=0))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = _server(tiny_model_dir)
    yield running
    running.close()


def _open(stream_id: int, request: pb.GenerateRequest, **kwargs) -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(open=pb.OpenGenerate(stream_id=stream_id, request=request,
                                                       **kwargs))


def _by_call(messages) -> dict[int, tuple[list[int], list[pb.GenerateResponse], pb.CallStatus]]:
    """Per stream id: its token ids, its responses, its status (None if none came)."""
    calls: dict = {}
    for message in messages:
        for entry in message.entries:
            tokens, responses, _ = calls.setdefault(entry.stream_id, ([], [], None))
            if entry.HasField("response"):
                assert calls[entry.stream_id][2] is None, "a response after the status"
                responses.append(entry.response)
                for delta in entry.response.outputs:
                    tokens += delta.token_ids
            else:
                calls[entry.stream_id] = (tokens, responses, entry.status)
    return calls


def _holds_no_request(server, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not server.holds_no_request():
        time.sleep(0.05)
    return server.holds_no_request()


class _Requests:
    """A request iterator for a sync bidi call, fed from the test."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __iter__(self):
        while (entry := self.queue.get()) is not None:
            yield entry

    def send(self, entry) -> None:
        self.queue.put(entry)

    def close(self) -> None:
        self.queue.put(None)


def test_model_info_says_the_engine_serves_generate_many(server):
    assert server.stub.GetModelInfo(pb.GetModelInfoRequest()).generate_many


def test_calls_on_one_stream_get_what_their_own_calls_get_a_step_in_one_message(server):
    prompts = [PROMPT[:10] + [1000 + i] for i in range(8)]
    want = [_collect(server.stub.Generate(_request(p, max_tokens=24)))[0] for p in prompts]
    messages = list(server.stub.GenerateMany(iter(
        [_open(i + 1, _request(p, max_tokens=24)) for i, p in enumerate(prompts)])))
    calls = _by_call(messages)  # the stream ended once the calls had: the caller half-closed
    assert sorted(calls) == list(range(1, 9))
    for i in range(8):
        tokens, responses, status = calls[i + 1]
        assert tokens == want[i]
        assert status.code == grpc.StatusCode.OK.value[0]
        assert responses[-1].finished and responses[-1].usage.completion_tokens == 24
        assert list(responses[0].prompt_token_ids) == prompts[i]
    # the eight decode together: a step's news for all of them leaves as one message
    assert max(len(m.entries) for m in messages) >= 8
    assert len(messages) < sum(len(m.entries) for m in messages) / 4


def test_a_cancelled_call_is_aborted_and_the_others_run_on(server):
    requests = _Requests()
    stream = server.stub.GenerateMany(iter(requests))
    requests.send(_open(1, _request(PROMPT, max_tokens=900)))
    requests.send(_open(2, _request(PROMPT[:20], max_tokens=40)))
    messages = []
    for message in stream:
        messages.append(message)
        if any(e.stream_id == 1 and e.HasField("response") for e in message.entries):
            break
    requests.send(pb.GenerateManyRequest(cancel=1))
    requests.send(pb.GenerateManyRequest(cancel=77))  # unknown: ignored
    requests.close()
    messages += list(stream)
    calls = _by_call(messages)
    assert calls[1][2] is None  # a cancelled call gets no status
    assert len(calls[1][0]) < 900
    tokens, responses, status = calls[2]
    assert status.code == grpc.StatusCode.OK.value[0] and len(tokens) == 40
    assert _holds_no_request(server)


def test_a_call_past_its_timeout_ends_deadline_exceeded_and_its_work_stops(server):
    messages = list(server.stub.GenerateMany(iter(
        [_open(5, _request(PROMPT, max_tokens=900), timeout_s=0.5)])))
    tokens, _, status = _by_call(messages)[5]
    assert status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert len(tokens) < 900
    assert _holds_no_request(server)


def test_a_bad_call_gets_its_status_naming_the_field_and_its_neighbour_is_served(server):
    bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(temperature=-1.0))
    messages = list(server.stub.GenerateMany(iter(
        [_open(1, bad), _open(2, _request(PROMPT, max_tokens=8))])))
    calls = _by_call(messages)
    status = calls[1][2]
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in status.details
    assert {(m.key, m.value) for m in status.trailing_metadata} == {
        (FIELD_METADATA, "sampling.temperature")}
    assert calls[2][2].code == grpc.StatusCode.OK.value[0] and len(calls[2][0]) == 8


def test_a_stream_id_reused_while_open_ends_the_stream_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.GenerateMany(iter([_open(3, _request(PROMPT, max_tokens=900)),
                                            _open(3, _request(PROMPT, max_tokens=8))])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_id 3" in err.value.details()
    assert _holds_no_request(server)  # the open call was cancelled with the stream


async def _client_run(port: int, body):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    many = GenerateMany(engine_pb2_grpc.EngineServiceStub(channel), "engine-0")
    try:
        return await body(many)
    finally:
        await many.close()
        await channel.close()


async def _tokens(many: GenerateMany, request: pb.GenerateRequest, **kwargs):
    tokens, last = [], None
    async for message in many.generate(request, **kwargs):
        for delta in message.outputs:
            tokens += delta.token_ids
        last = message
    return tokens, last


def test_the_router_side_relays_each_call_as_a_generate_call_would(server):
    prompts = [PROMPT[:12] + [2000 + i] for i in range(6)]
    want = [_collect(server.stub.Generate(_request(p, max_tokens=16)))[0] for p in prompts]
    bad = pb.GenerateRequest(text="hi", sampling=pb.SamplingOptions(top_p=2.0))

    async def body(many):
        results = await asyncio.gather(*(_tokens(many, _request(p, max_tokens=16))
                                         for p in prompts))
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await _tokens(many, bad)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await _tokens(many, _request(PROMPT, max_tokens=900), timeout_s=0.3)
        # closing a call early cancels it on the engine
        stream = many.generate(_request(PROMPT, max_tokens=900))
        first = await anext(stream)
        await stream.aclose()
        again = await _tokens(many, _request(prompts[0], max_tokens=16))
        return results, invalid.value, late.value, first, again

    results, invalid, late, first, again = server.call(_client_run(server.port, body))
    assert [tokens for tokens, _ in results] == want
    assert all(last.finished and last.usage.completion_tokens == 16 for _, last in results)
    assert invalid.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(invalid.trailing_metadata())[FIELD_METADATA] == "sampling.top_p"
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert first.prompt_token_ids
    assert again[0] == want[0]
    assert _holds_no_request(server)


def test_open_calls_fail_unavailable_when_the_engine_goes_and_a_new_stream_is_opened(
        tiny_model_dir):
    running = _server(tiny_model_dir)
    port = running.port
    try:
        async def body(many):
            stream = many.generate(_request(PROMPT, max_tokens=900))
            await anext(stream)
            await running.server.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                async for _ in stream:
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _tokens(many, _request(PROMPT, max_tokens=4))
            return gone.value, refused.value

        gone, refused = running.call(_client_run(port, body))
    finally:
        running.close()
    assert gone.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.code() == grpc.StatusCode.UNAVAILABLE


def test_a_turn_over_the_budget_leaves_in_several_messages_in_order():
    message = pb.GenerateManyResponse()
    for stream_id in range(1, 11):
        entry = message.entries.add(stream_id=stream_id)
        entry.response.prompt_token_ids.extend(range(stream_id * 100))  # about 2-3 bytes each
    small = split_message(message, budget=1 << 20)
    assert small == [message]
    budget = 1200
    parts = split_message(message, budget=budget)
    assert len(parts) > 1
    assert [e for part in parts for e in part.entries] == list(message.entries)
    for part in parts:
        assert part.ByteSize() <= budget or len(part.entries) == 1
