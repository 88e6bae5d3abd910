"""What every Quire gRPC server (router and engine) shares at its edge: its options and an
interceptor that answers undecodable request bytes with INVALID_ARGUMENT.

- ``grpc.so_reuseport`` is off: gRPC turns SO_REUSEPORT on by default on Linux, so a second server
  started on a busy port would bind it silently and take part of its traffic. With it off the
  bind fails, and ``bind_port`` says which port.
- A request that is not a valid protobuf message is the client's mistake. gRPC's default answer
  is UNKNOWN with a traceback in the log; ``BadRequestBytes`` answers INVALID_ARGUMENT and logs one
  line.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import grpc

from quire.ports import PortInUseError

logger = logging.getLogger(__name__)

# A server option, not a channel one: refuse to share a listening port with another process.
NO_PORT_REUSE = ("grpc.so_reuseport", 0)


def bind_port(server: grpc.aio.Server, host: str, port: int,
              credentials: grpc.ServerCredentials | None = None, *, what: str = "gRPC") -> int:
    """``add_(in)secure_port``, raising PortInUseError naming the port instead of returning 0
    or raising a bare RuntimeError."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if not bound:
        raise PortInUseError(f"port: cannot listen on {address} ({what}): the port is in use "
                             f"or the address is not local")
    return bound


class _Undecodable:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            return _Undecodable(e)
    return parse


def _message(method: str, bad: _Undecodable) -> str:
    return (f"request: not a valid protobuf message for {method} "
            f"({type(bad.error).__name__})")


async def _refuse(method: str, bad: _Undecodable, context) -> None:
    logger.warning("%s: refused undecodable request bytes from %s (%s)", method,
                   context.peer(), type(bad.error).__name__)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, bad))


def _guard_unary_stream(method: str, behaviour):
    if not inspect.isasyncgenfunction(behaviour):  # a coroutine writing with context.write
        return _guard_unary_unary(method, behaviour)

    async def run(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(method, request, context)
            return
        # aclosing: a cancelled call closes the servicer's stream now (its finally aborts the
        # request upstream), not whenever the garbage collector gets to it
        async with contextlib.aclosing(behaviour(request, context)) as stream:
            async for message in stream:
                yield message
    return run


def _guard_unary_unary(method: str, behaviour):
    async def run(request, context):
        if isinstance(request, _Undecodable):
            await _refuse(method, request, context)
        return await behaviour(request, context)
    return run


class BadRequestBytes(grpc.aio.ServerInterceptor):
    """Undecodable request messages -> INVALID_ARGUMENT naming the method, one log line."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        parse = _safe(handler.request_deserializer)
        if handler.unary_stream is not None:
            return handler._replace(request_deserializer=parse,
                                    unary_stream=_guard_unary_stream(method, handler.unary_stream))
        if handler.unary_unary is not None:
            return handler._replace(request_deserializer=parse,
                                    unary_unary=_guard_unary_unary(method, handler.unary_unary))
        return handler
