"""Checks, before a slow start (loading a model, starting engines), that every port a command
will listen on is free, so a busy port is one clear line naming it instead of an OSError
traceback minutes later. Torch-free; used by ``quire up``, ``quire engine`` and ``quire router``.

The check binds each port the way the servers will (SO_REUSEADDR, which lets a port in
TIME_WAIT be reused, and never SO_REUSEPORT) and closes it again at once. Port 0 (any free port)
and -1 / None (not listening) are skipped. The servers check again when they bind.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable



class PortInUseError(ValueError):
    """A port a server was asked to listen on cannot be bound."""


def _families(host: str) -> list[tuple[int, tuple]]:
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PortInUseError(f"host: cannot resolve {host!r}: {e}") from None
    seen, out = set(), []
    for family, _, _, _, address in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and (family, address[0]) not in seen:
            seen.add((family, address[0]))
            out.append((family, address))
    return out


def check_port_free(host: str, port: int | None, what: str) -> None:
    """PortInUseError naming ``what`` and the port if ``host:port`` cannot be bound now."""
    if port is None or port <= 0:
        return
    for family, address in _families(host):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address[0], port, *address[2:]))
                sock.listen(1)
            except OSError as e:
                raise PortInUseError(f"{what}: port {port} on {host or '*'} is not free "
                                     f"({e.strerror or e})") from None


def check_ports_free(ports: Iterable[tuple[str, int | None, str]]) -> None:
    """``check_port_free`` for each (host, port, what) in order; the first busy one raises."""
    for host, port, what in ports:
        check_port_free(host, port, what)
