"""Which of the engine's errors is which kind; ``quire.errors`` maps kinds to statuses."""

from __future__ import annotations

import grpc

from engine_worker.engine import EngineDeadError
from engine_worker.grammar import WorkerDidNotStart
from engine_worker.server.async_engine import EngineUnavailableError, QueueFullError
from quire import errors
from quire.errors import ErrorKind, NotFoundError

KINDS: errors.ErrorKinds = (
    (NotFoundError, ErrorKind.NOT_FOUND),  # a FieldError: before ValueError
    (ValueError, ErrorKind.INVALID_ARGUMENT),
    (QueueFullError, ErrorKind.RESOURCE_EXHAUSTED),
    (EngineUnavailableError, ErrorKind.UNAVAILABLE),
    (EngineDeadError, ErrorKind.UNAVAILABLE),
    (WorkerDidNotStart, ErrorKind.UNAVAILABLE),
)


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the error's status; the message names the bad field where known."""
    await errors.abort_with(context, error, KINDS)
