"""A header deadline for the aiohttp front: a request's headers must arrive within
``header_timeout_s`` of its first byte, or the connection is closed (slowloris: a client
sending a few header bytes a second would otherwise hold a connection for minutes).

aiohttp has no such timeout, so its protocol is wrapped: the first bytes of a request arm a
timer, and the front's middleware disarms it once aiohttp has parsed the headers and called the
handler (``headers_done``), re-enabling it when the response is finished (``request_done``).
Body reads are bounded separately, in the handler.

A request aiohttp itself refuses (bad framing, a malformed chunk) is the client's mistake:
``ClientErrorLog`` makes it one WARNING line, rate-limited, where aiohttp would log a traceback
at ERROR for each; tracebacks stay for the front's own bugs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

logger = logging.getLogger(__name__)


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s`` through ``log``; the lines dropped are counted
    and the count is said with the next line let through (a flood of bad requests must not
    become a flood of log lines)."""

    def __init__(self, log: logging.Logger, *, burst: int = 10, window_s: float = 10.0,
                 clock=time.monotonic) -> None:
        self.log = log
        self.burst, self.window_s = burst, window_s
        self._clock = clock
        self._window_start_s = -window_s
        self._num_logged = 0
        self.num_dropped = 0

    def __call__(self, level: int, msg: str, *args) -> None:
        now = self._clock()
        if now - self._window_start_s >= self.window_s:
            self._window_start_s, self._num_logged = now, 0
        if self._num_logged >= self.burst:
            self.num_dropped += 1
            return
        self._num_logged += 1
        if self.num_dropped:
            msg += " (%d similar lines dropped)"
            args = (*args, self.num_dropped)
            self.num_dropped = 0
        self.log.log(level, msg, *args)


class ClientErrorLog(logging.LoggerAdapter):
    """The logger aiohttp's request handler writes to. ``exception()`` with an error aiohttp
    raised for the client's malformed HTTP is one rate-limited WARNING line, no traceback;
    any other exception (the front's bug) keeps its traceback."""

    def __init__(self, log: logging.Logger, client_errors: RateLimitedLog) -> None:
        super().__init__(log, {})
        self.client_errors = client_errors

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(error, HttpProcessingError):
            self.client_errors(logging.WARNING, "%s: HTTP %s %s", msg % args, error.code,
                               " ".join(str(error.message).split())[:200])
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kwargs)


class HeaderDeadline(asyncio.Protocol):
    """Wraps one aiohttp RequestHandler; forwards every protocol call to it."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float,
                 client_errors: RateLimitedLog) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.client_errors = client_errors
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
            self.client_errors(logging.WARNING, "HTTP client %s sent no complete request "
                               "headers within %.1f s; closing the connection", peer,
                               self.timeout_s)
            self.transport.close()


class _GuardedServer:
    """aiohttp's ``web.Server`` (the protocol factory) with each protocol wrapped."""

    def __init__(self, server: web.Server, timeout_s: float,
                 client_errors: RateLimitedLog) -> None:
        self._server = server
        self._timeout_s = timeout_s
        self._client_errors = client_errors

    def __call__(self) -> HeaderDeadline:
        return HeaderDeadline(self._server(), self._timeout_s, self._client_errors)

    def __getattr__(self, name):
        return getattr(self._server, name)


class GuardedAppRunner(web.AppRunner):
    """An AppRunner whose connections get a header deadline, whose clients' HTTP mistakes are
    logged in one rate-limited line (``client_errors``), and which never inflates a request
    body: a ``Content-Encoding`` is refused by the handler (415), so a gzip bomb costs what
    its compressed bytes cost to receive."""

    def __init__(self, app: web.Application, *, header_timeout_s: float,
                 client_errors: RateLimitedLog, **kwargs) -> None:
        super().__init__(app, auto_decompress=False,
                         logger=ClientErrorLog(logging.getLogger("aiohttp.server"),
                                               client_errors), **kwargs)
        self._header_timeout_s = header_timeout_s
        self._client_errors = client_errors

    async def _make_server(self):
        return _GuardedServer(await super()._make_server(), self._header_timeout_s,
                              self._client_errors)


def deadline_of(request: web.Request) -> HeaderDeadline | None:
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, HeaderDeadline) else None
