"""The engine's side of ``GenerateMany``: many Generate calls on one stream, one message a turn.

A router streams every request it sends an engine. With one ``Generate`` call per request, a
decode step of 64 requests cost 64 gRPC messages on each side, each a trip through the gRPC
core (on a 2-core Intel Xeon, 65 % of the engine's event loop was that per-message work), and
every millisecond of it runs on a core the engine's OpenMP team is using for the next step.
On a ``GenerateMany`` stream each call is still run by the servicer's own ``Generate``
handler (validation, tracing, statuses unchanged; it gets a ``LocalContext``), but what the
calls yield in one turn of the event loop leaves as one message: the engine hands a step's
outputs to the loop in one callback, so that is one message a step.

While the transport is busy (the router reads slower than the engine writes), calls stop
taking their outputs, which their ``OutputCollector`` then merges: the stream catches up with
one entry per call instead of falling behind by one per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from quire.local_context import LocalContext
from quire.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

Handler = Callable[[pb.GenerateRequest, LocalContext], AsyncIterator[pb.GenerateResponse]]

# A turn's entries leave in messages of about this many bytes at most: many calls' prompt
# logprobs in one turn could otherwise pass the server's send limit (16 MiB by default), which
# each call's own messages keep to, and a message over it would end every call on the stream.
MESSAGE_BUDGET_BYTES = 4 << 20


def split_message(message: pb.GenerateManyResponse, budget: int = MESSAGE_BUDGET_BYTES
                  ) -> list[pb.GenerateManyResponse]:
    """``message``'s entries, in order, in messages of at most ``budget`` bytes (an entry
    larger than that alone in one)."""
    if message.ByteSize() <= budget:
        return [message]
    parts, part, size = [], pb.GenerateManyResponse(), 0
    for entry in message.entries:
        entry_size = entry.ByteSize() + 8  # the field's tag and length
        if part.entries and size + entry_size > budget:
            parts.append(part)
            part, size = pb.GenerateManyResponse(), 0
        part.entries.add().CopyFrom(entry)
        size += entry_size
    parts.append(part)
    return parts


class ProtocolError(Exception):
    """The caller broke the stream's rules (a stream id reused while its call is open)."""


class GenerateManyStream:
    """One ``GenerateMany`` call: ``serve(requests)`` yields the response messages."""

    def __init__(self, handler: Handler, *, peer: str = "") -> None:
        """``handler(request, context)``: the servicer's ``Generate``."""
        self._handler = handler
        self._peer = peer
        self._calls: dict[int, asyncio.Task] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._expired: set[int] = set()
        self._pending = pb.GenerateManyResponse()  # entries not sent yet
        self._wake = asyncio.Event()  # entries came, a call ended, or the reader stopped
        self._flowing = asyncio.Event()  # clear while a message waits on the transport
        self._flowing.set()
        self._reading = True  # the caller may still open calls
        self._error: BaseException | None = None

    async def serve(self, requests: AsyncIterator[pb.GenerateManyRequest]
                    ) -> AsyncIterator[pb.GenerateManyResponse]:
        """Run the calls ``requests`` opens; yield their entries, a message a turn. Ends once
        the caller has stopped sending and every call has ended; its end cancels the calls
        still open (each aborts its request on the engine)."""
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                if not self._pending.entries:
                    if self._error is not None:
                        raise self._error
                    if not self._reading and not self._calls:
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                message, self._pending = self._pending, pb.GenerateManyResponse()
                self._flowing.clear()
                try:
                    for part in split_message(message):
                        yield part
                finally:
                    self._flowing.set()
        finally:
            reader.cancel()
            tasks = [reader, *self._calls.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        try:
            async for entry in requests:
                kind = entry.WhichOneof("kind")
                if kind == "open":
                    self._open(entry.open)
                elif kind == "cancel":
                    self._cancel(entry.cancel)
        except ProtocolError as e:
            self._error = e
        finally:
            self._reading = False
            self._wake.set()

    def _open(self, request: pb.OpenGenerate) -> None:
        stream_id = request.stream_id
        if stream_id in self._calls:
            raise ProtocolError(f"stream_id {stream_id} is already open on this stream")
        timeout_s = request.timeout_s if request.HasField("timeout_s") else None
        context = LocalContext([(m.key, m.value) for m in request.metadata], timeout_s,
                               peer=self._peer)
        task = asyncio.ensure_future(self._run(stream_id, request.request, context))
        self._calls[stream_id] = task
        if timeout_s is not None:
            self._timers[stream_id] = asyncio.get_running_loop().call_later(
                max(timeout_s, 0.0), self._expire, stream_id)

    def _cancel(self, stream_id: int) -> None:
        task = self._calls.get(stream_id)
        if task is not None:
            task.cancel()

    def _expire(self, stream_id: int) -> None:
        task = self._calls.get(stream_id)
        if task is not None:
            self._expired.add(stream_id)
            task.cancel()

    async def _run(self, stream_id: int, request: pb.GenerateRequest,
                   context: LocalContext) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            async with contextlib.aclosing(self._handler(request, context)) as stream:
                async for message in stream:
                    self._pending.entries.add(stream_id=stream_id).response.CopyFrom(message)
                    self._wake.set()
                    if not self._flowing.is_set():  # the transport is behind: wait for it
                        await self._flowing.wait()
            if context.code() not in (None, grpc.StatusCode.OK):
                code, details = context.code(), context.details()  # set_code without abort
        except grpc.aio.AbortError:
            code, details = context.code() or grpc.StatusCode.UNKNOWN, context.details()
        except asyncio.CancelledError:
            if stream_id not in self._expired:
                return  # the caller cancelled it (or the stream ended): no status follows
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception as e:  # noqa: BLE001 - as grpc answers a handler's exception
            logger.exception("Generate call %d of a GenerateMany stream failed", stream_id)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            context.finish()
            self._calls.pop(stream_id, None)
            self._expired.discard(stream_id)
            timer = self._timers.pop(stream_id, None)
            if timer is not None:
                timer.cancel()
            self._wake.set()
        status = self._pending.entries.add(stream_id=stream_id).status
        status.code, status.details = code.value[0], details
        for key, value in context.trailing_metadata():
            status.trailing_metadata.add(key=key, value=value)
