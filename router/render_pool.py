"""Where the HTTP front renders chat templates and tokenizes: small jobs inline on the event
loop, larger ones on a pool of threads (the tokenizer releases the GIL on long texts).

One pool for every job let a small chat wait behind large ones: two dozen 1 MB ``/tokenize``
calls (which need no engine and pass no flow control) held a 2-token chat for up to 5 s
(probe 7). A job of at most ``INLINE_CHARS`` characters costs a millisecond or two, less
than the hand-off to a thread, so it never queues; a large one still never runs on the loop.
Nor do many small ones at once (a batch of 256 prompts or conversations, each small): the
loop renders at most ``INLINE_CHARS_PER_WINDOW`` characters each ``WINDOW_S``, and the rest
of a burst goes to the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# characters of text (messages, tools, a prompt) rendered and tokenized on the loop itself:
# about a millisecond of template and tokenizer work on these CPUs
INLINE_CHARS = 2048
WINDOW_S = 0.02
INLINE_CHARS_PER_WINDOW = 4 * INLINE_CHARS  # a few milliseconds of each window, at most


def approx_chars(*parts: object, limit: int = INLINE_CHARS) -> int:
    """The characters of the strings in ``parts`` (dicts' keys and values, lists), counted
    until they pass ``limit`` (the rest is not walked: the job is large either way)."""
    total, stack = 0, list(parts)
    while stack and total <= limit:
        part = stack.pop()
        if isinstance(part, str):
            total += len(part)
        elif isinstance(part, dict):
            stack.extend(part.keys())
            stack.extend(part.values())
        elif isinstance(part, (list, tuple)):
            stack.extend(part)
        else:
            total += 1
    return total


class Renderer:
    def __init__(self, threads: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="openai-render")
        self._clock = clock
        self._window_start = -WINDOW_S
        self._window_chars = 0  # rendered inline since the window started

    async def run(self, size: int, fn: Callable, *args):
        """``fn(*args)``: inline when ``size`` (its characters, or token ids) is small and
        the window has room for it, else on the pool."""
        if size <= INLINE_CHARS and self._inline_room(size):
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _inline_room(self, size: int) -> bool:
        now = self._clock()
        if now - self._window_start >= WINDOW_S:
            self._window_start, self._window_chars = now, 0
        if self._window_chars + size > INLINE_CHARS_PER_WINDOW:
            return False
        self._window_chars += size
        return True

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
