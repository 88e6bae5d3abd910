"""The router's side of GenerateMany: a lagging call's messages merged, losing nothing."""

from __future__ import annotations

import asyncio

import grpc

from quire.v1 import engine_pb2 as pb
from quire.local_context import rpc_error
from router.generate_many import _Call, merge_response


def _delta(index, ids, text, finish=pb.FINISH_REASON_UNSPECIFIED, logprob=None):
    delta = pb.CompletionDelta(index=index, token_ids=ids, text=text, finish_reason=finish)
    if logprob is not None:
        for token_id in ids:
            delta.logprobs.add(token_ids=[token_id], logprobs=[logprob])
    return delta


def _messages():
    first = pb.GenerateResponse(request_id="r", prompt_token_ids=[1, 2, 3],
                                outputs=[_delta(0, [5], "a", logprob=-0.5)])
    first.prompt_logprobs.add()
    second = pb.GenerateResponse(request_id="r", outputs=[_delta(1, [6, 7], "bc"),
                                                          _delta(0, [8], "d", logprob=-1.0)])
    last = pb.GenerateResponse(request_id="r", finished=True, outputs=[
        _delta(0, [9], "e", pb.FINISH_REASON_LENGTH, logprob=-2.0),
        _delta(1, [10], "f", pb.FINISH_REASON_STOP)])
    last.outputs[1].stop_reason = "f"
    last.usage.CopyFrom(pb.Usage(prompt_tokens=3, completion_tokens=6, cached_tokens=0))
    return [first, second, last]


def _joined(messages):
    joined = {}
    for message in messages:
        for d in message.outputs:
            ids, text, lps, _ = joined.get(d.index, ([], "", [], None))
            joined[d.index] = (ids + list(d.token_ids), text + d.text,
                               lps + [lp.logprobs[0] for lp in d.logprobs],
                               (d.finish_reason, d.stop_reason))
    return joined


def test_merged_messages_carry_what_the_parts_carried():
    parts = _messages()
    merged = pb.GenerateResponse()
    merged.CopyFrom(parts[0])
    for later in parts[1:]:
        merge_response(merged, later)
    assert _joined([merged]) == _joined(parts)
    assert list(merged.prompt_token_ids) == [1, 2, 3] and len(merged.prompt_logprobs) == 1
    assert merged.finished and merged.usage.completion_tokens == 6
    assert merged.request_id == "r"


def test_a_lagging_reader_takes_one_merged_message_and_then_the_status():
    async def run():
        call = _Call()
        for message in _messages():
            call.push(message)
        call.end(rpc_error(grpc.StatusCode.CANCELLED, "gone"))
        first = await call.next()
        end = await call.next()
        return first, end, call.items

    first, end, left = asyncio.run(run())
    assert _joined([first]) == _joined(_messages())
    assert isinstance(end, grpc.aio.AioRpcError) and end.code() == grpc.StatusCode.CANCELLED
    assert not left


def test_a_reader_that_keeps_up_gets_each_message():
    async def run():
        call = _Call()
        got = []

        async def read():
            while (item := await call.next()) is not None:
                got.append(item)

        reader = asyncio.ensure_future(read())
        for message in _messages():
            await asyncio.sleep(0)  # the reader takes each before the next comes
            await asyncio.sleep(0)
            call.push(message)
        await asyncio.sleep(0)
        call.end(None)
        await reader
        return got

    got = asyncio.run(run())
    assert len(got) == 3 and _joined(got) == _joined(_messages())

