"""Take what a server process built at start out of the garbage collector's sight.

A served engine process holds about 200,000 objects the collector tracks once its model,
tokenizer and gRPC server are up, and none of them is ever garbage. Serving allocates
futures, tasks and handles by the thousand, so the collector's oldest generation comes due
now and then, and each full collection walked all of them while holding the GIL: 95-148 ms
on a 2-core Zen 4 (measured with a ``gc.callbacks`` hook under ``quire bench serving``'s
load), a whole decode step of 64 requests during which the engine loop could not run.
``gc.freeze()`` moves every object alive at that point into a generation the collector
never walks; vLLM's engine and API server do the same after start-up (``freeze_gc_heap``).
Only long-running server processes call this: objects frozen are never collected, so a
process that builds and drops engines (a test run, a script) must not.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze the rest; the number frozen."""
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects (the garbage collector's full collections no longer "
                "walk them)", frozen)
    return frozen
