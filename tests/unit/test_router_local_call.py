"""The HTTP front's in-process Generate call answers as a grpc.aio stream call would: messages,
EOF, the handler's abort status with its trailing metadata, the deadline, and cleanup on close."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from quire.errors import FIELD_METADATA, field_of
from router.local_call import LocalCall, local_unary


def _run(coro):
    return asyncio.run(coro)


def _first_then_hang(done: asyncio.Event):
    """A Generate handler that yields one message, then waits; ``done`` is set by its
    cleanup (as the real one aborts the engine request there)."""
    async def handler(request, context):
        try:
            yield "first"
            await asyncio.sleep(60)
            yield "never"
        finally:
            done.set()
    return handler


def test_messages_then_eof_and_context_metadata():
    seen = {}

    async def handler(request, context):
        seen["metadata"] = context.invocation_metadata()
        seen["remaining"] = context.time_remaining()
        await context.send_initial_metadata((("x-engine", "e1"),))
        for i in range(request):
            yield i

    async def scenario():
        call = LocalCall(handler, 3, metadata=(("authorization", "Bearer k"),), timeout_s=30)
        got = []
        while (message := await call.read()) is not grpc.aio.EOF:
            got.append(message)
        assert await call.read() is grpc.aio.EOF  # stays at EOF
        return got, call.context.initial_metadata()

    got, initial = _run(scenario())
    assert got == [0, 1, 2]
    assert initial == (("x-engine", "e1"),)
    assert seen["metadata"] == (("authorization", "Bearer k"),)
    assert 0 < seen["remaining"] <= 30


def test_abort_becomes_the_error_a_grpc_client_sees():
    async def handler(request, context):
        yield "first"
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_k: too large",
                            trailing_metadata=((FIELD_METADATA, "sampling.top_k"),))

    async def scenario():
        call = LocalCall(handler, None)
        assert await call.read() == "first"
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call.read()
        return raised.value, call.context

    error, context = _run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "top_k: too large"
    assert field_of(error) == "sampling.top_k"
    assert context.code() == grpc.StatusCode.INVALID_ARGUMENT  # what a tracing span reads


def test_set_code_without_abort_is_an_error_at_the_end():
    async def handler(request, context):
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("queue full")
        context.set_trailing_metadata((("retry-after", "2"),))
        return
        yield

    async def scenario():
        call = LocalCall(handler, None)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call.read()
        return raised.value

    error = _run(scenario())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "queue full"
    assert list(error.trailing_metadata()) == [("retry-after", "2")]


@pytest.mark.parametrize("away", [False, True], ids=["reading", "away"])
def test_deadline_exceeded_closes_the_handler(away):
    """The deadline is one timer for the call: it ends the read in progress, or, when it
    fires while the reader is away (writing the last message to its client), the next read;
    a reader away is not cancelled."""
    cleaned = asyncio.Event()
    handler = _first_then_hang(cleaned)

    async def scenario():
        call = LocalCall(handler, None, timeout_s=0.2)
        assert await call.read() == "first"
        if away:
            await asyncio.sleep(0.3)
            assert asyncio.current_task().cancelling() == 0
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call.read()
        assert asyncio.current_task().cancelling() == 0  # the timer's cancel withdrawn
        return raised.value, cleaned.is_set()

    error, was_cleaned = _run(scenario())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert was_cleaned


def test_aclose_runs_the_handlers_cleanup_once():
    closed = []

    async def handler(request, context):
        try:
            while True:
                yield "token"
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    async def scenario():
        call = LocalCall(handler, None)
        assert await call.read() == "token"
        await call.aclose()
        await call.aclose()  # a second close is a no-op
        return await call.read()

    assert _run(scenario()) is grpc.aio.EOF
    assert closed == [True]


@pytest.mark.parametrize("timeout_s", [None, 0.3], ids=["no deadline", "deadline armed"])
def test_a_cancelled_reader_stops_the_handler(timeout_s):
    """A client that leaves cancels the HTTP handler's task while it waits in read(): the
    reader sees CancelledError (the front then closes the call), not a deadline status, and
    an armed deadline is disarmed."""
    closed = asyncio.Event()
    handler = _first_then_hang(closed)

    async def scenario():
        call = LocalCall(handler, None, timeout_s=timeout_s)

        async def reader():
            await call.read()
            await call.read()

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await call.aclose()
        await asyncio.sleep(0.4)  # past any deadline: nothing fires on a closed call
        assert not call._expired
        return closed.is_set(), await call.read()

    was_closed, after = _run(scenario())
    assert was_closed and after is grpc.aio.EOF


def test_a_client_leaving_as_the_deadline_fires_is_a_cancellation():
    """The timer and a client's disconnect in one loop iteration: the reader is cancelled
    (the client left), not answered DEADLINE_EXCEEDED; one that had swallowed a cancellation
    earlier still gets the deadline."""
    async def scenario(leaving: bool):
        call = LocalCall(_first_then_hang(asyncio.Event()), None, timeout_s=60)
        assert await call.read() == "first"

        async def read():
            if not leaving:  # an earlier cancellation this reader caught and went on from
                asyncio.current_task().cancel()
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    pass
            return await call.read()

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.01)  # suspended inside the handler
        if leaving:
            reader.cancel()
        call._expire()  # the timer, firing now
        try:
            await reader
        except asyncio.CancelledError:
            return "cancelled"
        except grpc.aio.AioRpcError as e:
            return e.code()

    assert asyncio.run(scenario(True)) == "cancelled"
    assert asyncio.run(scenario(False)) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unary_answers_aborts_and_deadline():
    async def echo(request, context):
        return (request, context.invocation_metadata())

    async def refuse(request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing",
                            trailing_metadata=((FIELD_METADATA, "input"),))

    async def slow(request, context):
        await asyncio.sleep(60)

    async def scenario():
        answer = await local_unary(echo, 7, metadata=(("k", "v"),), timeout_s=5)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await local_unary(refuse, None)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await local_unary(slow, None, timeout_s=0.1)
        return answer, refused.value, late.value

    answer, refused, late = _run(scenario())
    assert answer == (7, (("k", "v"),))
    assert refused.code() == grpc.StatusCode.NOT_FOUND and field_of(refused) == "input"
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("ending", ["eof", "abort", "deadline", "aclose", "cancelled"])
def test_done_callbacks_run_once_however_the_call_ends(ending):
    """The router's flow control releases a request's slot from a done callback."""
    ran = []

    async def handler(request, context):
        context.add_done_callback(lambda ctx: ran.append(ctx))
        yield "first"
        if ending == "abort":
            await context.abort(grpc.StatusCode.INTERNAL, "boom")
        if ending in ("deadline", "aclose", "cancelled"):
            await asyncio.sleep(60)

    async def scenario():
        call = LocalCall(handler, None, timeout_s=0.2 if ending == "deadline" else None)
        assert await call.read() == "first"
        if ending == "aclose":
            await call.aclose()
        elif ending == "cancelled":
            task = asyncio.create_task(call.read())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif ending == "eof":
            assert await call.read() is grpc.aio.EOF
        else:
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        await call.aclose()
        return call.context

    context = _run(scenario())
    assert ran == [context]
