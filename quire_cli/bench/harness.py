"""What the online benchmarks share: engine subprocesses, an in-process router, one streaming
client request timed message by message, and percentiles.

Times are ``time.perf_counter()`` seconds relative to a run's own start, so requests of one
run line up on one clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from quire.v1 import engine_pb2 as pb
from quire.v1 import engine_pb2_grpc

ENGINE_ID_METADATA = "quire-engine-id"  # the router's initial metadata (router.server)
FIRST_SAFE_TOKEN_ID = 1000  # far from special / control tokens at either end of the vocabulary


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One streamed request. ``chunks`` holds (arrival_s, num_tokens) per message with tokens."""

    req_id: str
    engine_id: str
    sent_s: float
    end_s: float
    chunks: tuple[tuple[float, int], ...]
    prompt_tokens: int  # as the engine reported (usage); 0 when no usage arrived
    cached_tokens: int
    finish_reason: str  # FINISH_REASON_* name, "" when the stream broke off
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.finish_reason) and bool(self.chunks)

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft_s(self) -> float:
        return self.chunks[0][0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with a single token)."""
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    def itls_s(self) -> list[float]:
        """Gaps between messages; a message of k tokens counts as k gaps of 1/k each, so every
        token after the first has one inter-token latency."""
        gaps = []
        for (before, _), (at, n) in zip(self.chunks, self.chunks[1:]):
            gaps += [(at - before) / n] * n
        return gaps


def generate_request(req_id: str, token_ids: Sequence[int], output_len: int
                     ) -> pb.GenerateRequest:
    # Greedy and never stopping early, so every request yields exactly output_len tokens.
    return pb.GenerateRequest(
        request_id=req_id, token_ids=pb.TokenIds(ids=list(token_ids)),
        sampling=pb.SamplingOptions(temperature=0, max_tokens=output_len, ignore_eos=True))


async def stream_request(stub: engine_pb2_grpc.EngineServiceStub, request: pb.GenerateRequest,
                         *, t0: float, timeout_s: float, engine_id: str = "",
                         metadata: tuple[tuple[str, str], ...] = ()) -> RequestResult:
    """Send ``request`` (with ``metadata``) and time each message; the engine id comes from
    the router's initial metadata (``engine_id`` names it when talking to an engine
    directly)."""
    sent = time.perf_counter()
    call = stub.Generate(request, timeout=timeout_s, metadata=metadata)
    chunks: list[tuple[float, int]] = []
    usage, finish, error = None, "", None
    try:
        async for message in call:
            now = time.perf_counter() - t0
            num_tokens = sum(len(d.token_ids) for d in message.outputs)
            if num_tokens:
                chunks.append((now, num_tokens))
            for delta in message.outputs:
                if delta.finish_reason:
                    finish = pb.FinishReason.Name(delta.finish_reason)
            if message.HasField("usage"):
                usage = message.usage
        metadata = dict(await call.initial_metadata() or ())
        engine_id = metadata.get(ENGINE_ID_METADATA, engine_id)
    except grpc.aio.AioRpcError as e:
        error = f"{e.code().name}: {e.details()}"
    end = time.perf_counter() - t0
    return RequestResult(req_id=request.request_id, engine_id=engine_id, sent_s=sent - t0,
                         end_s=end, chunks=tuple(chunks),
                         prompt_tokens=usage.prompt_tokens if usage else 0,
                         cached_tokens=usage.cached_tokens if usage else 0,
                         finish_reason=finish, error=error)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def describe_ms(values_s: Sequence[float], quantiles=(50, 90, 99)) -> dict[str, float | None]:
    """p50/p90/p99 and mean of seconds, in milliseconds."""
    out = {f"p{q}": _ms(percentile(values_s, q)) for q in quantiles}
    out["mean"] = _ms(sum(values_s) / len(values_s)) if values_s else None
    return out


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else value_s * 1e3


def cpu_busy(window_s: float) -> float:
    """The fraction of every CPU's time spent busy (not idle or waiting on I/O) over the next
    ``window_s`` seconds, from /proc/stat (Linux)."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_until_quiet(max_busy: float = 0.1, window_s: float = 1.0,
                     timeout_s: float = 30.0) -> dict:
    """Waits until the machine's CPUs are at most ``max_busy`` busy over a window (what a
    server that just finished a run still does: freeing, logging, collecting), at most
    ``timeout_s``; returns how long it waited and the last window's busy fraction, for the
    run's record."""
    start = time.monotonic()
    while True:
        busy = cpu_busy(window_s)
        waited = time.monotonic() - start
        if busy <= max_busy or waited >= timeout_s:
            return {"waited_s": round(waited, 1), "cpu_busy": round(busy, 3)}


