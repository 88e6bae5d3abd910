"""A header deadline for the aiohttp front: a request's headers must arrive within
``header_timeout_s`` of its first byte, or the connection is closed (slowloris: a client
sending a few header bytes a second would otherwise hold a connection for minutes).

aiohttp has no such timeout, so its protocol is wrapped: the first bytes of a request arm a
timer, and the front's middleware disarms it once aiohttp has parsed the headers and called the
handler (``headers_done``), re-enabling it when the response is finished (``request_done``).
Body reads are bounded separately, in the handler.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

logger = logging.getLogger(__name__)


class HeaderDeadline(asyncio.Protocol):
    """Wraps one aiohttp RequestHandler; forwards every protocol call to it."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._in_request = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._timer is None and not self._in_request:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc) -> None:
        self._cancel()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def headers_done(self) -> None:
        self._in_request = True
        self._cancel()

    def request_done(self) -> None:
        self._in_request = False

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            peer = self.transport.get_extra_info("peername")
            logger.warning("HTTP client %s sent no complete request headers within %.1f s; "
                           "closing the connection", peer, self.timeout_s)
            self.transport.close()


class _GuardedServer:
    """aiohttp's ``web.Server`` (the protocol factory) with each protocol wrapped."""

    def __init__(self, server: web.Server, timeout_s: float) -> None:
        self._server = server
        self._timeout_s = timeout_s

    def __call__(self) -> HeaderDeadline:
        return HeaderDeadline(self._server(), self._timeout_s)

    def __getattr__(self, name):
        return getattr(self._server, name)


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose connections get a header deadline."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self):
        return _GuardedServer(await super()._make_server(), self._header_timeout_s)


def deadline_of(request: web.Request) -> HeaderDeadline | None:
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, HeaderDeadline) else None
