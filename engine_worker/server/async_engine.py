"""The engine loop in its own thread, and the asyncio side that gRPC handlers talk to.

Handlers never run model work: they put commands (frozen dataclasses, below) on a queue that
the loop thread drains between steps, and results come back to the event loop with one
``call_soon_threadsafe`` per step, carrying every request's output of that step (one wake-up
of the event loop, not one per request). Each request's outputs wait in an ``OutputCollector``,
which merges them while its stream is behind. Only the loop thread touches the ``LLMEngine``;
what the asyncio side reads of it (``load``) is a snapshot the loop thread publishes after each
step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from engine_worker.engine import EngineStats, LLMEngine
from engine_worker.lora.manager import LoRAStats
from engine_worker.server.collector import OutputCollector
from engine_worker.server.model_thread import ModelThread
from engine_worker.input_processor import PromptType
from engine_worker.outputs import PoolingRequestOutput, RequestOutput
from engine_worker.pooling_params import PoolingParams
from engine_worker.sampling_params import RequestOutputKind, SamplingParams
from engine_worker.spec_decode.stats import SpecDecodingStats
from quire.kv_events import KVCacheSnapshot, KVEventBatch

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The waiting queue is at its limit; the caller should retry later or elsewhere."""


class EngineUnavailableError(Exception):
    """The engine died or is shutting down."""


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_running: int
    num_waiting: int
    num_queued_tokens: int
    kv_cache_usage: float
    timestamp_s: float
    spec_decoding: SpecDecodingStats | None = None  # totals; None when speculation is off
    lora: LoRAStats | None = None  # None: LoRA is off
    batch_full: bool = False  # SchedulerStats.batch_full


