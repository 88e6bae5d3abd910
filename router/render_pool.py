"""Where the HTTP front renders chat templates and tokenizes: small jobs inline on the event
loop, larger ones on a pool of threads (the tokenizer releases the GIL on long texts).

One pool for every job let a small chat wait behind large ones: two dozen 1 MB ``/tokenize``
calls (which need no engine and pass no flow control) held a 2-token chat for up to 5 s
(probe 7). A job of at most ``INLINE_CHARS`` characters costs a millisecond or two, less
than the hand-off to a thread, so it never queues; a large one still never runs on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# characters of text (messages, tools, a prompt) rendered and tokenized on the loop itself:
# about a millisecond of template and tokenizer work on these CPUs
INLINE_CHARS = 2048


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
    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="openai-render")

    async def run(self, size: int, fn: Callable, *args):
        """``fn(*args)``: inline when ``size`` (its characters, or token ids) is small, else
        on the pool."""
        if size <= INLINE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
