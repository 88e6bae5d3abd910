"""The part of a grpc.aio servicer context a streaming handler uses, for calls made in process.

The router's HTTP front runs the router's ``Generate`` handler in its own process
(``router.local_call``), and an engine runs its ``Generate`` handler once per call of a
``GenerateMany`` stream (``engine_worker.server.generate_many``): both hand the handler a
``LocalContext`` in place of the context grpc.aio would have made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc

Metadata = Sequence[tuple[str, str]]


def rpc_error(code: grpc.StatusCode, details: str, *, trailing: Metadata = (),
              initial: Metadata = ()) -> grpc.aio.AioRpcError:
    """The error a grpc.aio client raises for a call that ended with ``code``."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(*initial), grpc.aio.Metadata(*trailing),
                                details=details)


class LocalContext:
    """The part of ``grpc.aio.ServicerContext`` a servicer's ``Generate`` uses, for a local call.

    ``abort`` raises ``grpc.aio.AbortError`` as the real one does, after recording the status;
    ``LocalCall`` turns it into the ``AioRpcError`` a remote caller would have seen."""

    __slots__ = ("_metadata", "_deadline", "_code", "_details", "_trailing", "_initial",
                 "_done_callbacks", "_peer")

    def __init__(self, metadata: Metadata, timeout_s: float | None, *,
                 peer: str = "local:http-front") -> None:
        self._peer = peer
        self._metadata = tuple(metadata)
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, str], ...] = ()
        self._initial: tuple[tuple[str, str], ...] = ()
        self._done_callbacks: list[Callable] | None = []  # None once the call ended

    def add_done_callback(self, callback: Callable) -> None:
        """``callback(context)`` once the call ends, however it ends (as grpc.aio's)."""
        if self._done_callbacks is None:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    def finish(self) -> None:
        """The call ended: run the done callbacks (once)."""
        callbacks, self._done_callbacks = self._done_callbacks, None
        for callback in callbacks or ():
            callback(self)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    @property
    def deadline(self) -> float | None:
        """The call's deadline on ``time.monotonic``'s clock (None: none)."""
        return self._deadline

    async def send_initial_metadata(self, metadata: Metadata) -> None:
        self._initial = tuple(metadata)

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._initial

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self._trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Metadata = ()) -> None:
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def error(self, code: grpc.StatusCode | None = None, details: str | None = None
              ) -> grpc.aio.AioRpcError:
        """The status this call ended with, as the error a grpc.aio client raises."""
        return rpc_error(code or self._code or grpc.StatusCode.UNKNOWN,
                         self._details if details is None else details,
                         trailing=self._trailing, initial=self._initial)