# ------------------------------------------------------------ commands to the loop thread
@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request; ``added`` resolves once the engine accepted (or refused) it, and its
    outputs then go to ``stream``."""

    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int
    cache_salt: str | None
    stream: OutputCollector
    added: Future
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class CallEngine:
    """Run ``fn(engine)`` between steps (LoRA adapters in and out); ``done`` resolves to its
    result or its exception."""

    fn: Callable[[LLMEngine], object]
    done: Future


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class SubscribeKVEvents:
    """Add ``sink`` to the KV-event feed; ``taken`` resolves to the snapshot it starts from."""

    sink: asyncio.Queue
    taken: Future


@dataclass(frozen=True, slots=True)
class UnsubscribeKVEvents:
    sink: asyncio.Queue


@dataclass(frozen=True, slots=True)
class Wake:
    """Nothing to do: wakes an idle loop (to notice it is stopping)."""


Command = (AddRequest | AbortRequest | SubscribeKVEvents | UnsubscribeKVEvents | CallEngine
           | Wake)


class AsyncEngine:
    """Owns the loop thread. ``max_waiting_requests`` / ``max_queued_tokens`` bound the queue."""

    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int = 1024,
                 max_queued_tokens: int = 1 << 20,
                 on_step: Callable[[EngineStats], None] | None = None,
                 on_finished: Callable[[RequestOutput, int], None] | None = None,
                 model_thread: ModelThread | None = None) -> None:
        """``model_thread``: the thread that built ``engine``, to run the loop on (one OpenMP
        pool: ``engine_worker.server.model_thread``); None: a thread of its own."""
        self.engine = engine
        self._model_thread = model_thread
        self._loop_done: Future | None = None
        self.max_waiting_requests = max_waiting_requests
        self.max_queued_tokens = max_queued_tokens
        self._on_step = on_step
        self._on_finished = on_finished
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, OutputCollector] = {}  # filled via the event loop
        self._num_generated: dict[str, int] = {}  # tokens streamed so far, per request
        self._subscribers: list[asyncio.Queue] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._ids = itertools.count()
        self.dead_reason: str | None = None
        self._joined = False  # requests were added since the last step
        self._joined_pooling = False  # ... pooling ones among them
        self.load = LoadSnapshot(0, 0, 0, 0.0, time.time(), lora=engine.stats().lora)
        # a multi-step decode ends at the next pass once a request, abort or call comes in
        engine.set_step_interrupt(lambda: not self._commands.empty())

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        thread = self._model_thread or ModelThread()
        self._loop_done = thread.submit(self._run)
        if self._model_thread is None:
            thread.close()  # a thread of its own ends with the loop

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(Wake())
        if self._loop_done is not None:
            wait([self._loop_done], timeout=30)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and not self._stopping.is_set()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------- asyncio side
    def _internal_id(self, request_id: str) -> str:
        """The engine's own id of a request: the caller's with a suffix no other live request
        has, as vLLM adds one (its PR 27987), so that two clients that happen to pick one id
        (through one router, or a retried request whose first try is still being aborted)
        never collide; outputs carry the caller's id back."""
        n = next(self._ids)
        return f"{request_id}-{n}" if request_id else f"req-{n}"

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield DELTA outputs until the request finishes. Leaving the loop early (cancel,
        deadline, closed stream) aborts the request in the engine."""
        if not self.alive:
            raise EngineUnavailableError(self.dead_reason or "the engine is shutting down")
        client_id, request_id = request_id, self._internal_id(request_id)
        params = params.clone(output_kind=RequestOutputKind.DELTA)
        if params.structured_outputs is not None:
            # compiled on the grammar cache's thread, never the loop's: only this request waits
            # (a spec xgrammar refuses raises FieldError here, before anything is queued)
            await self.engine.grammars.compile_async(params.structured_outputs)
        stream = OutputCollector()
        added: Future = Future()
        self._commands.put(AddRequest(request_id, prompt, params, priority, cache_salt, stream,
                                      added, lora_name))
        try:
            await asyncio.wrap_future(added)  # raises ValueError / QueueFullError from the loop
        except asyncio.CancelledError:  # the caller left while the add was queued or running
            self._commands.put(AbortRequest(request_id))
            raise
        finished = False
        try:
            while True:
                try:
                    output = await stream.get()  # what came since the last turn, merged
                except asyncio.CancelledError:
                    raise
                except BaseException:
                    finished = True  # the engine ended the stream: nothing left to abort
                    raise
                output.request_id = client_id or request_id
                yield output
                if output.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(AbortRequest(request_id))

    async def embed(self, request_id: str, prompt: PromptType, params: PoolingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_name: str | None = None) -> PoolingRequestOutput:
        """The prompt's pooled vector (a pooling request, batched with the engine's other
        work). Cancelling the caller aborts the request in the engine."""
        if not self.alive:
            raise EngineUnavailableError(self.dead_reason or "the engine is shutting down")
        client_id, request_id = request_id, self._internal_id(request_id)
        stream = OutputCollector()
        added: Future = Future()
        self._commands.put(AddRequest(request_id, prompt, params, priority, cache_salt, stream,
                                      added, lora_name))
        try:
            await asyncio.wrap_future(added)  # raises ValueError / QueueFullError from the loop
            output = await stream.get()  # its one output; the engine's failure raises here
            output.request_id = client_id or request_id
            return output
        except asyncio.CancelledError:
            self._commands.put(AbortRequest(request_id))
            raise

    async def subscribe_kv_events(self) -> tuple[KVCacheSnapshot, asyncio.Queue]:
        """A snapshot and a queue of every later KV event batch (None when the feed ends)."""
        sink: asyncio.Queue = asyncio.Queue()
        taken: Future = Future()
        self._commands.put(SubscribeKVEvents(sink, taken))
        return await asyncio.wrap_future(taken), sink

    async def call(self, fn: Callable[[LLMEngine], object]):
        """``fn(engine)`` on the loop thread, between steps; its result (or exception)."""
        if not self.alive:
            raise EngineUnavailableError(self.dead_reason or "the engine is shutting down")
        done: Future = Future()
        self._commands.put(CallEngine(fn, done))
        return await asyncio.wrap_future(done)

    def unsubscribe_kv_events(self, sink: asyncio.Queue) -> None:
        self._commands.put(UnsubscribeKVEvents(sink))

    # -------------------------------------------------------------- loop thread
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            if engine.dead_reason is not None:  # e.g. a tensor-parallel worker died while idle
                logger.error("the engine failed; it stops serving: %s", engine.dead_reason)
                self._die(engine.dead_reason)
                return
            idle = not engine.has_unfinished_requests()
            self._drain_commands(block=idle)
            if self._joined:
                # requests joined since the last step: the gauges say so before the step,
                # which may take seconds (a pooling request admitted and finished within one
                # step was never seen in them); see _after_admission for the load report
                self._after_admission(engine.stats(), publish=self._joined_pooling)
                self._joined = self._joined_pooling = False
            if not engine.has_unfinished_requests():
                continue
            try:
                result = engine.step()
            except Exception as e:  # the engine is dead: end every stream, never hang one
                logger.exception("engine step failed; the engine stops serving")
                self._die(engine.dead_reason or f"{type(e).__name__}: {e}")
                return
            self._deliver(result.outputs)
            self._after_step(result.stats, result.kv_event_batches)
        self._end_all(EngineUnavailableError("the engine is shutting down"))

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: Command) -> None:
        match command:
            case AddRequest():
                self._add(command)
            case AbortRequest(request_id=request_id):
                if request_id in self._streams:
                    self.engine.abort_request(request_id)
            case SubscribeKVEvents(sink=sink, taken=taken):
                if taken.set_running_or_notify_cancel():  # not if the subscriber already left
                    self._subscribers.append(sink)
                    taken.set_result(self.engine.kv_cache_snapshot())
            case UnsubscribeKVEvents(sink=sink):
                if sink in self._subscribers:
                    self._subscribers.remove(sink)
            case CallEngine(fn=fn, done=done):
                if done.set_running_or_notify_cancel():
                    try:
                        done.set_result(fn(self.engine))
                    except Exception as e:  # noqa: BLE001 - the caller's to map
                        done.set_exception(e)
                    # adapters came or went: the load report says so before any step
                    self._publish_load(self.engine.stats())
            case Wake():
                pass

    def _add(self, command: AddRequest) -> None:
        added = command.added
        if not added.set_running_or_notify_cancel():
            return  # the caller was cancelled before the engine saw the request
        load = self.engine.stats().scheduler
        if load.num_waiting >= self.max_waiting_requests:
            added.set_exception(QueueFullError(
                f"{load.num_waiting} requests are waiting (limit "
                f"{self.max_waiting_requests})"))
            return
        if load.num_queued_tokens >= self.max_queued_tokens:
            added.set_exception(QueueFullError(
                f"queued prompt tokens at the limit of {self.max_queued_tokens}"))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params,
                                    priority=command.priority, cache_salt=command.cache_salt,
                                    lora_request=command.lora_name)
        except ValueError as e:
            added.set_exception(e)
            return
        self._streams[command.request_id] = command.stream
        self._joined = True
        self._joined_pooling |= isinstance(command.params, PoolingParams)
        added.set_result(None)

    def _deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        """Hand a step's outputs to the event loop in one call (one wake-up per step)."""
        batch = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if isinstance(output, PoolingRequestOutput):  # one output, always the last
                del self._streams[output.request_id]
                batch.append((stream, output))
                continue
            if output.error is not None:  # its own input ended it: the client's error
                del self._streams[output.request_id]
                self._num_generated.pop(output.request_id, None)
                self.engine.abort_request(output.request_id)  # (its other samples too)
                self._loop.call_soon_threadsafe(stream.fail, output.error)
                continue
            generated = self._num_generated.get(output.request_id, 0) + \
                sum(len(c.token_ids) for c in output.outputs)
            self._num_generated[output.request_id] = generated
            if output.finished:
                del self._streams[output.request_id]
                del self._num_generated[output.request_id]
                if self._on_finished is not None:
                    self._on_finished(output, generated)
            batch.append((stream, output))
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _publish_load(self, stats: EngineStats) -> None:
        self.load = LoadSnapshot(num_running=stats.scheduler.num_running,
                                 num_waiting=stats.scheduler.num_waiting,
                                 num_queued_tokens=stats.scheduler.num_queued_tokens,
                                 kv_cache_usage=stats.kv_cache.usage, timestamp_s=time.time(),
                                 spec_decoding=stats.scheduler.spec_decoding,
                                 lora=stats.lora, batch_full=stats.scheduler.batch_full)

    def _after_step(self, stats: EngineStats, batches: tuple[KVEventBatch, ...]) -> None:
        self._publish_load(stats)
        for batch in batches:
            for sink in self._subscribers:
                self._loop.call_soon_threadsafe(sink.put_nowait, batch)
        if self._on_step is not None:
            self._on_step(stats)

    def _after_admission(self, stats: EngineStats, *, publish: bool) -> None:
        """The step gauges as of requests joining, between steps (``on_step`` takes running
        totals, so a second report counts nothing twice), and with ``publish`` the load report
        routers read. Only pooling requests are published so: they can be admitted and
        finished within the step, unseen otherwise; a generation request shows in the report
        after its first step, and a report of it waiting, published as it joined, outlives the
        step by up to a router's read interval (100 ms), during which other routers took the
        engine that had just taken it as loaded and placed the next request of a warm prefix
        on a cold engine (CI caught it with three router replicas)."""
        if publish:
            self._publish_load(stats)
        if self._on_step is not None:
            self._on_step(stats)

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._end_all(EngineUnavailableError(f"the engine failed: {reason}"))

    def _end_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            self._loop.call_soon_threadsafe(stream.fail, error)
        self._streams.clear()
        for sink in self._subscribers:
            self._loop.call_soon_threadsafe(sink.put_nowait, None)
        self._subscribers.clear()
        while True:  # refuse what is still queued
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            match command:
                case AddRequest(added=future) | SubscribeKVEvents(taken=future):
                    if future.set_running_or_notify_cancel():
                        future.set_exception(EngineUnavailableError(str(error)))


def _put_all(batch: list[tuple[OutputCollector, RequestOutput]]) -> None:
    """On the event loop: one step's outputs into their streams' collectors."""
    for stream, output in batch:
        stream.put(output)
