"""An asyncio loop on its own daemon thread, so synchronous tests can drive async servers."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """Subclasses set ``server`` (with ``async stop(grace)``) and ``channel``; ``close()``
    closes the channel, stops the server and ends the loop."""

    server = None
    channel = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        try:
            if self.server is not None:
                self.call(self.server.stop(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
