"""The one place that maps the router's errors to gRPC status codes."""

from __future__ import annotations

import grpc

from router.balancer import NoEndpointError

_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (NoEndpointError, grpc.StatusCode.UNAVAILABLE),
)

# Upstream failures that say nothing about the request itself: another engine may serve it.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.UNKNOWN})


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message). An engine's own status is relayed as it came."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or ""
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    code, message = status_for(error)
    await context.abort(code, message)
