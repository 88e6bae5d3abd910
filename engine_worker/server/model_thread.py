"""The one thread of a serving process that runs model work: it builds the engine, then runs
the engine loop (``AsyncEngine``), so that one thread, and one OpenMP pool, does it all.

libgomp keeps a pool of worker threads per thread that has started a parallel region, for
the life of that thread. Built on the main thread and stepped on another, an engine leaves
two pools: the main thread's (idle from then on) and the loop thread's. libgomp counts every
pool's threads, and when they outnumber the CPUs it stops spinning at barriers (a thousand
spins instead of 300,000) and its threads sleep on a futex at every parallel region's end:
on a 2-core Zen 4 serving 64 streams the loop thread and its worker slept about 2,000 times a
second each and the cores stood 13 % idle; the same requests offline (one pool) left them
busy. Building the engine where it will run keeps one pool of ``num_threads`` threads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


class ModelThread:
    """A daemon thread that runs the functions given to ``submit`` one after another."""

    def __init__(self, name: str = "engine-loop") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], T]) -> Future:
        """``fn()`` on the thread after what was submitted before; its result or exception."""
        done: Future = Future()
        self._jobs.put((fn, done))
        return done

    def close(self) -> None:
        """The thread ends once what was submitted has run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, done = job
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the submitter gets it
                done.set_exception(e)
