"""Optional API-key auth for both fronts: ``authorization: Bearer <key>``.

Keys are compared in constant time (``hmac.compare_digest`` against every key, without an early
exit), so response timing reveals neither a key's prefix nor which key matched. Health checks,
reflection and metrics stay open: probes and scrapers carry no keys.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_HTTP_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(k.encode("utf-8") for k in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value carries one of the keys."""
        scheme, _, token = (authorization or "").partition(" ")
        # the header's bytes as sent: aiohttp decodes a non-UTF-8 value with surrogateescape
        presented = token.strip().encode("utf-8", "surrogateescape") \
            if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok and bool(presented)


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call UNAUTHENTICATED."""
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "authorization: missing or invalid API key (send "
                            "'authorization: Bearer <key>' metadata)")

    async def deny_stream(request_or_iterator, context):
        await deny(request_or_iterator, context)
        yield  # pragma: no cover - makes this an async generator, never reached

    kwargs = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self.keys.check(metadata.get("authorization")):
            return handler
        return _deny_handler(handler)
