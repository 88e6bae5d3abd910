"""Being told to stop, shared by every long-running command."""

from __future__ import annotations

import asyncio
import signal


def shutdown_event() -> asyncio.Event:
    """An event set by SIGTERM (Kubernetes) or SIGINT (Ctrl-C). Handlers are installed now,
    so call this before announcing readiness: a signal right after the announcement is caught."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
