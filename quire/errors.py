"""The one mapping of error kinds to gRPC and HTTP statuses, shared by the engine and the router.

Each application lists which of its exceptions is which kind (``engine_worker.server.errors``,
``router.errors``) and aborts calls with ``abort_with``; the router's HTTP front turns a gRPC
status into an HTTP one with ``http_status``. A message names the offending field where known;
an internal error's message names only the exception type (never internals).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import grpc


class ErrorKind(enum.Enum):
    """(gRPC status, HTTP status) of each kind of failure."""

    INVALID_ARGUMENT = (grpc.StatusCode.INVALID_ARGUMENT, 400)
    OUT_OF_RANGE = (grpc.StatusCode.OUT_OF_RANGE, 400)
    UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, 401)
    PERMISSION_DENIED = (grpc.StatusCode.PERMISSION_DENIED, 403)
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404)
    RESOURCE_EXHAUSTED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429)
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503)
    DEADLINE_EXCEEDED = (grpc.StatusCode.DEADLINE_EXCEEDED, 504)
    INTERNAL = (grpc.StatusCode.INTERNAL, 500)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]


_HTTP_FOR_GRPC = {kind.grpc_code: kind.http_status for kind in ErrorKind}

# Trailing metadata naming the offending request field, so a router's HTTP front can fill
# OpenAI's ``error.param`` from an engine's answer without parsing its message.
FIELD_METADATA = "quire-error-field"


class FieldError(ValueError):
    """A bad request field: ``field`` names it; the message reads ``"<field>: <detail>"``."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field


def renamed(error: FieldError, field: str) -> FieldError:
    """The same error (same type, so the same status) naming ``field`` instead."""
    detail = str(error).removeprefix(f"{error.field}: ")
    clone = type(error).__new__(type(error))  # not copy.copy: it calls __init__ with args
    clone.__dict__.update(error.__dict__)
    clone.args = (f"{field}: {detail}",)
    clone.field = field
    return clone


class NotFoundError(FieldError):
    """A field names something that is not here (a LoRA adapter no engine holds): gRPC
    NOT_FOUND, HTTP 404, the name in the message."""


def field_of(error: BaseException) -> str | None:
    """The field an error names: a ``FieldError``'s, or what an upstream status carried."""
    if isinstance(error, FieldError):
        return error.field
    if isinstance(error, grpc.aio.AioRpcError):
        for key, value in error.trailing_metadata() or ():
            if key == FIELD_METADATA:
                return value
    return None

# (exception type, kind), first match wins: an application's table of its own errors.
ErrorKinds = Sequence[tuple[type[BaseException], ErrorKind]]


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status for a gRPC status (500 for one no kind names)."""
    return _HTTP_FOR_GRPC.get(code, 500)


def status_for(error: BaseException, kinds: ErrorKinds) -> tuple[grpc.StatusCode, str]:
    """(code, message) for ``error``. A status from upstream (an engine's, seen by the router)
    is relayed as it came."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details() or ""
    for exception_type, kind in kinds:
        if isinstance(error, exception_type):
            return kind.grpc_code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException,
                     kinds: ErrorKinds) -> None:
    """End the call with the error's status (and the bad field's name as trailing metadata)."""
    code, message = status_for(error, kinds)
    field = field_of(error)
    await context.abort(code, message,
                        trailing_metadata=((FIELD_METADATA, field),) if field else ())
