"""``StreamLoad``'s contract, served the same way by an engine and by a router: a
``LoadReport`` at once, then one every ``interval_ms`` (1000 when unset, at least 10)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from quire.v1 import engine_pb2 as pb

DEFAULT_INTERVAL_MS = 1000
MIN_INTERVAL_MS = 10


def load_interval_s(request: pb.StreamLoadRequest) -> float:
    return max(MIN_INTERVAL_MS, request.interval_ms or DEFAULT_INTERVAL_MS) / 1000


async def load_reports(request: pb.StreamLoadRequest,
                       current: Callable[[], pb.LoadReport]) -> AsyncIterator[pb.LoadReport]:
    """``current()`` stamped with the wall clock, at the interval the request asks for; runs
    until the client closes the stream."""
    interval_s = load_interval_s(request)
    while True:
        report = current()
        report.timestamp_s = time.time()
        yield report
        await asyncio.sleep(interval_s)
