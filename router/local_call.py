"""A streaming ``Generate`` call made inside the router's process, shaped like a grpc.aio call.

The HTTP front used to reach the router's placement through the router's own gRPC port on
loopback. Every message was then serialised and parsed twice more in this process (client and
server side of that channel) and crossed the gRPC core's completion queue twice: about 0.4 ms of
router CPU per streamed message on a 2-core Zen 3, taken from the engine that shares the cores.
``LocalCall`` runs the servicer's handler (the same decorated ``Generate``: tracing, retries,
limits and statuses unchanged) directly, and answers ``read()`` as the grpc.aio call did
(``aclose()`` replaces ``cancel()``), so the front's error mapping stays the one for gRPC
statuses.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from quire.local_context import LocalContext, Metadata


class LocalCall:
    """``handler(request, context)`` (an async generator) read like a grpc.aio stream call.

    ``read()`` returns the next message or ``grpc.aio.EOF`` and raises ``AioRpcError`` for a
    status other than OK (DEADLINE_EXCEEDED when ``timeout_s`` passes); ``aclose()`` closes
    the handler, whose cleanup aborts the request on its engine."""

    def __init__(self, handler: Callable[[object, LocalContext], AsyncIterator], request,
                 *, metadata: Metadata = (), timeout_s: float | None = None) -> None:
        self.request = request
        self.context = LocalContext(metadata, timeout_s)
        self._stream = handler(request, self.context)
        self._done = False
        # The deadline is one timer for the whole call, armed at the first read: it cancels
        # the task waiting in read() when it fires. (An ``asyncio.timeout_at`` around every
        # read made and cancelled a timer a streamed token: 7 % of the router's CPU on its
        # request path, py-spy on an Intel Xeon serving 64 streams.)
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._reader: asyncio.Task | None = None  # the task inside read(), while it waits
        self._cancelled: asyncio.Task | None = None  # the task the timer cancelled

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        try:
            return await self._next()
        except BaseException:  # it ended: an error status, the deadline, or a cancelled reader
            self._end()
            raise

    def _end(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        self.context.finish()

    def _expire(self) -> None:
        self._expired = True
        if self._reader is not None:
            self._reader.cancel()
            self._cancelled = self._reader

    def _take_timer_cancel(self, task: asyncio.Task | None) -> int | None:
        """Withdraw the timer's cancellation of ``task`` (once): -> the cancellations still
        requested of it, or None where the timer did not cancel it."""
        if task is None or self._cancelled is not task:
            return None
        self._cancelled = None
        return task.uncancel()

    async def _deadline_exceeded(self) -> BaseException:
        await self._stream.aclose()
        return self.context.error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    async def _next(self):
        deadline = self.context.deadline
        if deadline is not None and self._timer is None:
            loop = asyncio.get_running_loop()
            # Same clock as the context; asyncio's loop clock is monotonic too.
            self._timer = loop.call_at(loop.time() + (deadline - time.monotonic()),
                                       self._expire)
        if self._expired:
            raise await self._deadline_exceeded()
        task = self._reader = asyncio.current_task() if deadline is not None else None
        # cancellations the reader already had (as asyncio.timeout counts them on entry)
        base = 0 if task is None else task.cancelling()
        try:
            return await anext(self._stream)
        except asyncio.CancelledError:
            remaining = self._take_timer_cancel(task)
            if remaining is not None and remaining <= base:  # the timer's alone: the deadline
                raise await self._deadline_exceeded() from None
            raise
        except StopAsyncIteration:
            if self.context.code() not in (None, grpc.StatusCode.OK):
                raise self.context.error() from None  # set_code without abort
            self._end()
            return grpc.aio.EOF
        except grpc.aio.AbortError:
            raise self.context.error() from None
        finally:
            self._reader = None
            self._take_timer_cancel(task)  # a handler that turned it into something else

    async def aclose(self) -> None:
        """Close the handler (no-op once it finished): its cleanup aborts the engine request."""
        self._done = True  # a read while the cleanup runs answers EOF
        try:
            await self._stream.aclose()
        finally:
            self._end()


async def local_unary(handler: Callable[[object, LocalContext], Awaitable], request, *,
                      metadata: Metadata = (), timeout_s: float | None = None):
    """``handler(request, context)`` (a unary servicer method) called in process: its answer,
    or the ``AioRpcError`` a grpc.aio client would raise (DEADLINE_EXCEEDED past
    ``timeout_s``). Cancelling the awaiting task cancels the handler."""
    context = LocalContext(metadata, timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            answer = await handler(request, context)
    except grpc.aio.AbortError:
        raise context.error() from None
    except TimeoutError:
        raise context.error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
    finally:
        context.finish()
    if context.code() not in (None, grpc.StatusCode.OK):
        raise context.error()
    return answer


class BatchCall:
    """Several ``LocalCall``s (one per prompt of a completions batch) read as one stream.

    Prompt ``k``'s choice ``i`` becomes choice ``k * n + i``, as vLLM numbers a batch's
    choices, and each message names its prompt's request (``request_id``); each call's usage
    is held back and one message with their sum is read last. Every call is read from the
    start, whatever the reader does (so each finishes, and frees its flow-control slot, even
    while other prompts of the batch still wait for one), and nothing is returned before every
    prompt has answered once: a prompt the engine refuses fails the whole request with its own
    status before any output. ``aclose()`` closes every call (each aborts its engine request)."""

    def __init__(self, calls: list[LocalCall], n: int, usage_message: Callable[[], object]
                 ) -> None:
        """``usage_message()``: an empty response message whose ``usage`` is filled in."""
        self.calls, self.n = calls, n
        self._usage = usage_message()
        self._ready: deque = deque()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = len(calls)
        self._started = self._done = False

    def _renumbered(self, k: int, message):
        message.request_id = self.calls[k].request.request_id
        for output in message.outputs:
            output.index += k * self.n
        if message.HasField("usage"):
            for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                setattr(self._usage.usage, name,
                        getattr(self._usage.usage, name) + getattr(message.usage, name))
            message.ClearField("usage")
        return message

    async def _pump(self, k: int, call: LocalCall) -> None:
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                await self._queue.put((k, self._renumbered(k, message)))
            await self._queue.put((k, grpc.aio.EOF))
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            await self._queue.put((k, e))

    async def _next(self) -> tuple[int, object]:
        k, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is grpc.aio.EOF:
            self._open -= 1
        elif item.outputs or item.prompt_token_ids or item.prompt_logprobs:
            self._ready.append(item)
        return k, item

    async def read(self):
        if self._done:
            return grpc.aio.EOF
        if not self._started:
            self._started = True
            self._pumps = [asyncio.ensure_future(self._pump(k, call))
                           for k, call in enumerate(self.calls)]
            answered: set[int] = set()
            while len(answered) < len(self.calls):  # each prompt's first answer (or error)
                answered.add((await self._next())[0])
        while not self._ready and self._open:
            await self._next()
        if self._ready:
            return self._ready.popleft()
        self._done = True
        return self._usage

    async def aclose(self) -> None:
        self._done = True
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)  # no call left mid-read
        for call in self.calls:
            await call.aclose()