def machine_info() -> dict:
    return {"platform": platform.platform(), "python": sys.version.split()[0],
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg())}


@contextlib.contextmanager
def running_engines(num_engines: int, flags: list[str], startup_timeout_s: float):
    """``num_engines`` fresh ``quire engine`` processes (cold caches); yields their addresses.
    Each gets cpu_count // num_engines torch threads unless ``flags`` set ``--num-threads``."""
    with engine_processes(num_engines, flags, startup_timeout_s) as control:
        yield [engine.address for engine in control.engines]


class EngineControl:
    """The engine processes of a run: kill one (SIGKILL, as a crashed pod) and start it again
    at the same address. ``engines`` always holds the live process of each, for the stop."""

    def __init__(self, engines: list) -> None:
        self.engines = engines

    def kill(self, i: int) -> None:
        self.engines[i].proc.kill()
        self.engines[i].proc.wait()

    def restart(self, i: int) -> None:
        """Blocks until the new process listens (run it off the event loop)."""
        from quire_cli.stack import restart_engine

        self.engines[i] = restart_engine(self.engines[i])


@contextlib.contextmanager
def engine_processes(num_engines: int, flags: list[str], startup_timeout_s: float):
    """As ``running_engines``, yielding an ``EngineControl`` over the processes."""
    from quire_cli.stack import StackConfig, start_engines, stop_engines

    control = EngineControl(start_engines(StackConfig(num_engines=num_engines,
                                                      startup_timeout_s=startup_timeout_s),
                                          flags))
    try:
        yield control
    finally:
        stop_engines(control.engines)


@contextlib.asynccontextmanager
async def running_router(addresses: Sequence[str], policy: str, timeout_s: float, *,
                         tokenizer: str | None = None, placement: dict | None = None,
                         flow: dict | None = None):
    """An in-process router (gRPC only) over ``addresses`` (engine list entries: ``host:port``
    or ``vllm://...``), once every engine serves. vLLM engines need ``tokenizer`` (a
    directory) and their block size in ``placement``; ``flow``: flow-control options."""
    from router.app import RouterServer

    router = RouterServer.static(addresses, policy=policy, host="127.0.0.1", port=0,
                                 http_port=-1, tokenizer=tokenizer, placement=placement,
                                 flow=flow)
    await router.start()
    try:
        if not await router.wait_ready(len(addresses), timeout_s=timeout_s):
            raise RuntimeError(f"engines not serving: {router.engine_states()}")
        yield router
    finally:
        # Closing its engine clients logs each engine as unreachable at WARNING: expected on
        # the way out, so kept from the benchmark's output (failures during a run still show).
        client_log = logging.getLogger("router.engine_client")
        level = client_log.level
        client_log.setLevel(logging.ERROR)
        try:
            await router.stop(0)
        finally:
            client_log.setLevel(level)


async def model_info(address: str) -> pb.ModelInfo:
    async with grpc.aio.insecure_channel(address) as channel:
        return await engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), timeout=60)


async def warm_up(addresses: Sequence[str], prompt_len: int, output_len: int,
                  timeout_s: float) -> None:
    """One request straight to each engine, so first-call costs (allocation, kernel choice)
    stay out of the measurement. Its tokens share no block with any workload prompt."""
    prompt = [FIRST_SAFE_TOKEN_ID - 1 - i % 500 for i in range(prompt_len)]

    async def one(i: int, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            result = await stream_request(
                stub, generate_request(f"warm-up-{i}", prompt, output_len),
                t0=time.perf_counter(), timeout_s=timeout_s, engine_id=address)
        if not result.ok:
            raise RuntimeError(f"warm-up request to {address} failed: {result.error}")

    await asyncio.gather(*(one(i, a) for i, a in enumerate(addresses)))
