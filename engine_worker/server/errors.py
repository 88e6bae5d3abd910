"""The one place that maps domain errors to gRPC status codes."""

from __future__ import annotations

import grpc

from engine_worker.engine import EngineDeadError
from engine_worker.server.async_engine import EngineUnavailableError, QueueFullError

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the error's status; the message names the bad field where known."""
    code = status_for(error)
    message = str(error) if code != grpc.StatusCode.INTERNAL else \
        f"internal error: {type(error).__name__}"
    await context.abort(code, message)
