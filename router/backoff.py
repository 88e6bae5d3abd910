"""Reconnect delays: doubling from ``min_s`` up to ``max_s``, back to ``min_s`` after a success.

One object per reconnect loop (an engine's supervisor, its KV and load feeds, the Kubernetes
watch). It only computes delays; the loop sleeps as suits it (``asyncio`` or a thread's
``Event.wait``), so a stop request can break the wait.
"""

from __future__ import annotations

import asyncio


class Backoff:
    """``next_s()`` after each failure, ``reset()`` after each success."""

    __slots__ = ("min_s", "max_s", "_delay_s")

    def __init__(self, min_s: float, max_s: float) -> None:
        if min_s <= 0 or max_s <= 0:
            raise ValueError(f"min_s and max_s must be > 0, got {min_s} and {max_s}")
        self.min_s = min(min_s, max_s)  # a ceiling set below the default floor wins
        self.max_s = max_s
        self._delay_s = self.min_s

    def reset(self) -> None:
        self._delay_s = self.min_s

    def next_s(self) -> float:
        """The delay to wait now; the one after it is twice as long (at most ``max_s``)."""
        delay_s = self._delay_s
        self._delay_s = min(delay_s * 2, self.max_s)
        return delay_s

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_s())
