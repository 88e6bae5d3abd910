"""The router's side of ``GenerateMany``: every Generate call to one engine on one stream.

``GenerateMany.generate`` is ``EngineClient.generate`` for engines that serve the RPC
(``ModelInfo.generate_many``): the same async iterator of ``GenerateResponse`` messages,
raising the same ``grpc.aio.AioRpcError`` a ``Generate`` call would (DEADLINE_EXCEEDED past
its timeout, the engine's status otherwise; UNAVAILABLE for every open call when the stream
breaks), and closing it cancels the engine's request. What changes is the cost: the engine
sends one message a step for all of its running requests (``engine_worker.server.
generate_many``), which this side reads once and hands out to the calls, so the router's
gRPC work per streamed token is a share of one message instead of one message.

A call whose reader lags (a slow HTTP client) gets its waiting messages merged into one, as
the engine merges a lagging Generate call's outputs: it catches up with one message a turn.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator

import grpc

from quire.local_context import rpc_error
from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc

logger = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def merge_response(into: pb.GenerateResponse, later: pb.GenerateResponse) -> None:
    """``later`` (the next message of the same call) appended to ``into``, losslessly."""
    for delta in later.outputs:
        for earlier in into.outputs:
            if earlier.index == delta.index:
                earlier.token_ids.extend(delta.token_ids)
                earlier.text += delta.text
                earlier.logprobs.extend(delta.logprobs)
                earlier.finish_reason = delta.finish_reason
                earlier.stop_reason = delta.stop_reason
                break
        else:
            into.outputs.add().CopyFrom(delta)
    into.prompt_logprobs.extend(later.prompt_logprobs)
    into.prompt_token_ids.extend(later.prompt_token_ids)
    if later.HasField("usage"):
        into.usage.CopyFrom(later.usage)
    into.finished = later.finished


class _Call:
    """One Generate call's messages waiting for its reader, then its end."""

    __slots__ = ("items", "waiter", "ended", "expired")

    def __init__(self) -> None:
        self.items: deque = deque()  # GenerateResponse, then None (OK) or an AioRpcError
        self.waiter: asyncio.Future | None = None
        self.ended = False  # the engine sent its status or the stream broke: nothing to cancel
        self.expired = False

    def push(self, item) -> None:
        items = self.items
        if items and isinstance(item, pb.GenerateResponse) and \
                isinstance(items[-1], pb.GenerateResponse):
            merge_response(items[-1], item)  # the reader lags: one message to catch up with
        else:
            items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def end(self, item) -> None:
        self.ended = True
        self.push(item)

    async def next(self):
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class _Session:
    """One open ``GenerateMany`` stream and the calls on it."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub, engine_id: str) -> None:
        self.engine_id = engine_id
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.calls: dict[int, _Call] = {}
        self.broken = False
        self.stream = stub.GenerateMany(self._requests())
        self.reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[pb.GenerateManyRequest]:
        while (entry := await self.outbox.get()) is not None:
            yield entry

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                             f"engine {self.engine_id} ended its GenerateMany stream")
        try:
            async for message in self.stream:
                calls = self.calls
                for entry in message.entries:
                    call = calls.get(entry.stream_id)
                    if call is None:
                        continue  # cancelled by its reader
                    if entry.HasField("response"):
                        call.push(entry.response)
                        continue
                    del calls[entry.stream_id]
                    code = _CODES.get(entry.status.code, grpc.StatusCode.UNKNOWN)
                    call.end(None if code is grpc.StatusCode.OK else rpc_error(
                        code, entry.status.details,
                        trailing=[(m.key, m.value) for m in entry.status.trailing_metadata]))
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed the stream")
        finally:
            self.broken = True
            self.outbox.put_nowait(None)  # the request iterator ends
            if self.calls:
                logger.warning("engine %s: GenerateMany stream ended (%s) with %d calls open",
                               self.engine_id, error.code().name, len(self.calls))
            for call in self.calls.values():
                call.end(error)
            self.calls.clear()

    async def close(self) -> None:
        self.broken = True
        self.outbox.put_nowait(None)
        self.stream.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)


class GenerateMany:
    """The Generate calls a router makes to one engine, multiplexed on ``GenerateMany``
    streams (one at a time; a broken one is replaced on the next call)."""

    def __init__(self, stub: engine_pb2_grpc.EngineServiceStub, engine_id: str) -> None:
        self._stub = stub
        self._engine_id = engine_id
        self._session: _Session | None = None
        self._ids = itertools.count(1)

    def _open_session(self) -> _Session:
        session = self._session
        if session is None or session.broken:
            session = self._session = _Session(self._stub, self._engine_id)
        return session

    async def generate(self, request: pb.GenerateRequest, *, timeout_s: float | None = None,
                       metadata: tuple[tuple[str, str], ...] = ()
                       ) -> AsyncIterator[pb.GenerateResponse]:
        """Relay the engine's stream for ``request``; closing the iterator (or cancelling
        the task reading it) cancels the call, which aborts the request on the engine."""
        session = self._open_session()
        stream_id = next(self._ids)
        call = session.calls[stream_id] = _Call()
        opening = pb.OpenGenerate(stream_id=stream_id, request=request)
        for key, value in metadata:
            opening.metadata.add(key=key, value=value)
        timer = None
        if timeout_s is not None:
            opening.timeout_s = timeout_s
            timer = asyncio.get_running_loop().call_later(max(timeout_s, 0.0), _expire, call)
        session.outbox.put_nowait(pb.GenerateManyRequest(open=opening))
        try:
            while True:
                item = await call.next()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if timer is not None:
                timer.cancel()
            if not call.ended or call.expired:
                session.calls.pop(stream_id, None)
                if not session.broken:
                    session.outbox.put_nowait(pb.GenerateManyRequest(cancel=stream_id))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _expire(call: _Call) -> None:
    """The call's deadline passed here first: it ends DEADLINE_EXCEEDED (and is cancelled)."""
    if not call.ended:
        call.expired = True
        call.end(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
