"""Which of the router's errors is which kind; ``quire.errors`` maps kinds to statuses."""

from __future__ import annotations

import grpc

from quire import errors
from quire.errors import ErrorKind, NotFoundError
from router.balancer import NoEndpointError

KINDS: errors.ErrorKinds = (
    (NotFoundError, ErrorKind.NOT_FOUND),  # a FieldError: before ValueError
    (ValueError, ErrorKind.INVALID_ARGUMENT),
    (NoEndpointError, ErrorKind.UNAVAILABLE),
)

# Upstream failures that say nothing about the request itself: another engine may serve it.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.UNKNOWN})


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    """End the call with the error's status; an engine's own status is relayed as it came."""
    await errors.abort_with(context, error, KINDS)
